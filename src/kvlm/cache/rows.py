"""RowCache: the caches whose store has one row per sequence (contiguous, window).

    store: (layers, 2, batch, kv_heads, slots, head_dim)     slots: max_tokens or S + W

fork(n) copies each row n times (repeat_interleave on the batch dim); free() and import
reallocate when the batch changes. Paged keeps rows in blocks of a shared pool instead.
"""

from __future__ import annotations

import torch

from kvlm.cache.base import CacheSpec, KVCache
from kvlm.cache.storage import Store


class RowCache(KVCache):
    def __init__(self, spec: CacheSpec, slots: int) -> None:
        super().__init__(spec)
        self.slots = slots
        self.store = self._allocate(spec.batch)

    def _allocate(self, batch: int) -> Store:
        s = self.spec
        shape = (s.num_layers, 2, batch, s.num_kv_heads, self.slots, s.head_dim)
        return s.store(shape)

    def _held(self) -> tuple:
        """A store index (on the layers, K/V, row, head dims) of the slots holding tokens."""
        return ()

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def _fork(self, n: int) -> None:
        old = self.store
        self.store = self._allocate(self.batch * n)
        held = self._held()
        self.store.put_raw(
            held, {k: t.repeat_interleave(n, dim=2) for k, t in old.raw(held).items()}
        )

    def _release(self) -> None:
        if self.store.shape[2] != self.spec.batch:  # shrink back after a fork
            self.store = self._allocate(self.spec.batch)

    def _import_rows(self, tensors: dict[str, torch.Tensor], index: tuple) -> None:
        if self.store.shape[2] != self.batch:
            self.store = self._allocate(self.batch)
        self.store.put_raw(index, tensors)
