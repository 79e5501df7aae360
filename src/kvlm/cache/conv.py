"""A short convolution's rows (kvlm.model.conv; the layer kind ConvWindow): what its layers
keep of a sequence is not a row per token but the last L - 1 rows of its input u, a fixed
window per sequence. `ConvRows` holds them for a group of conv layers and a batch of
sequences in lockstep, the way a cache holds K/V: `begin(n)` a `ConvStep` that the forward
reads the rows before the step from and stages its new rows in, `commit(step)` only once
the forward has succeeded; `rollback` (within the slack), `fork`, `snapshot`/`restore`.
`ConvCache` is the part of a cache that keeps them (kvlm.cache.hybrid: a cache of a model
with conv layers keeps a part per layer group, the conv layers' this one), its step's
`conv` the ConvStep the model reads (Transformer.forward).

    rows: (conv layers, B, keep, H), keep = L - 1 + slack, positions end - keep .. end - 1
                                                                     (zeros before 0)
          [ .. slack rows .. | L - 1 rows ]  end
    a step at start (end - slack <= start <= end) reads the L - 1 rows before start

A draft (KVCache.begin(n, draft=True): one sequence's n tokens as n rows of one token) is
one sequence of n tokens to the convolution: the model's ShortConv takes the rows as
(1, n, H) over the window before the first (`ConvStep.draft`).

The fused C decode step (kvlm.model.fused, kernels/conv.c) reads and writes the rows in
place, in this layout, through `ConvCache.kv_views` (a `ConvView`): it reads the L - 1 rows
before each step as `ConvStep.window` does and moves the rows on as `commit` would, once
its logits are made; the cache told (`written_in_place`), its commit only records the
positions.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from kvlm.cache.base import CacheSpec, CacheStep, ConvView, KVCache, KVPair
from kvlm.cache.kinds import CONV_ROW_DTYPE, RING_SLACK, ConvWindow
from kvlm.errors import CacheOverflowError, InvalidRequestError


class ConvRows:
    """The conv layers' rows of `batch` sequences advanced in lockstep: `rows` (conv
    layers, batch, keep, width) at positions end - keep .. end - 1, keep = kind.rows +
    `slack`; `length` the tokens the sequences hold (end - slack <= length <= end: a
    rollback leaves the rows)."""

    def __init__(
        self, kind: ConvWindow, layers: int, batch: int, dtype: torch.dtype,
        device: torch.device, slack: int = RING_SLACK,
    ) -> None:  # fmt: skip
        self.kind, self.slack = kind, slack
        self.keep = kind.rows + slack
        self.rows = torch.zeros(layers, batch, self.keep, kind.width, dtype=dtype, device=device)
        self.end = 0
        self.length = 0
        # the first position whose row is held (a row before 0 is a zero, held)
        self.first = -self.keep

    @property
    def batch(self) -> int:
        return self.rows.shape[1]

    def begin(self, n_new: int, draft: bool = False) -> ConvStep:
        """The step of `n_new` tokens after the `length` the sequences hold (`draft`: fed
        as n_new rows of one token, one sequence to the convolution)."""
        return ConvStep(self, self.length, n_new, draft)

    def commit(self, step: ConvStep) -> None:
        """Keep the step's rows: the sequences hold start + n_new tokens (`in_place`: the
        fused step has moved the rows on itself)."""
        if step.start != self.length or (not step.in_place and any(u is None for u in step.staged)):
            raise ValueError("a conv step committed out of order, or not run through")
        keep = self.keep
        if step.in_place:
            self.end = self.length = step.start + step.n_new
            self.first = max(self.first, self.end - keep)
            return
        staged = torch.stack(step.staged).to(self.rows.dtype)  # type: ignore[arg-type]
        before = self.rows[:, :, : keep - (self.end - step.start)]  # up to start
        rows = torch.cat([before, staged], dim=2)[:, :, -keep:]  # (layers, B, <= keep, H)
        if rows.shape[2] < keep:  # a step shorter than the rollback before it: the rows
            # below end - keep were not kept, so the slack left is smaller (`first`)
            pad = rows.new_zeros(*rows.shape[:2], keep - rows.shape[2], rows.shape[3])
            rows = torch.cat([pad, rows], dim=2)
        self.rows = rows.contiguous()  # the layout the fused step reads in place
        self.end = self.length = step.start + step.n_new
        self.first = max(self.first, self.end - keep)

    def can_roll_back(self, n: int) -> bool:
        """Whether the rows before length - n are still held."""
        return 0 <= n <= self.length and self.length - n - self.kind.rows >= self.first

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (the rows stay: at most `slack` behind their end)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        if not self.can_roll_back(n):
            raise CacheOverflowError(
                f"the short convolutions keep {self.slack} rows for a rollback; "
                f"{self.end - self.length + n} tokens back is past them"
            )
        self.length -= n

    def reset(self) -> None:
        self.rows = self.rows.new_zeros(self.rows.shape)  # an inference tensor, maybe
        self.end = self.length = 0
        self.first = -self.keep

    def fork(self, n: int) -> None:
        """Each sequence as n (n samples decoding from one prompt)."""
        self.rows = self.rows.repeat_interleave(n, dim=1)

    def snapshot(self) -> tuple[torch.Tensor, int, int, int]:
        return self.rows.clone(), self.end, self.length, self.first

    def restore(self, saved: tuple[torch.Tensor, int, int, int]) -> None:
        rows, self.end, self.length, self.first = saved
        self.rows = rows.clone()

    def at_length(self) -> torch.Tensor:
        """The rows as if end were length (those past length dropped, zeros below)."""
        behind = self.end - self.length
        if behind == 0:
            return self.rows
        pad = self.rows.new_zeros(*self.rows.shape[:2], behind, self.rows.shape[3])
        return torch.cat([pad, self.rows[:, :, : self.keep - behind]], dim=2)


class ConvStep:
    """One forward's view of the conv rows: `window(slot)` the L - 1 rows before `start`
    of conv layer `slot` (B, L - 1, H); `put(slot, u)` stages the step's rows (B, T, H),
    kept only by `ConvRows.commit`. `draft`: the step's tokens come as rows of one token
    (n, 1, H), one sequence's (ShortConv reads them as (1, n, H))."""

    def __init__(self, rows: ConvRows, start: int, n_new: int, draft: bool = False) -> None:
        self.start, self.n_new, self.draft = start, n_new, draft
        self.in_place = False  # the rows moved on by the fused step (ConvCache.written_in_place)
        behind = rows.end - start  # 0, or up to slack after a rollback
        keep, r = rows.keep, rows.kind.rows
        self._before = rows.rows[:, :, keep - behind - r : keep - behind]
        self.staged: list[torch.Tensor | None] = [None] * rows.rows.shape[0]

    def window(self, slot: int) -> torch.Tensor:
        return self._before[slot]

    def put(self, slot: int, u: torch.Tensor) -> None:
        self.staged[slot] = u


