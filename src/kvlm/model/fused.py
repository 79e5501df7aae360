"""The fused decode step: one C call per step for one or many sequences (kernels/qgemm.c).

A decode step of the torch model is ~500 small ops (norms, RoPE, cache writes, attention,
residuals) around 121 products; at 576 wide each op costs a few microseconds of dispatch,
together about as much as the low-bit products themselves. `kvlm_decode_batch` runs the
same math for one token of each of B sequences in one call: every layer's norm, fused
q|k|v product, RoPE at each row's own position, K/V written into each row's slot (fp32;
bf16 rounded as torch rounds; int8 quantized as kvlm.cache.storage does, K through its
rotation), attention over each row's slots so far (the query heads of a KV head together,
positions split in chunks across threads and merged by log-sum-exp), o product, residual,
norm, gate|up, SiLU, down, residual, then the final norm and the vocabulary. The products
read each weight once for up to 16 rows. With `--activations int8` the products round
their input to int8 per group of 32 (kvlm.model.quant), as the torch path's products do.
Over an int8 cache the scores are integer dot products: each query head (rotated like K)
rounds to int8 with one scale, as llama.cpp does for its q8_0 cache; the torch path
dequantizes K instead, so the two agree to that rounding.

The cache is addressed through block tables (`FusedDecoder.run`, called by
kvlm.engine.runner.ModelRunner.run): a paged pool (kvlm.cache.paged: the engine's batch,
a PagedCache's rows) or a contiguous cache, whose row b is block b of a pool of blocks
holding every slot (one request's cache, and its n samples after `cache.fork(n)`).
Chunks start at multiples of 16 and every product sums a row alike whatever rows share
it, so a sequence gets the same logits, bit for bit, alone or in any batch, paged or
contiguous (tests/test_fused_batch.py).

Every supported family's block: the q|k|v bias (Qwen2) and o_proj's (Llama's
attention_bias) added after their products, as torch's Linear adds them; the per-head q/k
RMSNorm before RoPE (Qwen3); the model's sliding window (Mistral), the query at p seeing
keys p - W < s <= p as kvlm.cache.base.causal_mask does (its chunks then cover the visible
keys from the multiple of 16 below the first, boundaries still set by p alone); head_dim
up to 128; a tied or separate lm_head.

It applies where that is the whole story: CPU, fp32 activations, low-bit weights in every
projection (`--weights int8|int4|native`), no MLP biases, and fp32, bf16 or int8 K/V in a
contiguous or paged cache. Anything else (prefill, window and basic caches, other formats)
runs the torch model.
`KVLM_NO_FUSED=1` turns it off. Tests hold its logits to the torch path's.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

from kvlm import kernels
from kvlm.cache import KVCache
from kvlm.cache.contiguous import ContiguousCache
from kvlm.cache.paged import Int8PagedCache, PagedCache
from kvlm.cache.storage import Store, key_rotation
from kvlm.model.layers import Linear
from kvlm.model.quant import KIND_CODES
from kvlm.model.transformer import Transformer

MAX_ROWS = 256  # the most sequences one step takes (MAX_BATCH in qgemm.c)
CACHE_MODES = ("contiguous", "paged", "int8")  # the caches whose layout the step reads
NOT_THIS_CACHE = "the fused step reads contiguous and paged caches"  # why the others do not
QMAT_PARTS = 3  # row parts of different kinds one projection may have (qgemm.c)


def _fields(ctype, names: str) -> list[tuple[str, type]]:
    """A ctypes Structure's fields of one type, named in order."""
    return [(name, ctype) for name in names.split()]


# kvlm_qpart, kvlm_qmat, kvlm_qlayer and kvlm_qmodel in qgemm.c
class _QPart(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("data", ctypes.c_void_p), ("n", ctypes.c_int64)]


class _QMat(ctypes.Structure):
    _fields_ = [*_fields(ctypes.c_int64, "n k parts"), ("part", _QPart * QMAT_PARTS)]


