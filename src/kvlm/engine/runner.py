"""ModelRunner: feeds tokens through the model and one cache step, and times it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlm.cache import KVCache
from kvlm.model.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.device = model.device

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Run `token_ids` after what `cache` holds; return the last position's logits (V,).

        The cache commits the tokens only if the whole forward succeeded.
        """
        step = cache.begin(len(token_ids))  # raises on overflow before any write
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with self.model.step_context(cache.spec.batch * len(token_ids)):
            logits = self.model(ids.expand(cache.spec.batch, -1), step.positions, step)
        cache.commit(step)
        return logits[0, -1]

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Teacher-forced logits for every position, (T, V): the reference tests' view."""
        step = cache.begin(len(token_ids))
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(ids, step.positions, step, last_only=False)
        cache.commit(step)
        return out[0]
