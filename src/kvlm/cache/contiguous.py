"""`contiguous`: one preallocated, zero-filled, head-major buffer and a position counter.

    buffer: (layers, 2, batch, kv_heads, max_tokens, head_dim)      2 = K, V

    layer l, K, one sequence, one kv head:
      slot  0    1    2   ...  n-1 | n  ...  max_tokens-1
          [ t0 ][ t1 ][ t2 ] .. [ ] | [ 0 ] ... [ 0 ]
          <------- num_tokens ----->  free (zeros or stale rows past a rollback)

A step of T tokens writes slots [n, n+T) of every layer in place and attends over the view
[0, n+T): no reallocation, no copy of the history, so the per-token cost stays flat. Each
head's positions are contiguous, which is what an attention kernel reads. Rollback moves
the counter back; rows past it are overwritten before anything reads them.
"""

from __future__ import annotations

import torch

from kvlm.cache.base import CacheSpec, CacheStep, KVCache


class _ContiguousStep(CacheStep):
    def __init__(self, cache: ContiguousCache, start: int, n_new: int) -> None:
        super().__init__(cache.spec, start, n_new, n_keys=start + n_new)
        self.buffer = cache.buffer

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t0, t1 = self.start, self.start + self.n_new
        kv = self.buffer[layer]  # (2, B, Hkv, max_tokens, D)
        kv[0, :, :, t0:t1] = k
        kv[1, :, :, t0:t1] = v
        k_all, v_all = kv[0, :, :, :t1], kv[1, :, :, :t1]  # views, no copy
        if k_all.dtype != k.dtype:  # a cache dtype narrower than the compute dtype
            return k_all.to(k.dtype), v_all.to(v.dtype)
        return k_all, v_all


class ContiguousCache(KVCache):
    mode = "contiguous"

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        shape = (
            spec.num_layers,
            2,
            spec.batch,
            spec.num_kv_heads,
            spec.max_tokens,
            spec.head_dim,
        )
        self.buffer = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _begin(self, n_new: int) -> CacheStep:
        return _ContiguousStep(self, self.num_tokens, n_new)
