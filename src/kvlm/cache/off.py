"""`off`: no cache. Every forward recomputes the whole sequence.

It is the correctness oracle (no state to get wrong) and the baseline of the speed story:
per-forward time grows with the sequence instead of staying flat.
"""

from __future__ import annotations

import torch

from kvlm.cache.base import CacheFileError, CacheSpec, CacheStep, DenseStep, KVCache, KVPair


class _OffStep(DenseStep):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        return k, v  # the queries attend to exactly the keys computed in this forward


class OffCache(KVCache):
    mode = "off"
    drafts = False

    @property
    def nbytes(self) -> int:
        return 0

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return 0

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return _OffStep(self, n_new)  # from position 0: the off cache holds no token

    def commit(self, step: CacheStep) -> None:
        """Nothing is kept, so the caller feeds the full sequence again next time."""

    def _fork(self, n: int) -> None:
        pass  # nothing stored; the caller feeds each row's full sequence

    def _export(self) -> dict[str, torch.Tensor]:
        raise CacheFileError("--kv off keeps no cache: there is nothing to save or snapshot")

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        raise CacheFileError("--kv off keeps no cache: it cannot be restored into")
