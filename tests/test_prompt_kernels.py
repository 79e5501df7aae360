"""The prompt's own C kernels: attention (kvlm_attend), SwiGLU (kvlm_silu_mul) and the int8
products at any row count (kvlm_qgemm_i8), against torch in fp64 with bounds derived from
the arithmetic (tests/numerics.py), and the property the engine relies on: a row's result
depends only on its own inputs, not on how many rows share the call or how a prompt was
chunked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import needs_kernels, needs_vector_kernels
from kvlm import kernels
from kvlm.model import quant
from kvlm.model.attention import _attend_kernel, attend
from numerics import U32, gamma

pytestmark = needs_kernels


def _attention_bound(q, k, v, scale):
    """|fp32 attention - exact| per output, from the arithmetic: each score q.k over D
    terms is within gamma_D * scale * sum|q_d k_d| (E); a probability's relative error is
    then at most 2E plus the exponential's and the normalising sum's (exp512 is within 4
    units of roundoff; the sum over S keys gamma_S); the output, a convex combination of V
    rows summed over S terms, inherits that relative error on max|v| plus its own
    gamma_S."""
    D, S = q.shape[-1], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)
    e = gamma(D) * scale * float((q.abs() @ kk.abs().transpose(-1, -2)).max())
    return float(v.abs().max()) * (2 * e + 8 * U32 + 3 * gamma(S))


def _exact(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, is_causal=causal, enable_gqa=True
    )


@needs_vector_kernels
@pytest.mark.parametrize(
    ("H", "Hkv", "D", "T"),
    [(9, 3, 64, 37), (14, 2, 64, 100), (16, 8, 128, 70), (12, 2, 128, 33), (4, 4, 96, 19),
     (2, 1, 256, 9), (4, 2, 32, 2)],
)  # fmt: skip
def test_attention_matches_exact_softmax(H, Hkv, D, T):
    torch.manual_seed(H * D + T)
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    got = _attend_kernel(q, k, v, None, True)
    assert got is not None and got.shape == (1, H, T, D)
    bound = _attention_bound(q, k, v, D**-0.5)
    assert float((got.double() - _exact(q, k, v, causal=True)).abs().max()) <= bound
    # no mask, not causal: every row sees every key
    full = _attend_kernel(q, k, v, None, False)
    assert float((full.double() - _exact(q, k, v)).abs().max()) <= bound


@needs_vector_kernels
@pytest.mark.parametrize("window", [None, 7, 40])
def test_attention_with_an_explicit_mask(window):
    """A chunk after a cached prefix (bottom-right triangle), with or without a model
    window, and a mask given as (1, 1, T, S)."""
    torch.manual_seed(1)
    H, Hkv, D, S, T = 8, 2, 64, 90, 25
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)
    pos = torch.arange(S - T, S)[:, None]
    keys = torch.arange(S)[None, :]
    mask = keys <= pos
    if window is not None:
        mask &= (pos - keys) < window
    bound = _attention_bound(q, k, v, D**-0.5)
    for m in (mask, mask[None, None]):
        got = _attend_kernel(q, k, v, m, False)
        assert float((got.double() - _exact(q, k, v, mask)).abs().max()) <= bound


@needs_vector_kernels
def test_a_row_gets_the_same_bits_whole_or_chunked():
    """Rows a .. b - 1 of a prompt, as a chunk over the keys 0 .. b - 1 (the cache holds
    the first a), are bit for bit the rows of the whole prompt's causal attention."""
    torch.manual_seed(2)
    H, Hkv, D, S = 6, 2, 64, 131
    q, k, v = torch.randn(1, H, S, D), torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)
    whole = _attend_kernel(q, k, v, None, True)
    for a, b in [(0, 1), (0, 17), (17, 18), (17, 64), (64, 131), (100, 131), (3, 99)]:
        mask = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]
        part = _attend_kernel(q[:, :, a:b], k[:, :, :b], v[:, :, :b], mask, False)
        assert torch.equal(part, whole[:, :, a:b]), (a, b)


