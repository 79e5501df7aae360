"""GGUF's Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks multiplied as stored
(kvlm.model.quant's GGML_KINDS, kernels/qgemm.c), packed by the C packer (kvlm_qpack) as the
torch packer does, and weights of row parts, stacked without unpacking (a Q4_K_M file's
q|k|v: Q4_K q and k, Q6_K v)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers import (
    PACKERS,
    assert_top_k_both_ways,
    fused_and_torch,
    low_bit_llm,
    needs_kernels,
    needs_vector_kernels,
    portable_build_params,
    portable_kernels,
    portable_simd,
    random_blocks,
    ref_dequant_rows,
    save_tiny_model,
    write_gguf_from_hf,
)
from kvlm import kernels
from kvlm.model import quant
from numerics import SAME_ROUNDING, assert_as_exact_as, assert_product_close

TYPES = {"q4_0": "Q4_0", "q5_0": "Q5_0", "q5_1": "Q5_1", "q4_k": "Q4_K", "q5_k": "Q5_K",
         "q6_k": "Q6_K"}  # fmt: skip
# the blocks every kind packs from (quant.BLOCK_FORMATS)
SOURCES = {"q8": "Q8_0", "q4": "Q4_1", **TYPES}
# The file's own bytes per weight, which the packed layout keeps (kernels/qgemm.c)
BYTES_PER_WEIGHT = {"q4_0": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "q4_k": 144 / 256,
                    "q5_k": 176 / 256, "q6_k": 210 / 256}  # fmt: skip
COLS = 512  # two super-blocks of 256, sixteen groups of 32


def _blocks(kind: str, rows: int, seed: int, source: str = "codes") -> np.ndarray:
    """Blocks written from random codes and parameters (helpers.PACKERS), or random bytes
    (every bit pattern of codes and packed scales; fp16 fields of either sign, subnormal)."""
    rng = np.random.default_rng(seed)
    if source == "random":
        return random_blocks(TYPES[kind], rows, COLS, rng)
    return PACKERS[TYPES[kind]](rows, COLS, rng)


def _gguf_dense(kind: str, raw: np.ndarray) -> torch.Tensor:
    rows = raw.shape[0]
    return torch.from_numpy(gguf.quants.dequantize(raw, Q[TYPES[kind]])).reshape(rows, -1)


def _weight(kind: str, rows: int, seed: int) -> tuple[quant.QuantWeight, torch.Tensor]:
    raw = _blocks(kind, rows, seed)
    return quant.QuantWeight.from_blocks(kind, torch.from_numpy(raw)), _gguf_dense(kind, raw)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16)[..., 0].double()


def _magnitudes(q: quant.QuantWeight) -> torch.Tensor:
    """Per weight, the size of what a product sums for it, fp64: |s (code - offset)| + |z|,
    the kernels forming sum(s q x) + z sum(x) for the kinds with a z term (q5_1: m, q4_k and
    q5_k: -dmin mn; q4: m; q4_0's fp32 products too: -8d, as q4 held Q4_0), |w| for the
    others. Two evaluations of x @ W^T that sum these
    terms in different orders are within 2 gamma_K |x| @ magnitudes^T (numerics.py), as
    |w| <= these everywhere."""
    if q.kind == quant.MIXED:
        return torch.cat([_magnitudes(p) for p in q.parts()])
    if q.kind in ("q8", "q4"):
        codes, scale, zero = q.unpacked()
        n, groups = scale.shape
        if q.kind == "q8":
            return (
                (codes.double().view(n, groups, 32) * scale.double()[..., None]).abs().view(n, -1)
            )
        c = codes.view(n, groups, 16)
        c = torch.cat((c & 15, c >> 4), -1).double()
        return ((c * scale.double()[..., None]).abs() + zero.double().abs()[..., None]).view(n, -1)
    f = quant._unpack_fields(q.kind, q.data, q.out_features, q.in_features)
    n = f["codes"].shape[0]
    codes, z = f["codes"].double(), 0.0
    off = {"q5_0": 16, "q6_k": 32}.get(q.kind, 0)
    if q.kind in ("q4_0", "q5_0", "q5_1"):
        s = _f16(f["d"]).repeat_interleave(32, 1)
        if q.kind != "q5_0":  # q5_1: m; q4_0: -8d
            z = _f16(f["m" if q.kind == "q5_1" else "d"]).abs().repeat_interleave(32, 1)
            z = z * (8 if q.kind == "q4_0" else 1)
    elif q.kind == "q6_k":
        s = (_f16(f["d"])[..., None] * f["scales"].view(torch.int8).double()).view(n, -1)
        s = s.repeat_interleave(16, 1)
    else:
        sc, mn = quant._scale_min_k4(f["scales"])
        s = (_f16(f["d"])[..., None] * sc.double()).view(n, -1).repeat_interleave(32, 1)
        z = (_f16(f["dmin"])[..., None] * mn.double()).abs().view(n, -1).repeat_interleave(32, 1)
    return (s * (codes - off)).abs() + z


# ---- packing and dequantization -------------------------------------------------------


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 16, 37])
@pytest.mark.parametrize("source", ["codes", "random", "pieces"])
def test_blocks_round_trip_and_dequantize_as_gguf_py(kind, rows, source, monkeypatch):
    """The packed weight gives the file's blocks back byte for byte, its size is the file's
    (per 16 rows), and it dequantizes to gguf-py's numbers bit for bit: the torch fallback,
    the compiled kernels (fp32, and bf16 rounded as torch rounds). "pieces": packed 16 rows
    at a time (as a large tensor is), the same bytes."""
    if source == "pieces":
        monkeypatch.setattr(quant, "PACK_WEIGHTS", 16 * COLS)
    raw = _blocks(kind, rows, seed=rows, source="codes" if source == "pieces" else source)
    q = quant.QuantWeight.from_blocks(kind, torch.from_numpy(raw))
    assert (q.kind, q.out_features, q.in_features) == (kind, rows, COLS)
    padded = -(-rows // 16) * 16
    assert q.data.dtype == torch.uint8 and q.data.shape[0] == padded // 16
    assert q.nbytes == padded * raw.shape[1] == padded * COLS * BYTES_PER_WEIGHT[kind]
    back, scale, zero = q.unpacked()
    assert scale is None and zero is None and torch.equal(back, torch.from_numpy(raw))
    want = _gguf_dense(kind, raw)
    assert torch.equal(_bits(quant._dense_torch(q)), _bits(want))
    if kernels.library() is not None:
        assert torch.equal(_bits(q.dense()), _bits(want))
        assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(want.bfloat16()))


@pytest.mark.parametrize("kind", TYPES)
def test_the_blocks_mean_what_ggml_says(kind):
    """gguf-py's dequantization against helpers' own decoder of ggml's layouts (the numbers
    the bit-for-bit checks above hold kvlm to are ggml's)."""
    raw = _blocks(kind, 8, seed=3)
    want, _ = ref_dequant_rows(raw, TYPES[kind], with_size=True)
    assert np.array_equal(_gguf_dense(kind, raw).double().numpy(), want.astype(np.float32))


def test_the_layout_puts_row_i_in_lane_i():
    """Two documented places of the packed layout (kernels/qgemm.c), by hand: q4_k's header
    (row i's packed scales in lane i of three vectors, then d and dmin of the 16 rows) and
    its first codes; q5_0's nibbles and d."""
    raw = _blocks("q4_k", 2, seed=1)
    data = quant.QuantWeight.from_blocks("q4_k", torch.from_numpy(raw)).data.numpy()
    for i in range(2):
        for w in range(3):  # the 12 scale bytes: bytes 4w .. 4w + 3 in lane i of vector w
            assert (
                data[0, 64 * w + 4 * i : 64 * w + 4 * i + 4] == raw[i, 4 + 4 * w : 8 + 4 * w]
            ).all()
        assert (data[0, 192 + 2 * i : 194 + 2 * i] == raw[i, 0:2]).all()  # d
        assert (data[0, 224 + 2 * i : 226 + 2 * i] == raw[i, 2:4]).all()  # dmin
        # sub-block 0 is the low nibbles of qs[0:32]; kvlm's byte 0 holds weights 0 and 16
        assert data[0, 256 + 4 * i] == (raw[i, 16] & 15) | ((raw[i, 32] & 15) << 4)
    raw = _blocks("q5_0", 2, seed=2)
    data = quant.QuantWeight.from_blocks("q5_0", torch.from_numpy(raw)).data.numpy()
    for i in range(2):
        assert (data[0, 4 * i : 4 * i + 4] == raw[i, 6:10]).all()  # qs: ggml's own nibbles
        assert (data[0, 320 + 2 * i : 322 + 2 * i] == raw[i, 0:2]).all()  # d after the codes
    raw = _blocks("q4_0", 2, seed=2)
    data = quant.QuantWeight.from_blocks("q4_0", torch.from_numpy(raw)).data.numpy()
    for i in range(2):
        assert (data[0, 4 * i : 4 * i + 4] == raw[i, 2:6]).all()  # ggml's own nibbles
        assert (data[0, 64 + 4 * i : 68 + 4 * i] == raw[i, 6:10]).all()
        assert (data[0, 256 + 2 * i : 258 + 2 * i] == raw[i, 0:2]).all()  # d after them


def test_blocks_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="multiple of 144"):
        quant.QuantWeight.from_blocks("q4_k", torch.zeros(4, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="from_blocks"):
        quant.QuantWeight("q6_k", torch.zeros(4, 32), torch.zeros(4, 1))


@needs_kernels
@pytest.mark.parametrize("kind", SOURCES)
def test_the_c_packer_writes_the_torch_packers_bytes(kind):
    """kvlm_qpack against the torch packer (from_blocks(reference=True)), byte for byte:
    random bytes (every code, high bit and scale pattern), row counts in whole blocks of 16
    and not, several widths, rows as stored and in a permuted order (llama's q/k rows),
    from a tensor and from a read-only numpy view (a file's map). q8 and q4 (from Q8_0 and
    Q4_1 blocks): also the bytes of the weight built from their natural arrays."""
    rng = np.random.default_rng(5)
    per = quant.BLOCK_FORMATS[kind][0]
    for rows in (1, 15, 16, 17, 40):
        for cols in (256, 512, 1280) if per == 256 else (32, 96, 256, 1280):
            raw = random_blocks(SOURCES[kind], rows, cols, rng)
            view = raw.copy()
            view.flags.writeable = False
            for order in (None, torch.from_numpy(rng.permutation(rows))):
                want = quant.QuantWeight.from_blocks(
                    kind, torch.from_numpy(raw), order, reference=True
                )
                got = quant.QuantWeight.from_blocks(kind, view, order)
                assert got.data.shape == want.data.shape == (-(-rows // 16), 16 * raw.shape[1])
                assert torch.equal(got.data, want.data), (rows, cols, order is not None)
                if kind in ("q8", "q4"):
                    rows_in_order = torch.from_numpy(raw)[order] if order is not None else raw
                    arrays = quant._block_arrays(kind, torch.as_tensor(rows_in_order))
                    assert torch.equal(quant.QuantWeight(kind, *arrays).data, want.data)


@needs_kernels
def test_the_c_packer_refuses_a_bad_order_or_buffer():
    raw = torch.from_numpy(_blocks("q4_k", 20, seed=1))
    with pytest.raises(ValueError, match="refused"):
        quant.QuantWeight.from_blocks("q4_k", raw, torch.arange(20) + 1)
    with pytest.raises(ValueError, match="20 entries"):
        quant.QuantWeight.from_blocks("q4_k", raw, torch.arange(19))
    with pytest.raises(ValueError, match="contiguous bytes"):
        quant._pack_blocks("q4_k", raw, None, torch.empty(10, dtype=torch.uint8))


def _allocations(monkeypatch) -> list[int]:
    """The storages quant._new_data hands out from now on (their data pointers)."""
    made, new = [], quant._new_data

    def tracked(nbytes: int) -> torch.Tensor:
        t = new(nbytes)
        made.append(t.untyped_storage().data_ptr())
        return t

    monkeypatch.setattr(quant, "_new_data", tracked)
    return made


def _no_repacking(monkeypatch) -> None:
    def refuse(p):
        raise AssertionError("a part was unpacked to be packed again")

    monkeypatch.setattr(quant, "_blocks_of", refuse)


def test_parts_in_whole_blocks_are_stacked_as_packed(monkeypatch):
    """concat of parts of one kind whose row counts (all but the last) fill their blocks of
    16: the parts' packed bytes one after another, the same bytes as packing their stacked
    blocks at once, whether the parts come packed or as blocks not yet packed (the loader's
    way: each packed straight into its place, rows in its own order), with nothing
    unpacked; every buffer from quant._new_data."""
    rng = np.random.default_rng(8)
    raws = [torch.from_numpy(_blocks("q4_k", n, seed)) for n, seed in ((32, 1), (16, 2), (21, 3))]
    orders = [None, torch.from_numpy(rng.permutation(16)), None]
    stacked = torch.cat([r if o is None else r[o] for r, o in zip(raws, orders, strict=True)])
    whole = quant.QuantWeight.from_blocks("q4_k", stacked)
    packed = [
        quant.QuantWeight.from_blocks("q4_k", r, o) for r, o in zip(raws, orders, strict=True)
    ]
    blocks = [quant.Blocks("q4_k", r.numpy(), o) for r, o in zip(raws, orders, strict=True)]
    made = _allocations(monkeypatch)
    _no_repacking(monkeypatch)
    for parts in (packed, blocks, [packed[0], blocks[1], packed[2]]):
        fused = quant.concat(parts)
        assert (fused.kind, fused.out_features, fused._parts) == ("q4_k", 69, None)
        assert torch.equal(fused.data, whole.data)
        assert torch.equal(fused.data, torch.cat([p.data for p in packed]))
        assert fused.data.untyped_storage().data_ptr() in made
    # kinds that differ: a MIXED weight, each run packed in place from a 64-byte boundary
    v_raw = _blocks("q6_k", 24, seed=4)
    v = quant.QuantWeight.from_blocks("q6_k", torch.from_numpy(v_raw))
    from_packed = quant.concat([*packed[:2], v])
    from_blocks = quant.concat([*blocks[:2], quant.Blocks("q6_k", v_raw)])
    assert from_packed.kind == from_blocks.kind == quant.MIXED
    assert torch.equal(from_packed.data, from_blocks.data)
    assert from_blocks.data.untyped_storage().data_ptr() in made
    qk, vv = from_blocks.parts()
    assert (qk.kind, qk.out_features, vv.kind, vv.out_features) == ("q4_k", 48, "q6_k", 24)
    assert torch.equal(qk.data, whole.data[:3]) and torch.equal(vv.data, v.data)
    gap = -(-quant.packed_bytes("q4_k", 48, COLS) // 64) * 64  # q|k's bytes, padded
    assert vv.data.data_ptr() - qk.data.data_ptr() == gap


def test_parts_that_end_inside_a_block_are_packed_anew():
    """A part of 24 rows ends inside its second block: the run's rows are packed again from
    their blocks, the same bytes as packing the stacked blocks at once."""
    raws = [_blocks("q5_0", 24, 1), _blocks("q5_0", 40, 2)]
    want = quant.QuantWeight.from_blocks("q5_0", torch.from_numpy(np.concatenate(raws)))
    for parts in (
        [quant.QuantWeight.from_blocks("q5_0", torch.from_numpy(r)) for r in raws],
        [quant.Blocks("q5_0", r) for r in raws],
    ):
        fused = quant.concat(parts)
        assert (fused.kind, fused.out_features) == ("q5_0", 64)
        assert torch.equal(fused.data, want.data)
    q8 = [quant.quantize(torch.randn(n, 64), "q8") for n in (8, 16)]
    codes, scale, _ = zip(*(q.unpacked() for q in q8), strict=True)
    want = quant.QuantWeight("q8", torch.cat(codes), torch.cat(scale))
    assert torch.equal(quant.concat(q8).data, want.data)


def test_every_packed_buffer_comes_from_new_data(monkeypatch):
    """quant._new_data allocates every packed weight's data (the one place a later arena
    hands buffers out)."""
    made = _allocations(monkeypatch)
    raw = torch.from_numpy(_blocks("q6_k", 20, 1))
    weights = [
        quant.QuantWeight.from_blocks("q6_k", raw),
        quant.QuantWeight.from_blocks("q6_k", raw, reference=True),
        quant.quantize(torch.randn(20, 64), "q8"),
        quant.quantize(torch.randn(20, 64), "q4"),
        quant.concat([quant.Blocks("q6_k", raw.numpy()), quant.Blocks("q6_k", raw.numpy())]),
    ]
    for w in weights:
        assert w.data.untyped_storage().data_ptr() in made


# ---- products -------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 40])
def test_kernel_products_equal_the_dequantized_weight(kind, rows):
    """x @ W^T of gguf-py's dequantized weight: the C kernel (up to 16 rows), the dense GEMM
    (more), on fp32 activations; and on int8 activations (up to 16 rows: x rounded per
    group of 32 as round_activations does, q6_k's scales applied per 16), the product of
    the rounded x. 72 rows: a part-filled block of 16."""
    torch.manual_seed(rows)
    q, w = _weight(kind, 72, seed=rows)
    x = torch.randn(rows, COLS)
    x[0, :32] = 0.0  # an all-zero group: int8 scale 0
    size = _magnitudes(q)
    assert (size >= w.double().abs()).all()
    assert_product_close(q.matmul(x), x @ w.t(), x, size)
    if rows <= quant.SMALL_M:
        xr = quant.round_activations(x)
        assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, size)
    xf = quant.round_activations(x, fine=True)  # int16: any row count, MT rows a pass
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, size)


@pytest.mark.parametrize("kind", TYPES)
def test_without_kernels_the_torch_fallback_gives_the_same_products(kind, monkeypatch):
    q, w = _weight(kind, 40, seed=9)
    x = torch.randn(3, COLS)
    xr = quant.round_activations(x)
    xf = quant.round_activations(x, fine=True)
    monkeypatch.setattr(kernels, "library", lambda: None)
    assert torch.equal(_bits(q.dense()), _bits(w))
    assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(w.bfloat16()))
    size = _magnitudes(q)
    assert_product_close(q.matmul(x), x @ w.t(), x, size)
    assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, size)
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, size)


