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
than un-rotating the whole history (QuaRot's trick). A quantized V is stored through the
same R when head_dim is a power of two (value_rotation(): Hadamard's R is symmetric, so
R^T = R), v' = v R: the attention output over rotated V is o R, and attention multiplies
it by R^T per head (llama.cpp rotates both whenever K or V is quantized, PR 21038). V of
another head_dim is stored as it is (no symmetric R to undo it with in the C step).

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

K and V may each keep a dtype of their own (`--k-dtype`, `--v-dtype`; llama.cpp's -ctk,
-ctv): part_layout gives such a store K's tensors and V's apart, each [layers, 1, ...];
a store in one dtype keeps the one [layers, 2, ...] tensor (and its scales) it always had,
so cache files and tier records of one dtype are unchanged.

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
ALL = slice(None)


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


def value_rotation(head_dim: int) -> torch.Tensor | None:
    """The R a quantized V is stored through (v R; the output undone by R^T = R): K's
    Hadamard R for a power-of-two head_dim, else None (V stored as it is)."""
    return key_rotation(head_dim) if head_dim & (head_dim - 1) == 0 else None


def v_rotated(v_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether V of this dtype and head_dim is stored through R (value_rotation)."""
    return v_dtype in CODECS and value_rotation(head_dim) is not None


# A storage name's mark for V stored through R (CacheSpec.kv_format): cache files and tier
# records name it, so rotated rows are never read as plain ones, nor the reverse
V_ROTATED = "+vrot"


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

KV = ("k.", "v.")  # a split store's part names: K's, then V's


def part_layout(
    shape: tuple[int, ...], k_dtype: torch.dtype, v_dtype: torch.dtype | None = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors (name -> shape, dtype) a store of K/V rows of logical shape [layers, 2
    (K, V), ..., head_dim] keeps: K and V in one dtype, "values" [layers, 2, ...] (q4:
    head_dim / 2 bytes a row) and for int8 and q4 "scales" (int8: (step, zero) a row; q4:
    a scale per group); K and V in two (--k-dtype, --v-dtype): each its own "k.values",
    "k.scales", "v.values", "v.scales", of [layers, 1, ...]. The one table the stores,
    cache files and tier records are shaped and checked by."""
    v_dtype = k_dtype if v_dtype is None else v_dtype
    if k_dtype == v_dtype:
        return _half_layout(shape, k_dtype, "")
    one = (shape[0], 1, *shape[2:])
    return {**_half_layout(one, k_dtype, KV[0]), **_half_layout(one, v_dtype, KV[1])}


def _half_layout(shape: tuple[int, ...], dtype: torch.dtype, prefix: str) -> dict:
    d = shape[-1]
    if dtype == Q4 and d % 2:
        raise ValueError(f"q4 K/V needs an even head_dim, not {d}")
    out = {prefix + "values": ((*shape[:-1], d // 2) if dtype == Q4 else tuple(shape), dtype)}
    if dtype in CODECS:
        per = d // q4_group(d) if dtype == Q4 else PARAMS_PER_ROW
        out[prefix + "scales"] = ((*shape[:-1], per), PARAM_DTYPE)
    return out


def parts_as(
    parts: dict[str, torch.Tensor], k_dtype: torch.dtype, v_dtype: torch.dtype, dtype: torch.dtype
) -> torch.Tensor:
    """Stored parts (as part_layout names them, indexed alike) as one `dtype` tensor of K
    and V along dim 1: [layers, 2, ...]."""
    if k_dtype == v_dtype:
        return dequantize_stored(parts["values"], parts.get("scales"), k_dtype, dtype)
    halves = [
        dequantize_stored(parts[p + "values"], parts.get(p + "scales"), dt, dtype)
        for p, dt in zip(KV, (k_dtype, v_dtype), strict=True)
    ]
    return torch.cat(halves, dim=1)


class _Rows:
    """Rows in one dtype: codes and scales, or floats (K and V, or one of them)."""

    def __init__(self, dtype: torch.dtype, values: torch.Tensor, scales: torch.Tensor | None):
        self.dtype, self.values, self.scales = dtype, values, scales

    def put(self, index: tuple, x: torch.Tensor) -> None:
        if self.scales is not None:
            self.values[index], self.scales[index] = CODECS[self.dtype][0](x)
        else:
            self.values[index] = x.to(self.dtype)

    def get(self, index: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self.scales is not None:
            return dequantize_stored(self.values[index], self.scales[index], self.dtype, dtype)
        return self.values[index].to(dtype)  # the view itself when it is already `dtype`

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales is not None:
            quantize_as, dequantize_as = CODECS[self.dtype]
            return dequantize_as(*quantize_as(x), x.dtype)
        return x if x.dtype == self.dtype else x.to(self.dtype).to(x.dtype)


class Store:
    """K/V slots of logical shape [layers, 2 (K, V), X, heads, Y, head_dim], as part_layout
    keeps them: one tensor `values` (plus int8/q4 `scales`) when K and V share a dtype, or
    K's and V's own (`split`). Indexing is on the leading dimensions only, (layer, kv, X,
    ...), so the same index addresses a value row and its parameters, K and V alike."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        zero: bool = True,
        v_dtype: torch.dtype | None = None,
    ) -> None:
        self.shape = tuple(shape)
        self.head_dim = shape[-1]
        self.k_dtype, self.v_dtype = dtype, dtype if v_dtype is None else v_dtype
        self.dtype = dtype  # K's (and V's, unless split)
        self.split = self.k_dtype != self.v_dtype
        self.k_quantized = self.k_dtype in CODECS  # codes and scales; K through R
        self.quantized = self.k_quantized or self.v_dtype in CODECS
        # a quantized V through R (value_rotation): a power-of-two head_dim's
        self.v_rotated = v_rotated(self.v_dtype, self.head_dim)
        make = torch.zeros if zero else torch.empty
        layout = part_layout(self.shape, self.k_dtype, self.v_dtype)
        # by name, as snapshots, cache files and tier records hold them
        self.parts = {n: make(s, dtype=dt, device=device) for n, (s, dt) in layout.items()}
        prefixes = KV if self.split else ("",)
        self._rows = [
            _Rows(dt, self.parts[p + "values"], self.parts.get(p + "scales"))
            for p, dt in zip(prefixes, (self.k_dtype, self.v_dtype), strict=False)
        ]

    @property
    def values(self) -> torch.Tensor:
        """The one tensor of K and V rows (a store in one dtype)."""
        if self.split:
            raise AttributeError("K and V are stored apart: use rows(kv)")
        return self.parts["values"]

    @property
    def scales(self) -> torch.Tensor | None:
        """The int8/q4 parameters of a store in one dtype (None for floats)."""
        if self.split:
            raise AttributeError("K and V are stored apart: use rows(kv)")
        return self.parts.get("scales")

    def rows(self, kv: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K's (kv 0) or V's (1) values and scales, [layers, X, heads, Y, row] views."""
        r = self._rows[kv] if self.split else self._rows[0]
        at = 0 if self.split else kv
        return r.values[:, at], None if r.scales is None else r.scales[:, at]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def _pick(self, index: tuple) -> list[tuple[_Rows, tuple]]:
        """(rows, index into them) for a store index: K's, V's or both when split."""
        if not self.split:
            return [(self._rows[0], index)]
        index = tuple(index)
        layer, kv = (*index, ALL, ALL)[:2]
        rest = index[2:]
        if isinstance(kv, int):
            return [(self._rows[kv], (layer, 0, *rest))]
        if kv != ALL:
            raise IndexError(f"a split store's K/V index must be 0, 1 or all, not {kv!r}")
        return [(r, (layer, ALL, *rest)) for r in self._rows]

    def put(self, index: tuple, x: torch.Tensor) -> None:
        """Store float rows x at `index` (quantizing for int8 and q4): K's or V's rows."""
        picked = self._pick(index)
        if len(picked) != 1:
            raise IndexError("put() of a split store writes K or V: index one of them")
        picked[0][0].put(picked[0][1], x)

    def get(self, index: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The rows at `index` in `dtype` (a view when no conversion is needed)."""
        picked = self._pick(index)
        if len(picked) != 1:
            raise IndexError("get() of a split store reads K or V: index one of them")
        return picked[0][0].get(picked[0][1], dtype)

    def roundtrip(self, x: torch.Tensor, kv: int) -> torch.Tensor:
        """x (K's rows for kv 0, V's for 1) as it would read back after being stored
        (rounded or quantized), in x's dtype."""
        return self._rows[kv if self.split else 0].roundtrip(x)

    def raw(self, index: tuple) -> dict[str, torch.Tensor]:
        """Stored rows as they are (codes and scales, or floats), by part name: for
        snapshots (a split store's with a K/V axis of 1)."""
        if not self.split:
            return {name: t[index] for name, t in self.parts.items()}
        out = {}
        for (rows, at), prefix in zip(self._pick(index), KV, strict=True):
            out[prefix + "values"] = rows.values[at]
            if rows.scales is not None:
                out[prefix + "scales"] = rows.scales[at]
        return out

    def put_raw(self, index: tuple, raw: dict[str, torch.Tensor]) -> None:
        if not self.split:
            for name, t in self.parts.items():
                t[index] = raw[name]
            return
        for (rows, at), prefix in zip(self._pick(index), KV, strict=True):
            rows.values[at] = raw[prefix + "values"]
            if rows.scales is not None:
                rows.scales[at] = raw[prefix + "scales"]

    def zero_(self, index: tuple) -> None:
        for rows, at in self._pick(index):
            rows.values[at] = 0
            if rows.scales is not None:
                rows.scales[at] = 0
