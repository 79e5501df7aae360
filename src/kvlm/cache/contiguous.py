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

from collections.abc import Sequence

import torch

from kvlm.cache.base import CacheSpec, CacheStep, DenseStep, DraftRows, KVPair, KVView
from kvlm.cache.rows import RowCache

ALL = slice(None)


class _ContiguousStep(DenseStep):
    def __init__(self, cache: ContiguousCache, n_new: int) -> None:
        super().__init__(cache, n_new)
        self._over(cache.store)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        k, v = self._keys_in(k), self._values_in(v)
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
    fused_step = True
    pool_mode = "paged"

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec, slots=spec.max_tokens)

    def _held(self) -> tuple:
        return (ALL, ALL, ALL, ALL, slice(0, self.num_tokens))

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return batch * spec.max_tokens * spec.bytes_per_token  # preallocated, whatever is used

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return (DraftRowsStep if draft else _ContiguousStep)(self, n_new)

    def _export(self) -> dict[str, torch.Tensor]:
        return self.store.raw(self._held())

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        self._import_rows(tensors, (ALL, ALL, ALL, ALL, slice(0, length)))

    def kv_views(self, rows: Sequence[int], step: CacheStep | None = None) -> list[KVView]:
        """One view: row b of the store is block b, holding every slot."""
        return [KVView(self.store, [[r] for r in rows], self.slots)]


class DraftRowsStep(DraftRows, _ContiguousStep):
    """A draft's check on a contiguous cache (kvlm.cache.base.DraftRows)."""
