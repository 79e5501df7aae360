"""Low-bit weights (kvlm.model.quant), the C kernels, GGUF native blocks, the fused step."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_top_k_both_ways,
    fused_and_torch,
    low_bit_llm,
    needs_kernels,
    needs_vector_kernels,
    portable_build_params,
    portable_kernels,
    portable_simd,
)
from kvlm import kernels
from kvlm.model import quant
from kvlm.model.layers import Linear, _onednn_works
from numerics import (
    BF16_STEP,
    FP16_STEP,
    SAME_ROUNDING,
    U32,
    assert_as_exact_as,
    assert_product_close,
    product_bound,
)

# A group's fp16 scale (and q4 minimum) rounds by 2^-11 relative; times a code of up to 127
# (q8) or the scale and the minimum together (q4), within 4 x 2^-11 of the group's max |w|.
FP16_PARAMS = 4 * FP16_STEP
REAL_PROMPT = "The three most important inventions of the nineteenth century were"


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_quantize_rounds_each_group_to_its_grid(kind):
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q = quant.quantize(w, kind)
    codes, scale, _ = q.unpacked()
    deq = quant._dense_torch(q)
    g = w.view(48, 3, 32)
    # scales are stored in fp16, as GGUF stores them: 2 bytes per group (q4: 4)
    assert torch.equal(scale, scale.half().float())
    if kind == "q8":  # symmetric: within half a step of s = max|w| / 127
        step = g.abs().amax(-1, keepdim=True) / 127
        assert codes.dtype == torch.int8 and q.nbytes == 48 * 96 + 48 * 3 * 2
    else:  # asymmetric over [min, max]: min kept to fp16's precision
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
        assert codes.shape == (48, 48) and q.nbytes == 48 * 48 + 2 * 48 * 3 * 2
        # the minimum is stored in fp16: within half its ulp, 2^-11 relative
        torch.testing.assert_close(deq.view(48, 3, 32).amin(-1), g.amin(-1), rtol=FP16_STEP, atol=0)
    # within half a step of the fp16 grid (scales rounded before the codes were chosen)
    slack = g.abs().amax(-1, keepdim=True) * FP16_PARAMS
    assert ((deq.view(48, 3, 32) - g).abs() <= step / 2 + slack).all()
    # quantizing the dequantized weight again gives the same codes (the grid is stable)
    again = quant.quantize(deq, kind)
    assert torch.equal(again.data, q.data)


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_the_packed_layout_round_trips(kind, rows):
    """Blocks of 16 rows (the last padded with zero rows), 4 code bytes of a row per 32-bit
    lane, fp16 scales after each group's codes: unpacking gives the natural arrays back."""
    torch.manual_seed(rows)
    groups = 3
    if kind == "q8":
        codes = torch.randint(-127, 128, (rows, groups * 32), dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, (rows, groups * 16), dtype=torch.uint8)
    scale = torch.rand(rows, groups).half().float()
    zero = torch.randn(rows, groups).half().float() if kind == "q4" else None
    q = quant.QuantWeight(kind, codes, scale, zero)
    blocks = -(-rows // 16)
    record = (512 + 32) if kind == "q8" else (256 + 64)
    assert q.data.shape == (blocks, groups * record) and q.data.dtype == torch.uint8
    back = q.unpacked()
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale)
    assert (back[2] is None) if kind == "q8" else torch.equal(back[2], zero)
    # row 0's first 4 code bytes sit in lane 0 of the first vector; row 1's in lane 1
    raw = codes.view(torch.uint8)
    assert torch.equal(q.data[0, :4], raw[0, :4])
    if rows > 1:
        assert torch.equal(q.data[0, 4:8], raw[1, :4])


def test_widths_not_in_groups_of_32_are_refused():
    assert not quant.can_quantize(torch.zeros(8, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(torch.zeros(8, 40), "q8")


@needs_kernels
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40])
def test_kernel_products_equal_the_dequantized_weight(kind, rows):
    """The C kernel (SMALL_M rows a call, at any row count) and the dense GEMM of a
    block's prompt rows (PROMPT_BLOCK rows a call) both compute x @ W^T of the dequantized
    weight; the torch fallback gives the same numbers."""
    torch.manual_seed(rows)
    q = quant.quantize(torch.randn(72, 160) * 0.1, kind)  # 72: a part-filled block of 16
    x = torch.randn(rows, 160)
    w = quant._dense_torch(q)
    torch.testing.assert_close(q.dense(), w, atol=0, rtol=0)
    assert_product_close(q.matmul(x), x @ w.t(), x, w)
    assert_product_close(q.matmul(x, prompt=True), x @ w.t(), x, w)


def test_without_kernels_the_torch_fallback_gives_the_same_product(monkeypatch):
    torch.manual_seed(0)
    q = quant.quantize(torch.randn(64, 96), "q4")
    x = torch.randn(2, 96)
    w = quant._dense_torch(q)
    expected = x @ w.t()
    monkeypatch.setattr(kernels, "library", lambda: None)
    assert_product_close(q.matmul(x), expected, x, w)


