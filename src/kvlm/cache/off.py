"""`off`: no cache. Every forward recomputes the whole sequence.

It is the correctness oracle (no state to get wrong) and the baseline of the speed story:
per-forward time grows with the sequence instead of staying flat.
"""

from __future__ import annotations

import torch

from kvlm.cache.base import CacheStep, KVCache


class _OffStep(CacheStep):
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # the queries attend to exactly the keys computed in this forward


class OffCache(KVCache):
    mode = "off"

    @property
    def nbytes(self) -> int:
        return 0

    def _begin(self, n_new: int) -> CacheStep:
        return _OffStep(self.spec, start=0, n_new=n_new, n_keys=n_new)

    def commit(self, step: CacheStep) -> None:
        """Nothing is kept, so the caller feeds the full sequence again next time."""