ACTS = (0, 1, 2)  # fp32, int8 and int16 activations


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
def test_the_portable_build_computes_the_same_products(march, monkeypatch):
    """The code paths of CPUs without AVX-512 / VNNI (the scalar loops, -march=x86-64; the
    vector code in AVX2 halves, -march=haswell): the same dequantized numbers bit for bit,
    the same products to summation order, every kind."""
    portable = portable_kernels(march)
    assert portable.kvlm_kernel_simd() == portable_simd(march) and not portable.kvlm_kernel_vnni()
    torch.manual_seed(4)
    cases = []
    for kind in TYPES:
        q, w = _weight(kind, 40, seed=4)
        x = torch.randn(5, COLS)
        cases.append((q, w, x, [q.matmul(x, act_int8=a > 0, act_int16=a > 1) for a in ACTS]))
    monkeypatch.setattr(kernels, "library", lambda: portable)
    for q, w, x, fast in cases:
        assert torch.equal(_bits(q.dense()), _bits(w)), q.kind
        assert torch.equal(_bits(q.dense(dtype=torch.bfloat16)), _bits(w.bfloat16())), q.kind
        size = _magnitudes(q)
        for act, expected in zip(ACTS, fast, strict=True):
            xa = quant.round_activations(x, fine=act > 1) if act else x
            got = q.matmul(x, act_int8=act > 0, act_int16=act > 1)
            assert_product_close(got, expected, xa, size)
            assert_product_close(got, xa @ w.t(), xa, size)


