"""Low-bit weights in groups of 32 (llama.cpp's blocks), multiplied by kvlm's C kernels.

    q8: int8 codes, one fp16 scale per group:      w = s * q        (Q8_0's numerics)
    q4: 4-bit codes, fp16 (d, m) per group:        w = d * q + m    (Q4_1's; Q4_0 is m = -8d)

A QuantWeight comes either from a float weight (`quantize(w, "q8" | "q4")`: `--weights
int8|int4`) or straight from a GGUF file's Q8_0/Q4_0/Q4_1 blocks (`--weights native`: the
file's own numbers, nothing re-rounded), packed row-interleaved for the kernels
(`QuantWeight`) and moved onto huge pages with the rest of the model's weights
(`move_to_huge_pages`). Products keep fp32 activations: the C kernel widens the codes in
registers (decode, up to SMALL_M rows), or the weight is dequantized once into a dense fp32
matrix for a BLAS GEMM (prefill). Opt-in `act_int8` (`--activations int8`) rounds each row
of x to int8 per group of 32 in the small products, as llama.cpp does, for integer dot
products (AVX512-VNNI). Without the compiled kernels the same products run in torch (from
the same packed bytes): the same numbers, slower.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvlm import kernels

GROUP = 32
KINDS = ("q8", "q4")
FORMATS = {"int8": "q8", "int4": "q4"}  # --weights name -> kind
# Up to this many rows the C kernel (reads the low-bit weight once); above, a dense GEMM.
SMALL_M = 16


class QuantWeight:
    """A low-bit weight [N, K] in the kernels' packed layout (kernels/qgemm.c): blocks of 16
    rows, each row's 4 consecutive code bytes in one 32-bit lane, fp16 scales after each
    block's codes. Built from codes in their natural order:

        q8: codes int8 [N, K], scale [N, K/32]
        q4: codes uint8 [N, K/2] (byte j of a group: element j low, j + 16 high nibble),
            scale d and zero m [N, K/32]

    Scales are stored in fp16 (a GGUF file's own d and m are fp16: kept exactly).
    `unpacked()` gives the natural arrays back."""

    __slots__ = ("data", "in_features", "kind", "out_features")

    def __init__(
        self,
        kind: str,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown quantized kind {kind!r}")
        if (kind == "q4") != (zero is not None):
            raise ValueError("q4 weights need a zero per group; q8 weights have none")
        n, groups = scale.shape
        self.kind = kind
        self.out_features, self.in_features = n, groups * GROUP
        self.data = _pack(kind, codes, scale, zero)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes and scales (with the rows padding a block)."""
        return self.data.numel()

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scale, zero) in the natural order, scales as fp32."""
        return _unpack(self)

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
        lib.kvlm_qdequant(_KIND[self.kind], dtype == torch.bfloat16, k, _ptr(self.data), n,
                          _ptr(out))  # fmt: skip
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
        numel = self.out_features * self.in_features
        if x.dtype == torch.float64:  # the reference: the same weights, fp64 sums
            return torch.matmul(x, self.dense(_scratch(numel)).t().double())
        lib = kernels.library()
        if m > SMALL_M and prefill_bf16:
            w = self.dense(_scratch(numel, torch.bfloat16), torch.bfloat16)
            return torch.matmul(x.to(torch.bfloat16), w.t()).float()
        if lib is None and m <= SMALL_M and act_int8:
            x = round_activations(x)
        if lib is None or m > SMALL_M:
            return torch.matmul(x, self.dense(_scratch(numel)).t())
        n = self.out_features
        y = torch.empty(m, n, dtype=torch.float32)
        fn = lib.kvlm_qgemm_i8 if act_int8 else lib.kvlm_qgemm
        if fn(_KIND[self.kind], _ptr(x), m, k, _ptr(self.data), n, _ptr(y)) != 0:
            raise MemoryError("no scratch memory for a low-bit product")
        return y


_KIND = {"q8": 8, "q4": 4}
BLOCK_ROWS = 16  # rows per packed block: one per 32-bit lane of a 512-bit vector


def _pack(
    kind: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """Natural codes and scales -> the packed layout: uint8 [blocks, groups * record], a
    record being one group of 16 rows: codes (4 bytes of each row per 32-bit lane), then
    the 16 fp16 scales (q4: then the 16 zeros)."""
    n, groups = scale.shape
    blocks = -(-n // BLOCK_ROWS)
    pad = blocks * BLOCK_ROWS - n
    width = GROUP if kind == "q8" else GROUP // 2  # code bytes per row and group
    c = F.pad(codes.contiguous().view(torch.uint8).reshape(n, groups, width), (0, 0, 0, 0, 0, pad))
    parts = [c.view(blocks, BLOCK_ROWS, groups, width // 4, 4).permute(0, 2, 3, 1, 4)]
    for t in (scale,) if zero is None else (scale, zero):
        t = F.pad(t.to(torch.float16), (0, 0, 0, pad)).view(blocks, BLOCK_ROWS, groups)
        parts.append(t.transpose(1, 2).contiguous().view(torch.uint8))
    parts = [p.reshape(blocks, groups, -1) for p in parts]
    return torch.cat(parts, dim=2).reshape(blocks, -1)


def _unpack(q: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n, groups, blocks = q.out_features, q.in_features // GROUP, q.data.shape[0]
    width = GROUP if q.kind == "q8" else GROUP // 2
    rec = q.data.view(blocks, groups, -1)
    c = rec[..., : width * BLOCK_ROWS].reshape(blocks, groups, width // 4, BLOCK_ROWS, 4)
    c = c.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK_ROWS, groups * width)[:n].contiguous()
    codes = c.view(torch.int8) if q.kind == "q8" else c
    scales = []
    for i in range(1 if q.kind == "q8" else 2):
        at = width * BLOCK_ROWS + 2 * BLOCK_ROWS * i
        t = rec[..., at : at + 2 * BLOCK_ROWS].contiguous().view(torch.float16)
        scales.append(t.transpose(1, 2).reshape(blocks * BLOCK_ROWS, groups)[:n].float())
    return codes, scales[0].contiguous(), scales[1].contiguous() if q.kind == "q4" else None


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
    codes, scale, zero = q.unpacked()
    n, groups = scale.shape
    if q.kind == "q8":
        w = codes.view(n, groups, GROUP).float() * scale[..., None]
    else:
        packed = codes.view(n, groups, GROUP // 2)
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
        w = codes * scale[..., None] + zero[..., None]
    return w.view(n, groups * GROUP)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the int8-activation kernels see it: per group of 32, e = max|x| / 127
    and x -> e * round(x / e) (nearest even), in fp32."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).reshape(m, k)


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to fp16's grid (the stored scales), kept as fp32."""
    return t.to(torch.float16).float()


