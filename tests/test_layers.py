"""Linear kernels against F.linear, per dtype and row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlm.model.layers import Linear, _onednn_works
from numerics import (
    BF16_STEP,
    FP16_STEP,
    U32,
    assert_product_close,
    attention_bound,
    product_bound,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if with_bias else None
    x = torch.randn(2, rows, 32, generator=g).to(dtype)[:1]  # (1, rows, 32)
    lin = Linear(w, b)
    with torch.inference_mode():
        got = lin(x)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (1, rows, 48) and got.dtype == dtype
    # Summed in the dtype's own precision at worst (fp16/bf16 kernels may accumulate so),
    # the result rounded to it, the bias added with one more rounding.
    u = {torch.float32: U32, torch.bfloat16: BF16_STEP, torch.float16: FP16_STEP}[dtype]
    xf, wf = x.float(), w.float()
    bound = product_bound(xf, wf, u) + 2 * u * (xf.abs() @ wf.abs().T)
    if b is not None:
        bound += 2 * u * b.double().abs()
    assert ((got.double() - expected.double()).abs() <= bound).all()


def test_kernel_choice_and_rows_view():
    w = torch.randn(16, 8)
    fp32 = Linear(w)
    assert fp32.kernel == "cpu-fp32" and fp32.weight.shape == (8, 16)
    assert torch.equal(fp32.rows(), w)  # a view of the transposed storage
    fp16 = Linear(w.half())
    assert fp16.kernel == "torch" and torch.equal(fp16.rows(), w.half())
    bf16 = Linear(w.bfloat16())
    if _onednn_works(torch.bfloat16):
        assert bf16.kernel == "onednn" and bf16.rows() is None
        x = torch.randn(1, 8).bfloat16()
        assert torch.equal(bf16(x), F.linear(x, w.bfloat16()))  # packed, bitwise the same
    else:
        assert bf16.kernel == "torch"


def test_one_row_fp32_takes_the_blas_path_when_available():
    from kvlm.model.blas import openblas_available

    lin = Linear(torch.randn(16, 8))
    assert lin.uses_blas == openblas_available()


@pytest.mark.skipif(not _onednn_works(torch.float32), reason="oneDNN cannot run fp32 products here")
@pytest.mark.parametrize("width", [64, 1536])
def test_onednn_packed_rows_do_not_depend_on_their_batch(width):
    """The serving kernel: a row's result is the same bits alone, in a decode batch, or in
    a padded prefill chunk (kvlm.model.layers.Linear._onednn). 1536: oneDNN's one-row
    kernel sums rows this long in another order than its multi-row one (seen on EPYC); one
    row is run as two."""
    torch.manual_seed(0)
    w, b = torch.randn(96, width), torch.randn(96)
    lin = Linear(w, b)
    lin.pack_onednn()
    assert lin.kernel == "onednn" and not lin.uses_blas
    x = torch.randn(1, 40, width)
    alone = torch.cat([lin(x[:, i : i + 1]) for i in range(40)], dim=1)
    for rows in (1, 5, 16, 17, 33, 40):  # exact, exact, exact, padded, padded, padded
        y = lin(x[:, :rows])
        assert y.shape == (1, rows, 96)
        assert torch.equal(y, alone[:, :rows])
    assert_product_close(alone, F.linear(x, w, b), x, w, bias=b)


@pytest.mark.parametrize("with_mask", [False, True])
def test_attention_with_kv_heads_repeated_equals_grouped_query_sdpa(with_mask):
    """`attend` repeats K/V heads where SDPA has no grouped-query kernel taking a mask (CUDA);
    the result is the grouped-query one."""
    from kvlm.model.attention import attend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 16, generator=g)
    k, v = (torch.randn(2, 2, 9, 16, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3 if with_mask else None
    if mask is not None:
        mask[..., 0] = True  # every query sees something
    grouped = attend(q, k, v, mask, False, expand=False)
    repeated = attend(q, k, v, mask, False, expand=True)
    bound = attention_bound(q, k, v)  # the same attention in another order
    assert (repeated - grouped).abs().max() <= bound
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask
    )
    assert (grouped - ref).abs().max() <= bound


@pytest.mark.parametrize("lengths", [[9, 9, 9], [9, 4, 7]])
def test_attention_row_by_row_gives_each_row_its_bits_alone(lengths):
    """On the CPU one SDPA call over B rows is not B calls of one: its kernel divides the
    work by the batch's size. `attend_rows` runs each row alone, over its own keys."""
    from types import SimpleNamespace

    from kvlm.cache.base import causal_mask
    from kvlm.model.attention import attend, attend_rows

    g = torch.Generator().manual_seed(0)
    B, S = len(lengths), max(lengths)
    q = torch.randn(B, 9, 1, 64, generator=g)
    k, v = (torch.randn(B, 3, S, 64, generator=g) for _ in range(2))
    same = len(set(lengths)) == 1
    rows = None if same else [(n, *causal_mask(n - 1, 1, n, None, q.device)) for n in lengths]
    kv = SimpleNamespace(rows=rows, mask=None, is_causal=False)
    got = attend_rows(q, k, v, kv)
    for b, n in enumerate(lengths):
        alone = attend(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None, False)
        assert torch.equal(got[b : b + 1], alone)
