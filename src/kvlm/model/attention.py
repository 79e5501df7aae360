"""Grouped-query self-attention over whatever the cache step hands back."""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlm import kernels
from kvlm.errors import UnsupportedModelError
from kvlm.model.layers import Linear, RMSNorm, apply_rope, prompt_rows
from kvlm.model.numerics import ModelNumerics

if TYPE_CHECKING:
    from kvlm.cache.paged import Segments

GPU_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class KVStep(Protocol):
    """What attention needs from the cache for one forward (see kvlm.cache.base)."""

    mask: torch.Tensor | None
    is_causal: bool
    key_rotation: torch.Tensor | None
    # R when the values update() returns are v @ R: the output is then o R, times R^T
    value_rotation: torch.Tensor | None
    # (S,) int64 when update() takes and returns K *before* RoPE and the keys it returns are
    # to be rotated at these positions (the window cache's positions inside the cache).
    key_rope_positions: torch.Tensor | None
    # (keys, mask, is_causal) of each row when rows see different numbers of keys
    rows: list[tuple[int, torch.Tensor | None, bool]] | None
    # a ragged step's sequences (kvlm.cache.paged.Segments): update() returns the keys of
    # every sequence packed, (Tk, Hkv, D), and attend_ragged reads them; else None
    segments: Segments | None
    # the rows whose logits the forward computes (a ragged step's), or None
    logit_rows: torch.Tensor | None

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def for_layer(self, layer: int) -> KVStep:
        """The step with `layer`'s attention window in its masks (kvlm.cache.base)."""
        ...