# ---- weights of parts of different kinds ----------------------------------------------


def _mixed_parts() -> list[tuple[quant.QuantWeight, torch.Tensor]]:
    """q (24 rows) and k (40) Q4_K, v (24) Q6_K: row counts off the blocks of 16."""
    return [_weight("q4_k", 24, 11), _weight("q4_k", 40, 12), _weight("q6_k", 24, 13)]


def test_a_weight_of_parts_keeps_each_parts_kind_and_numbers(monkeypatch):
    parts = _mixed_parts()
    fused = quant.concat([q for q, _ in parts])
    w = torch.cat([d for _, d in parts])
    assert fused.kind == quant.MIXED and (fused.out_features, fused.in_features) == (88, COLS)
    assert [(p.kind, p.out_features) for p in fused.parts()] == [("q4_k", 64), ("q6_k", 24)]
    assert fused.nbytes == sum(p.nbytes for p in fused.parts()) == 64 * 144 * 2 + 32 * 210 * 2
    with pytest.raises(ValueError, match="parts"):
        fused.unpacked()
    assert torch.equal(_bits(quant._dense_torch(fused)), _bits(w))
    x = torch.randn(4, COLS)
    size = _magnitudes(fused)
    if kernels.library() is not None:
        assert torch.equal(_bits(fused.dense()), _bits(w))
        assert torch.equal(_bits(fused.dense(dtype=torch.bfloat16)), _bits(w.bfloat16()))
        for act in ACTS:  # each part's columns are its own product, bit for bit
            how = {"act_int8": act > 0, "act_int16": act > 1}
            alone = torch.cat([q.matmul(x, **how) for q, _ in parts], 1)
            assert torch.equal(fused.matmul(x, **how), alone)
    assert_product_close(fused.matmul(x), x @ w.t(), x, size)
    many = torch.randn(20, COLS)  # the dense path
    assert_product_close(fused.matmul(many), many @ w.t(), many, size)
    # a part of another kind after it: three parts; q8 and q4 mix as well
    q8 = quant.quantize(torch.randn(8, COLS), "q8")
    three = quant.concat([fused, q8])
    assert [p.kind for p in three.parts()] == ["q4_k", "q6_k", "q8"]
    legacy = quant.concat([quant.quantize(torch.randn(16, COLS), "q4"), q8])
    assert [p.kind for p in legacy.parts()] == ["q4", "q8"]
    monkeypatch.setattr(kernels, "library", lambda: None)
    assert_product_close(fused.matmul(x), x @ w.t(), x, size)
    xr = quant.round_activations(x)
    assert_product_close(fused.matmul(x, act_int8=True), xr @ w.t(), xr, size)


