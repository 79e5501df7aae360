"""The fused decode step: one C call per step for one or many sequences (kernels/decode.c).

A decode step of the torch model is ~500 small ops (norms, RoPE, cache writes, attention,
residuals) around 121 products; at 576 wide each op costs a few microseconds of dispatch,
together about as much as the low-bit products themselves. `kvlm_decode_batch` runs the
same math for one token of each of B sequences in one call: every layer's norm, fused
q|k|v product, RoPE at each row's own position, K/V written into each row's slot (fp32;
bf16 rounded as torch rounds; int8 quantized as kvlm.cache.storage does, K through its
rotation), attention over each row's slots so far (the query heads of a KV head together,
positions split in chunks across threads and merged by log-sum-exp), o product, residual,
norm, gate|up, SiLU (or GELU), down, residual, then the final norm and the vocabulary. The
products read each weight once for up to 16 rows. With `--activations int8|int16` the
products round their input per group of 32 to int8 (and an int8 residual: int16;
kvlm.model.quant), as the torch path's products do. Over an int8 cache the scores are
integer dot products: each query head (rotated like K) rounds to int8 with one scale, as
llama.cpp does for its q8_0 cache; the torch path dequantizes K instead, so the two agree
to that rounding.

The cache is addressed through views (kvlm.cache.base.KVView: what a cache declares,
`KVCache.kv_views`, and `BlockPool.views` for the engine's pool): each a store, the rows'
block tables, a block size, a ring size and its window, and the model layers it holds;
every layer reads and writes its own view. A paged pool (kvlm.cache.paged: the engine's
batch, a PagedCache's rows) is a view per layer group; a contiguous cache one, its row b
being block b of a pool of blocks holding every slot (one request's cache, and its n
samples after `cache.fork(n)`); a hybrid contiguous cache (kvlm.cache.hybrid) one per
part, its whole part so and each window's ring, where position s is slot s % (W +
RING_SLACK): the local layers' cost stays that of their window however long the context.
The step writes them in place; the cache is told (`KVCache.written_in_place`: a ring takes
a draft's undo record first, then its commit only records the positions). Chunks start
at multiples of 16 and every product sums a row alike whatever rows share it, so a
sequence gets the same logits, bit for bit, alone or in any batch, paged or contiguous
(tests/test_fused_batch.py; a ring whose size is a multiple of 4 groups its rows as a pool
does).

Every block the families describe (kvlm.config.ModelConfig): the q|k|v bias (Qwen2) and
o_proj's (Llama's attention_bias) added after their products, as torch's Linear adds them;
the q/k RMSNorms before RoPE (ModelConfig.qk_norm), each head's or each whole
projection's (qk_norm_extent); the model's sliding window
(Mistral), the query at p seeing keys p - W < s <= p as kvlm.cache.base.causal_mask does
(its chunks then cover the visible keys from the multiple of 16 below the first, boundaries
still set by p alone); a window per layer (layer_windows: 0 on the global ones) and a RoPE
table per layer (the local layers' own base, rope_local_theta), the attention's and the
MLP's outputs normed before the residual (norm_layout "sandwich"; a family's 1 + w norms
come folded into the weights), GeGLU with tanh's GELU (activation), the score scale
(query_scale: in the q norm where there is one, else on the scores), the attention soft-cap
on the scores in C and the final logit soft-cap on the logits after the call (the embeddings
come scaled by `Transformer.embed`); head_dim up to 256 (MAX_HEAD_DIM); a tied or separate
lm_head, read in its stored format (a 262k-entry vocabulary's Q6_K blocks). Gated short
convolutions beside attention layers (the conv layer kind, kvlm.model.conv;
kernels/conv.c): in_proj, B * x, the taps over the sequence's held rows and the new one,
C * that, out_proj, the rows read and moved on in place through a `ConvView` of the
cache's conv part
(kvlm.cache.conv: the rows ConvStep reads, moved on as ConvRows.commit moves them, once
the step's logits are made, so a step that fails leaves them as they were), or of the
engine pool's slots (ConvSlots.view: a ring a slot, each row's u written at its
position's ring row after the logits, the sealed blocks' end rows copied by
ConvSlots.written); a draft's rows are one sequence to the convolution, as the torch
model takes them. Recurrent layers beside attention layers (a gated DeltaNet, a Mamba2
layer: kvlm.model.deltanet, kvlm.model.mamba2; kernels/deltanet.c, mamba2.c): in_proj,
the taps over the sequence's held rows and the new one, the layer's kernel from the row's
state before the step to its state after, out_proj, through a `StateView` (kvlm.cache.
recurrent): the states read where they are (a one-sequence cache's DeltaRows, the pool's
slots), each row's after written into the step's out buffer, which the cache keeps once
the step succeeded (DeltaRows.commit), or into the pool's slots in place (the C step
refuses a bad step before it writes any; StateSlots.written then takes the snapshots), the
conv rows moved on in place as a conv layer's; one row a sequence (a draft's rows keep
each row's state: the torch step's). Gated attention (q|gate|k|v, the output times
sigmoid(gate)) and partial RoPE (the first rotary_dim of each head), a residual
multiplier (each output times it before the add) and logit divisor (after the call) and
NoPE (RoPE tables of zero frequencies: cos 1, sin 0). Attention sinks (a logit a query
head in each row's softmax denominator: the merge of a head's chunks starts at it). A
mixture of experts (kernels/experts.c): the routers "softmax", "sigmoid" (a selection
bias) and "topk_softmax" over every expert (not group-limited routing: the torch step
routes it), the router's own bias, the routed experts' gate|up and down biases, their
activation the model's or the clamped SwiGLU, a shared expert beside them.

It applies where that is the whole story: CPU, fp32 activations, low-bit weights in every
projection (`--weights int8|int4|native`), no biases on a dense or shared MLP (a routed
expert's it adds), and fp32, bf16, fp16, int8 or q4 K/V
in a contiguous, paged or hybrid contiguous cache (a conv model's rows, a recurrent model's
states beside either) or the engine's pool (a conv group's slots, a state group's too:
`pool_why_not`).
Anything else (prefill, the window, basic and off caches, a draft longer than a ring's
slack: `drafts`, other formats) runs the torch model. `KVLM_NO_FUSED=1` turns it off.
Tests hold its logits to the torch path's.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref
from collections.abc import Sequence

import torch

from kvlm import kernels
from kvlm.cache import KVCache
from kvlm.cache.base import CacheStep, ConvView, KVView, StateView
from kvlm.cache.factory import FUSED_MODES
from kvlm.cache.paged import BlockPool
from kvlm.cache.storage import Store, key_rotation, value_rotation
from kvlm.config import ModelConfig
from kvlm.dtypes import Q4
from kvlm.model.attention import _base, _room
from kvlm.model.experts import EXPERT_ACT_CODES, GROUPS_REFUSED, ROUTER_CODES, Experts
from kvlm.model.layers import MLP, Linear
from kvlm.model.quant import KIND_CODES
from kvlm.model.transformer import Block, Transformer

_ABI = kernels.CONSTANTS  # kernels/abi.h's numbers: one place for each
MAX_ROWS = _ABI["MAX_BATCH"]  # the most sequences one step takes
# why the other modes' caches decode on the torch step (FUSED_MODES: the caches declare it)
_READ = " and ".join(filter(None, [", ".join(FUSED_MODES[:-1]), FUSED_MODES[-1]]))
NOT_THIS_CACHE = f"the fused step reads {_READ} caches"
QMAT_PARTS = _ABI["QMAT_PARTS"]  # row parts of different kinds one projection may have


def _fields(ctype, names: str) -> list[tuple[str, type]]:
    """A ctypes Structure's fields of one type, named in order."""
    return [(name, ctype) for name in names.split()]


