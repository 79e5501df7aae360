"""Latent attention: K and V of every head made from one compressed latent a token.

Each token's hidden state gives a latent c (kv_a's first `kv_rank` rows, RMSNormed) and one
key part k_r shared by every head (its last `rope_dim` rows, RoPE-rotated). A head h's key
is [W_uk[h] c, k_r] and its value W_uv[h] c, W_uk and W_uv the rows of kv_b; its query
[q_n, q_r] (a plain projection, or a compressed one: q_a, its RMSNorm, q_b), q_r rotated.

The cache keeps c and k_r alone, kv_rank + rope_dim values a token and layer, as the rows
of one KV head of half that each (kvlm.cache.kinds.LatentAttention: the first half in K's
place, the rest in V's), so every cache mode keeps them as it keeps K/V rows. What the
heads attend over is then made per step, two ways that are the same mathematics:

- materialised (a step of several rows of a sequence: prompts, chunks, drafts): every
  key's K and V from the latent rows (kv_b over them), then attention as usual;
- absorbed (one row: decode): W_uk folded into the query, q_n W_uk[h] (kv_rank wide), so
  the scores are over the latent rows themselves (q_n W_uk c + q_r k_r), the weighted sum
  of the latents times W_uv after: attention of H query heads over one KV head of
  kv_rank + rope_dim (MQA), nothing per key made.

Attention itself is kvlm.model.attention's (`attend`, `attend_rows`' row rule): one
sequence's rows on the C kernels where they apply, a batch a row at a time on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.config import Latent
from kvlm.errors import UnsupportedModelError
from kvlm.model.attention import KVStep, attend, turned_back
from kvlm.model.layers import Linear, RMSNorm, apply_rope, prompt_rows
from kvlm.model.numerics import ModelNumerics

# a cache that keeps keys before RoPE and turns them at read (the window cache)
KEYS_UNROTATED = (
    "latent attention keeps each token's key part rotated at its position, and a cache "
    "that rotates keys where they sit (the window cache) cannot hold it: use another --kv mode"
)


class LatentAttention(nn.Module):
    """A latent attention mixer (the module docstring). `q` the query projection (q_proj,
    or q_b after `q_a` and `q_norm`), `kv_a` to the latent and key part, `kv_norm` the
    latent's RMSNorm, `kv_b` (H x (nope_dim + v_dim), kv_rank) the heads' K and V rows of
    the latent, `o_proj` from the heads' values. `scale`: the scores' scale."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        sizes: Latent,
        q: Linear,
        kv_a: Linear,
        kv_norm: RMSNorm,
        kv_b: torch.Tensor,
        o_proj: Linear,
        scale: float,
        q_a: Linear | None = None,
        q_norm: RMSNorm | None = None,
        numerics: ModelNumerics | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.sizes = sizes
        self.q, self.q_a, self.q_norm = q, q_a, q_norm
        self.kv_a, self.kv_norm, self.o_proj = kv_a, kv_norm, o_proj
        self.scale = scale
        w = kv_b.view(num_heads, sizes.nope_dim + sizes.v_dim, sizes.kv_rank)
        self.register_buffer("kv_b", kv_b, persistent=False)
        # the key and value halves a head, (H, nope_dim, kv_rank) and (H, v_dim, kv_rank)
        self.register_buffer("w_uk", w[:, : sizes.nope_dim].contiguous(), persistent=False)
        self.register_buffer("w_uv", w[:, sizes.nope_dim :].contiguous(), persistent=False)
        # decode rows absorb kv_b (False: every step materialises K/V; tests compare the two)
        self.absorb = True
        self.prompt_bf16_from = (numerics or ModelNumerics()).attention_bf16_from

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVStep,
        key_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (B, T, hidden); cos, sin (B, T, 1, rope_dim) at the new tokens' positions."""
        if key_rope is not None:
            raise UnsupportedModelError(KEYS_UNROTATED)
        B, T, _ = x.shape
        s, H = self.sizes, self.num_heads
        q = self.q(x if self.q_a is None else self.q_norm(self.q_a(x))).view(B, T, H, s.qk_dim)
        qn, qr = q.split([s.nope_dim, s.rope_dim], dim=-1)
        qr = apply_rope(qr, cos, sin)
        c, kr = self.kv_a(x).split([s.kv_rank, s.rope_dim], dim=-1)
        kr = apply_rope(kr.view(B, T, 1, s.rope_dim), cos, sin).view(B, T, s.rope_dim)
        row = torch.cat([self.kv_norm(c.contiguous()), kr], dim=-1)  # (B, T, kv_rank + rope)
        half = (s.row + 1) // 2
        if 2 * half != s.row:  # an odd row: a zero past its end
            row = F.pad(row, (0, 1))
        k_all, v_all = kv.update(self.layer_idx, row[..., None, :half].transpose(1, 2),
                                 row[..., None, half:].transpose(1, 2))  # fmt: skip
        k_all, v_all = turned_back(kv, k_all, v_all)  # the row's halves, as given
        lat = torch.cat([k_all, v_all], dim=-1)[..., : s.row]  # (B, 1, S, row) or (Tk, 1, row)
        qn, qr = qn.transpose(1, 2), qr.transpose(1, 2)  # (B, H, T, *)
        prompt = prompt_rows(x)
        if kv.segments is not None:  # a ragged step: each sequence over its own rows
            seg, parts = kv.segments, []
            for i in range(len(seg)):
                qa, qb, ka, kb = seg.cu_q[i], seg.cu_q[i + 1], seg.cu_k[i], seg.cu_k[i + 1]
                rows = lat[ka:kb].transpose(0, 1)[None]  # (1, 1, S, row)
                parts.append(self._attend(qn[:, :, qa:qb], qr[:, :, qa:qb], rows, *seg.mask(i),
                                          prompt))  # fmt: skip
            out = torch.cat(parts, dim=2)
        elif kv.rows is not None or (B > 1 and x.is_cpu):  # a row at a time (attend_rows)
            rows = kv.rows or [(lat.shape[2], kv.mask, kv.is_causal)] * B
            parts = []
            for b, (n, mask, causal) in enumerate(rows):
                if mask is not None and mask.dim() == 4 and mask.shape[0] > 1:
                    mask = mask[b : b + 1]
                parts.append(self._attend(qn[b : b + 1], qr[b : b + 1], lat[b : b + 1, :, :n],
                                          mask, causal, prompt))  # fmt: skip
            out = torch.cat(parts)
        else:
            out = self._attend(qn, qr, lat, kv.mask, kv.is_causal, prompt)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * s.v_dim))

    def _attend(
        self,
        qn: torch.Tensor,
        qr: torch.Tensor,
        lat: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        prompt: bool,
    ) -> torch.Tensor:
        """Queries qn (B, H, T, nope_dim), qr (B, H, T, rope_dim) over the latent rows lat
        (B, 1, S, kv_rank + rope_dim) -> each head's output (B, H, T, v_dim): absorbed for a
        lone row, else materialised. `attend` scales scores by its head size ** -0.5: the
        queries carry the rest of `scale`."""
        s = self.sizes
        T = qn.shape[2]
        bf16_from = self.prompt_bf16_from if prompt else None
        if T == 1 and self.absorb:
            q = torch.cat([torch.einsum("bhtn,hnr->bhtr", qn, self.w_uk), qr], dim=-1)
            q = q * (self.scale * s.row**0.5)
            o = attend(q, lat, lat, mask, causal, prompt=prompt)[..., : s.kv_rank]
            return torch.einsum("bhtr,hvr->bhtv", o, self.w_uv)
        B, H, S = qn.shape[0], self.num_heads, lat.shape[2]
        c, kr = lat.split([s.kv_rank, s.rope_dim], dim=-1)  # (B, 1, S, *)
        kvh = F.linear(c, self.kv_b).view(B, S, H, -1).transpose(1, 2)  # (B, H, S, nope + v)
        kn, v = kvh.split([s.nope_dim, s.v_dim], dim=-1)
        k = torch.cat([kn, kr.expand(B, H, S, s.rope_dim)], dim=-1)
        q = torch.cat([qn, qr], dim=-1)
        D = max(s.qk_dim, s.v_dim)  # one head size for the kernels: the narrower padded
        q, k, v = (F.pad(t, (0, D - t.shape[-1])) for t in (q, k, v))
        q = q * (self.scale * D**0.5)
        out = attend(q, k, v, mask, causal, bf16_from=bf16_from, prompt=prompt)
        return out[..., : s.v_dim]