def test_weights_of_parts_move_to_huge_pages_unchanged():
    fused = quant.concat([q for q, _ in _mixed_parts()])
    plain, _ = _weight("q5_k", 16, 14)
    x = torch.randn(2, COLS)
    before = [(w.data.clone(), w.matmul(x), w.dense()) for w in (fused, plain)]
    if not quant.move_to_huge_pages([fused, plain]):
        return  # no huge pages here: nothing moved
    assert fused.data.data_ptr() % kernels.HUGE_PAGE == 0
    for w, (data, y, dense) in zip((fused, plain), before, strict=True):
        assert torch.equal(w.data, data)
        assert torch.equal(w.matmul(x), y) and torch.equal(w.dense(), dense)


# ---- GGUF files -------------------------------------------------------------------------

Q4_K_M = {"*attn_v*": Q.Q6_K, "*ffn_down*": Q.Q6_K, "output.weight": Q.Q6_K, "*": Q.Q4_K}
MIXES = {
    "Q4_K_M": Q4_K_M,
    "Q5_K": {"*": Q.Q5_K},
    "Q6_K": {"*": Q.Q6_K},
    "Q5_0+Q5_1": {"*attn*": Q.Q5_0, "*": Q.Q5_1},
    "Q4_0": {"*": Q.Q4_0},
}
PROJECTIONS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """hidden 256: rows long enough for 256-element K-quant super-blocks."""
    return save_tiny_model(tmp_path_factory.mktemp("wide"), "llama", seed=7, hidden_size=256,
                           intermediate_size=512, head_dim=64)  # fmt: skip