@needs_kernels
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
@pytest.mark.parametrize("width", [32, 96, 576])
def test_int8_activation_products_round_x_per_group(kind, rows, width):
    """--activations int8: x rounded per group of 32 to int8 (round_activations), then the
    integer products (VNNI here) give x' @ W^T of the dequantized weight. Widths cover a
    partial step of four groups (q4) and two (q8)."""
    torch.manual_seed(rows * width)
    q = quant.quantize(torch.randn(70, width) * 0.1, kind)
    x = torch.randn(rows, width) * 3
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by it
    xr = quant.round_activations(x)
    # the rounding: 255 levels per group, within half a step, the group max kept exactly
    g, gr = x.view(rows, -1, 32), xr.view(rows, -1, 32)
    top = g.abs().amax(-1, keepdim=True)
    step = top / 127
    # half a step, plus the fp32 rounding of x / step and of code * step
    assert ((gr - g).abs() <= step / 2 + 2 * U32 * top).all()
    torch.testing.assert_close(gr.abs().amax(-1), g.abs().amax(-1), rtol=2 * U32, atol=0)
    # integer products (exact) scaled per group: x' @ W^T to fp32 summation order
    w = quant._dense_torch(q)
    assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, w)
    # any number of rows: the caller decides (Linear: decode rows), 16 rows per call
    many = torch.randn(40, width)
    manyr = quant.round_activations(many)
    assert_product_close(q.matmul(many, act_int8=True), manyr @ w.t(), manyr, w)
    assert torch.equal(q.matmul(many, act_int8=True)[16:32], q.matmul(many[16:32], act_int8=True))


@needs_kernels
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("width", [32, 96, 576])
def test_int16_activation_products_keep_a_residual(kind, rows, width):
    """--activations int16: x per group of 32 as int8 codes c and an int8 residual r, x ~
    e (c + r / 256) (round_activations(x, fine=True)); the kernel's two integer products
    of the same weight codes give x' @ W^T, x' within e / 512 of x (e / 256 where the
    residual's tie is taken as 127), 128x closer than int8's e / 2."""
    torch.manual_seed(rows * width + 1)
    q = quant.quantize(torch.randn(70, width) * 0.1, kind)
    x = torch.randn(rows, width) * 3
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by it
    x[-1, -32:] = torch.linspace(-1, 1, 32)  # y - c of exactly 1/2: the residual's tie
    xr = quant.round_activations(x, fine=True)
    g, gr = x.view(rows, -1, 32), xr.view(rows, -1, 32)
    top = g.abs().amax(-1, keepdim=True)
    step = top / 127
    assert ((gr - g).abs() <= step / 256 + 4 * U32 * top).all()
    coarse = quant.round_activations(x).view(rows, -1, 32)
    assert (gr - g).abs().sum() * 32 < (coarse - g).abs().sum()
    w = quant._dense_torch(q)
    got = q.matmul(x, act_int8=True, act_int16=True)
    assert_product_close(got, xr @ w.t(), xr, w)
    many = torch.randn(40, width)
    manyr = quant.round_activations(many, fine=True)
    fine = {"act_int8": True, "act_int16": True}
    assert_product_close(q.matmul(many, **fine), manyr @ w.t(), manyr, w)
    # a row's product is its own, however many rows share the call
    rows_apart = torch.cat([q.matmul(many[i : i + 1], **fine) for i in range(40)])
    assert torch.equal(q.matmul(many, **fine), rows_apart)


def test_int8_activations_without_kernels_give_the_same_product(monkeypatch):
    torch.manual_seed(1)
    q = quant.quantize(torch.randn(64, 96), "q4")
    x = torch.randn(3, 96)
    xr, w = quant.round_activations(x), quant._dense_torch(q)
    xf = quant.round_activations(x, fine=True)
    monkeypatch.setattr(kernels, "library", lambda: None)
    assert_product_close(q.matmul(x, act_int8=True), xr @ w.t(), xr, w)
    assert_product_close(q.matmul(x, act_int8=True, act_int16=True), xf @ w.t(), xf, w)


ACTS = (0, 1, 2)  # fp32, int8 and int16 activations


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
def test_the_portable_build_computes_the_same_products(march, monkeypatch):
    """The code paths for CPUs without AVX-512 / VNNI: the scalar loops (-march=x86-64) and
    the vector code in AVX2 halves (-march=haswell)."""
    portable = portable_kernels(march)
    assert portable.kvlm_kernel_simd() == portable_simd(march) and not portable.kvlm_kernel_vnni()
    torch.manual_seed(2)
    cases = []
    for kind in ("q8", "q4"):
        q = quant.quantize(torch.randn(40, 96), kind)
        x = torch.randn(5, 96)
        cases.append((q, x, [q.matmul(x, act_int8=a > 0, act_int16=a > 1) for a in ACTS]))
    monkeypatch.setattr(kernels, "library", lambda: portable)
    for q, x, fast in cases:
        w = quant._dense_torch(q)
        for act, expected in zip(ACTS, fast, strict=True):
            # the same rounding in both
            xa = quant.round_activations(x, fine=act > 1) if act else x
            assert_product_close(q.matmul(x, act_int8=act > 0, act_int16=act > 1), expected, xa, w)
        assert torch.equal(q.dense(), quant._dense_torch(q))
        assert torch.equal(q.dense(dtype=torch.bfloat16), quant._dense_torch(q).bfloat16())


