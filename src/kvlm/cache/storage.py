"""Slot storage shared by the cache layouts, in a float dtype or int8 with scales.

Every stored layout is [layers, 2 (K, V), X, kv_heads, Y, head_dim]:

    contiguous  X = sequence row, Y = position       (batch, max_tokens)
    paged       X = block id,     Y = slot in block  (num_blocks, block_size)
    window      X = sequence row, Y = ring slot      (batch, sinks + window)

int8 is asymmetric and per token: each (layer, K/V, X, head, Y) row of head_dim values
keeps its own step and zero point, x ~ (q + 128) * step + min, step = (max - min) / 255,
both as fp16 (`params`, trailing dim 2). K is quantized in a rotated basis: k' = k R with
R orthonormal (Hadamard when head_dim is a power of two, key_rotation()), which spreads a
few outlier channels over all of them so one per-token range fits; attention multiplies
the queries by R too, since (q R).(k R) = q.k, a T x D x D product on the queries rather
than un-rotating the whole history (QuaRot's trick). V is stored as it is.

Measured on the default model (benchmarks/bench_int8.py, three prompts x 256 greedy tokens
against the fp32 oracle): all four candidates agree on ~99.35% of greedy tokens (the misses
are near-ties), but the mean logit drift is 0.35 for symmetric per-token scales, 0.22-0.29
for symmetric scales per 32 channels, 0.23-0.28 for asymmetric per-token, and 0.15-0.17 with
K rotated. KIVI quantizes K per channel over groups of tokens, which reconstructs K better
still (same benchmark), but shares parameters across a group: the partial group needs a
full-precision residual, and a rollback into a group or a ring evicting part of one must
requantize it. Here every slot stays self-contained: one token, one row, its parameters.

q4 (llama.cpp's q4_0 rule) is symmetric per group of 32 values of a row (of the whole row
when head_dim is not a multiple of 32): d = m / -8 with m the group's value of largest
magnitude, codes c = round(x / d) + 8 in 0..15 (m itself is code 0), x ~ (c - 8) d; two
codes a byte (even index in the low nibble), d as fp16. K goes through R as for int8.
0.5 + 2/32 = 0.5625 bytes per element (0.14x of fp32, 0.28x of fp16).

Bytes per element: 1 + 4/head_dim (0.266x of fp32 at head_dim 64).
Error bound of one element: |x - dequant(x)| <= s/2 + 2^-10 (|min| + 255 s) + 2^-24 with
s = max(step, 2^-14): half a step, plus the fp16 rounding of the step and the zero point
(a step under fp16's smallest normal is clamped there). The parameters are fp16, so rows
must stay within +-65504, as fp16-trained activations do.
"""

from __future__ import annotations

from functools import cache

import torch

from kvlm.dtypes import Q4

PARAM_DTYPE = torch.float16
PARAMS_PER_ROW = 2  # step, zero point (the row's minimum)
Q4_GROUP = 32  # values per q4 scale (the whole row when head_dim is not a multiple)


@cache
def key_rotation(head_dim: int) -> torch.Tensor:
    """The orthonormal R (fp32, D x D) int8 caches store K through: Sylvester's Hadamard
    matrix / sqrt(D) for a power of two, else a fixed random orthogonal matrix."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / head_dim**0.5
    g = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g))
    return q * torch.sign(torch.diagonal(r))  # a unique, deterministic orthogonal matrix


def itemsize(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one stored element costs, quantization parameters included."""
    if dtype == torch.int8:
        return 1 + PARAMS_PER_ROW * PARAM_DTYPE.itemsize / head_dim
    if dtype == Q4:
        return 0.5 + PARAM_DTYPE.itemsize / q4_group(head_dim)
    return dtype.itemsize


def q4_group(head_dim: int) -> int:
    return Q4_GROUP if head_dim % Q4_GROUP == 0 else head_dim