@pytest.fixture(scope="module")
def k_files(wide_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kfiles")
    return {
        name: write_gguf_from_hf(wide_llama, folder / f"{name}.gguf", types=types)
        for name, types in MIXES.items()
    }


def _type_of(types: dict, name: str) -> str:
    from fnmatch import fnmatch

    return next(t for p, t in types.items() if fnmatch(name, p)).name.lower()


@pytest.mark.parametrize("mix", MIXES)
def test_native_weights_keep_each_tensors_kind(k_files, mix, caplog):
    """--weights native: every projection holds the file's blocks in their own kind (q|k|v
    and gate|up as parts where they differ), the same numbers as the float loader's (q/k
    rows un-permuted), nothing re-quantized and so nothing named."""

    with caplog.at_level(logging.WARNING, logger="kvlm.loading"):
        llm = low_bit_llm(model=k_files[mix], max_context=64)
    assert not caplog.records
    types, src = MIXES[mix], llm.loaded.weights
    for i, block in enumerate(llm.model.layers):
        fused = {"qkv": block.attn.qkv, "o": block.attn.o_proj, "gate_up": block.mlp.gate_up,
                 "down": block.mlp.down}  # fmt: skip
        members = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                   "o": ["self_attn.o_proj"], "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
                   "down": ["mlp.down_proj"]}  # fmt: skip
        for key, lin in fused.items():
            kinds = [_type_of(types, f"blk.{i}.{PROJECTIONS[m]}.weight") for m in members[key]]
            runs = [k for j, k in enumerate(kinds) if j == 0 or kinds[j - 1] != k]
            assert [p.kind for p in lin.quant.parts()] == runs, (i, key)
            names = [f"model.layers.{i}.{m}.weight" for m in members[key]]
            want = torch.cat([src.get(n) for n in names])
            assert torch.equal(_bits(lin.quant.dense()), _bits(want)), (i, key)
    assert llm.model.lm_head.quant.kind == _type_of(types, "output.weight")


