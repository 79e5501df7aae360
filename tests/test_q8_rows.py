"""Q8_0 weights read where they lie (the kind "q8_0_rows", kvlm.model.quant.ROWS_KIND,
kernels/weights.c's Q8R): ggml's block_q8_0 rows as a GGUF file stores them, never packed
or copied at load; the kernels pack each block of 16 rows into q8's records as they read
it. The weight is the blocks' own memory (a file's map); its dequantized values are
gguf-py's bit for bit; its products are packed q8's bit for bit on every road (fp32, int8,
int16 activations, the prompt's tiles, bf16) at any row count, so within numerics.py's
bound of the dense product; on the native build, the portable ones and torch's code."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers import (
    assert_kind_refuses_short_buffers,
    needs_kernels,
    needs_vector_kernels,
    portable_build_params,
    portable_kernels,
)
from kvlm import kernels
from kvlm.model import quant
from numerics import assert_product_close

COLS = 256  # eight groups of 32
BLOCK = 34  # fp16 d, then 32 int8 codes
ROWS = quant.ROWS_KIND


def _blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q8_0 blocks [rows, cols / 32 * 34]: every code, scales of ~2^-10 .. 2^-4."""
    rng = np.random.default_rng(seed)
    b = rng.integers(-128, 128, (rows, cols // 32, BLOCK), dtype=np.int16).astype(np.uint8)
    d = rng.uniform(2**-10, 2**-4, (rows, cols // 32)) * rng.choice([-1, 1], (rows, cols // 32))
    b[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def _gguf(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)).reshape(raw.shape[0], -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _pair(rows: int, seed: int) -> tuple[quant.QuantWeight, quant.QuantWeight, torch.Tensor]:
    """The same blocks in place and packed as q8, and gguf-py's dense weight."""
    raw = _blocks(rows, COLS, seed)
    return (quant.QuantWeight.from_blocks(ROWS, raw),
            quant.QuantWeight.from_blocks("q8", torch.from_numpy(raw)), _gguf(raw))  # fmt: skip


ACTS = {"fp32": {}, "int8": {"act_int8": True}, "int16": {"act_int8": True, "act_int16": True},
        "prompt": {"prompt": True}, "bf16": {"prefill_bf16": True}}  # fmt: skip


def test_the_weight_is_the_file_maps_own_memory(tmp_path):
    """Blocks read from a file's map: the weight's data is that memory (its pointer inside
    the map, nothing copied), its values gguf-py's."""
    raw = _blocks(40, COLS, seed=1)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    q = quant.QuantWeight.from_blocks(ROWS, mapped)
    base = mapped.ctypes.data
    assert q.data.data_ptr() == base and q.data.numel() == raw.size == q.nbytes
    assert q.in_place
    assert torch.equal(_bits(q.dense()), _bits(_gguf(raw)))


def test_dequantized_values_are_gguf_pys():
    """fp32, bf16 (rounded as torch rounds) and picked rows: gguf-py's numbers, bit for bit,
    and packed q8's."""
    q, p, w = _pair(37, seed=2)
    assert torch.equal(_bits(q.dense()), _bits(w))
    assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(w.bfloat16()))
    assert torch.equal(_bits(q.rows(torch.tensor([0, 17, 36]))), _bits(w[[0, 17, 36]]))
    codes, scale, _ = q.unpacked()
    assert torch.equal(codes, p.unpacked()[0]) and torch.equal(scale, p.unpacked()[1])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 40])
def test_products_are_packed_q8s_and_within_the_bound(rows):
    """x @ W^T (37 rows: a part-filled block of 16) on every road: packed q8's bits, and
    within the summation-order bound of the dense product of x as each road rounds it;
    fp64 the dense weight's own."""
    torch.manual_seed(rows)
    q, p, w = _pair(37, seed=rows)
    x = torch.randn(rows, COLS)
    x[0, :32] = 0.0  # an all-zero group: int8 scale 0
    for how in ACTS.values():
        assert torch.equal(_bits(q.matmul(x, **how)), _bits(p.matmul(x, **how))), how
    assert_product_close(q.matmul(x), x @ w.t(), x, w)
    assert_product_close(q.matmul(x, prompt=True), x @ w.t(), x, w)
    xr = quant.round_activations(x)
    assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, w)
    xf = quant.round_activations(x, fine=True)
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, w)
    assert torch.equal(q.matmul(x.double()), x.double() @ w.double().t())


@needs_kernels
@pytest.mark.parametrize("act", ACTS)
def test_a_rows_result_is_its_own_at_any_row_count(act):
    """Each of 40 rows alone and among all 40 (passes of 4 and 8 rows, calls of 16, the
    prompt's blocks of 128): the same bits."""
    q, _, _ = _pair(40, seed=7)
    x = torch.randn(40, COLS)
    together = q.matmul(x, **ACTS[act])
    for i in range(40):
        alone = q.matmul(x[i : i + 1].contiguous(), **ACTS[act])
        assert torch.equal(_bits(alone), _bits(together[i : i + 1]))