class _QLayer(ctypes.Structure):
    _fields_ = [
        *_fields(ctypes.c_void_p, "input_norm post_norm"),
        *_fields(_QMat, "qkv o gate_up down"),
        *_fields(ctypes.c_void_p, "qkv_bias o_bias q_norm k_norm"),  # NULL when absent
    ]


class _QModel(ctypes.Structure):
    _fields_ = [
        *_fields(ctypes.c_int64, "n_layers hidden n_heads n_kv_heads head_dim inter slots"),
        ("eps", ctypes.c_float),
        ("layers", ctypes.POINTER(_QLayer)),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", _QMat),
        *_fields(ctypes.c_int64, "kv_dtype act_int8"),
        *_fields(ctypes.c_void_p, "kv_params key_rot"),
        # window: the model's sliding window (0: none); head_act_int8: the vocabulary
        # projection's own setting
        *_fields(ctypes.c_int64, "window head_act_int8"),
    ]


# the cache dtypes the fused step reads and writes (kvlm_qmodel.kv_dtype in qgemm.c)
_KV_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float16: 3}


def _qmat(lin: Linear) -> _QMat:
    q = lin.quant
    parts = [_QPart(KIND_CODES[p.kind], p.data.data_ptr(), p.out_features) for p in q.parts()]
    if len(parts) > QMAT_PARTS:
        raise ValueError(f"a projection of {len(parts)} parts of different kinds")
    return _QMat(q.out_features, q.in_features, len(parts), (_QPart * QMAT_PARTS)(*parts))


def _ptr(t: torch.Tensor | None, n: int) -> int | None:
    """The address of an fp32 CPU vector of n elements (None: NULL)."""
    if t is None:
        return None
    if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
        raise ValueError(f"expected {n} contiguous fp32 values, got {tuple(t.shape)} {t.dtype}")
    return t.data_ptr()


GEMMA_BLOCK = "not yet Gemma's block (norms after attention and the MLP, GeGLU, per-layer windows)"