class _ConvCacheStep(CacheStep):
    """A ConvCache's step: no K/V (a conv layer attends to nothing); `conv` its rows."""

    def __init__(self, cache: ConvCache, n_new: int, draft: bool) -> None:
        super().__init__(cache.num_tokens, n_new, cache.batch, cache.spec.device, None, False)
        self.conv = cache.rows.begin(n_new, draft)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        raise RuntimeError("a conv layer has no K/V")  # a bug, not a user error


class ConvCache(KVCache):
    """The rows of a group of conv layers (`spec.num_layers` of them, kind `kind`) for
    `spec.batch` sequences: a part of a HybridCache, any mode."""

    mode = "conv"

    def __init__(self, spec: CacheSpec, kind: ConvWindow) -> None:
        super().__init__(spec)
        self.kind = kind
        self.rows = ConvRows(kind, spec.num_layers, spec.batch, CONV_ROW_DTYPE, spec.device)

    @property
    def capacity(self) -> int:
        return sys.maxsize  # a window a sequence: any length

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return _ConvCacheStep(self, n_new, draft)

    def _commit(self, step: CacheStep) -> None:
        self.rows.commit(step.conv)  # type: ignore[arg-type]

    def _check_rollback(self, n: int) -> None:
        if not self.rows.can_roll_back(n):
            raise InvalidRequestError(
                f"the short convolutions keep the rows of {RING_SLACK} tokens for a rollback; "
                f"{self.rows.end - self.rows.length + n} tokens back is past them"
            )

    def _truncate(self, length: int) -> None:
        if length == 0:
            self.rows.reset()
        else:
            self.rows.rollback(self.rows.length - length)

    def _fork(self, n: int) -> None:
        self.rows.fork(n)

    def kv_views(self, rows: Sequence[int]) -> list[ConvView]:
        """The rows as one view (the fused step's): token i through sequence rows[i],
        every sequence's rows ending at `end`."""
        return [ConvView(self.rows.rows, list(rows), [self.rows.end] * len(rows))]

    def written_in_place(self, step: CacheStep) -> None:
        """The fused step reads the rows before the step and moves them on itself (after
        its logits are made): commit then only records the positions."""
        step.conv.in_place = True  # type: ignore[attr-defined]

    def _release(self) -> None:  # back to the spec's batch
        self.rows = ConvRows(self.kind, self.spec.num_layers, self.spec.batch, CONV_ROW_DTYPE,
                             self.spec.device)  # fmt: skip

    def _export(self) -> dict[str, torch.Tensor]:
        """`rows` (layers, B, keep, width) ending at the held length; `held` (1,) int64:
        how many positions before it are held (length - first)."""
        held = torch.tensor([self.rows.length - self.rows.first], dtype=torch.int64)
        return {"rows": self.rows.at_length(), "held": held}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        rows, held = tensors["rows"], int(tensors["held"][0])
        self.rows.reset()
        # contiguous, as every other road leaves them: the fused step's layout
        self.rows.rows = rows.to(CONV_ROW_DTYPE, copy=True).to(self.spec.device).contiguous()
        self.rows.end = self.rows.length = length
        self.rows.first = length - held

    @property
    def nbytes(self) -> int:
        return self.rows.rows.numel() * self.rows.rows.element_size()

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        raise TypeError("a conv part's plan is its kind's: LayerGroup.sequence_bytes")
