"""The FFN kind "experts" (ModelConfig.experts): a router picks `top_k` of `count` gated
MLPs for each token, and the token's output is their outputs weighted by the router.

    logits = x @ router^T                  fp32, each row's bits its own (Linear's road of
                                           the vocabulary projection: any batch, any cut)
    p      = softmax(logits)               over every expert
    chosen = the top_k of p, the lower index first among equal ones (a stable sort: ties
             broken one way everywhere, so a row routes alone as in any batch)
    w      = p[chosen], divided by their sum where the family normalises (norm_topk_prob)
    y      = sum over chosen, in ascending expert order, of w_e * MLP_e(x)

transformers' sparse MoE blocks of this router compute the same (softmax in fp32, top-k,
the renormalisation, then the experts in ascending order, each one's rows added into zeros),
so the exact path follows its sums term by term. Each expert is kvlm's gated MLP over the
rows routed to it (its products' rows are their own: the same bits for a row however many
share the expert), under the numerics of the rows the block was given: decoded rows stay
decoded rows when they are gathered (kvlm.model.layers.feeding_prompt).
"""

from __future__ import annotations

import torch
from torch import nn

from kvlm.config import Experts as ExpertsConfig
from kvlm.model.layers import MLP, Linear, feeding_prompt, prompt_rows


class Experts(nn.Module):
    """A mixture-of-experts FFN: `router` (count x hidden, its products in `router_dtype`:
    fp32, or an fp64 model's fp64) and one gated MLP an expert."""

    def __init__(
        self,
        config: ExpertsConfig,
        router: Linear,
        experts: list[MLP],
        router_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if len(experts) != config.count or router.out_features != config.count:
            raise ValueError(f"{len(experts)} experts and a router of {router.out_features} "
                             f"for {config.count}")  # fmt: skip
        self.config = config
        self.router, self.router_dtype = router, router_dtype
        self.experts = nn.ModuleList(experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of x (N, hidden): its experts (N, top_k), the higher weight first,
        and their weights (N, top_k) fp32."""
        logits = self.router(x.to(self.router_dtype))
        probs = torch.softmax(logits, dim=-1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        chosen = order[:, : self.config.top_k]
        weights = probs.gather(1, chosen)
        if self.config.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role, shape = prompt_rows(x), x.shape
        flat = x.reshape(-1, shape[-1])
        with feeding_prompt(role):
            chosen, weights = self.route(flat)
            weights = weights.to(x.dtype)
            out = torch.zeros_like(flat)
            for e in torch.unique(chosen).tolist():  # ascending
                rows, slot = torch.where(chosen == e)
                y = self.experts[e](flat[rows].unsqueeze(0))[0]
                out.index_add_(0, rows, y * weights[rows, slot, None])
        return out.view(shape)