# kvlm_qpart, kvlm_qmat, kvlm_qlayer and kvlm_qmodel in kernels/abi.h, field for field
# (tests/test_kernel_abi.py holds names, order, types, offsets and sizes to the header's)
class _QPart(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        *_fields(ctypes.c_int64, "n bytes"),
    ]


class _QMat(ctypes.Structure):
    _fields_ = [*_fields(ctypes.c_int64, "n k parts"), ("part", _QPart * QMAT_PARTS)]


class _QLayer(ctypes.Structure):
    _fields_ = [
        *_fields(ctypes.c_void_p, "input_norm post_norm"),
        *_fields(_QMat, "qkv o gate_up down"),
        # NULL when absent: biases, q/k norms, a sandwich block's output norms
        *_fields(ctypes.c_void_p, "qkv_bias o_bias q_norm k_norm attn_out_norm mlp_out_norm"),
        # window: the layer's own (0: whole context; -1: the step's); rope: its cos/sin
        # table; view, index: where its K/V are (a _KVView, its layer inside that store),
        # or a conv layer's rows (a _ConvView); mixer: MIX_ATTENTION or MIX_CONV
        *_fields(ctypes.c_int64, "window rope view index mixer"),
        # a conv layer's products, their biases, its taps (L, H) and their bias (NULL: none)
        *_fields(_QMat, "in_proj out_proj"),
        *_fields(ctypes.c_void_p, "in_bias out_bias taps taps_bias"),
        # a recurrent layer's A_log, dt_bias, D (NULL: a DeltaNet's) and gated norm weight
        *_fields(ctypes.c_void_p, "a_log dt_bias d gnorm"),
        # FFN_MLP (gate_up, down) or FFN_EXPERTS: the router's fp32 (experts, hidden) and
        # each expert's gate|up and down (arrays of n_experts), top_k a row
        ("ffn", ctypes.c_int64),
        ("router", ctypes.c_void_p),
        *_fields(ctypes.POINTER(_QMat), "exp_gate_up exp_down"),
        *_fields(ctypes.c_int64, "n_experts top_k normalize expert_inter"),
        # a shared expert beside them (gate_up and down above; 0: none) and its gate's
        # fp32 (hidden) (NULL: none)
        ("shared_inter", ctypes.c_int64),
        ("shared_gate", ctypes.c_void_p),
        # the router's kind (ROUTER_*), its selection bias (NULL: none), the
        # renormalisation's epsilon and the weights' scale
        ("router_kind", ctypes.c_int64),
        ("expert_bias", ctypes.c_void_p),
        *_fields(ctypes.c_double, "route_eps route_scale"),
        # the router's own bias, the experts' gate|up and down biases stacked (NULL: none),
        # their activation (EXP_ACT_*) and the clamped SwiGLU's alpha and limit
        *_fields(ctypes.c_void_p, "router_bias exp_gate_up_bias exp_down_bias"),
        ("exp_act", ctypes.c_int64),
        *_fields(ctypes.c_float, "swiglu_alpha swiglu_limit"),
        ("sinks", ctypes.c_void_p),  # attention sinks: a logit a query head (NULL: none)
    ]


class _QModel(ctypes.Structure):
    _fields_ = [
        *_fields(ctypes.c_int64, "n_layers hidden n_heads n_kv_heads head_dim inter slots"),
        ("eps", ctypes.c_float),
        ("layers", ctypes.POINTER(_QLayer)),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", _QMat),
        *_fields(ctypes.c_int64, "k_dtype v_dtype act_int8 act_int16"),
        ("key_rot", ctypes.c_void_p),
        # window: the step's sliding window for the layers without their own (0: none);
        # gelu: GeGLU, not SwiGLU
        *_fields(ctypes.c_int64, "window gelu"),
        *_fields(ctypes.c_float, "score_scale attn_softcap"),  # softcap 0: none
        ("rope_tables", ctypes.c_int64),  # cos/sin tables: 1, or 2 (a local base)
        ("conv_kernel", ctypes.c_int64),  # a conv or recurrent layer's taps (0: none)
        # the dimensions RoPE rotates; 1: q|gate|k|v, the output gated
        *_fields(ctypes.c_int64, "rotary_dim attn_gate"),
        *_fields(ctypes.c_float, "residual_scale rec_eps"),  # residual_scale 0: none
        # a recurrent layer's value heads, their channels, a key head's (the state size),
        # the key heads (groups)
        *_fields(ctypes.c_int64, "rec_heads rec_head_dim rec_key_dim rec_groups"),
        ("qk_norm_whole", ctypes.c_int64),  # 1: the q/k norms over each whole projection
        ("val_rot", ctypes.c_void_p),  # a quantized V stored as v R: R (NULL: V as it is)
    ]


class _KVView(ctypes.Structure):  # kvlm_kv_view
    _fields_ = [
        *_fields(ctypes.c_void_p, "k v kp vp tables"),
        *_fields(ctypes.c_int64, "width num_blocks block_size ring layers"),
        *_fields(ctypes.c_int64, "k_layer v_layer kp_layer vp_layer"),
        # the tables' int32s, and the bytes from k, v, kp, vp on (their storage's): the
        # C step refuses a pool whose blocks reach past them
        *_fields(ctypes.c_int64, "entries k_bytes v_bytes kp_bytes vp_bytes"),
    ]


