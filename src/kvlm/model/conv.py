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
u: its layer kind is `ConvWindow(rows=L - 1)` (docs/NOTES-kinds.md, step 4), a fixed
state per sequence. `ConvRows` holds them for the model's conv layers and a batch of
sequences in lockstep, the way a cache holds K/V: `begin(n)` a `ConvStep` that the
forward reads the rows before the step from and stages its new rows in, `commit(step)`
only once the forward has succeeded; `rollback`, `fork`, `snapshot`/`restore`. It is a
per-request object passed through the forward (`Transformer.forward(conv=)`) until the
caches hold a conv group of their own (docs/DESIGN.md section 5 says what is left).

    rows: (conv layers, B, keep, H), keep = L - 1 + slack, positions end - keep .. end - 1
                                                                     (zeros before 0)
          [ .. slack rows .. | L - 1 rows ]  end
    a step at start (end - slack <= start <= end) reads the L - 1 rows before start
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvlm.errors import CacheOverflowError
from kvlm.model.layers import Linear


@dataclass(frozen=True, slots=True)
class ConvWindow:
    """What a conv layer keeps of a sequence (a layer kind's spec, as kvlm.cache.kinds'
    FullAttention and SlidingWindow are): its input rows at the last `rows` positions
    (the kernel less one), and `slack` rows more, so a rollback of up to `slack` tokens
    still finds the rows before its new end."""

    rows: int
    slack: int = 0

    @property
    def keep(self) -> int:
        """Rows kept a sequence."""
        return self.rows + self.slack


class ConvRows:
    """The conv layers' rows of `batch` sequences advanced in lockstep: `rows` (conv
    layers, batch, keep, hidden) at positions end - keep .. end - 1; `length` the tokens
    the sequences hold (end - slack <= length <= end: a rollback leaves the rows)."""

    def __init__(
        self, kind: ConvWindow, layers: int, batch: int, hidden: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.kind = kind
        self.rows = torch.zeros(layers, batch, kind.keep, hidden, dtype=dtype, device=device)
        self.end = 0
        self.length = 0
        # the first position whose row is held (a row before 0 is a zero, held)
        self.first = -kind.keep

    @property
    def batch(self) -> int:
        return self.rows.shape[1]

    def begin(self, n_new: int) -> ConvStep:
        """The step of `n_new` tokens after the `length` the sequences hold."""
        return ConvStep(self, self.length, n_new)

    def commit(self, step: ConvStep) -> None:
        """Keep the step's rows: the sequences hold start + n_new tokens."""
        if step.start != self.length or any(u is None for u in step.staged):
            raise ValueError("a conv step committed out of order, or not run through")
        keep = self.kind.keep
        staged = torch.stack(step.staged).to(self.rows.dtype)  # type: ignore[arg-type]
        before = self.rows[:, :, : keep - (self.end - step.start)]  # up to start
        rows = torch.cat([before, staged], dim=2)[:, :, -keep:]  # (layers, B, <= keep, H)
        if rows.shape[2] < keep:  # a step shorter than the rollback before it: the rows
            # below end - keep were not kept, so the slack left is smaller (`first`)
            pad = rows.new_zeros(*rows.shape[:2], keep - rows.shape[2], rows.shape[3])
            rows = torch.cat([pad, rows], dim=2)
        self.rows = rows
        self.end = self.length = step.start + step.n_new
        self.first = max(self.first, self.end - keep)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (the rows stay: at most `slack` behind their end)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        if self.length - n - self.kind.rows < self.first:
            raise CacheOverflowError(
                f"the short convolutions keep {self.kind.slack} rows for a rollback; "
                f"{self.end - self.length + n} tokens back is past them"
            )
        self.length -= n

    def reset(self) -> None:
        self.rows.zero_()
        self.end = self.length = 0
        self.first = -self.kind.keep

    def fork(self, n: int) -> None:
        """Each sequence as n (n samples decoding from one prompt)."""
        self.rows = self.rows.repeat_interleave(n, dim=1)

    def snapshot(self) -> tuple[torch.Tensor, int, int, int]:
        return self.rows.clone(), self.end, self.length, self.first

    def restore(self, saved: tuple[torch.Tensor, int, int, int]) -> None:
        rows, self.end, self.length, self.first = saved
        self.rows = rows.clone()


class ConvStep:
    """One forward's view of the conv rows: `window(slot)` the L - 1 rows before `start`
    of conv layer `slot` (B, L - 1, H); `put(slot, u)` stages the step's rows (B, T, H),
    kept only by `ConvRows.commit`."""

    def __init__(self, rows: ConvRows, start: int, n_new: int) -> None:
        self.start, self.n_new = start, n_new
        behind = rows.end - start  # 0, or up to slack after a rollback
        kind = rows.kind
        self._before = rows.rows[:, :, kind.keep - behind - kind.rows : kind.keep - behind]
        self.staged: list[torch.Tensor | None] = [None] * rows.rows.shape[0]

    def window(self, slot: int) -> torch.Tensor:
        return self._before[slot]

    def put(self, slot: int, u: torch.Tensor) -> None:
        self.staged[slot] = u


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

    def forward(self, x: torch.Tensor, step: ConvStep) -> torch.Tensor:
        """x (B, T, H), the block's normed input -> (B, T, H)."""
        b, c, xs = self.in_proj(x).chunk(3, dim=-1)  # (B, T, H) each
        u = b * xs
        step.put(self.slot, u)
        seq = torch.cat([step.window(self.slot).to(u.dtype), u], dim=1)  # (B, L - 1 + T, H)
        w, t = self.kernel.to(u.dtype), u.shape[1]
        conv = seq[:, :t] * w[0]
        for k in range(1, w.shape[0]):
            conv = conv + seq[:, k : k + t] * w[k]
        if self.bias is not None:
            conv = conv + self.bias.to(u.dtype)
        return self.out_proj(c * conv)