@needs_kernels
@pytest.mark.parametrize("mix, act", [("Q4_K_M", "fp32"), ("Q4_K_M", "int8"), ("Q5_K", "fp32"),
                                      ("Q5_0+Q5_1", "fp32"), ("Q4_0", "fp32"),
                                      ("Q4_0", "int8")])  # fmt: skip
def test_the_fused_step_tracks_the_torch_model_on_k_quants(k_files, mix, act):
    """The fused decode step (kvlm_decode_batch: q|k|v of two kinds in one kvlm_qmat) and the
    torch model, against the same weights in fp64: the fused logits are as close to the
    exact result as the torch path's (fp32 activations: the same arithmetic in another
    order; int8 activations: both round x with the same rule), and at every step each
    side's best token is in the other's top 5."""
    from kvlm import LLM

    path = k_files[mix]
    llm = LLM(
        model=path,
        progress=False,
        max_context=64,
        weights="native",
        activations=act,
        prefill_dtype="fp32",
    )
    assert llm.runner.fused_reason is None, llm.runner.fused_reason
    exact = low_bit_llm(model=path, max_context=64, dtype="fp64")
    ids = llm.encode("a b c d e")
    tokens, fused, ref, _, _ = fused_and_torch(llm, ids, 24)
    want = exact.runner.logits(list(ids) + tokens, exact.new_cache("off"))[len(ids) :]
    assert_as_exact_as(fused, ref, want, SAME_ROUNDING)
    assert_top_k_both_ways(fused, ref)