STEP_TOKENS = (3, 7, 11, 5, 2)


def _fused_steps_per_library(llm, ids, *libs):
    """Logits of five fused steps after `ids`, once per compiled library."""
    from kvlm.model.fused import FusedDecoder

    logits = []
    for lib in libs:
        cache = llm.new_cache("contiguous")
        llm.runner.forward(ids, cache)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "library", lambda lib=lib: lib)
            slots = cache.store.shape[-2]
            mp.setitem(llm.runner._fused, slots, FusedDecoder(llm.model, slots))
            logits.append(torch.stack([llm.runner.forward([t], cache) for t in STEP_TOKENS]))
    return logits


@functools.cache
def _exact_llm(folder, weights):
    """The same weights in fp64: the exact result the fp32 paths are held to (loaded once
    per model and format; the torch path, never the fused step)."""
    from kvlm import LLM

    tiny = Path(folder).is_dir()
    return LLM(model=folder, progress=False, max_context=256 if tiny else 1024,
               weights=weights, dtype="fp64", activations="fp32", prefill_dtype="fp32")  # fmt: skip


def _exact_steps(folder, weights, ids, steps) -> torch.Tensor:
    """The logits of `steps` fed after `ids`, from the fp64 model with no cache."""
    exact = _exact_llm(folder, weights)
    return exact.runner.logits(list(ids) + list(steps), exact.new_cache("off"))[len(ids) :]


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "q4", "int8/q4", "q4/fp16"])
def test_the_portable_build_runs_the_same_fused_step(tiny_model_dir, march, kv_dtype):
    """The scalar attention (dot_kv / axpy_kv, the int8 and q4 rows one by one, K's and V's
    dtypes apart too) and products of a build without AVX-512: the same numerics in another
    summation order, so as close to the exact result as the AVX-512 build is (each rounds
    K/V, and for int8 the queries, the same way); the AVX2 build's halves likewise."""

    portable = portable_kernels(march)
    folder = tiny_model_dir("llama")
    llm = low_bit_llm(model=folder, max_context=64, weights="int4", kv_dtype=kv_dtype)
    ids = llm.encode("a b c d e")
    native, scalar = _fused_steps_per_library(llm, ids, kernels.library(), portable)
    exact = _exact_steps(folder, "int4", ids, STEP_TOKENS)
    assert_as_exact_as(scalar, native, exact)
    assert_as_exact_as(native, scalar, exact)


@needs_vector_kernels
@pytest.mark.parametrize("march", portable_build_params())
def test_the_int8_cache_attention_shapes_agree_with_the_portable_build(tmp_path, march):
    """The int8-cache attention's compiled cases (VNNI scores over one or two 64-code
    pieces, p.V over 4 or 8 vectors) and its fallback (more than 4 query heads per KV head)
    give the scalar build's logits: integer scores are exact, only p.V's order differs."""
    from helpers import save_tiny_model

    portable = portable_kernels(march)
    native = kernels.library()
    for heads, kv_heads, hidden in [(4, 2, 512), (6, 1, 384), (8, 1, 256)]:  # D 128, 64, 32
        folder = save_tiny_model(
            tmp_path / f"m{heads}", "llama", seed=7, num_attention_heads=heads,
            num_key_value_heads=kv_heads, hidden_size=hidden,
        )  # fmt: skip
        llm = low_bit_llm(model=folder, max_context=256, weights="int8", kv_dtype="int8")
        ids = llm.encode(" ".join(["a b c d e f g"] * 20))  # > 128 positions: chunks
        fast, scalar = _fused_steps_per_library(llm, ids, native, portable)
        exact = _exact_steps(folder, "int8", ids, STEP_TOKENS)
        assert_as_exact_as(scalar, fast, exact)
        assert_as_exact_as(fast, scalar, exact)


