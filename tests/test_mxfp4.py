"""MXFP4 weights (GGUF's MXFP4: E2M1 nibbles with one E8M0 exponent byte per 32, the experts
of llama.cpp's gpt-oss files) kept as stored, the kind "mxfp4" (kvlm.model.quant,
kernels/weights.c): packed from the file's blocks, dequantized to gguf-py's numbers bit
for bit at every exponent and code, multiplied on fp32, int8 and int16 activations within
the summation-order bound of the dense product, each row's result its own at any row
count, on the native build, the portable ones and the torch code without the kernels."""

from __future__ import annotations

import warnings

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
BLOCK = 17  # bytes of a block: the exponent, then 16 bytes of nibbles
# Exponents of weights that products are held to a rounding bound on: 2^(e - 128) from
# 2^-18 to 2^7. Far below, a group's scale times an activation's (int8 roads) or a
# product's terms fall among fp32's subnormals, whose rounding is absolute, not relative;
# far above, a value overflows (12 x 2^126 is past fp32's largest), as gguf-py's does.
PRODUCT_EXPONENTS = (110, 136)


def _blocks(rows: int, cols: int, seed: int, exponents: tuple[int, int] = (0, 256)) -> np.ndarray:
    """Random MXFP4 blocks [rows, cols / 32 * 17]: every nibble pattern, exponent bytes
    drawn from [lo, hi)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // 32, BLOCK), dtype=np.uint8)
    b[..., 0] = rng.integers(*exponents, (rows, cols // 32), dtype=np.uint8)
    return b.reshape(rows, -1)


def _every_exponent_and_code() -> np.ndarray:
    """32 rows of 256: group g of the 256 holds exponent g (0 and 1, the subnormal
    half-scales, to 255, whose large values overflow to inf as gguf-py's do), its 32
    elements every one of the 16 codes twice, in an order that differs per group."""
    rows, groups = 32, COLS // 32
    e = np.arange(256, dtype=np.uint8).reshape(rows, groups)
    codes = (np.arange(32)[None, None] + np.arange(256).reshape(rows, groups, 1) * 7) % 16
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([e[..., None], qs], -1).reshape(rows, -1)


def _gguf(raw: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the top exponents' values overflow to inf, as intended
        warnings.simplefilter("ignore", RuntimeWarning)
        with np.errstate(over="ignore"):
            dense = gguf.quants.dequantize(raw, Q.MXFP4)
    return torch.from_numpy(dense).reshape(raw.shape[0], -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _weight(rows: int, seed: int) -> tuple[quant.QuantWeight, torch.Tensor]:
    raw = _blocks(rows, COLS, seed, PRODUCT_EXPONENTS)
    return quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(raw)), _gguf(raw)


# ---- the format and its layout --------------------------------------------------------


def test_the_values_are_ggmls():
    """gguf-py's MXFP4 (what the bit-for-bit checks below hold kvlm to) is ggml's: value
    kv[q] times 2^(e - 128), element j in the low nibble of byte j and j + 16 in its high
    one, computed here in fp64 from the definition."""
    raw = _every_exponent_and_code()
    b = raw.reshape(32, -1, BLOCK)
    scale = np.ldexp(1.0, b[..., 0].astype(np.int64) - 128)[..., None]
    q = np.concatenate([b[..., 1:] & 15, b[..., 1:] >> 4], -1)
    want = (np.array(quant.MXFP4_VALUES, dtype=np.float64)[q] * scale).reshape(32, -1)
    with np.errstate(over="ignore"):
        assert np.array_equal(_gguf(raw).double().numpy(), want.astype(np.float32))


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_blocks_round_trip_and_dequantize_as_gguf_py(rows):
    """Packed at the file's own 17 bytes per 32 weights (per 16 rows), the blocks given
    back byte for byte, and dequantized to gguf-py's numbers bit for bit (every exponent
    0 .. 255 and every code): the torch reference, the kernels in fp32 and in bf16 (rounded
    as torch rounds), and the rows of an embedding lookup."""
    raw = _every_exponent_and_code()[:rows] if rows <= 32 else _blocks(rows, COLS, rows)
    q = quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(raw))
    assert (q.kind, q.out_features, q.in_features) == ("mxfp4", rows, COLS)
    padded = -(-rows // 16) * 16
    assert q.nbytes == padded * raw.shape[1] == padded * COLS * 17 // 32  # 4.25 bits a weight
    assert torch.equal(q.unpacked()[0], torch.from_numpy(raw))
    want = _gguf(raw)
    assert torch.equal(_bits(quant._dense_torch(q)), _bits(want))
    if kernels.library() is not None:
        assert torch.equal(_bits(q.dense()), _bits(want))
        assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(want.bfloat16()))
        ids = torch.tensor([[0, rows - 1], [rows // 2, 0]])
        assert torch.equal(_bits(q.rows(ids)), _bits(want[ids]))


ONE_HOT_COLUMNS = [32 * g + (5 * g) % 32 for g in range(COLS // 32)]  # one in each group


def _one_hot_columns(q: quant.QuantWeight) -> torch.Tensor:
    """x @ W^T for rows of x that each pick one column (ONE_HOT_COLUMNS) on fp32
    activations: each output a single code's value times its group's scale, so exactly
    that weight (the kernel's own scales, not the dequantizer's), inf where it overflows."""
    x = torch.zeros(len(ONE_HOT_COLUMNS), COLS)
    x[range(len(ONE_HOT_COLUMNS)), ONE_HOT_COLUMNS] = 1.0
    return q.matmul(x).t()


def test_every_exponent_dequantizes_as_gguf_py():
    """All 256 exponents with all 16 codes (32 rows of 8 groups): bit for bit, in the
    dequantizers and in the products' own scales (one column picked at a time)."""
    raw = _every_exponent_and_code()
    q = quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(raw))
    want = _gguf(raw)
    assert torch.isinf(want).any() and (want.abs() < 2.0**-126).any()  # both ends reached
    assert torch.equal(_bits(quant._dense_torch(q)), _bits(want))
    if kernels.library() is not None:
        assert torch.equal(_bits(q.dense()), _bits(want))
        assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(want.bfloat16()))
        assert torch.equal(_bits(_one_hot_columns(q)), _bits(want[:, ONE_HOT_COLUMNS]))