def test_types_without_a_kernel_are_named_once(wide_llama, tmp_path, caplog):
    """Q3_K (every ffn_down) and Q2_K (every attn_v) have no kernel: each is re-quantized to
    int8, and said once per kind of tensor; the rest of q|k|v keeps its Q4_K parts."""

    rng = np.random.default_rng(0)
    extra = {}
    for i in range(2):
        extra[f"blk.{i}.ffn_down.weight"] = (random_blocks("Q3_K", 256, 512, rng), Q.Q3_K)
        extra[f"blk.{i}.attn_v.weight"] = (random_blocks("Q2_K", 128, 256, rng), Q.Q2_K)
    path = write_gguf_from_hf(
        wide_llama, tmp_path / "m.gguf", types={"*": Q.Q4_K}, extra_tensors=extra
    )
    with caplog.at_level(logging.WARNING, logger="kvlm.loading"):
        llm = low_bit_llm(model=path, max_context=64)
    said = sorted(r.getMessage() for r in caplog.records)
    assert said == [
        "blk.*.attn_v.weight: Q2_K has no kvlm kernel; re-quantized to int8 (2 tensors)",
        "blk.*.ffn_down.weight: Q3_K has no kvlm kernel; re-quantized to int8 (2 tensors)",
    ]
    block = llm.model.layers[0]
    assert [p.kind for p in block.attn.qkv.quant.parts()] == ["q4_k", "q8"]
    assert block.mlp.down.quant.kind == "q8"
    out = llm.runner.logits(llm.encode("hello"), llm.new_cache("off"))
    assert torch.isfinite(out).all()