def _weight_error(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """How far each stored weight may be from w: half a quantization step of its group of
    32 (int8: max|w| / 127; int4: (max - min) / 15) plus the fp16 parameters' rounding;
    bf16: one rounding, 2^-8 relative."""
    if fmt == "bf16":
        return w.abs() * BF16_STEP
    g = w.view(w.shape[0], -1, 32)
    top = g.abs().amax(-1, keepdim=True)
    step = (
        top / 127 if fmt == "int8" else (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    )
    return (step / 2 + FP16_PARAMS * top).expand_as(g).reshape(w.shape)


def test_linear_formats_keep_the_product(tiny_model_dir):
    """Each format's product is x @ W^T within what its rounding of W (and, for bf16, of x
    and of the result) can move it, plus fp32 summation order."""
    torch.manual_seed(0)
    w, b = torch.randn(96, 64) * 0.1, torch.randn(96)
    x = torch.randn(2, 3, 64)
    ref = torch.nn.functional.linear(x, w, b)
    for fmt in ("int8", "int4", "bf16"):
        if fmt == "bf16":
            lin = Linear(w, b, bf16=True)
        else:  # as the loader builds them (transformer._WeightTaker._make)
            lin = Linear.from_quant(quant.quantize(w, quant.FORMATS[fmt]), b)
        # bf16 needs oneDNN's bf16 kernels (AVX512-BF16 or AMX): without, the weight stays
        # fp32 (an AVX2 CPU such as Zen 3), and so does its product
        bf16 = fmt == "bf16" and _onednn_works(torch.bfloat16)
        fp32 = "onednn" if _onednn_works(torch.float32) else "cpu-fp32"
        want = "quant" if fmt != "bf16" else ("bf16" if bf16 else fp32)
        assert lin.kernel == want
        assert (lin.rows() is None) == (want != "cpu-fp32")
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (2, 3, 96)
        err = _weight_error(w, fmt) if fmt != "bf16" or bf16 else torch.zeros_like(w)
        bound = x.abs() @ err.t() + product_bound(x, w).float()
        if bf16:  # x rounded too, and the result: 2^-8 of |x||w| and of |y| more
            bound += BF16_STEP * (x.abs() @ w.abs().t()) * 2 + BF16_STEP * ref.abs()
        assert ((y - ref).abs() <= bound).all()


def test_native_blocks_are_the_files_own_numbers(default_llm):
    """Q4_1 / Q8_0 blocks read as stored dequantize to exactly what the float loader gives
    (q/k rows un-permuted the same way)."""
    src = default_llm.loaded.weights
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]:
        q = src.get_quant(name)
        assert q is not None
        assert torch.equal(quant._dense_torch(q), src.get(name)), name
    assert src.get_quant("model.norm.weight") is None  # F32: no blocks


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "native"])
def test_weight_formats_agree_with_fp32_on_a_tiny_model(tiny_model_dir, fmt):
    """(int4 on random weights moves near-tied logits past the top-5 rule: it is held to the
    rule on the real model below, and its agreement is measured in BENCHMARKS.md.)"""
    from helpers import assert_generation_agrees
    from kvlm import LLM

    folder = tiny_model_dir("llama")
    ref = LLM(model=folder, progress=False, max_context=128)
    llm = low_bit_llm(model=folder, max_context=128, weights=fmt)
    assert llm.describe()["weights"] == ("fp32" if fmt == "f32" else fmt)
    assert_generation_agrees(ref, llm, "The quick brown fox", 24)


@pytest.fixture(scope="module")
def real_reference(default_llm):
    """default_llm's greedy answer to REAL_PROMPT and its no-cache logits, made once for the
    four LLMs held to it below."""
    from helpers import reference_generation

    return reference_generation(default_llm, REAL_PROMPT, 32)


@pytest.mark.parametrize("fmt", ["int4", "native"])
def test_low_bit_formats_agree_with_fp32_on_the_real_model(default_llm, real_reference, fmt):
    """The default file is Q4_1: `native` multiplies its blocks, `int4` re-derives them."""
    from helpers import assert_generation_agrees
    from kvlm import LLM

    llm = LLM(
        progress=False, max_context=256, weights=fmt, activations="fp32", prefill_dtype="fp32"
    )
    assert_generation_agrees(default_llm, llm, REAL_PROMPT, 32, real_reference)


def test_int8_activations_keep_greedy_agreement_on_the_real_model(default_llm, real_reference):
    from helpers import assert_generation_agrees
    from kvlm import LLM

    llm = LLM(
        progress=False, max_context=256, weights="native", activations="int8", prefill_dtype="fp32"
    )
    assert llm.describe()["activations"] == "int8"
    assert_generation_agrees(default_llm, llm, REAL_PROMPT, 32, real_reference)


def test_bf16_prefill_rounds_the_dense_weight_as_torch_does():
    torch.manual_seed(0)
    q = quant.quantize(torch.randn(64, 96), "q4")
    torch.testing.assert_close(
        q.dense(dtype=torch.bfloat16), quant._dense_torch(q).to(torch.bfloat16), atol=0, rtol=0
    )
    x = torch.randn(40, 96)
    xb, wb = x.bfloat16().float(), quant._dense_torch(q).bfloat16().float()
    ref = xb @ wb.t()
    # bf16 inputs, fp32 accumulation, the result rounded to bf16 (2^-8 relative); at any
    # number of rows (the caller, Linear, gives it the prompt's rows however chunked)
    bound = BF16_STEP * ref.abs() + product_bound(xb, wb).float()
    for rows in (40, 3, 1):
        got = q.matmul(x[:rows], prefill_bf16=True)
        assert ((got - ref[:rows]).abs() <= bound[:rows]).all()


def test_bf16_prefill_keeps_greedy_agreement_on_the_real_model(default_llm, real_reference):
    from helpers import assert_generation_agrees
    from kvlm import LLM

    llm = LLM(
        progress=False, max_context=256, weights="native", prefill_dtype="bf16", activations="fp32"
    )
    assert llm.describe()["prefill_dtype"] == "bf16"
    assert_generation_agrees(default_llm, llm, REAL_PROMPT, 32, real_reference)


