"""Linear kernels against F.linear, per dtype and row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlm.model import layers
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
    if _onednn_works(torch.float32):  # packed once, at construction: one layout for life
        assert fp32.kernel == "onednn" and fp32.rows() is None
    else:
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


def _kernels() -> list[tuple[str, torch.dtype, bool]]:
    """(name, weight dtype, bf16 storage) of every CPU kernel Linear picks here, and the
    portable one (fp32 where torch has no oneDNN: MKL or whatever BLAS torch was built on)."""
    found = [("fp32", torch.float32, False), ("fp32 without oneDNN", torch.float32, False)]
    if _onednn_works(torch.bfloat16):
        found += [("bf16 model", torch.bfloat16, False), ("bf16 weights", torch.float32, True)]
    return found


@pytest.mark.parametrize("width", [64, 1536, 2048])
@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k[0])
def test_a_decode_row_gets_its_bits_alone_in_any_batch_on_any_thread_count(
    kernel, width, monkeypatch
):
    """The contract batched = alone, at the product: a decode row's result is the same bits
    alone, in a decode batch of any size (exact row counts, padded ones), in a prompt's rows,
    and on 1 or 2 threads. 1536 / 2048: oneDNN's one-row kernel sums rows this long in
    another order than its multi-row one (fp32 past 1024, bf16 at 2048 on a Zen 4). Before,
    fp32 rows went to OpenBLAS alone and to MKL batched: other bits."""
    name, dtype, bf16 = kernel
    if name == "fp32 without oneDNN":
        monkeypatch.setattr(layers, "_onednn_works", lambda dtype: False)
    torch.manual_seed(0)
    w, b = torch.randn(96, width).to(dtype), torch.randn(96).to(dtype)
    lin = Linear(w, b, bf16=bf16)
    assert (lin.kernel == "cpu-fp32") == (name == "fp32 without oneDNN")
    x = torch.randn(40, 1, width).to(dtype)  # 40 sequences, one decode row each
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
        torch.set_num_threads(2)
        assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(40)]), alone)
        for rows in (2, 3, 5, 16, 17, 33, 40):  # exact row counts, then padded ones
            assert torch.equal(lin(x[:rows]), alone[:rows]), f"{rows} rows"
        prompt = lin(x.view(1, 40, width))  # the prompt road: calls of PROMPT_BLOCK rows
        assert torch.equal(prompt.view(40, 1, 96), alone)
    finally:
        torch.set_num_threads(threads)
    assert alone.dtype == dtype
    if not bf16 and dtype == torch.float32:
        assert_product_close(alone.view(1, 40, 96), F.linear(x.view(1, 40, width), w, b),
                             x.view(1, 40, width), w, bias=b)  # fmt: skip


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
