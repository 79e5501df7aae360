"""Grouped-query self-attention over whatever the cache step hands back."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.model.layers import Linear, RMSNorm, apply_rope


class KVStep(Protocol):
    """What attention needs from the cache for one forward (see kvlm.cache.base)."""

    mask: torch.Tensor | None
    is_causal: bool
    key_rotation: torch.Tensor | None
    # (S,) int64 when update() takes and returns K *before* RoPE and the keys it returns are
    # to be rotated at these positions (the window cache's positions inside the cache).
    key_rope_positions: torch.Tensor | None
    # (keys, mask, is_causal) of each row when rows see different numbers of keys
    rows: list[tuple[int, torch.Tensor | None, bool]] | None

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv: Linear,
        o_proj: Linear,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.qkv = qkv
        self.o_proj = o_proj
        self.q_norm = q_norm
        self.k_norm = k_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVStep,
        key_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """cos, sin (B, T, 1, D): RoPE at the new tokens' positions. `key_rope`: cos, sin
        (1, 1, S, D) at kv.key_rope_positions when the cache keeps K before RoPE: then only
        the queries are rotated before update(), and every key it returns after."""
        B, T, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(B, T, H + 2 * Hkv, self.head_dim)
        qk, v = qkv.split([H + Hkv, Hkv], dim=2)  # q and k heads side by side
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = qk.split([H, Hkv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        if key_rope is None:
            qk = apply_rope(qk, cos, sin)  # one rotation for all q and k heads
        q, k = qk.transpose(1, 2).split([H, Hkv], dim=1)  # (B, H, T, D), (B, Hkv, T, D)
        if key_rope is not None:
            q = apply_rope(q, cos.transpose(1, 2), sin.transpose(1, 2))
        v = v.transpose(1, 2)  # (B, Hkv, T, D)
        # The cache stores this step's K/V and returns everything the queries may see.
        k_all, v_all = kv.update(self.layer_idx, k, v)  # (B, Hkv, S, D)
        if key_rope is not None:  # keys came back before RoPE: rotate them where they sit
            k_all = apply_rope(k_all, *key_rope)
        if kv.key_rotation is not None:  # keys came back as k @ R: rotate the queries too
            q = q @ kv.key_rotation.to(q.dtype)
        if kv.rows is None and (B == 1 or not q.is_cpu):
            out = attend(q, k_all, v_all, kv.mask, kv.is_causal)  # (B, H, T, D)
        else:
            out = attend_rows(q, k_all, v_all, kv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVStep) -> torch.Tensor:
    """`attend` one row at a time, each over its own keys (kv.rows) or all of them: a row
    gets the bits it gets alone, in any batch. On the CPU one SDPA call over B rows is not
    that: its kernel splits the work by the batch's size (with 2 threads, 1 to 7 rows of
    9 heads sum a decode row in another order than 8 do), and over keys padded to the
    longest row the masked softmax sums in other vector lanes. The cost: B calls a layer."""
    rows = kv.rows or [(k.shape[2], kv.mask, kv.is_causal)] * q.shape[0]
    out = []
    for b, (n, mask, causal) in enumerate(rows):
        if mask is not None and mask.dim() == 4 and mask.shape[0] > 1:
            mask = mask[b : b + 1]  # a mask per row
        out.append(attend(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], mask, causal))
    return torch.cat(out)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    expand: bool | None = None,
) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k, v (B, Hkv, S, D), H a multiple of Hkv.

    On CUDA a grouped-query call with an explicit mask (a prefill chunk after the first, a
    batch of rows at different positions, a window step) finds no fused kernel: flash
    attention takes no mask and the memory-efficient one no GQA, so SDPA would fall back to
    the math path and its full score matrix. There (`expand` None: decided by device) the
    K/V heads are repeated to H first, which the memory-efficient kernel takes. On CPU
    enable_gqa serves every case."""
    gqa = q.shape[1] != k.shape[1]
    if expand is None:
        expand = q.is_cuda and mask is not None
    if gqa and expand:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa
    )