@needs_kernels
def test_a_batch_of_k_quant_rows_gets_each_rows_own_logits(k_files):
    """The server's batch over a paged pool (20 rows: the products in tiles of 16 and 4, each
    part of q|k|v writing its columns of the wider output): every row's logits bit for bit
    those it gets alone, and those of the contiguous single-sequence step."""
    from test_fused_batch import _rows_alone_and_together

    llm = low_bit_llm(model=k_files["Q4_K_M"], max_context=256)
    assert [p.kind for p in llm.model.layers[0].attn.qkv.quant.parts()] == ["q4_k", "q6_k"]
    _rows_alone_and_together(llm, [3, 16, 17, 9, 1, 33, 5, 21, 12, 7, 2, 4, 6, 8, 10, 11, 13, 14,
                                   19, 20])  # fmt: skip


@pytest.mark.parametrize("kind", [*TYPES, "q8", "q4"])
def test_rows_are_the_dense_weights_rows(kind, monkeypatch):
    """An embedding lookup from a table kept in its stored format: the picked rows,
    bit for bit those of the whole dequantized table (with and without the kernels); an id
    out of range is refused before any read."""
    if kind in ("q8", "q4"):
        q = quant.quantize(torch.randn(40, COLS), kind)
        dense = q.dense()
    else:
        q, dense = _weight(kind, 40, seed=11)
    ids = torch.tensor([[0, 39, 17], [16, 15, 17]])
    assert torch.equal(_bits(q.rows(ids)), _bits(dense[ids]))
    assert q.rows(torch.tensor([], dtype=torch.long)).shape == (0, COLS)
    with pytest.raises(IndexError):
        q.rows(torch.tensor([40]))
    with pytest.raises(IndexError):
        q.rows(torch.tensor([-1]))
    monkeypatch.setattr(kernels, "library", lambda: None)  # the torch fallback
    fresh = quant.QuantWeight.from_blocks(kind, torch.from_numpy(_blocks(kind, 40, 11))) if (
        kind not in ("q8", "q4")) else q  # fmt: skip
    assert torch.equal(_bits(fresh.rows(ids)), _bits(dense[ids]))


@pytest.mark.parametrize("mix", MIXES)
def test_a_files_tensors_dequantize_through_the_kernels_as_gguf_py(k_files, mix, monkeypatch):
    """A low-bit tensor read whole (a GPU's load, every dense weight: GGUFWeights.get)
    takes the kernels' road, on every core, and gives gguf-py's fp32 values bit for bit."""
    import gguf

    from kvlm.loading import gguf as loader

    src = loader.GGUFWeights(k_files[mix])
    names = [n for n in src.names() if src.is_quantized(n)]
    assert names
    for name in names:
        t, shape = src._tensors[name], src.shape(name)
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(shape)
        assert torch.equal(loader._dequantized(t, shape).reshape(shape), ref), name
    whole = {n: src.get(n) for n in names}
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("gguf-py's road"))
    assert all(torch.equal(src.get(n), whole[n]) for n in names)
