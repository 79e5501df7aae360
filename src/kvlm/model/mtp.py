"""A multi-token-prediction head (MTP, "next-n" layers, as some families'
checkpoints carry one, `mtp.*`): a drafter the model file brings along, trained to
predict the token after next from the model's own last hidden state.

    h_t        the model's hidden state at position t after its final norm (what its
               vocabulary projection reads; `Transformer.forward(hidden=True)`)
    x_{t+1}    the token after it (sampled, or a draft)
    u_t        = fc([enorm(embed(x_{t+1})), hnorm(h_t)])     (the embedding first)
    u_t        = block(u_t) at position t: one attention block of the model's attention
               kind, causal over the head's own K/V of positions 0..t (a cache of its own:
               a layer a block)
    logits     = lm_head(norm(u_t))  -> x_{t+2}; norm(u_t) is the next draft's h

So a head of k blocks drafts autoregressively: draft i runs block i mod k at position
t + i on its own output of the step before (as vLLM runs these heads). Its
norms are the family's (1 + w folded at load, as the model's). Nothing here changes the
model's own tokens: the engine verifies every draft (kvlm.engine.speculative).
"""

from __future__ import annotations

import torch
from torch import nn

from kvlm.cache.base import CacheSpec
from kvlm.config import ModelConfig
from kvlm.model.layers import Linear, RMSNorm


def head_spec(
    config: ModelConfig,
    max_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> CacheSpec:
    """The spec of an MTP head's own cache: a layer of the model's attention geometry a
    block (its K/V of positions 0..t: one sequence's, `max_tokens` of them), on the
    model's device."""
    return CacheSpec(num_layers=config.mtp_layers, num_kv_heads=config.num_kv_heads,
                     head_dim=config.head_dim, max_tokens=max_tokens, dtype=dtype,
                     device=torch.device(device))  # fmt: skip


class MtpHead(nn.Module):
    def __init__(
        self,
        fc: Linear,
        embed_norm: RMSNorm,
        hidden_norm: RMSNorm,
        blocks: list[nn.Module],
        norm: RMSNorm,
    ) -> None:
        super().__init__()
        self.fc = fc
        self.embed_norm = embed_norm
        self.hidden_norm = hidden_norm
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv,
        step: int = 0,
    ) -> torch.Tensor:
        """embeds (B, T, H): of the tokens after each position; hidden (B, T, H): the
        model's (or the head's own, drafting on) final-normed states at those positions;
        cos, sin: RoPE at the positions; kv: the head's cache step (its K/V at layer
        `step` mod the blocks). -> (B, T, H) normed, for the vocabulary projection."""
        x = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.fc(x)
        j = step % len(self.blocks)
        x = self.blocks[j](x, cos, sin, kv.for_layer(j))
        return self.norm(x)