@needs_kernels
def test_the_kernels_refuse_short_buffers():
    """Every entry point refuses (-2, nothing read or written) a buffer one byte or one
    element shorter than the shape needs and a width that is not whole groups; the
    packer refuses the kind (it is never packed)."""
    lib = kernels.library()
    code, n, k = quant.KIND_CODES[ROWS], 20, 64
    raw = torch.from_numpy(_blocks(n, k, seed=2))
    q = quant.QuantWeight.from_blocks(ROWS, raw)
    w, wn = q.data.data_ptr(), q.data.numel()
    assert wn == n * 2 * BLOCK  # unpadded: 20 rows, not 32
    assert_kind_refuses_short_buffers(q, ROWS, n, k)
    dst = torch.empty(32 * 2 * BLOCK, dtype=torch.uint8)
    assert lib.kvlm_qpack(code, w, wn, n, k, None, dst.data_ptr(), dst.numel()) == -2


def test_without_kernels_the_torch_code_gives_the_same_numbers(monkeypatch):
    """The torch road (no compiled kernels): the same dense weight bit for bit, products
    within the bound, from the same blocks."""
    raw = _blocks(40, COLS, 9)
    w = _gguf(raw)
    x = torch.randn(3, COLS)
    xr, xf = quant.round_activations(x), quant.round_activations(x, fine=True)
    monkeypatch.setattr(kernels, "library", lambda: None)
    q = quant.QuantWeight.from_blocks(ROWS, raw)
    assert torch.equal(_bits(q.dense()), _bits(w))
    assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(w.bfloat16()))
    assert torch.equal(_bits(q.rows(torch.tensor([3, 39]))), _bits(w[[3, 39]]))
    assert_product_close(q.matmul(x), x @ w.t(), x, w)
    assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, w)
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, w)


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
def test_the_portable_build_computes_the_same(march, monkeypatch):
    """The builds of CPUs without AVX-512 / VNNI (the scalar loops; AVX2 halves): the
    same dequantized numbers bit for bit, products packed q8's bits in that build and
    within the bound of the dense product (fp32, int8, int16 activations)."""
    raw = _blocks(40, COLS, 4)
    w = _gguf(raw)
    x = torch.randn(5, COLS)
    portable = portable_kernels(march)
    monkeypatch.setattr(kernels, "library", lambda: portable)
    q = quant.QuantWeight.from_blocks(ROWS, raw)
    p = quant.QuantWeight.from_blocks("q8", torch.from_numpy(raw))
    assert torch.equal(_bits(q.dense()), _bits(w))
    assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(w.bfloat16()))
    assert torch.equal(_bits(q.rows(torch.tensor([0, 39]))), _bits(w[[0, 39]]))
    for how in ({}, {"act_int8": True}, {"act_int8": True, "act_int16": True}):
        xa = quant.round_activations(x, fine="act_int16" in how) if how else x
        got = q.matmul(x, **how)
        assert torch.equal(_bits(got), _bits(p.matmul(x, **how))), how
        assert_product_close(got, xa @ w.t(), xa, w)


def test_a_stack_of_experts_joins_gate_and_up_in_place():
    """A mixture's stacked tensors read as E x rows rows, each expert's gate and up
    joined by concat without a copy (a weight of two parts, each the stack's own memory),
    its weights gguf-py's rows; products packed q8's bits."""
    for rows in (24, 32):
        gate, up = _blocks(3 * rows, COLS, seed=rows), _blocks(3 * rows, COLS, seed=rows + 1)
        dense, dense_up = _gguf(gate), _gguf(up)
        for e in range(3):
            part = slice(e * rows, (e + 1) * rows)
            fused = quant.concat([quant.Blocks(ROWS, gate[part]), quant.Blocks(ROWS, up[part])])
            assert fused.out_features == 2 * rows and fused.in_place
            a, b = fused.parts()
            assert a.data.data_ptr() == gate[part].ctypes.data
            assert b.data.data_ptr() == up[part].ctypes.data
            want = torch.cat([dense[part], dense_up[part]])
            assert torch.equal(_bits(fused.dense()), _bits(want))
            packed = quant.concat([quant.Blocks("q8", torch.from_numpy(gate[part])),
                                   quant.Blocks("q8", torch.from_numpy(up[part]))])  # fmt: skip
            x = torch.randn(3, COLS)
            for how in ACTS.values():
                assert torch.equal(_bits(fused.matmul(x, **how)), _bits(packed.matmul(x, **how)))
