"""`contiguous`: one preallocated, zero-filled, head-major buffer and a position counter.

    values: (layers, 2, batch, kv_heads, max_tokens, head_dim)      2 = K, V
            (int8: plus one fp16 scale per token and head, see kvlm.cache.storage)

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

from kvlm.cache.base import CacheSpec, CacheStep, DenseStep
from kvlm.cache.rows import RowCache

ALL = slice(None)


class _ContiguousStep(DenseStep):
    def __init__(self, cache: ContiguousCache, n_new: int) -> None:
        super().__init__(cache, n_new)
        self.store = cache.store
        self._over(self.store)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._keys_in(k)
        new = slice(self.start, self.start + self.n_new)
        seen = slice(0, self.start + self.n_new)
        self.store.put((layer, 0, ALL, ALL, new), k)
        self.store.put((layer, 1, ALL, ALL, new), v)
        # views when the storage dtype is the compute dtype; dequantized/cast copies otherwise
        return (
            self.store.get((layer, 0, ALL, ALL, seen), k.dtype),
            self.store.get((layer, 1, ALL, ALL, seen), v.dtype),
        )


class ContiguousCache(RowCache):
    mode = "contiguous"

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec, slots=spec.max_tokens)

    def _held(self) -> tuple:
        return (ALL, ALL, ALL, ALL, slice(0, self.num_tokens))

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return batch * spec.max_tokens * spec.bytes_per_token  # preallocated, whatever is used

    def _begin(self, n_new: int) -> CacheStep:
        return _ContiguousStep(self, n_new)

    def _export(self) -> dict[str, torch.Tensor]:
        return self.store.raw(self._held())

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        self._import_rows(tensors, (ALL, ALL, ALL, ALL, slice(0, length)))


class DraftRowsStep(DenseStep):
    """One sequence of a contiguous cache fed n tokens as n rows of one token each, at
    positions start .. start+n-1 (a speculative draft's check on the torch step): every
    row's K/V written into the sequence's row before any row attends, row i attending over
    the keys up to its own position (CacheStep.rows), as decoding its token alone would."""

    def __init__(self, cache: ContiguousCache, n_new: int) -> None:
        super().__init__(cache, n_new)
        if cache.batch != 1:
            raise ValueError("a draft check feeds one sequence")
        self.store = cache.store
        self._over(self.store)
        self.positions = self.positions.reshape(n_new, 1)  # (rows, 1)
        self.mask, self.is_causal = None, False
        self.rows = [(self.start + i + 1, None, False) for i in range(n_new)]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (rows, Hkv, 1, D) -> the sequence's keys (rows, Hkv, S, D), one view."""
        k = self._keys_in(k)
        n = k.shape[0]
        new = slice(self.start, self.start + n)
        seen = slice(0, self.start + n)
        self.store.put((layer, 0, 0, ALL, new), k[:, :, 0].transpose(0, 1))
        self.store.put((layer, 1, 0, ALL, new), v[:, :, 0].transpose(0, 1))
        keys = self.store.get((layer, 0, slice(0, 1), ALL, seen), k.dtype)
        values = self.store.get((layer, 1, slice(0, 1), ALL, seen), v.dtype)
        return keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1)