def test_weight_format_mistakes_are_clear():
    from kvlm import LLM
    from kvlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown weight format 'q3'"):
        LLM(weights="q3", progress=False, activations="fp32", prefill_dtype="fp32")
    with pytest.raises(InvalidRequestError, match="needs --dtype fp32"):
        LLM(weights="f32", dtype="bf16", progress=False, activations="fp32", prefill_dtype="fp32")
    with pytest.raises(InvalidRequestError, match="applies to --weights int8"):
        LLM(prefill_dtype="bf16", weights="f32", progress=False)
    with pytest.raises(InvalidRequestError, match="unknown prefill dtype 'fp8'"):
        LLM(weights="native", prefill_dtype="fp8", progress=False, activations="fp32")
    with pytest.raises(InvalidRequestError, match="--activations int8 applies to --weights"):
        LLM(activations="int8", weights="f32", progress=False)
    with pytest.raises(InvalidRequestError, match="unknown activations 'int4'"):
        LLM(weights="native", activations="int4", progress=False, prefill_dtype="fp32")


def _held_rows(cache, layer=slice(None)):
    n = cache.num_tokens
    store = cache.store
    if store.quantized:
        return store.values[layer, ..., :n, :], store.scales[layer, ..., :n, :]
    return store.values[layer, ..., :n, :], None


def _assert_fused_tracks_torch(llm, folder, weights, prompt_ids, steps, factor=SAME_ROUNDING):
    """The fused step and the torch model against the exact (fp64) result of the same
    weights: the fused logits are as close to it as the torch path's, within `factor`.
    Layer 0's K/V, whose inputs differ by fp32 rounding only, are within one storage step
    of each other (bf16: one ulp; int8: one code); fp32 K/V as exact as the torch path's."""
    tokens, fused, ref, fused_cache, torch_cache = fused_and_torch(llm, prompt_ids, steps)
    # the exact logits (_exact_steps' rows, bit for bit) and layer 0's exact K/V for the
    # fp32 check below from one fp64 forward over a contiguous cache, not one for each
    exact_cache = _exact_llm(folder, weights).new_cache("contiguous")
    seq = list(prompt_ids) + tokens
    exact = _exact_llm(folder, weights).runner.logits(seq, exact_cache)[len(prompt_ids) :]
    assert_as_exact_as(fused, ref, exact, factor)
    assert_top_k_both_ways(fused, ref)
    dtype = fused_cache.store.values.dtype
    (ours, our_scales), (theirs, _) = _held_rows(fused_cache, 0), _held_rows(torch_cache, 0)
    if dtype == torch.int8:  # a code on a rounding boundary may take its neighbour
        assert (ours.int() - theirs.int()).abs().max() <= 1
        assert torch.isfinite(our_scales).all()
    elif dtype == torch.bfloat16:
        a, b = ours.float(), theirs.float()
        ulp = torch.ldexp(torch.ones_like(a), torch.frexp(a.abs().maximum(b.abs()))[1] - 8)
        assert ((a - b).abs() <= ulp).all()
    else:
        n = exact_cache.num_tokens
        held = [c.store.values[..., :n, :] for c in (fused_cache, torch_cache, exact_cache)]
        assert_as_exact_as(*held)


@needs_kernels
def test_fused_decode_step_matches_the_torch_model_on_the_real_model(default_model_path):
    from kvlm import LLM

    llm = LLM(
        progress=False, max_context=256, weights="native", activations="fp32", prefill_dtype="fp32"
    )
    ids = llm.encode("The history of the city of Paris begins")
    _assert_fused_tracks_torch(llm, default_model_path, "native", ids, 48)


@needs_kernels
def test_fused_decode_step_reads_and_writes_a_bf16_cache(default_model_path):
    """Both paths round K/V to bf16, so both are as far from the exact result as bf16
    storage takes them; where a value sits on a rounding boundary they differ by one ulp."""

    llm = low_bit_llm(max_context=256, kv_dtype="bf16")
    assert llm.new_cache("contiguous").store.values.dtype == torch.bfloat16
    ids = llm.encode("The history of the city of Paris begins")
    _assert_fused_tracks_torch(llm, default_model_path, "native", ids, 32)


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4:i8"])
def test_fused_decode_step_matches_the_torch_model_on_a_tiny_model(tiny_model_dir, fmt):
    """fp32 activations: the same arithmetic in another order. int8 activations: both
    paths round them to int8 with the same rule (C for both), so their errors against the
    fp32-activation exact result are the same roundings."""
    from kvlm import LLM

    weights, _, act = fmt.partition(":")
    folder = tiny_model_dir("llama")
    llm = LLM(model=folder, progress=False, max_context=64, weights=weights,
              activations="int8" if act else "fp32", prefill_dtype="fp32")  # fmt: skip
    _assert_fused_tracks_torch(llm, folder, weights, llm.encode("a b c d e"), 40)


def test_fused_step_is_not_used_where_it_does_not_apply(tiny_model_dir):
    from kvlm import LLM

    fp32 = LLM(model=tiny_model_dir("llama"), progress=False, max_context=64)
    assert fp32.runner.fused_reason is not None  # fp32 weights: the torch model
    # biases, q/k norm and windows take the fused step now (tests/test_fused_arch.py)
    q8 = low_bit_llm(model=tiny_model_dir("llama"), max_context=64, weights="int8")
    if q8.runner.fused_reason is None:
        assert q8.runner.fused_for(q8.new_cache("window")) is None
        assert q8.runner.fused_for(q8.new_cache("basic")) is None
        assert q8.runner.fused_for(q8.new_cache("paged")) is not None
        assert q8.runner.fused_for(q8.new_cache("contiguous")) is not None