class _ConvView(ctypes.Structure):  # kvlm_conv_view
    _fields_ = [
        ("rows", ctypes.c_void_p),
        *_fields(ctypes.c_void_p, "seq ends"),  # [B] int64s each: a row's sequence, its end
        *_fields(ctypes.c_int64, "layers batch keep width"),
        ("layout", ctypes.c_int64),  # CONV_ROWS (ConvRows') or CONV_SLOTS (ConvSlots' rings)
        # seq's and ends' int64s, the bytes from rows on (its storage's)
        *_fields(ctypes.c_int64, "entries bytes"),
    ]


class _StateView(ctypes.Structure):  # kvlm_state_view
    _fields_ = [
        ("conv", _ConvView),
        *_fields(ctypes.c_void_p, "in out"),  # the states before the step; each row's after
        # a layer's state of a sequence (floats), out's rows, the bytes from in and out on
        *_fields(ctypes.c_int64, "state out_rows in_bytes out_bytes"),
        # the draft rows' states and the rows' convolution inputs (or NULL), snaps' rows a
        # layer, the bytes from snaps and urows on
        *_fields(ctypes.c_void_p, "snaps urows"),
        *_fields(ctypes.c_int64, "snap_rows snaps_bytes urows_bytes"),
        # a DeltaNet's carried rows before and after the step and the draft rows', a
        # layer's floats of one sequence (0: none, a Mamba2's), the bytes from each on
        *_fields(ctypes.c_void_p, "win win_out wsnaps"),
        *_fields(ctypes.c_int64, "carried win_bytes win_out_bytes wsnaps_bytes"),
    ]


# the cache dtypes the fused step reads and writes (kvlm_qmodel.k_dtype, v_dtype: abi.h)
_KV_DTYPE = {
    torch.float32: _ABI["KV_F32"],
    torch.bfloat16: _ABI["KV_BF16"],
    torch.int8: _ABI["KV_I8"],
    torch.float16: _ABI["KV_F16"],
    Q4: _ABI["KV_Q4"],
}


def _mlp(block: Block) -> MLP:
    """The block's gated MLP, or its first expert's: every expert's products take the
    same activation settings and its activation (the step's gate|up and down bits)."""
    return block.mlp.experts[0] if isinstance(block.mlp, Experts) else block.mlp


def block_products(block: Block) -> tuple[Linear, Linear, Linear, Linear]:
    """A block's four low-bit products in the step's order: its mixer's input and output
    (attention: q|k|v, o; a short convolution or a recurrent layer: in_proj, out_proj),
    gate|up, down (a mixture of experts': its first expert's, which stand for all;
    their bits of the activation masks, kvlm_qmodel.act_int8 / act_int16:
    `_product_bits`; the vocabulary's is ACT_HEAD)."""
    mlp = _mlp(block)
    mixer = block.conv if block.conv is not None else block.recurrent
    if mixer is not None:
        return mixer.in_proj, mixer.out_proj, mlp.gate_up, mlp.down
    return block.attn.qkv, block.attn.o_proj, mlp.gate_up, mlp.down


def _qmat(lin: Linear) -> _QMat:
    q = lin.quant
    parts = [_QPart(KIND_CODES[p.kind], p.data.data_ptr(), p.out_features, p.data.nbytes)
             for p in q.parts()]  # fmt: skip
    if len(parts) > QMAT_PARTS:
        raise ValueError(f"a projection of {len(parts)} parts of different kinds")
    return _QMat(q.out_features, q.in_features, len(parts), (_QPart * QMAT_PARTS)(*parts))


def _layer_bytes(t: torch.Tensor | None) -> int:
    """Bytes from one layer's rows (or parameters) to the next in a store's K or V."""
    return 0 if t is None else t.stride(0) * t.element_size()


def _bytes(t: torch.Tensor | None) -> int:
    """Bytes of t's storage from t's first element on (0: None): what the C step handed
    t.data_ptr() may reach."""
    return 0 if t is None else _room(t) * t.element_size()


