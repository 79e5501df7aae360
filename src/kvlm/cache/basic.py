"""`basic`: per-layer K and V grown by concatenation.

The simplest correct cache, and a teaching baseline: every decode step allocates a new
(S+1)-long tensor per layer and copies the old S rows into it, so its cost per token grows
with the sequence, gently, where `contiguous` writes one row in place. It is also the
reference the other modes are checked against (tests/test_cache_properties.py).
"""

from __future__ import annotations

import torch

from kvlm.cache.base import CacheSpec, CacheStep, DenseStep, DraftRows, KVCache
from kvlm.errors import InvalidRequestError


class _BasicStep(DenseStep):
    def __init__(self, cache: BasicCache, n_new: int) -> None:
        super().__init__(cache, n_new)
        self.cache = cache
        # Staged per layer; swapped in by commit, so a forward that raises changes nothing.
        self.staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(cache.k)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.cache.spec.dtype
        k_old, v_old = self.cache.k[layer], self.cache.v[layer]
        k_all = k.to(dtype) if k_old is None else torch.cat([k_old, k.to(dtype)], dim=2)
        v_all = v.to(dtype) if v_old is None else torch.cat([v_old, v.to(dtype)], dim=2)
        self.staged[layer] = (k_all, v_all)
        return k_all.to(k.dtype), v_all.to(v.dtype)


class BasicDraftRowsStep(DraftRows, _BasicStep):
    """A draft's check on a basic cache (kvlm.cache.base.DraftRows): the rows' K/V
    appended, staged for the commit as a one-sequence step's are."""


class BasicCache(KVCache):
    mode = "basic"

    def __init__(self, spec: CacheSpec) -> None:
        if spec.dtype == torch.int8:
            raise InvalidRequestError(
                "--kv basic stores floats; int8 needs --kv contiguous, paged or window"
            )
        super().__init__(spec)
        self.k: list[torch.Tensor | None] = [None] * spec.num_layers  # (B, Hkv, S, D) each
        self.v: list[torch.Tensor | None] = [None] * spec.num_layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return batch * tokens * spec.bytes_per_token

    def _begin(self, n_new: int) -> CacheStep:
        return _BasicStep(self, n_new)

    def _commit(self, step: CacheStep) -> None:
        assert isinstance(step, _BasicStep)
        for layer, kv in enumerate(step.staged):
            if kv is not None:
                self.k[layer], self.v[layer] = kv

    def _truncate(self, length: int) -> None:
        for layer in range(self.spec.num_layers):
            if length == 0:
                self.k[layer] = self.v[layer] = None
            elif self.k[layer] is not None:
                # clone: a slice would pin the old, longer storage
                self.k[layer] = self.k[layer][:, :, :length].clone()
                self.v[layer] = self.v[layer][:, :, :length].clone()

    def _fork(self, n: int) -> None:
        for layer in range(self.spec.num_layers):
            if self.k[layer] is not None:
                self.k[layer] = self.k[layer].repeat_interleave(n, dim=0)
                self.v[layer] = self.v[layer].repeat_interleave(n, dim=0)

    def _export(self) -> dict[str, torch.Tensor]:
        if self.num_tokens == 0:
            s = self.spec
            shape = (s.num_layers, 2, self.batch, s.num_kv_heads, 0, s.head_dim)
            return {"values": torch.zeros(shape, dtype=s.dtype, device=s.device)}
        pairs = [torch.stack([k, v]) for k, v in zip(self.k, self.v, strict=True)]
        return {"values": torch.stack(pairs)}  # (L, 2, B, Hkv, n, D)

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        if length == 0:
            return
        values = tensors["values"].to(self.spec.dtype)
        for layer in range(self.spec.num_layers):
            self.k[layer] = values[layer, 0].clone()
            self.v[layer] = values[layer, 1].clone()