def test_packed_weights_move_to_huge_pages_unchanged():
    """One 2 MiB-aligned buffer in the order given (Linux: madvise(MADV_HUGEPAGE)); every
    weight keeps its bytes and its products. Elsewhere nothing moves."""
    torch.manual_seed(5)
    ws = [quant.quantize(torch.randn(n, 64), kind) for n, kind in [(40, "q8"), (16, "q4")]]
    x = torch.randn(2, 64)
    before = [(w.data.clone(), w.matmul(x)) for w in ws]
    buf = kernels.huge_page_buffer(3 << 20)
    if buf is None:
        assert not quant.move_to_huge_pages(ws)
        return
    assert buf.numel() == 3 << 20 and buf.data_ptr() % kernels.HUGE_PAGE == 0
    assert int(buf.sum()) == 0  # anonymous memory: zero-filled
    assert quant.move_to_huge_pages(ws)
    assert ws[0].data.data_ptr() % kernels.HUGE_PAGE == 0
    assert ws[1].data.data_ptr() == ws[0].data.data_ptr() + -(-ws[0].nbytes // 64) * 64
    for w, (data, y) in zip(ws, before, strict=True):
        assert torch.equal(w.data, data)
        torch.testing.assert_close(w.matmul(x), y, atol=0, rtol=0)


def test_weights_pack_straight_into_one_arena_in_creation_order():
    """Inside packing_on_huge_pages every packed weight is the arena's next slice (64-byte
    aligned), byte for byte what ordinary memory gets; a weight that does not fit, and one
    made outside_arena(), get ordinary memory."""
    torch.manual_seed(6)
    dense = [torch.randn(n, 64) for n in (40, 16, 32)]
    plain = [quant.quantize(w, "q8") for w in dense]
    with quant.packing_on_huge_pages(8192) as arena:
        if arena is None:  # no huge pages here: ordinary memory, same bytes
            packed = [quant.quantize(w, "q8") for w in dense]
            assert all(torch.equal(a.data, b.data) for a, b in zip(packed, plain, strict=True))
            return
        first = quant.quantize(dense[0], "q8")
        with quant.outside_arena():
            loose = quant.quantize(dense[1], "q8")
        second = quant.quantize(dense[2], "q8")
        too_big = quant.quantize(torch.randn(256, 64), "q8")  # 8192 bytes are used up
    base = arena.buffer.data_ptr()
    assert first.data.data_ptr() == base and arena.holds(first.data)
    assert second.data.data_ptr() == base + -(-first.data.numel() // 64) * 64
    assert not arena.holds(loose.data) and not arena.holds(too_big.data)
    for w, ref in zip((first, loose, second), plain, strict=True):
        assert torch.equal(w.data, ref.data)


def test_a_native_model_packs_on_one_arena_in_decode_order(tiny_model_dir, tmp_path):
    """LLM(weights native) packs each layer's weights front to back into one buffer as
    it loads them (no second copy of the model), in the order a decode step reads them."""
    from gguf import GGMLQuantizationType as Q

    from helpers import write_gguf_from_hf
    from kvlm import LLM

    path = write_gguf_from_hf(tiny_model_dir("llama"), tmp_path / "q.gguf", Q.Q8_0)
    llm = LLM(path, progress=False, max_context=32)
    weights = [m.quant.data for m in llm.model.modules() if isinstance(m, Linear) and m.quant]
    assert len(weights) > 3
    if kernels.huge_page_buffer(1) is None:
        return  # no huge pages: ordinary memory, nothing to order
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts)  # module order: each layer's, then the head
    table = llm.model._embed_quant  # the embedding rows (packed too) lie between
    tiles = sorted(weights + ([table.data] if table is not None else []), key=torch.Tensor.data_ptr)
    for w, nxt in itertools.pairwise(tiles):  # the next 64-aligned slice
        assert nxt.data_ptr() == -(-(w.data_ptr() + w.numel()) // 64) * 64


# The fused step over an int8 cache also rounds each query head to int8 (one scale per
# head, llama.cpp's q8_0-cache numerics): one more int8 rounding of an attention input, of
# the size the K/V codes' own is, so its error against the exact result is up to twice
# the torch int8 path's (which keeps fp32 queries), times the spread SAME_ROUNDING allows.
INT8_QUERIES = 2 * SAME_ROUNDING


@needs_kernels
def test_fused_decode_step_reads_and_writes_an_int8_cache(default_model_path):

    llm = low_bit_llm(max_context=256, kv_dtype="int8")
    assert llm.new_cache("contiguous").store.values.dtype == torch.int8
    ids = llm.encode("The history of the city of Paris begins")
    _assert_fused_tracks_torch(llm, default_model_path, "native", ids, 32, INT8_QUERIES)


@needs_kernels
@pytest.mark.parametrize("build", ["native", *portable_build_params()])
def test_fused_int8_rows_are_quantized_as_the_store_quantizes(build):
    """The C row quantizer (fp16 step and zero, round half to even, clamp; F16C or the
    portable conversion) against storage.quantize on rows with ties, constant rows and
    ranges from 1e-6 to 1e3."""
    from kvlm.cache.storage import quantize

    lib = kernels.library() if build == "native" else portable_kernels(build)
    g = torch.Generator().manual_seed(0)
    rows = torch.cat(
        [
            torch.randn(64, 64, generator=g) * torch.logspace(-6, 3, 64)[:, None],
            torch.full((2, 64), 0.37),
            torch.zeros(1, 64),
            torch.cat([torch.tensor([0.0, 255 / 128]), (torch.arange(62.0) + 0.5) / 128])[None],
        ]
    )  # fmt: skip  the last row: step 2^-7 exactly, codes on .5 ties (half to even)
    codes = torch.empty(rows.shape, dtype=torch.int8)
    params = torch.empty(rows.shape[0], 2, dtype=torch.float16)
    rc = lib.kvlm_quantize_kv_rows(rows.data_ptr(), rows.numel(), codes.data_ptr(), codes.numel(),
                                   params.data_ptr(), params.numel(), *rows.shape)  # fmt: skip
    assert rc == 0
    want_codes, want_params = quantize(rows)
    assert torch.equal(params, want_params)
    assert torch.equal(codes, want_codes)


@needs_kernels
@pytest.mark.parametrize("build", ["native", *portable_build_params()])
@pytest.mark.parametrize("head_dim", [64, 16])
def test_fused_q4_rows_are_quantized_as_the_store_quantizes(build, head_dim):
    """The C q4 quantizer (the first value of largest magnitude, its fp16 scale, round half
    to even, clamp) against storage.quantize_q4 bit for bit: ranges from 1e-6 to 1e3, equal
    magnitudes of both signs, constant and zero rows, codes on .5 ties."""
    from kvlm.cache.storage import quantize_q4

    lib = kernels.library() if build == "native" else portable_kernels(build)
    g = torch.Generator().manual_seed(1)
    d = head_dim
    ties = (torch.arange(d, dtype=torch.float32) % 16 - 7.5) / 4  # d = -0.25: x / d on .5
    rows = torch.cat(
        [
            torch.randn(64, d, generator=g) * torch.logspace(-6, 3, 64)[:, None],
            torch.full((2, d), 0.37), torch.zeros(1, d), ties[None], -ties[None],
            torch.tensor([1.0, -1.0] * (d // 2))[None],
        ]
    )  # fmt: skip
    codes = torch.empty(rows.shape[0], d // 2, dtype=torch.uint8)
    scales = torch.empty(rows.shape[0], d // min(32, d), dtype=torch.float16)
    rc = lib.kvlm_quantize_q4_rows(rows.data_ptr(), rows.numel(), codes.data_ptr(), codes.numel(),
                                   scales.data_ptr(), scales.numel(), *rows.shape)  # fmt: skip
    assert rc == 0
    want_codes, want_scales = quantize_q4(rows)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)


@needs_kernels
@pytest.mark.parametrize("build", ["native", *portable_build_params()])
def test_fused_fp16_rows_are_rounded_as_torch_rounds(build):
    """The fp16 cache's conversions in C (F16C, or the portable code of a build without
    it) against torch's .to(float16) bit for bit: every half, the midpoints between
    neighbouring halves and their next floats (ties to even), subnormals, 65504 .. 65520
    (65520 and past: inf), inf, NaN (quiet, payload kept) and random bit patterns; and
    back to fp32 exactly."""
    lib = kernels.library() if build == "native" else portable_kernels(build)
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    finite = halves[torch.isfinite(halves)].unique().sort().values.double()
    mids = ((finite[1:] + finite[:-1]) / 2).float()  # exact in fp32
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(50000, generator=g) * torch.exp2(
        torch.randint(-30, 20, (50000,), generator=g).float()
    )
    bits = torch.randint(-(2**31), 2**31 - 1, (50000,), generator=g).to(torch.int32)
    edges = [65504.0, 65519.99, 65520.0, 1e5, -1e5, 3e38, 2.0**-24, 2.0**-25, 2.0**-26, -0.0]
    x = torch.cat(
        [halves, mids, mids.nextafter(up), mids.nextafter(down), scaled, bits.view(torch.float32),
         torch.tensor(edges), torch.tensor([float("inf"), float("-inf"), float("nan")])]
    ).contiguous()  # fmt: skip
    h = torch.empty(x.shape, dtype=torch.float16)
    y = torch.empty_like(x)
    n = x.numel()
    assert lib.kvlm_f16_round_trip(x.data_ptr(), n, h.data_ptr(), n, y.data_ptr(), n, n) == 0
    want = x.to(torch.float16)
    assert torch.isinf(want).sum() > 4 and torch.isnan(want).sum() > 4  # the cases are there
    assert torch.equal(h.view(torch.int16), want.view(torch.int16))
    nan = torch.isnan(want)
    assert torch.equal(y[~nan], want[~nan].float()) and torch.isnan(y[nan]).all()


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "int8"])
def test_fused_attention_split_into_position_chunks_matches_the_torch_model(
    kv_dtype, default_model_path
):
    """Past 128 positions the fused attention splits each KV head's history into chunks
    (the threads' work items, merged by log-sum-exp) and fetches rows ahead: same logits."""

    llm = low_bit_llm(max_context=512, kv_dtype=kv_dtype)
    ids = llm.encode(" ".join(f"item {i}," for i in range(70)))  # ~280 tokens: 4 chunks
    assert len(ids) > 256
    factor = INT8_QUERIES if kv_dtype == "int8" else SAME_ROUNDING
    _assert_fused_tracks_torch(llm, default_model_path, "native", ids, 6, factor)


def test_prompt_products_meet_one_gemm_shape_and_keep_a_rows_bits(monkeypatch):
    """oneDNN keeps a JIT-compiled primitive for every GEMM shape it meets (a server under
    varied load grew ~50 MiB a minute when chunks reached it at every row count), and its
    kernels and MKL's block a call by its shape: prompt chunks of every row count from 1 to
    300 reach the GEMM as calls of PROMPT_BLOCK rows, each row's result held to bf16's
    bound and the same bits as in the 300-row call, in bf16 and in fp32."""
    if kernels.library() is None:
        pytest.skip("the tiles are the compiled path")
    torch.manual_seed(5)
    q = quant.quantize(torch.randn(48, 64), "q4")
    x = torch.randn(300, 64)
    xb, wb = x.bfloat16().float(), quant._dense_torch(q).bfloat16().float()
    ref = xb @ wb.t()
    bound = BF16_STEP * ref.abs() + product_bound(xb, wb).float()
    rows, real = set(), torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: rows.add(a.shape[0]) or real(a, b))
    whole = q.matmul(x, prefill_bf16=True)
    whole32 = q.matmul(x, prompt=True)
    for m in range(1, 301):
        got = q.matmul(x[:m], prefill_bf16=True)
        assert got.shape == (m, 48) and ((got - ref[:m]).abs() <= bound[:m]).all()
        assert torch.equal(got, whole[:m])
        assert torch.equal(q.matmul(x[300 - m :], prompt=True), whole32[300 - m :])
    assert rows == {quant.PROMPT_BLOCK}
    assert [quant.onednn_rows(m) for m in (511, 513, 1025, 2000)] == [512, 544, 1088, 2048]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_products_dequantize_in_bounded_tiles(monkeypatch, dtype):
    """The dense (prefill) product dequantizes the weight a tile at a time: its scratch
    never holds more than TILE_WEIGHTS weights, the tiles cover every output (the last one
    partial), and the result is the whole weight's product to rounding."""
    if kernels.library() is None:
        pytest.skip("the tiles are the compiled path")
    torch.manual_seed(3)
    k = 96
    monkeypatch.setattr(quant, "TILE_WEIGHTS", 3 * quant.BLOCK_ROWS * k)  # 3 blocks a tile
    monkeypatch.setattr(quant, "_SCRATCH", {})
    q = quant.concat([quant.quantize(torch.randn(70, k), "q4"),
                      quant.quantize(torch.randn(37, k), "q8")])  # fmt: skip
    x = torch.randn(24, k)
    w = q.dense()
    if dtype == torch.bfloat16:
        got = q.matmul(x, prefill_bf16=True)
        xb, wb = x.bfloat16().float(), w.bfloat16().float()
        ref = xb @ wb.t()
        assert ((got - ref).abs() <= BF16_STEP * ref.abs() + product_bound(xb, wb)).all()
    else:
        assert_product_close(q.matmul(x), x @ w.t(), x, w)
    assert all(b.numel() <= quant.TILE_WEIGHTS for b in quant._SCRATCH.values())


def test_the_arena_faults_its_pages_in_ahead_and_at_most_a_slice_past_them():
    """The arena's pages come in ahead of the slices it hands out (kvlm_prefault, every
    thread): a slice's, and as many bytes again (at most PREFAULT_BYTES), whole huge pages,
    those no slice took given back when the packing ends; what a slice holds is what was
    written there; the kernel refuses a page under 4 KiB."""
    lib = kernels.library()
    if lib is None:
        pytest.skip("no C kernels")
    page = kernels.HUGE_PAGE
    with quant.packing_on_huge_pages(3 * quant.PREFAULT_BYTES) as arena:
        if arena is None:
            pytest.skip("no huge pages here")
        w = quant.quantize(torch.randn(64, 64), "q8")
    assert arena.faulted == page  # a small slice: its page (trimmed to it as packing ended)
    assert torch.equal(w.data, quant.quantize(w.dense(), "q8").data)
    part = arena.take(5 * page)
    assert part is not None
    assert arena.faulted == -(-(arena.used + 5 * page) // page) * page  # and 5 pages ahead
    arena.take(quant.PREFAULT_BYTES)  # a big slice: at most PREFAULT_BYTES ahead
    assert arena.faulted <= arena.used + quant.PREFAULT_BYTES + page
    arena.trim()  # as the packing ends: the pages no slice took given back
    assert arena.faulted == -(-arena.used // page) * page
    assert lib.kvlm_prefault(arena.buffer.data_ptr(), 4096, 2048) == -2