def test_the_layout_puts_row_i_in_lane_i():
    """kernels/weights.c's record of a group, by hand: the 16 rows' nibble bytes (ggml's
    own, 4 a lane, 4 vectors), then their exponent bytes, 272 bytes."""
    raw = _blocks(2, 64, seed=1)
    data = quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(raw)).data.numpy()
    assert data.shape == (1, 16 * 2 * BLOCK)
    for i in range(2):
        for g in range(2):
            rec, blk = data[0, 272 * g :], raw[i, BLOCK * g :]
            for v in range(4):
                assert (
                    rec[64 * v + 4 * i : 64 * v + 4 * i + 4] == blk[1 + 4 * v : 5 + 4 * v]
                ).all()
            assert rec[256 + i] == blk[0]
    assert not data[0, 258:272].any()  # rows past N: zero


@needs_kernels
def test_the_c_packer_writes_the_torch_packers_bytes():
    """kvlm_qpack against the torch packer byte for byte: row counts in whole blocks of 16
    and not, several widths, rows as stored and permuted, from a read-only numpy view."""
    rng = np.random.default_rng(5)
    for rows in (1, 15, 16, 17, 40):
        for cols in (32, 96, 1280):
            raw = _blocks(rows, cols, int(rng.integers(1 << 30)))
            view = raw.copy()
            view.flags.writeable = False
            for order in (None, torch.from_numpy(rng.permutation(rows))):
                want = quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(raw), order,
                                                     reference=True)  # fmt: skip
                got = quant.QuantWeight.from_blocks("mxfp4", view, order)
                assert torch.equal(got.data, want.data), (rows, cols, order is not None)


@needs_kernels
def test_the_kernels_refuse_short_buffers():
    """Every entry point refuses (-2, nothing read or written) a buffer one byte or one
    element shorter than the shape needs, and a width that is not whole groups of 32."""
    lib = kernels.library()
    code, n, k = quant.KIND_CODES["mxfp4"], 20, 64
    raw = torch.from_numpy(_blocks(n, k, seed=2))
    q = quant.QuantWeight.from_blocks("mxfp4", raw)
    wn = q.data.numel()
    assert wn == 32 * 2 * BLOCK
    assert_kind_refuses_short_buffers(q, "mxfp4", n, k)
    dst = torch.empty(wn, dtype=torch.uint8)
    src, sn = raw.data_ptr(), raw.numel()
    assert lib.kvlm_qpack(code, src, sn, n, k, None, dst.data_ptr(), wn) == 0
    assert torch.equal(dst, q.data.view(-1))
    assert lib.kvlm_qpack(code, src, sn - 1, n, k, None, dst.data_ptr(), wn) == -2
    assert lib.kvlm_qpack(code, src, sn, n, k, None, dst.data_ptr(), wn - 1) == -2
    assert lib.kvlm_qpack(code, src, sn, n, k + 32, None, dst.data_ptr(), 10 * wn) == -2


# ---- products -------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 40])
def test_products_equal_the_dequantized_weights(rows):
    """x @ W^T of gguf-py's dequantized weight (72 rows: a part-filled block of 16), within
    the summation-order bound (numerics.py; MXFP4 has no zero term, so its terms are those
    of |w|): fp32 activations (the C kernel up to 16 rows a call, the dense tiles for a
    prompt's rows), int8 (up to 16 rows) and int16 activations, against the product of x
    as those round it; and in fp64, the dense weight's own."""
    torch.manual_seed(rows)
    q, w = _weight(72, seed=rows)
    x = torch.randn(rows, COLS)
    x[0, :32] = 0.0  # an all-zero group: int8 scale 0
    assert_product_close(q.matmul(x), x @ w.t(), x, w)
    assert_product_close(q.matmul(x, prompt=True), x @ w.t(), x, w)
    if rows <= quant.SMALL_M:
        xr = quant.round_activations(x)
        assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, w)
    xf = quant.round_activations(x, fine=True)
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, w)
    assert torch.equal(q.matmul(x.double()), x.double() @ w.double().t())