def why_not(model: Transformer) -> str | None:
    """None when the fused step can run this model, else the reason it cannot."""
    if os.environ.get("KVLM_NO_FUSED"):
        return "disabled by KVLM_NO_FUSED"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "needs fp32 activations on the CPU"
    c = model.config
    if c.gemma:
        return GEMMA_BLOCK
    if c.num_heads // c.num_kv_heads > 8 or c.head_dim > 128:
        return "more than 8 query heads per KV head, or head_dim > 128"
    if any(isinstance(m, Linear) and m.kernel != "quant" for m in model.modules()):
        return "needs low-bit weights in every projection (--weights int8|int4|native)"
    for block in model.layers:
        if block.mlp.gate_up.bias is not None or block.mlp.down.bias is not None:
            return "MLP biases (the step adds only the attention projections' biases)"
        norms = [block.attn.q_norm, block.attn.k_norm]
        if norms.count(None) == 1:
            return "a q norm without a k norm, or the reverse"
        if any(n is not None and n.eps != c.rms_norm_eps for n in norms):
            return "a q/k norm eps other than the model's rms_norm_eps"
    if model.lm_head.bias is not None:
        return "an lm_head bias"
    if kernels.library() is None:
        return "no compiled kernels"
    return None


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
        positions = torch.arange(slots, dtype=torch.long)[None]
        rope = model.rope(positions, torch.float32)  # the torch path's own values
        self.cos, self.sin = (t.reshape(slots, -1).contiguous() for t in rope)
        layers = (_QLayer * c.num_layers)()
        d = c.head_dim
        for i, block in enumerate(model.layers):
            attn, mlp = block.attn, block.mlp
            norms = (block.input_norm.weight.data_ptr(), block.post_norm.weight.data_ptr())
            mats = [_qmat(lin) for lin in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down)]
            biases = [_ptr(lin.bias, lin.out_features) for lin in (attn.qkv, attn.o_proj)]
            qk = [_ptr(None if n is None else n.weight, d) for n in (attn.q_norm, attn.k_norm)]
            layers[i] = _QLayer(*norms, *mats, *biases, *qk)
        self._layers = layers  # keep alive: the struct points into it
        shape = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, d, c.intermediate_size)
        head = (model.norm.weight.data_ptr(), _qmat(model.lm_head))  # final_norm, lm_head
        self.spec = _QModel(*shape, slots, c.rms_norm_eps, layers, *head)
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.vocab = model.lm_head.out_features

    def accepts(self, cache: KVCache) -> bool:
        """A contiguous cache of these slots or a paged one, any batch up to MAX_ROWS."""
        if cache.batch > MAX_ROWS:
            return False
        if type(cache) is ContiguousCache:
            return cache.store.values.shape[-2] == self.slots and self.reads(cache.store)
        # --kv int8 is a paged cache storing int8 (Int8PagedCache): the same layout
        return type(cache) in (PagedCache, Int8PagedCache) and self.reads(cache.pool.store)

    def reads(self, store: Store) -> bool:
        """Whether the step reads and writes this storage (dtype, device, layout)."""
        values = store.values
        return values.dtype in _KV_DTYPE and values.device.type == "cpu" and values.is_contiguous()

    @staticmethod
    def _table(tables: Sequence[Sequence[int]], starts: Sequence[int], bs: int) -> torch.Tensor:
        """(B, width) int32 block ids, -1 past a row's table (the C step refuses those)."""
        width = max(s // bs + 1 for s in starts)
        table = torch.full((len(tables), width), -1, dtype=torch.int32)
        for b, t in enumerate(tables):
            row = t[:width]
            table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return table

    @torch.inference_mode()
    def run(
        self,
        store: Store,
        tokens: Sequence[int],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        block_size: int,
        window: int | None,
    ) -> torch.Tensor:
        """Logits (B, V) of one token per row: row b's token at position starts[b], its
        K/V written into block tables[b][starts[b] // block_size] of `store` (which the
        caller has made the row's own), attending over its blocks up to its position
        (within `window`). A contiguous cache is a pool of one block per row holding
        every slot (tables [[0], [1], ...], block_size its slots); a draft's rows share one
        table at consecutive positions, each row computing what decoding its token alone
        would. The caller plans and commits the cache step (kvlm.engine.runner)."""
        table = self._table(tables, starts, block_size)
        rows = len(tokens)
        x = self.model.embed(torch.tensor(tokens)).contiguous()
        pos = torch.tensor(starts, dtype=torch.int64)
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        need = self.lib.kvlm_decode_scratch(ctypes.byref(self.spec), rows)
        if self.scratch.numel() < need:  # grows to the largest batch seen, then stays
            self.scratch = torch.empty(need, dtype=torch.float32)
        self.spec.kv_dtype = _KV_DTYPE[store.values.dtype]
        if store.quantized:  # codes + (step, zero) per row; K stored rotated by R
            self.spec.kv_params = store.scales.data_ptr()
            self.spec.key_rot = key_rotation(store.values.shape[-1]).data_ptr()  # cached, fp32
        # --activations int8: LLM sets act_int8 on every block's Linear alike; the
        # vocabulary projection has its own (fp32 under the defaults: kvlm.defaults)
        self.spec.act_int8 = int(self.model.layers[0].attn.qkv.act_int8)
        self.spec.head_act_int8 = int(self.model.lm_head.act_int8)
        if window is not None and window < 1:
            raise ValueError(f"sliding window {window}: must be at least 1")
        self.spec.window = window or 0
        rc = self.lib.kvlm_decode_batch(
            ctypes.byref(self.spec), rows, x.data_ptr(), pos.data_ptr(), self.cos.data_ptr(),
            self.sin.data_ptr(), store.values.data_ptr(),
            store.values.shape[2], block_size,  # blocks (a contiguous cache: its one row)
            table.data_ptr(), table.shape[1], self.scratch.data_ptr(), logits.data_ptr(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("no scratch memory for the fused decode step")
        if rc != 0:
            raise ValueError(
                f"the fused decode step refused rows at positions {list(starts)} "
                f"({self.slots} slots, {store.values.shape[2]} blocks of {block_size})"
            )
        return logits
