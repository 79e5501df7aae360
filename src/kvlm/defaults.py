"""The numerics a model runs with when the user names none: the fast path, by default.

Four settings decide a CPU run's speed: the projection weights (`weights`), the products'
activations (`activations`), the prompt's products (`prefill_dtype`) and the cache's
storage (`kv_dtype`). Each accepts "auto" (the default), resolved here from the model file
and the CPU:

    weights        native when the file is a GGUF with low-bit projections (its own blocks,
                   multiplied as stored), else the compute dtype
    activations    int16 with low-bit weights where the kernels have integer dot products
                   (AVX512-VNNI): each decode row's values per group of 32 as int8 codes
                   and an int8 residual, 16 bits a value, two integer products of the
                   same weight codes (int8 alone, llama.cpp's rounding, lost 27 more of
                   216 whole answers than int16 against the fp32 reference on the
                   default model, for 1-12% of the decode step: docs/BENCHMARKS.md
                   19.11), else fp32
    prefill_dtype  with low-bit weights: bf16 where the CPU has AMX (oneDNN's bf16 GEMM on
                   the tiles), else int8 where the kernels have VNNI (the prompt's rows
                   rounded as decode rows are, integer products straight from the packed
                   blocks: on Zen 5 at the VNNI peak, ~1.1 TOPS on 2 cores, over oneDNN's
                   bf16 ~0.9 TFLOPS plus the dequantized tiles and their copies), else bf16
                   where the CPU has AVX512-BF16, else fp32
    (the prompt's attention follows: in bf16 with bf16 products; with int8 products, in
    bf16 for the rows that see LONG_ATTENTION keys or more where the CPU multiplies bf16:
    `attention_bf16_from`, kvlm.model.attention.attend)
    kv_dtype       fp16 with low-bit weights where the kernels' fused decode step reads
                   fp16 K/V (half the bytes a decode step reads from the cache; greedy
                   agreement as fp32 K/V; llama.cpp's default too), else the compute dtype
                   (a model the fused step refuses, kvlm.model.fused.config_why_not: its
                   decode is the torch step's, which would convert every layer's fp16 K/V
                   to fp32 each step; a 1.5B Mamba2 hybrid at 16k of context decoded
                   150 ms a step with fp16 K/V, 71 with fp32: docs/BENCHMARKS.md 24.7)

Those are the fastest numerics that keep greedy decoding within the top-5 rule of the fp32
reference on the tests' prompts (tests/test_defaults.py; figures in docs/BENCHMARKS.md).
`exact=True` (`--exact`) resolves every "auto" to the fp32 reference instead: the weights
dequantized to the compute dtype, fp32 activations and prompt products, and the cache in
the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlm import kernels
from kvlm.dtypes import kv_sides, parse_kv_dtypes
from kvlm.errors import InvalidRequestError
from kvlm.model import fused

if TYPE_CHECKING:
    from kvlm.model.weights import WeightSource

AUTO = "auto"
# With int8 prompt products, prompt rows at this position or later (that see this many keys
# or more) attend in bf16 pairs where the CPU has AVX512-BF16: there the attention is most
# of a long prompt's time (55% at 8k tokens on the Qwen2.5-0.5B shape, a Zen 4) and the
# pairs take 1.4-1.5x less of it, while below it they gain little (1.1-1.3x at 128-256
# keys, and the attention is a small share of a short prompt's time), so a short prompt
# keeps fp32's bits. On 8,000 tokens of real text the bf16 rows moved the default
# model's KL divergence from the fp32 reference by no more than the int8 products' own
# jitter (docs/BENCHMARKS.md 19.10).
LONG_ATTENTION = 2048
LOW_BIT = ("int8", "int4", "native")
# names of the projection weights whose storage decides `weights` (not norms, not biases)
_PROJECTION_SUFFIXES = ("proj.weight", "lm_head.weight")


@dataclass(slots=True, frozen=True)
class Numerics:
    """The resolved settings, and for each "auto" one, why it became what it is."""

    weights: str | None  # None: the compute dtype
    activations: str
    prefill_dtype: str
    kv_dtype: str | None  # None: the compute dtype
    reasons: tuple[str, ...] = ()
    # prompt rows at this position or later attend in bf16 (0: all; None: none, fp32)
    attention_bf16_from: int | None = None


def resolve(
    *,
    weights: str | None,
    activations: str,
    prefill_dtype: str,
    kv_dtype: str | None,
    exact: bool,
    fp32_cpu: bool,
    source: WeightSource,
    compute: str = "fp32",
) -> Numerics:
    """Resolve "auto" settings. `fp32_cpu`: fp32 compute on the CPU (the only place the
    low-bit kernels run); `source`: the model's WeightSource (a GGUF file answers
    `is_quantized(name)`); `compute`: the compute dtype's name, which a K or V side left
    to "auto" ("int8/auto") stores in where the fused step does not run."""
    requested = dict(
        weights=weights, activations=activations, prefill_dtype=prefill_dtype, kv_dtype=kv_dtype
    )
    if exact:
        named = [k for k, v in requested.items() if v not in (AUTO, None, "fp32", "f32")]
        if named:
            raise InvalidRequestError(
                f"exact is the fp32 reference path; it cannot be combined with "
                f"{', '.join(f'{k}={requested[k]!r}' for k in named)}"
            )
        return Numerics(None, "fp32", "fp32", None, ("exact: the fp32 reference path",))
    reasons: list[str] = []
    if weights == AUTO:
        weights = None
        if fp32_cpu and _low_bit_projections(source):
            weights = "native"
            reasons.append("weights native: the file's own low-bit blocks")
    low_bit = weights in LOW_BIT
    lib = kernels.library() if low_bit else None
    if activations == AUTO:
        activations = "fp32"
        if lib is not None and lib.kvlm_kernel_vnni():
            activations = "int16"
            reasons.append("activations int16: the CPU has VNNI integer dot products")
    if prefill_dtype == AUTO:
        prefill_dtype = "fp32"
        flags = set(kernels.cpu_flags()) if low_bit else set()
        if "amx_bf16" in flags:
            prefill_dtype = "bf16"
            reasons.append("prefill bf16: the CPU has AMX tiles for oneDNN's bf16 GEMM")
        elif lib is not None and lib.kvlm_kernel_vnni():
            prefill_dtype = "int8"
            reasons.append("prefill int8: VNNI integer products from the packed blocks")
        elif "avx512_bf16" in flags:
            prefill_dtype = "bf16"
            reasons.append("prefill bf16: the CPU multiplies bf16 in hardware")
    attention_bf16_from = None
    if prefill_dtype == "bf16":
        attention_bf16_from = 0
    elif prefill_dtype == "int8" and "avx512_bf16" in kernels.cpu_flags():
        attention_bf16_from = LONG_ATTENTION
        reasons.append(
            f"prompt attention bf16 from {LONG_ATTENTION:,} keys on: AVX512-BF16 pairs "
            "where the attention is most of a long prompt's time"
        )
    k, v = kv_sides(kv_dtype) if isinstance(kv_dtype, str) else ("", "")
    if AUTO in (k, v):
        auto = None
        config = getattr(source, "config", None)
        refused = None if config is None or lib is None else fused.config_why_not(config)
        if lib is not None and fp32_cpu and refused is None:  # the fused step reads fp16
            auto = "fp16"
            reasons.append("kv fp16: half the K/V bytes; the fused step reads fp16")
        elif lib is not None and fp32_cpu:
            reasons.append(f"kv in the compute dtype: the fused step cannot run this model "
                           f"({refused}), and the torch step would convert fp16 K/V to "
                           "fp32 every step")  # fmt: skip
        if "/" not in kv_dtype:
            kv_dtype = auto
        else:  # a side left to auto: fp16, or the compute dtype
            k, v = ((auto or compute) if s == AUTO else s for s in (k, v))
            kv_dtype = k if k == v else f"{k}/{v}"
    return Numerics(
        weights, activations, prefill_dtype, kv_dtype, tuple(reasons), attention_bf16_from
    )


def kv_dtypes(numerics: Numerics, compute: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """K's and V's storage under `numerics`: its kv_dtype, or (None) the compute dtype. The
    LLM allocates its cache in these, and `kvlm memory` counts in them."""
    if numerics.kv_dtype is None:
        return compute, compute
    return parse_kv_dtypes(numerics.kv_dtype)


def _low_bit_projections(source: WeightSource) -> bool:
    return any(n.endswith(_PROJECTION_SUFFIXES) and source.is_quantized(n) for n in source.names())