ACTS = {"fp32": {}, "int8": {"act_int8": True}, "int16": {"act_int8": True, "act_int16": True},
        "prompt": {"prompt": True}}  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("act", ACTS)
def test_a_rows_result_is_its_own_at_any_row_count(act):
    """Each of 40 rows multiplied alone and among all 40 (the kernel's passes of 4 and 8
    rows, its calls of 16, the prompt's blocks of 128): the same bits."""
    q, _ = _weight(40, seed=7)
    x = torch.randn(40, COLS)
    how = ACTS[act]
    together = q.matmul(x, **how)
    for i in range(40):
        assert torch.equal(
            _bits(q.matmul(x[i : i + 1].contiguous(), **how)), _bits(together[i : i + 1])
        )


def test_without_kernels_the_torch_code_gives_the_same_numbers(monkeypatch):
    """The torch road (no compiled kernels): the same dense weight bit for bit, products
    within the bound, from the same packed bytes."""
    raw = _blocks(40, COLS, 9, PRODUCT_EXPONENTS)
    w = _gguf(raw)
    x = torch.randn(3, COLS)
    xr, xf = quant.round_activations(x), quant.round_activations(x, fine=True)
    monkeypatch.setattr(kernels, "library", lambda: None)
    q = quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(raw))
    assert torch.equal(_bits(q.dense()), _bits(w))
    assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(w.bfloat16()))
    assert torch.equal(_bits(q.rows(torch.tensor([3, 39]))), _bits(w[[3, 39]]))
    assert_product_close(q.matmul(x), x @ w.t(), x, w)
    assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, w)
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, w)


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
def test_the_portable_build_computes_the_same(march, monkeypatch):
    """The builds of CPUs without AVX-512 / VNNI (the scalar loops, -march=x86-64; the
    vector code in AVX2 halves, -march=haswell): the same dequantized numbers bit for bit
    at every exponent and code, packing byte for byte, the same products to summation
    order (fp32, int8, int16 activations), the products' scales exact at every exponent."""
    every = _every_exponent_and_code()
    q, w = _weight(40, seed=4)
    x = torch.randn(5, COLS)
    acts = [{}, {"act_int8": True}, {"act_int8": True, "act_int16": True}]
    fast = [q.matmul(x, **a) for a in acts]
    portable = portable_kernels(march)
    monkeypatch.setattr(kernels, "library", lambda: portable)
    e = quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(every))
    assert torch.equal(e.data, quant.QuantWeight.from_blocks("mxfp4", torch.from_numpy(every),
                                                             reference=True).data)  # fmt: skip
    assert torch.equal(_bits(e.dense()), _bits(_gguf(every)))
    assert torch.equal(_bits(e.dense(dtype=torch.bfloat16)), _bits(_gguf(every).bfloat16()))
    assert torch.equal(_bits(e.rows(torch.tensor([0, 31]))), _bits(_gguf(every)[[0, 31]]))
    # the scalar loops sum w x, not codes times x scaled after: a row with an infinite
    # weight (the top exponents) is NaN whatever x, so only the others are compared
    finite = torch.isfinite(_gguf(every)).all(1)
    assert torch.equal(_bits(_one_hot_columns(e)[finite]),
                       _bits(_gguf(every)[:, ONE_HOT_COLUMNS][finite]))  # fmt: skip
    for how, expected in zip(acts, fast, strict=True):
        xa = quant.round_activations(x, fine="act_int16" in how) if how else x
        got = q.matmul(x, **how)
        assert_product_close(got, expected, xa, w)
        assert_product_close(got, xa @ w.t(), xa, w)


# ---- stacked experts ------------------------------------------------------------------


def test_a_stack_of_experts_splits_into_each_experts_blocks():
    """A mixture's stacked tensor (E, rows, K) read as E x rows rows of blocks, each
    expert's rows a Blocks of its own, gate and up joined by concat (rows off the blocks
    of 16: packed anew; in whole blocks: their packed bytes stacked): each expert's
    weights gguf-py's rows of it."""
    for rows in (24, 32):
        stack = _blocks(3 * rows, COLS, seed=rows)
        up = _blocks(3 * rows, COLS, seed=rows + 1)
        dense, dense_up = _gguf(stack), _gguf(up)
        for e in range(3):
            part = slice(e * rows, (e + 1) * rows)
            fused = quant.concat(
                [quant.Blocks("mxfp4", stack[part]), quant.Blocks("mxfp4", up[part])]
            )
            assert fused.kind == "mxfp4" and fused.out_features == 2 * rows
            want = torch.cat([dense[part], dense_up[part]])
            assert torch.equal(_bits(fused.dense()), _bits(want))