def can_quantize(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, kind: str) -> QuantWeight:
    """Round a float weight [N, K] (K a multiple of 32) to `kind`, per group of 32.

    q8: symmetric, s = max|w| / 127. q4: asymmetric over [min, max], d = (max - min) / 15,
    m = min (llama.cpp's Q4_1 rule). Scales are rounded to fp16 (as GGUF stores them) before
    the codes are chosen, so each weight is within half a step of its grid. Re-quantizing a
    Q4_1 file's dequantized weights this way recovers its blocks: each block's min and max
    are its codes 0 and 15.
    """
    if not can_quantize(weight):
        raise ValueError(f"weight {tuple(weight.shape)}: in_features must be a multiple of {GROUP}")
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if kind == "q8":
        scale = _fp16(g.abs().amax(dim=-1) / 127.0)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantWeight("q8", codes.reshape(n, k), scale)
    if kind == "q4":
        lo = _fp16(g.amin(dim=-1))
        d = _fp16((g.amax(dim=-1) - lo) / 15.0)
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round((g - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
        return QuantWeight("q4", packed.reshape(n, k // 2), d, lo)
    raise ValueError(f"unknown quantized kind {kind!r}")


def move_to_huge_pages(weights: Sequence[QuantWeight]) -> bool:
    """Move the packed weights, in the order given (a decode step's read order), into one
    buffer on transparent huge pages (kernels.huge_page_buffer): the kernels stream them
    with a page walk per 2 MiB instead of per 4 KiB. False (nothing moved) where the OS
    offers no huge pages."""
    sizes = [-(-w.data.numel() // 64) * 64 for w in weights]  # each start 64-byte aligned
    arena = kernels.huge_page_buffer(sum(sizes))
    if arena is None:
        return False
    at = 0
    for w, size in zip(weights, sizes, strict=True):
        view = arena[at : at + w.data.numel()].view(w.data.shape)
        view.copy_(w.data)
        w.data = view
        at += size
    return True


def concat(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Stack weights of one kind along their outputs (fused q|k|v, gate|up)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse weights of kinds {sorted(kinds)}")
    natural = [p.unpacked() for p in parts]
    zero = None if parts[0].kind == "q8" else torch.cat([z for _, _, z in natural])
    return QuantWeight(
        parts[0].kind,
        torch.cat([c for c, _, _ in natural]),
        torch.cat([s for _, s, _ in natural]),
        zero,
    )
