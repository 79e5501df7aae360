"""Low-bit weights in groups of 32 (llama.cpp's blocks), multiplied by kvlm's C kernels.

    q8: int8 codes, one fp32 scale per group:      w = s * q        (Q8_0's numerics)
    q4: 4-bit codes, fp32 (d, m) per group:        w = d * q + m    (Q4_1's; Q4_0 is m = -8d)

A QuantWeight comes either from a float weight (`quantize(w, "q8" | "q4")`: `--weights
int8|int4`) or straight from a GGUF file's Q8_0/Q4_0/Q4_1 blocks (`--weights native`: the
file's own numbers, nothing re-rounded). Products keep fp32 activations: the C kernel
widens each weight in registers (decode, up to SMALL_M rows), or the weight is dequantized
once into a dense fp32 matrix for a BLAS GEMM (prefill). Opt-in `act_int8` (`--activations
int8`) rounds each row of x to int8 per group of 32 in the small products, as llama.cpp
does, for integer dot products (AVX512-VNNI). Without the compiled kernels the same
products run in torch: the same numbers, slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlm import kernels

GROUP = 32
KINDS = ("q8", "q4")
FORMATS = {"int8": "q8", "int4": "q4"}  # --weights name -> kind
# Up to this many rows the C kernel (reads the low-bit weight once); above, a dense GEMM.
SMALL_M = 16


@dataclass(slots=True)
class QuantWeight:
    kind: str  # "q8" | "q4"
    codes: torch.Tensor  # q8: int8 [N, K]; q4: uint8 [N, K/2], two codes per byte
    scale: torch.Tensor  # fp32 [N, K/32]
    zero: torch.Tensor | None = None  # q4: fp32 [N, K/32]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized kind {self.kind!r}")
        self.codes = self.codes.contiguous()
        self.scale = self.scale.float().contiguous()
        if self.zero is not None:
            self.zero = self.zero.float().contiguous()
        if (self.kind == "q4") != (self.zero is not None):
            raise ValueError("q4 weights need a zero per group; q8 weights have none")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.scale.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        tensors = (
            (self.codes, self.scale) if self.zero is None else (self.codes, self.scale, self.zero)
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    def dense(
        self, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The weight as [N, K] in fp32, or in bf16 rounded to nearest even as torch rounds
        (written into `out` when given)."""
        n, k = self.out_features, self.in_features
        lib = kernels.library()
        if lib is None:
            return _dense_torch(self).to(dtype)
        out = torch.empty(n, k, dtype=dtype) if out is None else out.view(n, k)
        suffix = "_bf16" if dtype == torch.bfloat16 else ""
        if self.kind == "q8":
            fn = getattr(lib, "kvlm_q8_dequant" + suffix)
            fn(k, _ptr(self.codes), _ptr(self.scale), n, _ptr(out))
        else:
            fn = getattr(lib, "kvlm_q4_dequant" + suffix)
            fn(k, _ptr(self.codes), _ptr(self.scale), _ptr(self.zero), n, _ptr(out))
        return out

    def matmul(
        self, x: torch.Tensor, prefill_bf16: bool = False, act_int8: bool = False
    ) -> torch.Tensor:
        """x (M, K) fp32, contiguous -> x @ W^T (M, N) fp32. `prefill_bf16`: more than
        SMALL_M rows multiply in bf16 (inputs and weight rounded, fp32 accumulation; oneDNN
        with AVX512-BF16 runs it ~2x faster than fp32), a trade of exactness for TTFT.
        `act_int8`: up to SMALL_M rows multiply with x rounded to int8 per group of 32
        (`round_activations`), a trade of exactness for decode speed."""
        m, k = x.shape
        lib = kernels.library()
        numel = self.out_features * self.in_features
        if m > SMALL_M and prefill_bf16:
            w = self.dense(_scratch(numel, torch.bfloat16), torch.bfloat16)
            return torch.matmul(x.to(torch.bfloat16), w.t()).float()
        if lib is None and m <= SMALL_M and act_int8:
            x = round_activations(x)
        if lib is None or m > SMALL_M:
            return torch.matmul(x, self.dense(_scratch(numel)).t())
        n = self.out_features
        y = torch.empty(m, n, dtype=torch.float32)
        if act_int8:
            if self.kind == "q8":
                fn, args = lib.kvlm_q8_gemm_i8, (_ptr(self.scale),)
            else:
                fn, args = lib.kvlm_q4_gemm_i8, (_ptr(self.scale), _ptr(self.zero))
            if fn(_ptr(x), m, k, _ptr(self.codes), *args, n, _ptr(y)) != 0:
                raise MemoryError("no memory for the int8 activation rows")
            return y
        if self.kind == "q8":
            lib.kvlm_q8_gemm(_ptr(x), m, k, _ptr(self.codes), _ptr(self.scale), n, _ptr(y))
        else:
            lib.kvlm_q4_gemm(
                _ptr(x), m, k, _ptr(self.codes), _ptr(self.scale), _ptr(self.zero), n, _ptr(y)
            )
        return y


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One reused buffer per dtype for the weight being multiplied densely (prefill): a
    fresh 7 MiB tensor per product would be page-faulted and zeroed by the OS every time."""
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _dense_torch(q: QuantWeight) -> torch.Tensor:
    n, groups = q.scale.shape
    if q.kind == "q8":
        w = q.codes.view(n, groups, GROUP).float() * q.scale[..., None]
    else:
        packed = q.codes.view(n, groups, GROUP // 2)
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
        w = codes * q.scale[..., None] + q.zero[..., None]
    return w.view(n, groups * GROUP)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the int8-activation kernels see it: per group of 32, e = max|x| / 127
    and x -> e * round(x / e) (nearest even), in fp32."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).reshape(m, k)


def can_quantize(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, kind: str) -> QuantWeight:
    """Round a float weight [N, K] (K a multiple of 32) to `kind`, per group of 32.

    q8: symmetric, s = max|w| / 127. q4: asymmetric over [min, max], d = (max - min) / 15,
    m = min (llama.cpp's Q4_1 rule). Re-quantizing a Q4_1 file's dequantized weights this way
    recovers its blocks: each block's min and max are its codes 0 and 15.
    """
    if not can_quantize(weight):
        raise ValueError(f"weight {tuple(weight.shape)}: in_features must be a multiple of {GROUP}")
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if kind == "q8":
        scale = g.abs().amax(dim=-1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantWeight("q8", codes.reshape(n, k), scale)
    if kind == "q4":
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        d = (hi - lo) / 15.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round((g - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
        return QuantWeight("q4", packed.reshape(n, k // 2), d, lo)
    raise ValueError(f"unknown quantized kind {kind!r}")


def concat(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Stack weights of one kind along their outputs (fused q|k|v, gate|up)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse weights of kinds {sorted(kinds)}")
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
    return QuantWeight(
        parts[0].kind,
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        zero,
    )