@needs_vector_kernels
def test_a_row_that_sees_no_key_is_zero_and_strided_inputs_are_read_in_place():
    torch.manual_seed(3)
    H, D, T = 2, 64, 5
    qkv = torch.randn(1, T, 3 * H, D)  # q, k, v heads side by side, as attention makes them
    q, k, v = (t.transpose(1, 2) for t in qkv.split([H, H, H], dim=2))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    mask[2] = False
    got = _attend_kernel(q, k, v, mask, False)
    assert torch.equal(got[:, :, 2], torch.zeros(1, H, D))
    ref = _attend_kernel(q.contiguous(), k.contiguous(), v.contiguous(), mask, False)
    assert torch.equal(got, ref)


def test_what_the_kernel_does_not_take_goes_to_sdpa():
    q, k, v = torch.randn(1, 2, 4, 24), torch.randn(1, 2, 4, 24), torch.randn(1, 2, 4, 24)
    assert _attend_kernel(q, k, v, None, True) is None  # head size 24: not a multiple of 16
    q64, k64 = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64)
    assert _attend_kernel(q64.double(), k64.double(), k64.double(), None, True) is None
    additive = torch.zeros(4, 4)  # a float mask
    assert _attend_kernel(q64, k64, k64, additive, False) is None
    out = attend(q, k, v, None, True)  # and attend() still answers
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_silu_mul_matches_torch():
    """exp512 is within 4 units of roundoff of exp; 1 + e, the division and the product
    add three roundings: relative error at most ~8 u of silu(g) * u."""
    torch.manual_seed(4)
    lib = kernels.library()
    gu = torch.randn(37, 2 * 200) * 4
    out = torch.empty(37, 200)
    assert lib.kvlm_silu_mul(gu.data_ptr(), gu.numel(), 37, 200, out.data_ptr(), out.numel()) == 0
    g, u = gu.double().chunk(2, dim=-1)
    ref = F.silu(g) * u
    assert float(((out.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()) <= 16 * U32


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_int8_products_at_any_row_count_are_the_rows_alone(kind):
    """The prompt's int8 products (--prefill-dtype int8): one kernel call over many rows
    (8 per pass over a weight block, PROMPT_ROWS per call) gives each row exactly what it
    gets alone (integer sums are exact; each row's float steps are its own)."""
    torch.manual_seed(5)
    w = quant.quantize(torch.randn(40, 96), kind)
    x = torch.randn(quant.PROMPT_ROWS + 37, 96)
    many = w.matmul(x, act_int8=True)
    alone = torch.cat([w.matmul(x[i : i + 1], act_int8=True) for i in range(0, x.shape[0], 41)])
    assert torch.equal(many[::41], alone)
    # and the products are those of the rounded activations, within one product's bound
    xr = quant.round_activations(x).double()
    ref = xr @ w.dense().double().t()
    bound = 2 * gamma(96) * (xr.abs() @ w.dense().double().abs().t())
    assert bool(((many.double() - ref).abs() <= bound + 1e-30).all())


def test_prompt_int8_is_a_setting_of_its_own():
    from kvlm import LLM
    from kvlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="applies to --weights"):
        LLM(progress=False, weights="f32", prefill_dtype="int8")
    with pytest.raises(InvalidRequestError, match="valid: fp32, bf16, int8"):
        LLM(progress=False, prefill_dtype="int4")


def test_a_long_prompt_goes_through_the_mlp_in_pieces_with_the_same_bits():
    """Over PIECE_ROWS rows a low-bit MLP takes the prompt in pieces (bounded buffers); each
    row's result is what it is in any piece, with the prompt's numerics throughout."""
    from kvlm.model.layers import MLP, PIECE_ROWS, Linear, feeding_prompt

    torch.manual_seed(6)
    gate_up = Linear.from_quant(quant.quantize(torch.randn(2 * 64, 96) * 0.1, "q8"))
    down = Linear.from_quant(quant.quantize(torch.randn(96, 64) * 0.1, "q8"))
    for lin in (gate_up, down):
        lin.prefill_int8 = lin.act_int8 = True
    mlp = MLP(gate_up, down)
    x = torch.randn(1, PIECE_ROWS + 77, 96)
    whole = mlp(x)
    with feeding_prompt(True):
        parts = torch.cat([mlp(x[:, :300]), mlp(x[:, 300:301]), mlp(x[:, 301:])], dim=1)
    assert whole.shape == (1, PIECE_ROWS + 77, 96)
    assert torch.equal(whole, parts)


def _rms_norm_exact(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("n", [64, 128, 896, 1000, 7])
def test_rms_norm_matches_the_exact_norm(n):
    """kvlm_rms_norm, the vector body and the scalar tail: the sum of n squares is within
    gamma_n of exact, the mean, +eps, sqrt and 1/x add ~4 roundings (r's relative error is
    half the sum's plus those), the two products two more: |y - exact| <= (gamma_n + 8u)
    |exact| elementwise. A row's bits do not depend on how many rows share the call."""
    from kvlm.model.layers import RMSNorm

    torch.manual_seed(n)
    x, w = torch.randn(33, n) * 3, torch.randn(n)
    norm = RMSNorm(w, 1e-6)
    got = norm(x)
    exact = _rms_norm_exact(x, w, 1e-6)
    assert bool(((got.double() - exact).abs() <= (gamma(n) + 8 * U32) * exact.abs()).all())
    assert torch.equal(norm(x[5:6]), got[5:6]) and torch.equal(norm(x[None]), got[None])
    # a strided input is not the kernel's: torch's rms_norm answers, within the same bound
    strided = norm(torch.cat([x, x], dim=1)[:, :n])
    assert bool(((strided.double() - exact).abs() <= (gamma(n) + 8 * U32) * exact.abs()).all())


def _attention_inputs(norms: bool):
    from kvlm.model.attention import Attention
    from kvlm.model.layers import Linear, RMSNorm

    torch.manual_seed(7)
    H, Hkv, D, hidden = 4, 2, 64, 96
    qkv = Linear(torch.randn((H + 2 * Hkv) * D, hidden) * 0.2)
    o = Linear(torch.randn(hidden, H * D) * 0.1)
    qn = RMSNorm(torch.rand(D) + 0.5, 1e-6) if norms else None
    kn = RMSNorm(torch.rand(D) + 0.5, 1e-6) if norms else None
    return Attention(0, H, Hkv, D, qkv, o, qn, kn)


@pytest.mark.parametrize("rotary", [64, 16], ids=["whole", "partial"])
@pytest.mark.parametrize("norms", [False, True])
def test_qk_norm_rope_is_the_torch_steps(norms, rotary):
    """kvlm_qk_norm_rope on a q|k|v product: RoPE alone has apply_rope's bits exactly (the
    same two roundings per product and one per sum, no fused multiply-add); with Qwen3's
    per-head norms first, each head is within the norm's bound of torch's (then rotated
    alike: RoPE's error is relative to the rotated pair's size). A partial rotary factor
    (Qwen3.5's: cos/sin of 16 of 64 dims) rotates each head's first 16, as apply_rope."""
    from kvlm.model.layers import apply_rope

    attn = _attention_inputs(norms)
    H, Hkv, D = 4, 2, 64
    T = 21
    qkv = torch.randn(1, T, H + 2 * Hkv, D)
    angles = torch.arange(T)[:, None] * torch.rand(rotary // 2)[None] * 3
    emb = torch.cat([angles, angles], dim=-1)[None, :, None]
    cos, sin = emb.cos(), emb.sin()
    qk = qkv[:, :, : H + Hkv]
    if norms:
        qn, kn = attn.q_norm, attn.k_norm  # torch's own rms_norm, not the kernel's
        q = F.rms_norm(qk[:, :, :H], (D,), qn.weight, qn.eps)
        qk = torch.cat([q, F.rms_norm(qk[:, :, H:], (D,), kn.weight, kn.eps)], dim=2)
    ref = apply_rope(qk, cos, sin)
    got = qkv.clone()
    assert attn._norm_rope_in_c(got, cos, sin)
    assert torch.equal(got[:, :, H + Hkv :], qkv[:, :, H + Hkv :])  # v untouched
    if norms:
        # per pair, torch's and the kernel's normalised inputs are each within the norm
        # bound of exact; rotating adds 3 roundings of the pair's magnitude
        size = qk.abs().amax(-1, keepdim=True)
        assert bool(((got[:, :, : H + Hkv] - ref).abs() <= (2 * gamma(D) + 40 * U32) * size).all())
    else:
        assert torch.equal(got[:, :, : H + Hkv], ref)
    # one row alone: its own bits
    one = qkv[:, 3:4].clone()
    assert attn._norm_rope_in_c(one, cos[:, 3:4].contiguous(), sin[:, 3:4].contiguous())
    assert torch.equal(one, got[:, 3:4])


def test_qk_norm_rope_declines_what_it_does_not_take():
    attn = _attention_inputs(True)
    qkv = torch.randn(1, 5, 8, 64)
    cos = sin = torch.ones(1, 5, 1, 64)
    assert not attn._norm_rope_in_c(qkv.double(), cos.double(), sin.double())  # not fp32
    assert not attn._norm_rope_in_c(qkv, cos[:, :1].expand(1, 5, 1, 64), sin)  # a broadcast
    assert not attn._norm_rope_in_c(qkv.transpose(1, 2).contiguous().transpose(1, 2), cos, sin)


@pytest.mark.parametrize("declined", [True, False], ids=["torch-flash", "kvlm-pairs"])
@pytest.mark.parametrize(
    ("H", "Hkv", "D", "T", "S"),
    [(14, 2, 64, 100, 100), (8, 8, 128, 33, 90), (12, 2, 128, 37, 37), (4, 2, 64, 5, 71)],
)
def test_prompt_attention_in_bf16_is_within_its_rounding(H, Hkv, D, T, S, declined, monkeypatch):
    """`attend(bf16_from=0)` (--prefill-dtype bf16): q, k, v rounded to bf16 (relative
    2^-9 each), fp32 scores and softmax, the weights rounded to bf16 for p.V. A score is
    then within 2 * 2^-9 * scale * sum|q_d k_d| (E, plus the fp32 terms); a probability
    within 2E relative; the output within (2E + 2 * 2^-9) max|v| (v's and p's rounding)
    plus the fp32 bound. A chunk after a prefix (an explicit mask) too. Both roads:
    kvlm_attend's bf16 pairs (AVX512-BF16, AMX CPUs too), and torch's flash attention
    where kvlm_attend declines (here made to; on a CPU without AVX512-BF16 it does)."""
    from kvlm.cache.base import causal_mask
    from kvlm.model import attention

    if declined:
        monkeypatch.setattr(attention, "_attend_kernel", lambda *a, **kw: None)
    torch.manual_seed(T + S)
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)
    mask, causal = causal_mask(S - T, T, S, None, q.device)
    got = attend(q, k, v, mask, causal, bf16_from=0)
    assert got.dtype == torch.float32 and got.shape == (1, H, T, D)
    want = _exact(q, k, v, mask, causal)
    group = H // Hkv
    kk = k.repeat_interleave(group, dim=1)
    e = 2 * 2**-9 * D**-0.5 * float((q.abs() @ kk.abs().transpose(-1, -2)).max())
    bound = float(v.abs().max()) * (2 * e + 2 * 2**-9) + _attention_bound(q, k, v, D**-0.5)
    err = float((got.double() - want).abs().max())
    assert err <= bound
    fp32 = attend(q, k, v, mask, causal)
    pairs = not torch.equal(_attend_kernel(q, k, v, mask, causal, bf16_row=0),
                            _attend_kernel(q, k, v, mask, causal))  # fmt: skip
    # it did round (not the fp32 road's bits), but where this CPU's kernels have no bf16
    # pairs: there every row is fp32, as chunk-invariant as the rest of kvlm_attend
    assert torch.equal(got, fp32) == (not declined and not pairs)


@needs_kernels
@pytest.mark.parametrize("D", [32, 96, 256])
def test_bf16_rows_at_a_head_size_the_pairs_do_not_take_are_fp32_rows(D):
    """--prefill-dtype bf16 (the AMX CPUs' default: every prompt row in bf16) at a head
    size kvlm_attend's bf16 pairs do not take (64 and 128 only): every row through its
    fp32 kernel, whole or in chunks the same bits. It went to torch's bf16 flash
    attention, which splits a chunk's rows by its length: on the AMX Xeon a tiny
    Qwen3-MoE (head 32) answered a prompt in chunks 9 + 1 + 30 otherwise than whole."""
    from kvlm.cache.base import causal_mask

    torch.manual_seed(D)
    H, Hkv, T = 4, 2, 40
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    whole = attend(q, k, v, None, True, bf16_from=0)
    assert torch.equal(whole, attend(q, k, v, None, True))
    for a, b in ((0, 9), (9, 10), (10, 40)):
        mask, causal = causal_mask(a, b - a, b, None, q.device)
        part = attend(q[:, :, a:b], k[:, :, :b], v[:, :, :b], mask, causal, bf16_from=0,
                      prompt=True)  # fmt: skip
        assert torch.equal(part, whole[:, :, a:b])


@needs_vector_kernels
def test_prompt_attention_bf16_pairs_give_a_row_its_own_bits():
    """kvlm_attend's bf16 pairs: a row's result depends on its query and the keys it sees
    alone, as the fp32 kernel's: a prompt's rows attended whole or as a chunk after its
    prefix (an explicit mask over all keys) are the same bits; and it is not the fp32
    road's (it rounded)."""
    from kvlm.cache.base import causal_mask

    # the pairs are compiled into a 512-bit build of a CPU with AVX512-BF16; elsewhere
    # _attend_kernel retries every row in fp32 (which the last assert would take for them)
    if kernels.library().kvlm_kernel_simd() != 512 or "avx512_bf16" not in kernels.cpu_flags():
        pytest.skip("no AVX512-BF16 build: kvlm_attend's bf16 pairs decline (its fp32 rows)")
    torch.manual_seed(5)
    H, Hkv, D, T = 12, 2, 64, 45
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    whole = _attend_kernel(q, k, v, None, True, bf16_row=0)
    mask, causal = causal_mask(30, T - 30, T, None, q.device)
    tail = _attend_kernel(q[:, :, 30:], k, v, mask, causal, bf16_row=0)
    head = _attend_kernel(q[:, :, :30], k[:, :, :30], v[:, :, :30], None, True, bf16_row=0)
    assert torch.equal(tail, whole[:, :, 30:]) and torch.equal(head, whole[:, :, :30])
    assert not torch.equal(whole, _attend_kernel(q, k, v, None, True))


@needs_vector_kernels
@pytest.mark.parametrize(("H", "Hkv", "D"), [(12, 2, 64), (6, 2, 128)])
def test_prompt_attention_bf16_from_a_row_on(H, Hkv, D):
    """kvlm_attend's rows from `bf16_row` on take the bf16 pairs and the rows before it
    the fp32 kernel, each with the bits it has when the whole call is in its dtype (at
    row group boundaries of both kernels and off them), causal or after a prefix."""
    from kvlm.cache.base import causal_mask

    torch.manual_seed(D)
    T = 45
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    bf16 = _attend_kernel(q, k, v, None, True, bf16_row=0)
    if bf16 is None:
        pytest.skip("no AVX512-BF16: kvlm_attend's bf16 pairs decline (torch's road)")
    fp32 = _attend_kernel(q, k, v, None, True)
    assert torch.equal(_attend_kernel(q, k, v, None, True, bf16_row=T), fp32)
    mask, causal = causal_mask(20, T - 20, T, None, q.device)
    for r in (1, 13, 32, 44):
        got = _attend_kernel(q, k, v, None, True, bf16_row=r)
        assert torch.equal(got[:, :, :r], fp32[:, :, :r])
        assert torch.equal(got[:, :, r:], bf16[:, :, r:])
        tail = _attend_kernel(q[:, :, 20:], k, v, mask, causal, bf16_row=max(0, r - 20))
        assert torch.equal(tail, got[:, :, 20:])


@needs_vector_kernels
@pytest.mark.parametrize("D", [64, 96])
def test_attend_bf16_from_a_position_keeps_a_rows_bits_whatever_its_chunk(D):
    """`attend(bf16_from=N)` (int8 prompt products' long rows): a row at position N or
    later attends in bf16 and one before it in fp32, whether the prompt comes whole or in
    chunks that straddle N; where the bf16 pairs do not take the head size (96), every
    row keeps fp32 (not torch's bf16 road), so a row's bits never depend on its chunk."""
    from kvlm.cache.base import causal_mask

    torch.manual_seed(D + 1)
    H, Hkv, T, N = 8, 2, 70, 37
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    whole = attend(q, k, v, None, True, bf16_from=N)
    fp32 = attend(q, k, v, None, True)
    bf16 = _attend_kernel(q, k, v, None, True, bf16_row=0)
    if D == 96 or bf16 is None:  # the pairs decline: fp32 throughout
        assert torch.equal(whole, fp32)
    else:
        assert torch.equal(whole[:, :, :N], fp32[:, :, :N])
        assert torch.equal(whole[:, :, N:], bf16[:, :, N:])
    for a, b in ((0, 30), (30, 50), (50, 70)):  # chunks before, across and past N
        mask, causal = causal_mask(a, b - a, b, None, q.device)
        part = attend(q[:, :, a:b], k[:, :, :b], v[:, :, :b], mask, causal, bf16_from=N)
        assert torch.equal(part, whole[:, :, a:b])


@needs_kernels
def test_a_model_row_past_bf16_from_has_its_bits_whole_or_in_chunks():
    """The model's prompt rows (int8 products, row-count invariant) with the attention in
    bf16 from position 24 on: a 60-token prompt's logits whole or in three chunks (one
    straddling 24, at rows 20-39) are the same bits, and the rows from 24 on are not the
    fp32 road's where the CPU has the bf16 pairs (a row's position decides, not its
    chunk)."""
    from kvlm import LLM
    from kvlm.model.attention import Attention

    lib = kernels.library()
    if not lib.kvlm_kernel_vnni():
        pytest.skip("no VNNI: no row-count invariant int8 prompt products to hold the rest fixed")
    llm = LLM(progress=False, max_context=128, prefill_dtype="int8")
    layers = [m for m in llm.model.modules() if isinstance(m, Attention)]
    ids = [(11 * i) % 3000 + 50 for i in range(60)]

    def logits(bf16_from, cuts):
        for m in layers:
            m.prompt_bf16_from = bf16_from
        cache = llm.new_cache("contiguous")
        return torch.cat([llm.runner.logits(ids[a:b], cache) for a, b in cuts])

    whole = logits(24, [(0, 60)])
    # chunks of more than 16 rows: at 16 or fewer a projection takes the small products'
    # road, whose logits' last bits differ (seen with fp32 attention alike)
    assert torch.equal(logits(24, [(0, 20), (20, 40), (40, 60)]), whole)
    fp32 = logits(None, [(0, 60)])
    assert torch.equal(whole[:24], fp32[:24])
    q = torch.randn(1, 2, 4, 64)
    if _attend_kernel(q, q, q, None, True, bf16_row=0) is not None:  # the pairs run here
        assert not torch.equal(whole[24:], fp32[24:])


def test_prefill_bf16_takes_the_prompts_attention_and_nothing_else(monkeypatch):
    """With --prefill-dtype bf16 the prompt's forward attends in bf16 (one call a layer);
    decoded rows (and fp32 prompt products) keep their own attention."""
    from kvlm import LLM, SamplingParams
    from kvlm.model import attention

    calls = []
    attend = attention.attend

    def spy(q, *a, bf16_from=None, **kw):
        calls.append(torch.bfloat16 if bf16_from == 0 else q.dtype)
        return attend(q, *a, bf16_from=bf16_from, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prefill in ("bf16", "fp32"):
        llm = LLM(progress=False, max_context=256, prefill_dtype=prefill)
        layers = llm.config.num_layers
        calls.clear()
        llm.generate("The capital of France is", params)
        assert calls.count(torch.bfloat16) == (layers if prefill == "bf16" else 0)
