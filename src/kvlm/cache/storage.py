"""Slot storage shared by the cache layouts, in a float dtype or int8 with scales.

Every stored layout is [layers, 2 (K, V), X, kv_heads, Y, head_dim]:

    contiguous  X = sequence row, Y = position       (batch, max_tokens)
    paged       X = block id,     Y = slot in block  (num_blocks, block_size)
    window      X = sequence row, Y = ring slot      (batch, sinks + window)

int8 keeps one scale per (layer, K/V, X, head, Y), i.e. per token and head over head_dim
(absmax / 127, stored as fp16), for K and for V. KIVI quantizes K per channel because a few
channels of K carry outliers; at 2 bits that matters. At 8 bits it does not: on the default
model per-channel K (groups of 16 tokens) reconstructs K better (3.3e-3 vs 1.2e-2 relative
error) but the attention scores q.k come out the same (1.7e-3 vs 1.6e-3), and per-token
scales keep one slot per token in every layout, with no full-precision residual for a
partial group (benchmarks/bench_int8.py measures both). Bytes per element: 1 + 2/head_dim
(0.258x of fp32 at head_dim 64).

Error bound of one int8 element: |x - dequant(x)| <= 0.51 * scale, scale = fp16(absmax/127)
(half a step, plus the fp16 rounding of the scale, which the quantizer divides by).
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16


def itemsize(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes one stored element costs, scales included."""
    if dtype == torch.int8:
        return 1 + torch.empty((), dtype=SCALE_DTYPE).element_size() / head_dim
    return torch.empty((), dtype=dtype).element_size()


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> int8 (..., D) and scales (...,): symmetric, per row."""
    absmax = x.detach().abs().amax(dim=-1).float()
    scale = (absmax / 127.0).to(SCALE_DTYPE)
    # Divide by the scale as stored (fp16-rounded), so dequantization inverts exactly it.
    safe = scale.float().clamp_min(torch.finfo(SCALE_DTYPE).tiny)
    q = torch.round(x.float() / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


class Store:
    """A [layers, 2, X, heads, Y, head_dim] tensor of K/V slots (plus scales for int8).

    Indexing is on the leading dimensions only, so the same index addresses a value row
    and its scale.
    """

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zero: bool = True
    ) -> None:
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        make = torch.zeros if zero else torch.empty
        self.values = make(shape, dtype=dtype, device=device)
        self.scales = make(shape[:-1], dtype=SCALE_DTYPE, device=device) if self.quantized else None

    @property
    def nbytes(self) -> int:
        n = self.values.numel() * self.values.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def put(self, index: tuple, x: torch.Tensor) -> None:
        """Store float rows x at `index` (quantizing for int8)."""
        if self.quantized:
            q, s = quantize(x)
            self.values[index] = q
            self.scales[index] = s
        else:
            self.values[index] = x.to(self.dtype)

    def get(self, index: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The rows at `index` in `dtype` (a view when no conversion is needed)."""
        if self.quantized:
            return dequantize(self.values[index], self.scales[index], dtype)
        rows = self.values[index]
        return rows if rows.dtype == dtype else rows.to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """x as it would read back after being stored (rounded or quantized), in x's dtype."""
        if self.quantized:
            return dequantize(*quantize(x), x.dtype)
        return x if x.dtype == self.dtype else x.to(self.dtype).to(x.dtype)

    def raw(self, index: tuple) -> dict[str, torch.Tensor]:
        """Stored rows as they are (int8 values and scales, or floats): for snapshots."""
        out = {"values": self.values[index]}
        if self.scales is not None:
            out["scales"] = self.scales[index]
        return out

    def put_raw(self, index: tuple, raw: dict[str, torch.Tensor]) -> None:
        self.values[index] = raw["values"]
        if self.scales is not None:
            self.scales[index] = raw["scales"]

    def zero_(self, index: tuple) -> None:
        self.values[index] = 0
        if self.scales is not None:
            self.scales[index] = 0
