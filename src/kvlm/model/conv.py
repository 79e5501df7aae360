"""The gated short convolution: a mixer beside attention (kvlm.config.MIXERS "conv"; Liquid
AI's hybrid models). For the block's normed input x (B, T, H):

    B, C, x' = in_proj(x)                      # each (B, T, H)
    u = B * x'                                 # the convolution's input rows
    seq = [the L - 1 rows of u before the step | u]           # (B, L - 1 + T, H)
    conv[t] = w[:, 0] seq[t] + ... + w[:, L-1] seq[t + L - 1]  (+ bias)
    out = out_proj(C * conv)                   # (B, T, H)

a depthwise causal convolution of kernel L (`conv_kernel`, L_cache: 3) over each
channel, position t reading u at t - L + 1 .. t, zeros before the text.

What a conv layer keeps of a sequence is not a row per token but the last L - 1 rows of
u: its layer kind is kvlm.cache.kinds.ConvWindow(L - 1, H), a fixed window per sequence,
held by kvlm.cache.conv's ConvRows (a cache's conv part, or a caller's own passed as
`Transformer.forward(conv=)`) or the engine pool's ConvSlots (a slot a sequence); the
forward asks its step for the rows each tap reads (`taps`: the rows before the step, then
its own) and the step stages its new rows, kept when the cache commits.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlm import kernels
from kvlm.cache.base import Taps
from kvlm.cache.conv import ConvRows, ConvStep, SlotStep
from kvlm.model.layers import Linear

__all__ = ["ConvRows", "ConvStep", "ShortConv", "depthwise"]


class ShortConv(nn.Module):
    """A gated short convolution (the module docstring): `slot` its index among the
    model's conv layers (its rows in a ConvStep), `kernel` (H, L) the depthwise weights."""

    def __init__(
        self, slot: int, in_proj: Linear, kernel: torch.Tensor, bias: torch.Tensor | None,
        out_proj: Linear,
    ) -> None:  # fmt: skip
        super().__init__()
        self.slot = slot
        self.in_proj = in_proj
        self.kernel = nn.Parameter(kernel.t().contiguous(), requires_grad=False)  # (L, H)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_proj = out_proj

    def forward(self, x: torch.Tensor, step: ConvStep | SlotStep) -> torch.Tensor:
        """x (B, T, H), the block's normed input -> (B, T, H); a draft's (n, 1, H), one
        sequence's n tokens (ConvStep.draft; a pool's SlotStep knows its sequences)."""
        if step.draft:
            return self._mix(x.transpose(0, 1), step).transpose(0, 1)
        return self._mix(x, step)

    def _mix(self, x: torch.Tensor, step: ConvStep | SlotStep) -> torch.Tensor:
        b, c, xs = self.in_proj(x).chunk(3, dim=-1)  # (B, T, H) each
        u = b * xs
        taps = step.taps(self.slot, u)  # L of (B, T, H): what each tap reads, window first
        return self.out_proj(c * depthwise(taps, self.kernel, self.bias))


def depthwise(taps: Taps, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A depthwise causal convolution's output from its taps (ConvStep.taps: tap k the
    rows k - L + 1 positions back) and `kernel` (L, C): tap 0 times its weights, then each
    next tap's product added in order (every mixer with a convolution: the short
    convolution, the gated DeltaNet's, the Mamba2 layer's), then the bias where one is.
    In fp32 on the CPU one C pass over the taps' rows (kvlm_depthwise, the same operations:
    the torch ops' bits, without a tensor a tap); the torch ops below elsewhere."""
    rows = taps.rows
    lib = kernels.library() if rows.dtype == torch.float32 and rows.is_cpu else None
    if lib is not None:
        return _depthwise_c(lib, taps, kernel, bias)
    w = kernel.to(taps[0].dtype)
    conv = taps[0] * w[0]
    for k in range(1, w.shape[0]):
        conv = conv + taps[k] * w[k]
    return conv if bias is None else conv + bias.to(conv.dtype)


def _depthwise_c(lib, taps: Taps, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows, index = taps.rows.contiguous(), taps.index.contiguous()
    w = kernel.to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    length, n = index.shape
    out = torch.empty(taps.shape, dtype=torch.float32)
    rc = lib.kvlm_depthwise(
        rows.data_ptr(), rows.numel(), rows.shape[0], index.data_ptr(), index.numel(), length,
        n, rows.shape[1], w.data_ptr(), w.numel(), None if b is None else b.data_ptr(),
        0 if b is None else b.numel(), out.data_ptr(), out.numel(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"the kernels refused a convolution of {length} taps over "
                         f"{tuple(rows.shape)} rows into {taps.shape}")  # fmt: skip
    return out