def turned_back(kv: KVStep, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows update() returned, as they were given: K times R^T where the store keeps K
    as k R (int8/q4 K), V likewise (a quantized V, value_rotation); R orthonormal. For a
    mixer whose rows are not K and V heads (a latent, a K = V layer's halves)."""
    if kv.key_rotation is not None:
        k = k @ kv.key_rotation.to(k.dtype).T
    if kv.value_rotation is not None:
        v = v @ kv.value_rotation.to(v.dtype).T
    return k, v


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
        numerics: ModelNumerics | None = None,
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
        # the q and k norms over each whole projection (ModelConfig.qk_norm_extent
        # "projection"), not each head
        self.norm_projections = False
        self.q_scale: float | None = None  # queries times this (a score scale, no q norm)
        self.softcap: float | None = None  # scores soft-capped: cap * tanh(s / cap) (attn_softcap)
        # attention sinks (ModelConfig.attn_sinks): a logit a query head, (H,), that joins
        # each row's softmax denominator; None: none
        self.sinks: torch.Tensor | None = None
        # the output times sigmoid(a gate) per element (ModelConfig.attn_output_gate): qkv's
        # rows are then q, the gate (H heads each), k, v
        self.gated = False
        # prompt rows at this position or later attend in bf16 on the CPU (0: all, with
        # --prefill-dtype bf16; None: none): the model's numerics (kvlm.defaults), `attend`
        n = numerics or ModelNumerics()
        self.prompt_bf16_from: int | None = n.attention_bf16_from
        # K = V (ModelConfig.layer_k_eq_v): qkv's rows are q and k alone; V is the k
        # projection normed without a weight (v_norm), K that times the k norm's weight,
        # rotated. The cache keeps V alone, its first half in K's row and the rest in V's
        # (ModelConfig.kv_row_dim); K is made from it over every key, at its position, by
        # `key_rope` (the layer's RotaryEmbedding, set by the model)
        self.k_eq_v = False
        self.key_rope = None
        # V's RMSNorm (ModelConfig.v_norm: a weight of ones) before the cache, or None
        self.v_norm: RMSNorm | None = None
        # a layer that reads an earlier layer's K/V (ModelConfig.kv_sources): that layer's
        # Attention, in a tuple (not a submodule of this one); qkv's rows are q alone and
        # the step stores nothing of this layer's
        self.kv_from: tuple[Attention] | None = None
        # a layer whose K/V a later one reads: the keys and values its step returned, kept
        # until the model's forward ends (`kept`)
        self.keeps_kv = False
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None

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
        if self.kv_from is not None:
            return self._forward_reading(x, cos, sin, kv)
        if self.k_eq_v:
            return self._forward_k_eq_v(x, cos, sin, kv)
        gate = None
        if self.gated:
            qgkv = self.qkv(x).view(B, T, 2 * H + 2 * Hkv, self.head_dim)
            q, gate, kv_ = qgkv.split([H, H, 2 * Hkv], dim=2)
            gate = gate.reshape(B, T, H * self.head_dim)
            qkv = torch.cat([q, kv_], dim=2)
        else:
            qkv = self.qkv(x).view(B, T, H + 2 * Hkv, self.head_dim)
        prepared = key_rope is None and self._norm_rope_in_c(qkv, cos, sin)
        qk, v = qkv.split([H + Hkv, Hkv], dim=2)  # q and k heads side by side
        if self.q_norm is not None and not prepared:  # RMSNorms before RoPE
            q, k = qk.split([H, Hkv], dim=2)
            if self.norm_projections:  # each over the whole projection, then its heads again
                q = self.q_norm(q.reshape(B, T, H * self.head_dim)).view(q.shape)
                k = self.k_norm(k.reshape(B, T, Hkv * self.head_dim)).view(k.shape)
            else:  # each head's own (Qwen3)
                q, k = self.q_norm(q), self.k_norm(k)
            qk = torch.cat([q, k], dim=2)
        if key_rope is None and not prepared:
            qk = apply_rope(qk, cos, sin)  # one rotation for all q and k heads
        q, k = qk.transpose(1, 2).split([H, Hkv], dim=1)  # (B, H, T, D), (B, Hkv, T, D)
        if key_rope is not None:
            q = apply_rope(q, cos.transpose(1, 2), sin.transpose(1, 2))
        if self.v_norm is not None:
            v = self.v_norm(v.contiguous())
        v = v.transpose(1, 2)  # (B, Hkv, T, D)
        # The cache stores this step's K/V and returns everything the queries may see.
        k_all, v_all = kv.update(self.layer_idx, k, v)  # (B, Hkv, S, D)
        if key_rope is not None:  # keys came back before RoPE: rotate them where they sit
            k_all = apply_rope(k_all, *key_rope)
        if self.keeps_kv:  # a later layer reads them
            self.kept = (k_all, v_all)
        return self._attend_all(x, q, k_all, v_all, kv, gate)

    def _forward_k_eq_v(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVStep
    ) -> torch.Tensor:
        """A K = V layer (`k_eq_v`): V = the k projection normed without a weight, stored
        alone (its halves in K's and V's rows); every key made from the V the step returns,
        K = RoPE(V * the k norm's weight) at the key's position (as transformers' k norm
        makes it from the same normed rows: the same bits)."""
        if kv.key_rope_positions is not None:
            raise UnsupportedModelError(
                "a K = V layer's cache rows are V alone: a cache that keeps its K before "
                "RoPE cannot keep them"
            )
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, raw = self.qkv(x).view(B, T, H + Hkv, D).split([H, Hkv], dim=2)
        if self.q_norm is not None:
            q = self.q_norm(q.contiguous())
        q = apply_rope(q, cos, sin).transpose(1, 2)  # (B, H, T, D)
        v = self.v_norm(raw.contiguous()).transpose(1, 2)  # (B, Hkv, T, D)
        half = (D + 1) // 2
        first, rest = kv.update(self.layer_idx, v[..., :half].contiguous(),
                                v[..., half:].contiguous())  # fmt: skip
        first, rest = turned_back(kv, first, rest)  # V's halves, as given
        v_all = torch.cat([first, rest[..., : D - half]], dim=-1)
        k_all = v_all * self.k_norm.weight.to(v_all.dtype)
        k_all = apply_rope(k_all, *self._keys_rope(kv, k_all))
        if self.keeps_kv:  # a later layer reads them
            self.kept = (k_all, v_all)
        return self._attend_all(x, q, k_all, v_all, kv, None, rotated=False)

    def _keys_rope(self, kv: KVStep, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every key the step returned, at its position: the i-th key of a
        sequence at position i (a layer that sees the whole context); a ragged step's keys
        (Tk, Hkv, D) each sequence's from 0, the others' (B, Hkv, S, D) 0 .. S - 1."""
        seg = kv.segments
        if seg is not None:
            spans = [seg.cu_k[i + 1] - seg.cu_k[i] for i in range(len(seg))]
            at = torch.cat([torch.arange(n) for n in spans]).to(keys.device)
            cos, sin = self.key_rope.for_keys(at, keys.dtype)  # (1, 1, Tk, D)
            return cos[0].transpose(0, 1), sin[0].transpose(0, 1)  # (Tk, 1, D)
        at = torch.arange(keys.shape[2], device=keys.device)
        return self.key_rope.for_keys(at, keys.dtype)  # (1, 1, S, D)

    def _forward_reading(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVStep
    ) -> torch.Tensor:
        """A layer that reads an earlier layer's K/V (`kv_from`): its queries alone, over
        the keys and values that layer's step returned (rotated where they sit), with its
        step (`kv`: the same kind's masks)."""
        B, T, _ = x.shape
        kept = self.kv_from[0].kept
        if kept is None:
            raise ValueError(f"layer {self.layer_idx}'s K/V source ran no step before it")
        q = self.qkv(x).view(B, T, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.contiguous())
        q = apply_rope(q, cos, sin).transpose(1, 2)  # (B, H, T, D)
        return self._attend_all(x, q, *kept, kv, None, rotated=not self.kv_from[0].k_eq_v)

    def _attend_all(
        self, x: torch.Tensor, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
        kv: KVStep, gate: torch.Tensor | None, rotated: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """The queries q (B, H, T, D) over the keys and values the step returned: scores,
        softmax and the weighted sum as the step's masks say, then o_proj. `rotated`
        False: keys and values the layer turned back or made (K = V), in neither of the
        step's rotations."""
        B, T, _ = x.shape
        if kv.key_rotation is not None and rotated:  # keys came back as k @ R: q @ R too
            q = q @ kv.key_rotation.to(q.dtype)
        if self.q_scale is not None:
            q = q * self.q_scale
        cap, sinks = self.softcap, self.sinks
        prompt = prompt_rows(x)
        bf16_from = self.prompt_bf16_from if prompt else None
        if kv.segments is not None:
            out = attend_ragged(q, k_all, v_all, kv.segments, cap, bf16_from, sinks)
        elif kv.rows is None and (B == 1 or not q.is_cpu):
            out = attend(q, k_all, v_all, kv.mask, kv.is_causal, softcap=cap, bf16_from=bf16_from,
                         prompt=prompt, sinks=sinks)  # fmt: skip
        else:
            out = attend_rows(q, k_all, v_all, kv, cap, sinks)
        if kv.value_rotation is not None and rotated:  # values came back as v @ R: o R R^T
            out = out @ kv.value_rotation.T.to(out.dtype)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _norm_rope_in_c(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """The q and k heads' RMSNorm (Qwen3; or each whole projection's, a pass before:
        `norm_projections`) and RoPE in place, in one C pass over the rows (torch's cat,
        three products and an add per layer, and six passes per norm: ~10% of a Qwen3
        prompt), with apply_rope's bits (a partial rotary factor's too:
        cos/sin of R < D dims rotate each head's first R); False where it does not apply
        (not fp32 on the CPU, no kernels, cos/sin not one row per query row)."""
        B, T, heads, D = qkv.shape
        if qkv.dtype != torch.float32 or not qkv.is_cpu or not qkv.is_contiguous():
            return False
        R = cos.shape[-1]
        if cos.shape != (B, T, 1, R) or R > D or R % 2 or cos.dtype != torch.float32:
            return False
        if not (cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape):
            return False
        qn = kn = None
        if self.q_norm is not None:
            qn, kn = self.q_norm.c_weight(), self.k_norm.c_weight()
            if qn is None or kn is None or self.q_norm.eps != self.k_norm.eps:
                return False
            if qn.numel() != kn.numel() and not self.norm_projections:  # one length for both
                return False
        lib = kernels.library()
        if lib is None or qkv.numel() == 0:
            return False
        if self.norm_projections:  # the projections' norms first, in place: RoPE alone after
            self._norm_projections_in_c(lib, qkv, qn, kn)
            qn = kn = None
        # each buffer's length from the tensor itself: the kernel refuses (-2) sizes that
        # disagree (a caller's bug: everything it does not take is declined above)
        rc = lib.kvlm_qk_norm_rope(
            qkv.data_ptr(), qkv.numel(), B * T, heads * D, self.num_heads, self.num_kv_heads, D,
            None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(),
            0 if qn is None else qn.numel(), 0.0 if qn is None else self.q_norm.eps,
            cos.data_ptr(), cos.numel(), sin.data_ptr(), sin.numel(), R, R,
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"the kernels refused the q/k norms and RoPE of q|k|v {list(qkv.shape)} "
                f"({self.num_heads} + {self.num_kv_heads} heads) by cos {list(cos.shape)}"
                + ("" if qn is None else f", norm weights of {qn.numel()}")
            )
        return True

    def _norm_projections_in_c(
        self, lib, qkv: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor
    ) -> None:
        """The q and the k projections of each row of q|k|v (B, T, heads, D) RMSNormed in
        place, each as one vector (RMSNorm.forward's C rows: the same bits)."""
        B, T, heads, D = qkv.shape
        rs, eps, q = heads * D, self.q_norm.eps, self.num_heads * D
        for at, n, w in ((0, q, qn), (q, self.num_kv_heads * D, kn)):
            x = qkv.data_ptr() + at * qkv.element_size()
            rc = lib.kvlm_rms_norm(x, qkv.numel() - at, B * T, n, rs, w.data_ptr(), w.numel(),
                                   eps, x, qkv.numel() - at, rs)  # fmt: skip
            if rc != 0:
                raise ValueError(f"the kernels refused the q/k projections' norms of q|k|v "
                                 f"{list(qkv.shape)} by weights of {w.numel()}")  # fmt: skip


def attend_ragged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: Segments,
    softcap: float | None = None,
    bf16_from: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A ragged step's attention: q (1, H, N, D), every sequence's queries one after the
    other; k, v (Tk, Hkv, D), every sequence's keys packed; -> (1, H, N, D). On a GPU in
    bf16/fp16, one call of FlashAttention's variable-length kernel (torch's varlen_attn)
    for all sequences, causal from the bottom right (a chunk after a prefix, a decode row
    over all its keys); elsewhere, SDPA per sequence over its own keys (`attend`, with
    `bf16_from` as a lone sequence's prompt rows take it; with `softcap`, the explicit
    softmax's road, `attend_explicit`; with `sinks`, `attend`'s C kernels where they
    apply)."""
    explicit = softcap is not None or sinks is not None
    out = None if explicit else _varlen(q, k, v, seg)
    if out is not None:
        return out
    parts = []
    for i in range(len(seg)):
        qa, qb, ka, kb = seg.cu_q[i], seg.cu_q[i + 1], seg.cu_k[i], seg.cu_k[i + 1]
        ks, vs = (x[ka:kb].transpose(0, 1)[None] for x in (k, v))  # (1, Hkv, S, D)
        parts.append(attend(q[:, :, qa:qb], ks, vs, *seg.mask(i), softcap=softcap,
                            bf16_from=bf16_from, sinks=sinks))  # fmt: skip
    return torch.cat(parts, dim=2)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments):
    """torch.nn.attention.varlen.varlen_attn over the packed sequences, or None where it
    does not apply (not CUDA, not bf16/fp16, a torch without it, a window it cannot
    express)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return None
    fn, params = _varlen_fn()
    if fn is None:
        return None
    kwargs: dict = {}
    if "window_size" in params:  # (left, right): keys q - left .. q; causal is (-1, 0)
        kwargs["window_size"] = (-1 if seg.window is None else seg.window - 1, 0)
    elif seg.window is None and "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    group = q.shape[1] // k.shape[1]
    if group > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qs = q[0].transpose(0, 1)  # (N, H, D)
    max_q, max_k = seg.longest(seg.cu_q), seg.longest(seg.cu_k)
    out = fn(qs, k, v, seg.cu("q"), seg.cu("k"), max_q, max_k, **kwargs)  # (N, H, D)
    return out.transpose(0, 1)[None]


@functools.cache
def _varlen_fn():
    """(varlen_attn, its parameter names), or (None, ()) in a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, ()
    return varlen_attn, tuple(inspect.signature(varlen_attn).parameters)


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVStep, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
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
        kb, vb = k[b : b + 1, :, :n], v[b : b + 1, :, :n]
        out.append(attend(q[b : b + 1], kb, vb, mask, causal, softcap=softcap, sinks=sinks))
    return torch.cat(out)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    expand: bool | None = None,
    softcap: float | None = None,
    bf16_from: int | None = None,
    prompt: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k, v (B, Hkv, S, D), H a multiple of Hkv; with
    `softcap` (the scores capped first), which neither SDPA nor kvlm's C attention takes,
    the explicit road (`attend_explicit`); with `sinks` (a column more in each row's
    softmax, (H,)), which SDPA does not take, kvlm's C attention where it applies (one
    sequence in fp32 on the CPU: its online softmax starts at the sink), else the explicit
    road.

    `prompt` (None: T > 1): the rows are a prompt's; on the CPU one sequence's prompt rows
    go to kvlm_attend at any T, a chunk of one row too, so a row's bits are its own
    whichever chunk it comes in (a prefix hit's last rows, any chunk size).
    `bf16_from` (prompt rows on the CPU; Attention.prompt_bf16_from, from kvlm.defaults):
    the rows at that position or later (row t of T at position S - T + t) in bf16: q, k
    and v rounded to bf16, fp32 scores and softmax, the weights rounded to bf16 for p.V,
    in kvlm_attend's bf16 pairs (vdpbf16ps; on a Zen 4 1.4-1.55x its fp32 from 512 keys,
    where torch's bf16 flash attention is 0.4-0.85x of it: docs/BENCHMARKS.md 19.8,
    19.10), every row fp32 where its pairs do not apply (the head size, the CPU); torch's
    bf16 flash attention only without the kernels (with 0, --prefill-dtype bf16). With AMX
    too: torch's flash attention on the tiles (2-4x kvlm_attend's fp32 from 1,024 keys on
    the AMX Xeon) splits a chunk's rows by its length, so a row's bits followed its chunk
    (and did, for a head of 32 or 256, until the pairs' refusal fell back to fp32 rows).
    The prompt's largest cost at long contexts.

    On CUDA a grouped-query call with an explicit mask (a prefill chunk after the first, a
    batch of rows at different positions, a window step) finds no fused kernel: flash
    attention takes no mask and the memory-efficient one no GQA, so SDPA would fall back to
    the math path and its full score matrix. There (`expand` None: decided by device) the
    K/V heads are repeated to H first, which the memory-efficient kernel takes. On CPU
    enable_gqa serves every case."""
    if softcap is not None:
        return attend_explicit(q, k, v, mask, is_causal, softcap, sinks)
    T, S = q.shape[2], k.shape[2]
    prompt = T > 1 if prompt is None else prompt
    if bf16_from is not None and q.is_cpu and q.dtype == torch.float32 and prompt:
        first = min(T, max(0, bf16_from - (S - T)))  # the call's first row in bf16
        out = None
        if q.shape[0] == 1 and first < T:
            out = _attend_kernel(q, k, v, mask, is_causal, bf16_row=first, sinks=sinks)
        if out is not None:
            return out
        if bf16_from == 0 and sinks is None:  # every row: torch's road where kvlm's does not
            # apply (no SDPA takes a sink: a sink's rows go on in fp32 below)
            out = F.scaled_dot_product_attention(
                q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask, is_causal=is_causal,
                enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip
            return out.float()
    # decode rows too: torch's CPU SDPA splits one query row's keys across threads, so its
    # bits followed the thread count, which the engine changes with the load (FreeCores)
    if q.is_cpu and q.shape[0] == 1:
        out = _attend_kernel(q, k, v, mask, is_causal, decode=not prompt, sinks=sinks)
        if out is not None:
            return out
    if sinks is not None:  # where kvlm's C attention does not apply (fp64, a GPU, a batch)
        return attend_explicit(q, k, v, mask, is_causal, None, sinks)
    gqa = q.shape[1] != k.shape[1]
    if not q.is_cpu and q.shape[2] == 1 and mask is not None and expand is None:
        return attend_decode(q, k, v, mask)
    if expand is None:
        expand = q.is_cuda and mask is not None
    if gqa and expand:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa = False
    # on a GPU: not cuDNN's kernel, which builds a plan for every new shape: for prompt
    # rows ~0.65 ms of CPU a call (an H100), more than the attention itself for prompts of a
    # few hundred tokens; for an eager decode step every layer at every new key count (a
    # lone stream on a hybrid model's pool, a 350M one on the H200: 52 ms a step until each
    # length had been seen once, 9.3 ms with it off; docs/BENCHMARKS.md 26)
    with sdpa_kernel(GPU_BACKENDS) if not q.is_cpu else nullcontext():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa
        )


def attend_explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose scores are soft-capped before the softmax, cap * tanh(s / cap)
    (ModelConfig.attn_softcap), or whose softmax has a sink (ModelConfig.attn_sinks: a
    logit a query head, `sinks` (H,), joins each row's denominator and its column is
    dropped after), which no fused kernel takes: the scores are made whole, as
    transformers' eager attention makes them (the softmax in fp32, fp64 for an fp64 model).
    q (B, H, T, D), k, v (B, Hkv, S, D).

        p = softmax([s_1 .. s_S, sink_h])[:S]      a row that sees no key: all zeros
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if is_causal:
        T, S = q.shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    wide = torch.promote_types(q.dtype, torch.float32)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=wide)
    else:
        B, H, T, _ = scores.shape
        sink = sinks.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, T, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=wide)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def attend_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One query per row (decode) over masked keys on a GPU, the query heads of a K/V
    head as one product with it: SDPA has no fused kernel for a grouped-query call with a
    mask, and repeating each K/V head for its query heads (what `attend` does for prompt
    rows) copies the keys group-size times a layer. Scores, softmax and the weighted sum
    in fp32, as SDPA's kernels keep them. q (B, H, 1, D), k, v (B, Hkv, S, D), mask
    broadcastable to (B, 1, 1, S), True = may attend."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for the reference
    qg = q.reshape(B, Hkv, H // Hkv, D).to(wide)
    scores = torch.matmul(qg, k.to(wide).transpose(-1, -2)) * D**-0.5  # (B, Hkv, g, S)
    if mask.dim() == 2:  # (1, S)
        mask = mask[None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.to(wide))  # (B, Hkv, g, D)
    return out.to(q.dtype).reshape(B, H, 1, D)


def _room(t: torch.Tensor) -> int:
    """Elements of t's storage from t's first element on: what a kernel handed
    t.data_ptr() may read, whatever t's shape and strides."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def _base(t: torch.Tensor | None) -> int | None:
    """t's address for a kernel (None: NULL)."""
    return None if t is None else t.data_ptr()


def _count(t: torch.Tensor | None) -> int:
    """t's elements (0: None)."""
    return 0 if t is None else t.numel()


def _attend_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    bf16_row: int | None = None,
    decode: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One sequence's prompt rows (T > 1) through kvlm's C attention (kvlm_attend: ~4x
    torch's CPU SDPA at a 512-token prompt; rows from `bf16_row` on (0: all; None: none)
    in its bf16 pairs, head sizes 64 and 128 on AVX512-BF16), or None where it does not
    apply (not fp32, a float mask, no compiled kernels, a head size or CPU it does not take,
    for any of the rows): then SDPA. Each row's
    result depends only on its query and the keys it sees, so a prompt gets the same bits
    whole or in chunks. `decode`: the rows are decoded tokens, a one-row call of which goes
    to kvlm_attend_row (no copy of K; its keys in order). Either way a row gets the same
    bits on any thread count (each head's row is one thread's work). The fused step has
    its own attention. `sinks` (H,): a sink logit a query head, a column of each row's
    softmax without a value (the kernels' online softmax starts at it: m = sink, l = 1)."""
    if not (q.dtype == k.dtype == v.dtype == torch.float32):
        return None
    if sinks is not None:
        if sinks.dtype != torch.float32 or not sinks.is_cpu or sinks.numel() != q.shape[1]:
            return None
        sinks = sinks.contiguous()
    if mask is not None:
        if mask.dim() == 4 and mask.shape[:2] == (1, 1):
            mask = mask.reshape(mask.shape[-2:])
        if mask.dtype != torch.bool or mask.dim() != 2:
            return None
    lib = kernels.library()
    if lib is None:
        return None
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if T < 1 or S < 1:
        return None
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if mask is not None:
        mask = mask.expand(T, S)
        if mask.stride(1) != 1:
            mask = mask.contiguous()
    out = torch.empty(1, T, H, D, dtype=torch.float32)
    # each buffer's elements from its pointer on (q, k, v: views of a wider buffer, read at
    # their strides): the kernels refuse (-2) strides that would take them past them
    rc = -3
    if decode and T == 1 and not causal:  # (a causal one-row call sees key 0 alone)
        rc = lib.kvlm_attend_row(
            q.data_ptr(), _room(q), H, D, q.stride(1), k.data_ptr(), _room(k), v.data_ptr(),
            _room(v), Hkv, S, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
            None if mask is None else mask.data_ptr(), 0 if mask is None else _room(mask),
            D**-0.5, out.data_ptr(), out.numel(), _base(sinks), _count(sinks),
        )  # fmt: skip

    def every_row(bf16_from: int) -> int:
        """kvlm_attend over every row, those from `bf16_from` on in bf16."""
        return lib.kvlm_attend(
            q.data_ptr(), _room(q), H, T, D, q.stride(1), q.stride(2), k.data_ptr(), _room(k),
            v.data_ptr(), _room(v), Hkv, S, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
            None if mask is None else mask.data_ptr(), 0 if mask is None else _room(mask),
            0 if mask is None else mask.stride(0), int(causal and mask is None), D**-0.5,
            out.data_ptr(), out.numel(), bf16_from, _base(sinks), _count(sinks),
        )  # fmt: skip

    first_bf16 = T if bf16_row is None else bf16_row
    if rc == -3:  # not a decode row, or a head size the row kernel does not take
        rc = every_row(first_bf16)
    if rc == -3 and first_bf16 < T:
        # the bf16 pairs take heads of 64 and 128 only (or this CPU has none): every row in
        # fp32. SDPA instead (as ran on an AMX CPU, whose rows are all bf16 ones, for a head
        # of 32 or 256) split a chunk's rows by its length, so a row's bits followed it
        rc = every_row(T)
    if rc == -3:  # a head size or CPU it does not take
        return None
    if rc == -2:
        raise ValueError(
            f"the kernels refused attention of q {list(q.shape)} over k "
            f"{list(k.shape)}, v {list(v.shape)}: a shape or stride past a buffer"
        )
    if rc != 0:
        raise MemoryError("no scratch memory for the attention")
    return out.transpose(1, 2)  # (1, H, T, D), a view: the caller's transpose back is free