def quantize_q4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float, D even -> packed codes (..., D/2) uint8 and scales (..., D/G) fp16."""
    xf = x.detach().float()
    d_ = xf.shape[-1]
    g = xf.reshape(*xf.shape[:-1], d_ // q4_group(d_), q4_group(d_))
    at = g.abs().argmax(dim=-1, keepdim=True)
    scales = (g.gather(-1, at) / -8.0).squeeze(-1).to(PARAM_DTYPE)
    d = scales.float()[..., None]  # the stored scale: dequantize inverts it
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    codes = (torch.round(g * inv) + 8).clamp_(0, 15).to(torch.uint8).reshape(xf.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scales


def dequantize_q4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float() - 8
    d_ = codes.shape[-1]
    g = codes.reshape(*codes.shape[:-1], d_ // q4_group(d_), q4_group(d_))
    return (g * scales.float()[..., None]).reshape(codes.shape).to(dtype)


def dequantize_stored(
    values: torch.Tensor, scales: torch.Tensor | None, kv_dtype: torch.dtype, dtype: torch.dtype
) -> torch.Tensor:
    """Stored rows of `kv_dtype` (codes and scales, or floats) as `dtype`."""
    if kv_dtype in CODECS:
        return CODECS[kv_dtype][1](values, scales, dtype)
    return values.to(dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> int8 codes (..., D) and params (..., 2) = (step, zero)."""
    xf = x.detach().float()
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    params = torch.stack([(hi - lo) / 255.0, lo], dim=-1).to(PARAM_DTYPE)
    # Quantize against the parameters as stored (fp16-rounded), so dequantize inverts them.
    step = params[..., 0].float().clamp_min(torch.finfo(PARAM_DTYPE).tiny)[..., None]
    zero = params[..., 1].float()[..., None]
    codes = torch.round((xf - zero) / step).clamp_(0, 255) - 128
    return codes.to(torch.int8), params


def dequantize(q: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    p = params.float()
    return ((q.float() + 128) * p[..., 0:1] + p[..., 1:2]).to(dtype)


# the quantized K/V dtypes: (quantize: x -> codes, scales; dequantize: codes, scales, dtype)
CODECS = {torch.int8: (quantize, dequantize), Q4: (quantize_q4, dequantize_q4)}


class Store:
    """A [layers, 2, X, heads, Y, head_dim] tensor of K/V slots (plus int8 parameters:
    `scales`, [layers, 2, X, heads, Y, 2]).

    Indexing is on the leading dimensions only, so the same index addresses a value row
    and its parameters.
    """

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zero: bool = True
    ) -> None:
        self.dtype = dtype
        self.head_dim = shape[-1]
        self.quantized = dtype in CODECS  # codes and scales; K through R
        q4 = dtype == Q4
        if q4 and shape[-1] % 2:
            raise ValueError(f"q4 K/V needs an even head_dim, not {shape[-1]}")
        make = torch.zeros if zero else torch.empty
        rows = (*shape[:-1], shape[-1] // 2) if q4 else shape
        self.values = make(rows, dtype=dtype, device=device)
        per = shape[-1] // q4_group(shape[-1]) if q4 else PARAMS_PER_ROW
        params = (*shape[:-1], per)
        self.scales = make(params, dtype=PARAM_DTYPE, device=device) if self.quantized else None
        self.parts = {"values": self.values}  # by name, as snapshots and cache files hold them
        if self.scales is not None:
            self.parts["scales"] = self.scales

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def put(self, index: tuple, x: torch.Tensor) -> None:
        """Store float rows x at `index` (quantizing for int8 and q4)."""
        if self.quantized:
            self.values[index], self.scales[index] = CODECS[self.dtype][0](x)
        else:
            self.values[index] = x.to(self.dtype)

    def get(self, index: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The rows at `index` in `dtype` (a view when no conversion is needed)."""
        if self.quantized:
            return dequantize_stored(self.values[index], self.scales[index], self.dtype, dtype)
        return self.values[index].to(dtype)  # the view itself when it is already `dtype`

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """x as it would read back after being stored (rounded or quantized), in x's dtype."""
        if self.quantized:
            quantize_as, dequantize_as = CODECS[self.dtype]
            return dequantize_as(*quantize_as(x), x.dtype)
        return x if x.dtype == self.dtype else x.to(self.dtype).to(x.dtype)

    def raw(self, index: tuple) -> dict[str, torch.Tensor]:
        """Stored rows as they are (int8 values and scales, or floats): for snapshots."""
        return {name: t[index] for name, t in self.parts.items()}

    def put_raw(self, index: tuple, raw: dict[str, torch.Tensor]) -> None:
        for name, t in self.parts.items():
            t[index] = raw[name]

    def zero_(self, index: tuple) -> None:
        for t in self.parts.values():
            t[index] = 0
