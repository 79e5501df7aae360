"""Tolerances derived from the arithmetic, not read off one CPU's output.

The suite runs on CPUs whose kernels sum in different orders (AMD EPYC with AVX-512, Intel
Xeon with AMX: oneDNN and MKL pick other blockings, other tile sizes). Two evaluations of
the same mathematics may then differ, and by how much depends on the machine. So no test
compares two paths with a constant read off one machine; it uses one of these:

1. One product, y = x @ w.T over K terms: each fp32 evaluation is within gamma_K |x| @ |w|.T
   of the exact result, gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and
   Stability, Thm 3.5), whatever the order, so two evaluations are within twice that.
   `assert_product_close`: elementwise, rigorous.

2. A whole model (30 layers of products, norms, softmax): no useful rigorous bound, but
   rounding error scales with the unit roundoff. `assert_as_exact_as(got, ref, exact)`:
   `got`'s distance to the exact result (the same model in fp64, `LLM(dtype="fp64")`) is
   at most SAME_ROUNDING times `ref`'s, two fp32 evaluations that differ only in summation
   order; measured in the same test on the same CPU, so it calibrates itself to that CPU's
   kernels. And `fp64_reorder_bound(err32)`: two fp64 evaluations (say chunked and one-shot
   prefill) are within FP64_REORDER * err32 * 2^-29 of each other, err32 being the same
   forward's fp32 error on this CPU.

3. Quantized values: a rounding step. An int8 code computed from inputs that differ by a
   rounding error lands on the same code or its neighbour (one quantization step); bf16
   keeps 8 significant bits (relative step 2^-8).

Where a path rounds on purpose (int8 K/V, int8 activations, bf16), its logits are held to
the top-k rule (tests/helpers.py: assert_greedy_agreement), not to a tolerance.
"""

from __future__ import annotations

import contextlib
import math

import torch

U32 = 2.0**-24  # fp32 unit roundoff
U64 = 2.0**-53
BF16_STEP = 2.0**-8  # bf16: 8 significant bits
FP16_STEP = 2.0**-11  # fp16: 11 significant bits (quantization scales, int8 K/V parameters)
# Two fp32 forwards that differ only in summation order make errors of the same size: each
# the sum of as many roundings of the same values. Their largest errors over a vocabulary
# of logits differ by a small factor (0.7-1.3 seen); 4 leaves room without letting through
# a real bug, which moves logits by orders of magnitude more than rounding does.
SAME_ROUNDING = 4.0
# fp64 evaluations in two orders: each within ~2^-29 of its fp32 error (the same roundings
# at a unit roundoff 2^-29 smaller), the two within twice that; 8x more for the spread of
# maxima between evaluations (measured: 1.0-1.6x the scaled fp32 error).
FP64_REORDER = 16.0


def attention_bound(q, k, v, k_err: float = 0.0, n_keys: int | None = None) -> float:
    """How far apart two attention outputs may be when their inputs q (B, H, T, D), k, v
    (B, Hkv, S, D) are the same values up to fp32 rounding, computed in another order (other
    shapes, a masked extra key), plus keys off by at most k_err in 2-norm on one side.
    `n_keys`: the longer side's key count (default k's).

    - a score q.k / sqrt(D), on each side against its exact value: the D-term dot product
      within D u |q| |k|; each RoPE-rotated element within 3 u (|x_i| + |x_pair|) (cos and
      sin within 1 ulp each, whichever call computed them; two products and a sum rounded),
      which moves the score by at most 6 u |q| |k| for q's rotation and as much for k's.
      With a factor 2 of slack on the dot product, for both sides together:
      d = ((4 D + 24) u |q| |k| + |q| k_err) / sqrt(D).
    - softmax: scores that move by at most d move each weight by a factor within e^{+-2d},
      so the output by at most (e^{2d} - 1) max|v|; its sum, division and the weighted sum
      of n terms, in either order, add 2 (n + 8) u max|v| per side, doubled for CPU SDPA's
      blockwise rescaling.
    """
    d_head, n = q.shape[-1], n_keys or k.shape[-2]
    qn, kn, vmax = float(q.norm(dim=-1).max()), float(k.norm(dim=-1).max()), float(v.abs().max())
    d = ((4 * d_head + 24) * U32 * qn * kn + qn * k_err) / d_head**0.5
    return vmax * (math.expm1(2 * d) + 8 * (n + 8) * U32)


def gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def product_bound(x: torch.Tensor, w: torch.Tensor, u: float = U32) -> torch.Tensor:
    """Largest difference between two evaluations of x @ w.T (x (..., K), w (N, K)) in any
    summation orders, elementwise: 2 gamma_K |x| @ |w|.T."""
    k = x.shape[-1]
    return 2 * gamma(k, u) * (x.double().abs() @ w.double().abs().T)


def assert_product_close(
    got: torch.Tensor,
    want: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    u: float = U32,
    bias: torch.Tensor | None = None,
) -> None:
    """got and want are evaluations of x @ w.T (+ bias): equal to the summation-order
    bound (and one more rounding each where a bias is added)."""
    diff = (got.double() - want.double()).abs()
    bound = product_bound(x, w, u)
    if bias is not None:
        bound = bound + 2 * u * (x.double().abs() @ w.double().abs().T + bias.double().abs())
    bound = bound.reshape(diff.shape)
    worst = (diff - bound).max()
    assert worst <= 0, f"up to {float(diff.max()):.3g} apart, {float(worst):.3g} past the bound"


def max_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact.double()).abs().max())


def assert_as_exact_as(
    got: torch.Tensor,
    ref: torch.Tensor | list[torch.Tensor],
    exact: torch.Tensor,
    factor: float = SAME_ROUNDING,
) -> None:
    """`got` (fp32) is as close to `exact` (fp64) as `ref` (fp32, the same mathematics in
    another order) is, within `factor`. `ref` may be several such evaluations (see
    `nudged`): the reference's own error is then the largest of theirs."""
    refs = ref if isinstance(ref, list) else [ref]
    mine, theirs = max_error(got, exact), max(max_error(r, exact) for r in refs)
    assert mine <= factor * theirs, f"error {mine:.3g} vs the reference's own {theirs:.3g}"


@contextlib.contextmanager
def nudged(module: torch.nn.Module, seed: int):
    """While inside: each element of `module`'s fp32 output moved one ulp up or down (a
    seeded coin each), the rounding another evaluation order could have given it.

    For models whose error is chaotic in one layer's rounding (a random-weight recurrent
    layer: Qwen3.5's first DeltaNet measured 0.00038-0.00108 max logit error over eight
    such nudges of its input norm, HF's own evaluation 0.00023, on an AMX Xeon): one fp32
    evaluation of the reference samples its error once, and `assert_as_exact_as` takes the
    largest over the reference and a few nudged runs of it."""

    def hook(_mod, _inp, out):
        g = torch.Generator().manual_seed(seed)
        up = torch.rand(out.shape, generator=g) < 0.5
        return torch.nextafter(out, torch.where(up, torch.inf, -torch.inf).to(out.dtype))

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def fp64_reorder_bound(err32: float) -> float:
    """How far apart two fp64 evaluations of a forward may be, given its fp32 error."""
    return FP64_REORDER * err32 * (U64 / U32)


def int8_row_error(rows: torch.Tensor) -> torch.Tensor:
    """The most kvlm.cache.storage's int8 rows (one fp16 step and zero point per row of the
    last dim) can be off per element: half a step, plus the fp16 rounding of the step and
    the zero point (a step below fp16's smallest normal is clamped there). Shape (..., 1)."""
    lo, hi = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
    step = ((hi - lo) / 255).clamp_min(2**-14)
    return step / 2 + 2**-10 * (lo.abs() + 255 * step) + 2**-24