def _stacked(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Every expert's bias of one product stacked, (experts, rows) contiguous fp32, or None
    where they have none (_block_why_not: all or none of them have one)."""
    return None if biases[0] is None else torch.stack(biases).float().contiguous()


def _ptr(t: torch.Tensor | None, n: int) -> int | None:
    """The address of an fp32 CPU vector of n elements (None: NULL)."""
    if t is None:
        return None
    if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
        raise ValueError(f"expected {n} contiguous fp32 values, got {tuple(t.shape)} {t.dtype}")
    return t.data_ptr()


MAX_HEAD_DIM = _ABI["MAX_HEAD_DIM"]  # the attention's buffers (the widest head kvlm runs)
_REC_MAX_DIM = 512  # kernels/deltanet.c's DELTA_MAX_DIM, mamba2.c's MAMBA_MAX_DIM


OWN_HEADS = "layers of their own head size or KV heads"  # no part in kernels/ yet
# kvlm_qlayer has one FFN a layer, and kernels/experts.c's router no input norm or
# per-expert scale (Experts.beside_mlp, router_norm, expert_scale)
BESIDE = "experts beside a dense MLP, or a router's input norm or per-expert scales"


def mixer_why_not(mixer: str) -> str | None:
    """Why the fused step cannot run a layer of this mixer kind (None: it can)."""
    return None if mixer in _MIXERS else f"a {mixer} layer (the step has no kernel for one yet)"


def config_why_not(c: ModelConfig) -> str | None:
    """The reason the fused step cannot run any model of this config (None: it may, as
    far as the config says; `why_not` checks the built model too). kvlm.defaults reads
    it: a model this refuses decodes on the torch step, where fp16 K/V would be converted
    to fp32 every step."""
    if os.environ.get("KVLM_NO_FUSED"):
        return "disabled by KVLM_NO_FUSED"
    missing = sorted({m for m in c.layer_mixers if m not in _MIXERS})
    if missing:  # a layer kind kernels/ has no part for yet
        return mixer_why_not(missing[0])
    if c.rotary_dim % 2:
        return f"RoPE over an odd {c.rotary_dim} dimensions"
    # what kernels/ has no part for yet (the torch step runs them)
    if c.layer_head_dims or c.layer_kv_heads:
        return OWN_HEADS
    if any(c.layer_k_eq_v) or c.v_norm:
        return "K = V layers, or V normed"
    if len(c.cache_layers) != c.num_layers:
        return "layers that read an earlier layer's K/V"
    if c.per_layer_input or c.layer_scalars:
        return "per-layer inputs, or a scalar on each layer's output"
    if c.layer_intermediate_sizes:
        return "layers of their own MLP width"
    x = c.experts
    if x is not None and x.router not in ROUTER_CODES:
        return f"an expert router {x.router!r} (the step's routers: {', '.join(ROUTER_CODES)})"
    if x is not None and x.group_limited:
        return GROUPS_REFUSED
    if x is not None and x.activation not in EXPERT_ACT_CODES:
        return f"the experts' activation {x.activation!r}"
    if x is not None and (x.beside_mlp or x.router_norm or x.expert_scale):
        return BESIDE
    rec = c.deltanet or c.mamba2
    if rec is not None:  # kernels/deltanet.c's and mamba2.c's limits
        d = c.deltanet
        dims = (d.key_dim, d.value_dim) if d else (c.mamba2.head_dim, c.mamba2.state_size)
        if max(dims) > _REC_MAX_DIM or (c.mamba2 and c.mamba2.inner // c.mamba2.groups > 16384):
            return f"a recurrent layer's head over {_REC_MAX_DIM} (or a norm group over 16384)"
    return None


def why_not(model: Transformer) -> str | None:
    """None when the fused step can run this model, else the reason it cannot."""
    if os.environ.get("KVLM_NO_FUSED"):
        return "disabled by KVLM_NO_FUSED"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "needs fp32 activations on the CPU"
    c = model.config
    reason = config_why_not(c)
    if reason is not None:
        return reason
    if all(block.attn is None for block in model.layers):
        return "no attention layer"
    if c.num_heads // c.num_kv_heads > 8 or c.head_dim > MAX_HEAD_DIM or c.head_dim % 2:
        return f"more than 8 query heads per KV head, or head_dim > {MAX_HEAD_DIM} or odd"
    moes = [b.mlp for b in model.layers if isinstance(b.mlp, Experts)]
    routers = {id(m.router) for m in moes} | {id(m.shared_gate) for m in moes}
    if any(isinstance(m, Linear) and m.kernel != "quant" and id(m) not in routers
           for m in model.modules()):  # fmt: skip
        return "needs low-bit weights in every projection (--weights int8|int4|native)"
    for block in model.layers:
        reason = _block_why_not(block, c.rms_norm_eps)
        if reason is not None:
            return reason
    if model.lm_head.bias is not None:
        return "an lm_head bias"
    if kernels.library() is None:
        return "no compiled kernels"
    return None


def _block_why_not(block: Block, eps: float) -> str | None:
    """Why the step cannot run this block (None: it can)."""
    moe = block.mlp if isinstance(block.mlp, Experts) else None
    routed = [] if moe is None else [*moe.experts]
    dense = [block.mlp] if moe is None else [] if moe.shared is None else [moe.shared]
    if any(m.gate_up.bias is not None or m.down.bias is not None for m in dense):
        return "MLP biases (the step adds a routed expert's, not a dense or shared MLP's)"
    if len({(m.gate_up.bias is None, m.down.bias is None) for m in routed}) > 1:
        return "biases on some experts and not on others"
    # the activations the model's own (kvlm_qmodel.gelu): the dense MLP's, the shared
    # expert's, and the routed experts' where the config names none of theirs
    mlps = dense + ([] if moe is None or moe.config.activation else routed)
    if mlps and (any(m.act != mlps[0].act for m in mlps) or mlps[0].act not in _ACTS):
        return f"the MLP's activation {mlps[0].act!r}"
    if moe is not None and moe.router_weight.dtype != torch.float32:
        return "a router not in fp32"
    if moe is not None and moe.kernel_refusal() is not None:
        return moe.kernel_refusal()
    gate = None if moe is None else moe.shared_gate_weight
    if gate is not None and gate.dtype != torch.float32:
        return "a shared expert's gate not in fp32"
    rec = block.recurrent
    if rec is not None and not all(
        p.dtype == torch.float32 and p.is_contiguous() for p in rec.parameters(recurse=False)
    ):
        return "a recurrent layer's parameters not contiguous fp32"
    norms = [] if block.attn is None else [block.attn.q_norm, block.attn.k_norm]
    if norms.count(None) == 1:
        return "a q norm without a k norm, or the reverse"
    norms += [block.attn_out_norm, block.mlp_out_norm]
    if any(n is not None and n.eps != eps for n in norms):
        return "a q/k or output norm eps other than the model's rms_norm_eps"
    return None


_ACTS = {"silu": 0, "gelu_tanh": 1}  # kvlm_qmodel.gelu
# the products' bits of kvlm_qmodel.act_int8 / act_int16: an attention block's and a conv
# block's, in block_products' order; the vocabulary projection's
_ACT = {n: _ABI[f"ACT_{n}"] for n in ("QKV", "O", "CONV_IN", "CONV_OUT", "GATE_UP", "DOWN")}
_ATTENTION_BITS = tuple(_ACT[n] for n in ("QKV", "O", "GATE_UP", "DOWN"))
_CONV_BITS = tuple(_ACT[n] for n in ("CONV_IN", "CONV_OUT", "GATE_UP", "DOWN"))
_ACT_HEAD = _ABI["ACT_HEAD"]
_ACT_BITS = (*_ACT.values(), _ACT_HEAD)  # every bit of the masks
# kvlm_qlayer.mixer
_MIXERS = {"attention": _ABI["MIX_ATTENTION"], "conv": _ABI["MIX_CONV"],
           "deltanet": _ABI["MIX_DELTA"], "mamba2": _ABI["MIX_MAMBA2"]}  # fmt: skip
_CONV_ROWS, _CONV_SLOTS = _ABI["CONV_ROWS"], _ABI["CONV_SLOTS"]  # kvlm_conv_view.layout
_FFNS = {"mlp": _ABI["FFN_MLP"], "experts": _ABI["FFN_EXPERTS"]}  # kvlm_qlayer.ffn


def _product_bits(block: Block) -> tuple[int, ...]:
    """The mask bits of block_products(block), in its order (a recurrent layer's in_proj
    and out_proj take a conv layer's bits)."""
    return _ATTENTION_BITS if block.attn is not None else _CONV_BITS


class FusedDecoder:
    """Binds a model's weights once; `run` runs one token of each of up to MAX_ROWS rows."""

    def __init__(self, model: Transformer, slots: int) -> None:
        reason = why_not(model)
        if reason is not None:
            raise ValueError(f"the fused decode step cannot run this model: {reason}")
        self.lib = kernels.library()
        c = model.config
        self.model = model
        self.slots = slots
        self.cos, self.sin = self._rope_tables(model, slots)
        layers = (_QLayer * c.num_layers)()
        self._experts: list = []  # each expert layer's arrays of _QMat: kept alive
        for i, block in enumerate(model.layers):
            layers[i] = self._layer(block, i)
            self._ffn(layers[i], block)
        self._layers = layers  # keep alive: the struct points into it
        self._placed: tuple | None = None  # the layers' (view, index) last set
        # each layer's kind of view and its index among that kind's layers (attention:
        # None; a ShortConv's or a recurrent layer's slot), read every step by _placement
        self._slots = tuple(_slot_of(b) for b in model.layers)
        self._pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool_why_not's
        shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                 c.intermediate_size)  # fmt: skip
        head = (_ptr(model.norm.weight, c.hidden_size), _qmat(model.lm_head))  # final_norm, lm_head
        self.spec = _QModel(*shape, slots, c.rms_norm_eps, layers, *head)
        # the model's gated MLPs' activation (why_not: every dense MLP's, shared expert's
        # and routed expert's without one of its own; unread where there are none)
        self.spec.gelu = _ACTS.get(c.activation, 0)
        # the first block of each mixer, whose products' activation settings every block
        # of its kind shares (_set_storage)
        self._firsts = list({_slot_of(b)[0]: b for b in reversed(model.layers)}.values())
        # a score scale with no q norm to fold it into (the first attention layer's: every one's)
        q_scale = next(b.attn for b in model.layers if b.attn is not None).q_scale
        self.spec.score_scale = (q_scale or 1.0) * c.head_dim**-0.5
        self.spec.conv_kernel = c.conv_kernel if c.conv_layers else 0
        self.spec.attn_softcap = c.attn_softcap or 0.0
        self.spec.rope_tables = self.cos.shape[0]
        self.spec.rotary_dim, self.spec.attn_gate = c.rotary_dim, int(c.attn_output_gate)
        self.spec.qk_norm_whole = int(c.qk_norm_extent == "projection")
        self.spec.residual_scale = c.residual_scale or 0.0
        self._recurrent_sizes(model)
        self.final_softcap, self.logit_scale = c.final_softcap, c.logit_scale
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.last_x: torch.Tensor | None = None  # the latest step's rows after it (run)
        self.vocab = model.lm_head.out_features
        if self.lib.kvlm_decode_scratch(ctypes.byref(self.spec), 1) < 0:
            raise ValueError("the fused decode step refused the model's sizes or weights' shapes")

    @staticmethod
    def _rope_tables(model: Transformer, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (tables, slots, head_dim): the torch path's own values at every position,
        of the model's base, then (rope_local_theta) of its local layers' base."""
        positions = torch.arange(slots, dtype=torch.long)[None]
        ropes = [r for r in (model.rope, model.local_rope) if r is not None]
        cos, sin = zip(*(r(positions, torch.float32) for r in ropes), strict=True)
        return (torch.stack([t.reshape(slots, -1) for t in ts]).contiguous() for ts in (cos, sin))

    def _recurrent_sizes(self, model: Transformer) -> None:
        """kvlm_qmodel's recurrent fields from the model's recurrent layers (every one of
        one kind): a DeltaNet's (nk, nv, dk, dv), a Mamba2's (groups, heads, state_size,
        head_dim) as (key heads, value heads, a key head's, a value head's), its taps."""
        c, spec = model.config, self.spec
        layers = [b.recurrent for b in model.layers if b.recurrent is not None]
        if not layers:
            return
        if c.deltanet is not None:
            d = c.deltanet
            sizes = (d.key_heads, d.value_heads, d.key_dim, d.value_dim, d.conv_kernel)
        else:
            m = c.mamba2
            sizes = (m.groups, m.heads, m.state_size, m.head_dim, m.conv_kernel)
        spec.rec_groups, spec.rec_heads, spec.rec_key_dim, spec.rec_head_dim = sizes[:4]
        spec.conv_kernel, spec.rec_eps = sizes[4], layers[0].eps

    def _layer(self, block: Block, i: int) -> _QLayer:
        hidden = self.model.config.hidden_size
        norms = (_ptr(block.input_norm.weight, hidden), _ptr(block.post_norm.weight, hidden))
        outs = [_ptr(None if n is None else n.weight, hidden)
                for n in (block.attn_out_norm, block.mlp_out_norm)]  # fmt: skip
        if block.conv is not None:
            return self._conv_layer(block, norms, outs)
        if block.recurrent is not None:
            return self._recurrent_layer(block, norms, outs, self.model.config.layer_mixers[i])
        attn = block.attn
        mats = [_qmat(lin) for lin in block_products(block)]
        biases = [_ptr(lin.bias, lin.out_features) for lin in (attn.qkv, attn.o_proj)]
        sizes = self.model.config.qk_norm_sizes  # a head's, or each whole projection's
        qk = [_ptr(None if n is None else n.weight, size)
              for n, size in zip((attn.q_norm, attn.k_norm), sizes, strict=True)]  # fmt: skip
        windows = self.model.config.layer_windows
        window = (windows[i] or 0) if windows else -1  # -1: the step's (Mistral's)
        layer = _QLayer(*norms, *mats, *biases, *qk, *outs, window, self.model._rope_of[i], 0, i)
        if attn.sinks is not None:  # attention sinks: fp32 (H,), the model's own tensor
            layer.sinks = _ptr(attn.sinks.detach(), attn.num_heads)
        return layer

    def _ffn(self, layer: _QLayer, block: Block) -> None:
        """kvlm_qlayer's FFN fields: FFN_MLP (gate_up and down, set with the layer), or a
        mixture of experts' router and each expert's products."""
        moe = block.mlp
        if not isinstance(moe, Experts):
            layer.ffn = _FFNS["mlp"]
            return
        x = moe.config
        gate_up = (_QMat * x.count)(*(_qmat(e.gate_up) for e in moe.experts))
        down = (_QMat * x.count)(*(_qmat(e.down) for e in moe.experts))
        self._experts.append((gate_up, down))
        router = moe.router_weight
        layer.ffn, layer.router = _FFNS["experts"], _ptr(router, router.numel())
        layer.exp_gate_up, layer.exp_down = gate_up, down
        layer.n_experts, layer.top_k, layer.normalize = x.count, x.top_k, int(x.normalize)
        layer.expert_inter = x.intermediate
        layer.router_kind, layer.route_eps, layer.route_scale = (
            ROUTER_CODES[x.router], x.norm_eps, x.scale)  # fmt: skip
        if moe.bias is not None:
            layer.expert_bias = _ptr(moe.bias, moe.bias.numel())
        # the router's own bias; each expert's biases stacked (kept alive with the arrays)
        rb = moe.router_bias()
        biases = [_stacked([getattr(e, part).bias for e in moe.experts])
                  for part in ("gate_up", "down")]  # fmt: skip
        self._experts.append((rb, *biases))
        layer.router_bias = _ptr(rb, x.count)
        layer.exp_gate_up_bias = _ptr(biases[0], x.count * 2 * x.intermediate)
        layer.exp_down_bias = _ptr(biases[1], x.count * self.model.config.hidden_size)
        layer.exp_act = EXPERT_ACT_CODES[x.activation]
        layer.swiglu_alpha, layer.swiglu_limit = x.swiglu_alpha, x.swiglu_limit
        if moe.shared is not None:  # its products where a dense MLP's go
            layer.gate_up, layer.down = _qmat(moe.shared.gate_up), _qmat(moe.shared.down)
            layer.shared_inter = x.shared
            gate = moe.shared_gate_weight
            layer.shared_gate = None if gate is None else _ptr(gate, gate.numel())

    def _conv_layer(self, block: Block, norms: tuple, outs: list) -> _QLayer:
        """A conv layer's struct: its products, their biases, the taps (L, H) and theirs
        (kvlm_qlayer's conv fields); no q|k|v, o or window."""
        conv, c = block.conv, self.model.config
        h = c.hidden_size
        mlp = _mlp(block)
        layer = _QLayer(*norms, gate_up=_qmat(mlp.gate_up), down=_qmat(mlp.down),
                        attn_out_norm=outs[0], mlp_out_norm=outs[1], mixer=_MIXERS["conv"],
                        in_proj=_qmat(conv.in_proj), out_proj=_qmat(conv.out_proj))  # fmt: skip
        layer.in_bias = _ptr(conv.in_proj.bias, 3 * h)
        layer.out_bias = _ptr(conv.out_proj.bias, h)
        layer.taps = _ptr(conv.kernel, c.conv_kernel * h)
        layer.taps_bias = _ptr(conv.bias, h)
        return layer

    def _recurrent_layer(self, block: Block, norms: tuple, outs: list, mixer: str) -> _QLayer:
        """A recurrent layer's struct: its products, their biases, the taps (L, its conv's
        channels) and their bias (Mamba2's), A_log, dt_bias, D (Mamba2's) and the gated
        norm's weight (kvlm_qlayer's recurrent fields); no q|k|v, o or window."""
        rec = block.recurrent
        mlp = _mlp(block)
        layer = _QLayer(*norms, gate_up=_qmat(mlp.gate_up), down=_qmat(mlp.down),
                        attn_out_norm=outs[0], mlp_out_norm=outs[1], mixer=_MIXERS[mixer],
                        in_proj=_qmat(rec.in_proj), out_proj=_qmat(rec.out_proj))  # fmt: skip
        layer.in_bias = _ptr(rec.in_proj.bias, rec.in_proj.out_features)
        layer.out_bias = _ptr(rec.out_proj.bias, rec.out_proj.out_features)
        layer.taps = _ptr(rec.kernel, rec.kernel.numel())
        bias = getattr(rec, "conv_bias", None)
        layer.taps_bias = _ptr(bias, rec.kernel.shape[1])
        layer.a_log, layer.dt_bias = (_ptr(p, p.numel()) for p in (rec.a_log, rec.dt_bias))
        d = getattr(rec, "d", None)
        layer.d = _ptr(d, rec.a_log.numel())
        layer.gnorm = _ptr(rec.norm, rec.norm.numel())
        return layer

    def accepts(self, cache: KVCache) -> bool:
        """A cache whose K/V are views (KVCache.kv_views: contiguous, paged, int8, a
        hybrid cache of contiguous parts and rings, and of conv rows) of stores the step
        reads, in one pair of dtypes, each ring at least its window, conv rows it reads,
        positions within these slots, any batch up to MAX_ROWS."""
        if cache.batch > MAX_ROWS or cache.capacity > self.slots:
            return False
        views = cache.kv_views(())
        if not views:
            return False
        kv, convs, states = _split(views)
        if not kv or not all(self.reads_rows(v) for v in convs):
            return False
        if not all(self.reads_state(v) for v in states):
            return False
        try:
            self._placement(kv, convs, states)
        except ValueError:  # say, no conv rows: a cache made for another spec (the torch
            return False  # step says why)
        dtypes = (kv[0].store.k_dtype, kv[0].store.v_dtype)
        return all(self.reads(v.store) and (v.store.k_dtype, v.store.v_dtype) == dtypes
                   and (not v.ring or 0 < v.window <= v.ring) for v in kv)  # fmt: skip

    def reads_rows(self, view: ConvView) -> bool:
        """Whether the step reads and writes these conv rows: fp32 on the CPU, contiguous,
        (layers, sequences, keep, H) (ConvRows'), or (layers, slots * ring + 1, H) (ConvSlots'
        rings, `view.ring`), with keep (ring) at least the taps' L - 1."""
        rows, c = view.rows, self.model.config
        if view.ring:
            shape = rows.dim() == 3 and (rows.shape[1] - 1) % view.ring == 0 < rows.shape[1] - 1
            keep = view.ring
        else:
            shape, keep = rows.dim() == 4, rows.shape[2] if rows.dim() == 4 else 0
        return (rows.dtype == torch.float32 and rows.device.type == "cpu"
                and rows.is_contiguous() and shape and rows.shape[-1] == c.hidden_size
                and keep >= c.conv_kernel - 1)  # fmt: skip

    def reads_state(self, view: StateView) -> bool:
        """Whether the step reads these states and writes their rows: fp32 on the CPU,
        contiguous, the states (layers, sequences, *state) of this model's recurrent layers,
        their conv rows (layers, sequences, L - 1, channels) (ConvRows' layout)."""
        state, rows, spec = view.state, view.conv.rows, self.spec
        if not spec.rec_heads or view.conv.ring:
            return False
        floats = spec.rec_heads * spec.rec_head_dim * spec.rec_key_dim
        width = spec.rec_heads * spec.rec_head_dim + 2 * spec.rec_groups * spec.rec_key_dim
        fp32 = all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                   for t in (state, rows))  # fmt: skip
        return (fp32 and state.dim() >= 3 and math.prod(state.shape[2:]) == floats
                and rows.dim() == 4 and rows.shape[:2] == state.shape[:2]
                and rows.shape[2] == spec.conv_kernel - 1 and rows.shape[3] == width)  # fmt: skip

    def pool_why_not(self, pool: BlockPool) -> str | None:
        """Why the step does not decode on the engine's pool (None: it does), from what its
        layer groups declare (BlockPool.views without tables): K/V stores it reads in one
        pair of dtypes, conv rows it reads (a conv group's slots: fp32 rings on the CPU),
        every layer in a view of its kind. Asked once a pool (its groups are fixed)."""
        if pool not in self._pools:
            self._pools[pool] = self._pool_reason(pool)
        return self._pools[pool]

    def _pool_reason(self, pool: BlockPool) -> str | None:
        views = pool.views([[] for _ in pool.groups])
        kv, convs, states = _split(views or ())
        if not kv:
            return "a pool with no K/V view"
        if not all(self.reads(v.store) for v in kv):
            return "a pool store of another dtype, device or layout"
        if len({(v.store.k_dtype, v.store.v_dtype) for v in kv}) > 1:
            return "a pool whose layer groups keep K/V in different dtypes"
        if not all(self.reads_rows(v) for v in convs):
            return "a pool's conv rows not fp32 on the CPU"
        if not all(self.reads_state(v) for v in states):
            return "a pool's recurrent states not fp32 on the CPU"
        try:
            self._placement(kv, convs, states)
        except ValueError as exc:
            return f"a pool whose layer groups the step cannot place: {exc}"
        return None

    def reads(self, store: Store) -> bool:
        """Whether the step reads and writes this storage (dtypes, device, layout)."""
        return store.k_dtype in _KV_DTYPE and store.v_dtype in _KV_DTYPE and all(
            t.device.type == "cpu" and t.is_contiguous() for t in store.parts.values())  # fmt: skip

    def drafts(self, cache: KVCache, n: int) -> bool:
        """Whether n draft rows of one sequence go through the step: at most MAX_ROWS, and
        all rows' K/V are written before any attends, so a ring must keep what row 0 reads
        when row n - 1 has written (n <= ring - window + 1). Conv rows take any draft; a
        recurrent state keeps each draft row's (StateView.snaps)."""
        kv = _split(cache.kv_views(()) or ())[0]
        return n <= MAX_ROWS and all(n <= v.ring - v.window + 1 for v in kv if v.ring)

    @staticmethod
    def views_of(cache: KVCache, step: CacheStep, rows: Sequence[int]) -> list[View]:
        """The step's K/V of `cache` for the fused step's rows (token i through the cache's
        row rows[i]): the cache told that the step writes them in place
        (KVCache.written_in_place: a state group stages its out buffer), then its views
        (KVCache.kv_views)."""
        cache.written_in_place(step)
        views = cache.kv_views(rows, step)
        if views is None:
            raise ValueError(f"a {cache.mode} cache has no views for the fused step")
        return views

    def _place(self, kv: Sequence[KVView], convs: Sequence[ConvView],
               states: Sequence[StateView]) -> None:  # fmt: skip
        """Each layer's (view, index) (`_placement`), set where they changed."""
        key = self._placement(kv, convs, states)
        if key != self._placed:
            for layer, (v, n) in zip(self._layers, key, strict=True):
                layer.view, layer.index = v, n
            self._placed = key

    def _placement(self, kv: Sequence[KVView], convs: Sequence[ConvView],
                   states: Sequence[StateView]) -> tuple:  # fmt: skip
        """Each layer's (view, index) from the views' layers: every layer in one view
        exactly, an attention layer's a KVView (v: its number among them), a conv layer's
        a ConvView (among those) at its ShortConv's slot, a recurrent layer's a StateView
        at its slot among the recurrent layers (the C step checks each index against its
        store); else ValueError."""
        placed: list[tuple[int, int] | None] = [None] * len(self._layers)
        for kind, views in (("kv", kv), ("conv", convs), ("state", states)):
            for v, view in enumerate(views):
                for n, layer in enumerate(range(len(placed)) if view.layers is None
                                          else view.layers):  # fmt: skip
                    if placed[layer] is not None:
                        raise ValueError(f"layer {layer} in two views")
                    mine, slot = self._slots[layer]
                    if mine != kind or (slot is not None and slot != n):
                        raise ValueError(f"layer {layer} in a view of another kind, or slot")
                    placed[layer] = (v, n)
        if None in placed:
            raise ValueError(f"layer {placed.index(None)} in no view")
        return tuple(placed)

    @staticmethod
    def _table(tables: Sequence[Sequence[int]], starts: Sequence[int], bs: int, ring: int):
        """(B, width) int32 block ids, -1 past a row's table (the C step refuses those)."""
        width = max(min(s, ring - 1 if ring else s) // bs + 1 for s in starts)
        table = torch.full((len(tables), width), -1, dtype=torch.int32)
        for b, t in enumerate(tables):
            row = t[:width]
            table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table

    def _c_views(self, views: Sequence[KVView], starts: Sequence[int]) -> tuple:
        """The views as kvlm_kv_view structs, and the tensors they point into."""
        out, keep = (_KVView * len(views))(), []
        c = self.model.config
        for i, v in enumerate(views):
            # (layers, 2, blocks, kv_heads, block_size, head_dim): K's and V's rows apart
            layers, _, blocks, heads, bs, _ = v.store.shape
            if (heads, bs, v.store.head_dim) != (c.num_kv_heads, v.block_size, c.head_dim):
                raise ValueError(f"a store of shape {v.store.shape} for blocks of "
                                 f"{v.block_size}: not this model's K/V")  # fmt: skip
            table = self._table(v.tables, starts, v.block_size, v.ring)
            keep.append(table)
            (k, kp), (val, vp) = v.store.rows(0), v.store.rows(1)
            out[i] = _KVView(k.data_ptr(), val.data_ptr(), _base(kp), _base(vp),
                             table.data_ptr(), table.shape[1], blocks, bs, v.ring, layers,
                             _layer_bytes(k), _layer_bytes(val), _layer_bytes(kp),
                             _layer_bytes(vp), table.numel(), _bytes(k), _bytes(val),
                             _bytes(kp), _bytes(vp))  # fmt: skip
        return out, keep

    def _c_convs(self, convs: Sequence[ConvView]) -> tuple:
        """The conv views as kvlm_conv_view structs, and the tensors they point into."""
        out, keep = (_ConvView * len(convs))(), []
        for i, v in enumerate(convs):
            if not self.reads_rows(v):
                raise ValueError(f"conv rows of shape {tuple(v.rows.shape)} {v.rows.dtype}: "
                                 f"not this model's, or not contiguous fp32")  # fmt: skip
            out[i] = _conv_view(v, keep)
        return out, keep

    def _c_states(self, states: Sequence[StateView]) -> tuple:
        """The state views as kvlm_state_view structs, and the tensors they point into."""
        out, keep = (_StateView * len(states))(), []
        for i, v in enumerate(states):
            if not self.reads_state(v) or v.out is None or v.out.dtype != torch.float32:
                raise ValueError(
                    f"recurrent states of shape {tuple(v.state.shape)} {v.state.dtype}: not "
                    "this model's, or not contiguous fp32"
                )
            floats = math.prod(v.state.shape[2:])
            if not v.out.is_contiguous() or v.out.shape[0] != v.state.shape[0]:
                raise ValueError(f"an out buffer of shape {tuple(v.out.shape)}")
            for t in (v.snaps, v.urows, v.win, v.win_out, v.wsnaps):
                if t is not None and not (t.dtype == torch.float32 and t.is_contiguous()
                                          and t.device.type == "cpu"):  # fmt: skip
                    raise ValueError(f"a state's buffer of shape {tuple(t.shape)} {t.dtype}")
            snap_rows = 0 if v.snaps is None else v.snaps.shape[1]
            carried = 0 if v.win is None else math.prod(v.win.shape[2:])
            out[i] = _StateView(_conv_view(v.conv, keep), v.state.data_ptr(), v.out.data_ptr(),
                                floats, v.out.shape[1], _bytes(v.state), _bytes(v.out),
                                _base(v.snaps), _base(v.urows), snap_rows, _bytes(v.snaps),
                                _bytes(v.urows), _base(v.win), _base(v.win_out),
                                _base(v.wsnaps), carried, _bytes(v.win), _bytes(v.win_out),
                                _bytes(v.wsnaps))  # fmt: skip
        return out, keep

    @torch.inference_mode()
    def run(
        self,
        views: Sequence[KVView | ConvView],
        tokens: Sequence[int],
        starts: Sequence[int],
        window: int | None = None,
    ) -> torch.Tensor:
        """Logits (B, V) of one token per row: row b's token at position starts[b], its
        K/V written into each view's slot for that position (which the caller has made the
        row's own), attending over its positions up to it (within the layer's window, or
        `window` for a model without per-layer ones). `views`: a KVView per group of
        layers (`views_of`; the engine's pool: one, its block tables), and a ConvView per
        group of conv layers (read, and moved on past the step's rows). A contiguous cache
        is a pool of one block per row holding every slot (tables [[0], [1], ...],
        block_size its slots); a draft's rows share one table at consecutive positions,
        each row computing what decoding its token alone would. The caller plans and
        commits the cache step (kvlm.engine.runner)."""
        if window is not None and window < 1:
            raise ValueError(f"sliding window {window}: must be at least 1")
        rows = len(tokens)
        x = self.model.embed(torch.tensor(tokens)).contiguous()  # times embed_scale
        pos = torch.tensor(starts, dtype=torch.int64)
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        need = self.lib.kvlm_decode_scratch(ctypes.byref(self.spec), rows)
        if need < 0:
            raise ValueError(f"the fused decode step refused a step of {rows} rows")
        if self.scratch.numel() < need:  # grows to the largest batch seen, then stays
            self.scratch = torch.empty(need, dtype=torch.float32)
        kv, convs, states = _split(views)
        self._set_storage(kv[0].store, window)
        self._place(kv, convs, states)
        c_views, _keep = self._c_views(kv, starts)
        c_convs, _keep_rows = self._c_convs(convs)
        c_states, _keep_states = self._c_states(states)
        # each buffer's length from the tensor itself (the C step refuses, -2, buffers
        # shorter than the step's shape)
        rc = self.lib.kvlm_decode_batch(
            ctypes.byref(self.spec), rows, x.data_ptr(), x.numel(), pos.data_ptr(), pos.numel(),
            self.cos.data_ptr(), self.cos.numel(), self.sin.data_ptr(), self.sin.numel(),
            c_views, len(kv), c_convs, len(convs), c_states, len(states),
            self.scratch.data_ptr(), self.scratch.numel(), logits.data_ptr(), logits.numel(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("no scratch memory for the fused decode step")
        if rc != 0:
            shapes = [(v.store.shape[2:5:2], v.ring) for v in kv]
            ends = [list(v.ends) for v in convs]
            raise ValueError(
                f"the fused decode step refused rows at positions {list(starts)} "
                f"({self.slots} slots; (blocks, block size), ring of each view: {shapes}; "
                f"conv rows' ends: {ends})"
            )
        self.last_x = x  # the rows' residual stream after the step (an MTP head's input)
        if self.final_softcap is not None:  # as the torch model caps its logits
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        if self.logit_scale is not None:  # as the torch model divides them
            logits = logits / self.logit_scale
        return logits

    def _set_storage(self, store: Store, window: int | None) -> None:
        """The step's cache dtype, K's and V's rotations, products' settings and window."""
        self.spec.k_dtype, self.spec.v_dtype = _KV_DTYPE[store.k_dtype], _KV_DTYPE[store.v_dtype]
        if store.k_quantized:  # codes + (step, zero) or scales per row; K stored rotated by R
            self.spec.key_rot = key_rotation(store.head_dim).data_ptr()  # cached, fp32
        # V stored as v R (value_rotation, cached, fp32), or as it is
        self.spec.val_rot = value_rotation(store.head_dim).data_ptr() if store.v_rotated else None
        # --activations int8 / int16: each product's act_int8 and act_int16, the same in
        # every block of a kind (LLM sets them: the first attention block's and conv
        # block's are read), then the vocabulary projection's own (fp32 under the
        # defaults): a bit each in two masks
        bits = {_ACT_HEAD: self.model.lm_head}
        for block in self._firsts:
            bits.update(zip(_product_bits(block), block_products(block), strict=True))
        self.spec.act_int8 = sum(bit for bit, p in bits.items() if p.act_int8)
        self.spec.act_int16 = sum(bit for bit, p in bits.items() if p.act_int16)
        self.spec.window = window or 0


View = KVView | ConvView | StateView  # what a cache's kv_views hands the step


def _split(views: Sequence[View]) -> tuple[list[KVView], list[ConvView], list[StateView]]:
    """A cache's views (KVCache.kv_views): its K/V's, its conv rows', its states'."""
    kv = [v for v in views if isinstance(v, KVView)]
    convs = [v for v in views if isinstance(v, ConvView)]
    return kv, convs, [v for v in views if isinstance(v, StateView)]


def _slot_of(block: Block) -> tuple[str, int | None]:
    """The kind of view a block's layer is in ("kv", "conv", "state") and its slot among
    that kind's layers (None for attention: a KVView's layers say)."""
    if block.conv is not None:
        return "conv", block.conv.slot
    if block.recurrent is not None:
        return "state", block.recurrent.slot
    return "kv", None


def _conv_view(v: ConvView, keep: list) -> _ConvView:
    """A ConvView as a kvlm_conv_view (its seq and ends tensors appended to `keep`)."""
    seq, ends = (torch.tensor(t, dtype=torch.int64) for t in (v.seqs, v.ends))
    keep += [seq, ends]
    entries = min(seq.numel(), ends.numel())
    if v.ring:  # (layers, slots * ring + 1, H): slots of `ring` rows, the zero row
        layers, n, width = v.rows.shape
        shape, layout = (layers, (n - 1) // v.ring, v.ring, width), _CONV_SLOTS
    else:
        shape, layout = tuple(v.rows.shape), _CONV_ROWS
    return _ConvView(v.rows.data_ptr(), seq.data_ptr(), ends.data_ptr(), *shape, layout, entries,
                     _bytes(v.rows))  # fmt: skip
