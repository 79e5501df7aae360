"""A gated DeltaNet's state (kvlm.model.deltanet; the layer kind RecurrentState): what its
layers keep of a sequence is no row per token but a fixed state, its recurrence's
(value heads, key_dim, value_dim) and its convolution's last L - 1 input rows.
`DeltaRows` holds it for a group of DeltaNet layers and a batch of sequences in lockstep
(begin(n) -> a `DeltaStep` the model reads and stages in, commit only once the forward
succeeded; fork; a rollback only to a state it kept: a state cannot forget tokens).
`StateCache` is the part of a cache that keeps it (kvlm.cache.hybrid: a cache of a model
with DeltaNet layers keeps a part per layer group, the DeltaNet layers' this one), a
DeltaRows of the group's layers and the cache's sequences; its step's
`recurrent` the DeltaStep the model reads (Transformer.forward), kept by commit only once
the forward succeeded.

    conv:  (DeltaNet layers, B, L - 1, conv_width)        positions length - L + 1 .. length - 1
    state: (DeltaNet layers, B, value_heads, key_dim, value_dim)   at the chunk start c
    win:   (DeltaNet layers, B, value_heads, DELTA_CHUNK - 1, key_dim + value_dim + 2)
           the carried rows of positions c .. length - 1 (c = length - length % 16)

(the gated delta rule runs in chunks of kinds.DELTA_CHUNK at absolute positions, so a step
cut anywhere computes one shot's values: kvlm.model.deltanet; a Mamba2's state is the
one after `length` tokens, its `win` empty).

Both in kinds.state_dtype (fp32; fp64 for an fp64 cache). A state cannot forget tokens,
so a rollback goes back to a state kept for it: a draft step (begin(n, draft=True): the
last token and its draft as rows of one step) keeps the state and rows after each of
its rows, `hold_rollback(k)` those the last k one-token steps ended at (a draft model's
cache); `can_roll_back(n)` is False past them (a chat turn starts over), rollback to 0 is
a reset; fork copies it whole. A cache file holds it with its checkpoints (`state_layout`).

The fused C decode step (kvlm.model.fused) reads it through a `StateView`
(`StateCache.kv_views`, `StateSlots.view`): the states before the step where they are,
each row's after into the step's out buffer (a one-sequence cache's: DeltaStep.out_state,
which commit keeps; the pool's slots are updated in place, `StateSlots.written` then
moves the ends on and takes the snapshots), the conv rows moved on in place as a conv
layer's (ConvRows' layout; a kept state's rows copied
off first: `DeltaRows.own_rows`). A draft's rows are one run of its sequence: the state
after each but the last into the view's `snaps`, each row's convolution input into its
`urows`, kept with the rows from before the step as the torch step keeps them (a draft
step's kept states; the pool's `Drafted`).

`StateSlots` keeps it in the engine's pool (kvlm.cache.paged.BlockPool.groups; the slot
bookkeeping is kvlm.cache.slots'): a slot a sequence of both tensors above, its step a
`SlotDeltaStep` (the step's sequences at their row offsets `cu`, as GatedDeltaNet reads
them; a sequence's draft rows one of them, the state after each kept until its next step
for a rejected row's trim), and with the prefix cache snapshots of it at group 0's block
ends, which prefix hits restore a slot from.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvlm.cache.base import CacheSpec, CacheStep, ConvView, KVCache, KVPair, StateView, Taps
from kvlm.cache.conv import ConvRows, ConvStep
from kvlm.cache.groups import LayerGroup
from kvlm.cache.kinds import ConvWindow, RecurrentState, state_dtype
from kvlm.cache.slots import Piece, Slots, joined, sequences
from kvlm.errors import CacheOverflowError, InvalidRequestError

# Why a cache with a DeltaNet state refuses a rollback (and the callers that need one)
NO_ROLLBACK = "a gated DeltaNet's state cannot forget tokens"
# The checkpoints (positions asked for ahead: DeltaRows.checkpoint) a cache keeps, latest
CHECKPOINTS = 4
# A prompt leaves a snapshot of the state every this many tokens it passes (StateSlots;
# held by none, least recently used reused first): a long prefix another prompt shares (a
# system prompt, a document) then hits within it
SNAPSHOT_EVERY = 512


def state_layout(
    kind: RecurrentState, layers: int, batch: int, marks: int
) -> dict[str, tuple[int, ...]]:
    """The tensors a StateCache exports (a cache file's state group) and their shapes:
    `conv`, `state` and `win` (a DeltaNet's carried rows) as DeltaRows holds them, and its
    `marks` checkpoints' positions (`mark_pos`, ascending) and states, rows and carried
    rows (`mark_state`, `mark_conv`, `mark_win`)."""
    state, conv = (layers, batch, *kind.state_shape), (
        layers, batch, kind.conv_kernel - 1, kind.conv_width)  # fmt: skip
    out = {"conv": conv, "state": state, "mark_pos": (marks,), "mark_state": (marks, *state),
           "mark_conv": (marks, *conv)}  # fmt: skip
    if kind.chunk:  # a DeltaNet's carried rows (a Mamba2 carries none)
        win = (layers, batch, *kind.window_shape)
        out |= {"win": win, "mark_win": (marks, *win)}
    return out


# what a state kept for a rollback or a checkpoint is: (state, conv rows, carried rows)
Held = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DraftBuffers:
    """The buffers a fused step writes its draft rows' states into (StateView.snaps), each
    (layers, rows, *state) fp32, reused once nothing holds a state in it: a fresh buffer a
    step is a fresh mapping whose pages are faulted in anew (18 MiB a row at a 0.8B hybrid;
    docs/BENCHMARKS.md 24.7, 24.12)."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []

    def get(self, like: torch.Tensor, rows: int, held: Sequence[torch.Tensor]) -> torch.Tensor:
        """A buffer of at least `rows` states shaped as `like`'s (layers, sequences, ...)
        that none of `held` (the states still kept) lies in, else a new one (those of too
        few rows let go)."""
        taken = {t.untyped_storage().data_ptr() for t in held}
        for buf in self.bufs:
            if buf.shape[1] >= rows and buf.untyped_storage().data_ptr() not in taken:
                return buf
        buf = torch.empty(like.shape[0], rows, *like.shape[2:], dtype=torch.float32,
                          device=like.device)  # fmt: skip
        self.bufs = [b for b in self.bufs if b.untyped_storage().data_ptr() in taken] + [buf]
        return buf


class DeltaRows:
    """The DeltaNet layers' state of `batch` sequences advanced in lockstep: each layer's
    last L - 1 input rows of its convolution (`conv`, a ConvRows) and its recurrent state
    `state` (layers, batch, nv, dk, dv) in the recurrence's dtype; `length` the tokens
    they hold. A state cannot forget tokens, so a rollback goes back to a state kept:
    `kept` (position -> the state and conv rows there), each draft row's (a draft step
    keeps the state after each of its rows) and, for `depth` positions back, those each
    step ended at (`hold_rollback`: a draft model's own cache, whose drafts are steps of
    one token); and `marks`, the last CHECKPOINTS positions asked for ahead
    (`checkpoint(p)`: a chat's turn boundary), kept by the step that passes them."""

    def __init__(
        self, kind: RecurrentState, layers: int, batch: int, dtype: torch.dtype,
        device: torch.device, depth: int = 0,
    ) -> None:  # fmt: skip
        self.kind = kind
        window = ConvWindow(kind.conv_kernel - 1, kind.conv_width)
        self.conv = ConvRows(window, layers, batch, dtype, device, slack=0)
        self.state = torch.zeros(layers, batch, *kind.state_shape, dtype=state_dtype(dtype),
                                 device=device)  # fmt: skip
        # a DeltaNet's carried rows: its state is the one at the chunk start of `length`
        # (kinds.DELTA_CHUNK), these the chunk's rows since (kvlm.model.deltanet)
        self.win = torch.zeros(layers, batch, *kind.window_shape, dtype=self.state.dtype,
                               device=device)  # fmt: skip
        self.depth = depth
        # the buffer a committed step's state replaced, where nothing kept holds it: the
        # next step's C road writes its states into it (DeltaStep.out_state), so a step
        # allocates none (every layer's state of a sequence in one buffer, 55 MiB at
        # a 1.5B hybrid's 36 Mamba2 layers: a fresh mapping a step, its pages faulted in
        # anew: docs/BENCHMARKS.md 24.7)
        self.spare: torch.Tensor | None = None
        self.draft_bufs = DraftBuffers()  # the fused draft steps' (StateView.snaps)
        self.win_bufs = DraftBuffers()  # ... and their carried rows' (StateView.wsnaps)
        # position -> the state, conv rows and carried rows there
        self.kept: dict[int, Held] = {}
        self.wanted: set[int] = set()  # positions a step will keep the state at (marks)
        self.marks: dict[int, Held] = {}

    @property
    def length(self) -> int:
        return self.conv.length

    def begin(self, n_new: int, draft: bool = False) -> DeltaStep:
        """The step of `n_new` tokens after the `length` the sequences hold (`draft`: one
        sequence's tokens as rows of one token, the state after each kept)."""
        return DeltaStep(self, n_new, draft)

    def commit(self, step: DeltaStep) -> None:
        """Keep the step's rows and states (only once its forward succeeded)."""
        if any(s is None for s in step.staged) or (
            step.keep_rows and any(s is None for s in step.kept)
        ):
            raise ValueError("a DeltaNet step committed before it was run through")
        before, replaced = self.conv.rows, self.state
        self.conv.commit(step.conv)
        self.state = step.states()
        self.win = step.wins()
        start, end, r = step.start, step.start + step.n_new, self.conv.keep
        if step.keep_rows:  # the state and rows after each row kept
            # (layers, rows, ...): the fused draft step's buffer, else the staged stacked
            states, wins = step.kept_states(), step.kept_wins()
            rows = None
            if step.urows is not None:  # the fused step's: the rows before it, its u rows
                rows = torch.cat([step.before, step.urows[:, None].to(before.dtype)], dim=2)
            elif step.draft:  # a draft's rows are all staged
                new = torch.stack(step.conv.staged).to(before.dtype)  # type: ignore[arg-type]
                rows = torch.cat([before, new], dim=2)  # (layers, B, L - 1 + n, C)
            index = {row: i for i, row in enumerate(step.keep_rows)}
            for p in step.inside:  # sequence b's row of position p: b n + p - start - 1
                at = [index[b * step.n_new + p - start - 1] for b in range(self.batch)]
                q = p - start
                if rows is not None:
                    window = rows[:, :, q : q + r]
                else:
                    window = torch.stack([w[q] for w in step.conv.windows]).to(before.dtype)
                # one sequence's (a draft's): a view of the step's states, else gathered
                one = slice(at[0], at[0] + 1) if len(at) == 1 else at
                held = (states[:, one], window, wins[:, one])
                (self.marks if p in self.wanted else self.kept)[p] = held
        self.kept[end] = (self.state, self.conv.rows, self.win)
        if end in self.wanted:
            self.marks[end] = self.kept[end]
        self.wanted = {p for p in self.wanted if p > end}
        self.marks = dict(sorted(self.marks.items())[-CHECKPOINTS:])
        back = max(self.depth, step.n_new - 1 if step.draft else 0)
        self.kept = {p: t for p, t in self.kept.items() if end - back <= p <= end}
        held = {t[0].data_ptr() for t in (*self.kept.values(), *self.marks.values())}
        if replaced.data_ptr() not in held and replaced.data_ptr() != self.state.data_ptr():
            self.spare = replaced

    @property
    def batch(self) -> int:
        return self.state.shape[1]

    def checkpoint(self, position: int) -> None:
        """Keep the state at `position` when a step passes it (a rollback may go there)."""
        if position > self.length:
            self.wanted.add(position)

    def rollback_point(self, keep: int) -> int:
        """The furthest position at most `keep` a rollback can go back to (0: none)."""
        return max((p for p in (*self.kept, *self.marks) if p <= keep), default=0)

    def can_roll_back(self, n: int) -> bool:
        """Whether the state `n` tokens back is kept."""
        p = self.length - n
        return n == 0 or p in self.kept or p in self.marks

    def rollback(self, n: int) -> None:
        """Back to the state and rows `n` tokens before the end (kept: `can_roll_back`)."""
        if not self.can_roll_back(n):
            raise InvalidRequestError(f"{NO_ROLLBACK}: {n} of {self.length} tokens back is "
                                      "past the states kept")  # fmt: skip
        if n:
            length = self.length - n
            replaced = self.state
            state, rows, win = self.kept.get(length) or self.marks[length]
            if not state.is_contiguous():  # a draft row's, in its step's buffer: the
                # layout the fused step reads, in the spare buffer where there is one
                spare, self.spare = self.spare, None
                with torch.inference_mode():  # (the step's buffers are inference tensors)
                    fits = spare is not None and spare.shape == state.shape
                    state = spare.copy_(state) if fits else state.contiguous()  # type: ignore[union-attr]
            self.state = state
            self.win = win.contiguous()
            self.conv.rows = rows.contiguous()
            self.conv.end = self.conv.length = length
            self.conv.first = length - self.conv.keep
            self.kept = {p: t for p, t in self.kept.items() if p <= length}
            self.kept[length] = (self.state, self.conv.rows, self.win)
            self.marks = {p: t for p, t in self.marks.items() if p <= length}
            self.wanted = set()
            held = {t[0].data_ptr() for t in (*self.kept.values(), *self.marks.values())}
            if replaced.data_ptr() not in held and replaced.is_contiguous():
                self.spare = replaced  # the next step's out buffer

    def draft_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused draft step's buffers of its rows' states and carried rows
        (DraftBuffers), where nothing kept for a rollback or a checkpoint is held."""
        held = [t for h in (*self.kept.values(), *self.marks.values()) for t in (h[0], h[2])]
        return (self.draft_bufs.get(self.state, rows, held),
                self.win_bufs.get(self.win, rows, held))  # fmt: skip

    def own_rows(self) -> None:
        """Before a step that moves the conv rows on in place (the fused step's): the rows
        copied off first where a state kept for a rollback or a checkpoint holds them (the
        one at the end itself only where a rollback may return there)."""
        live = self.conv.rows.data_ptr()
        held = [t for p, t in self.kept.items() if self.depth or p != self.length]
        if any(t[1].data_ptr() == live for t in (*held, *self.marks.values())):
            self.conv.rows = self.conv.rows.clone()

    def fork(self, n: int) -> None:
        """Each sequence as n (n samples decoding from one prompt)."""
        self.conv.fork(n)
        self.state = self.state.repeat_interleave(n, dim=1)
        self.win = self.win.repeat_interleave(n, dim=1)
        self.kept = {self.length: (self.state, self.conv.rows, self.win)}
        self.marks, self.wanted = {}, set()


class DeltaStep:
    """One forward's view of the DeltaNet rows: `conv` the ConvStep of their convolution
    windows, `initial(layer)` a layer's state before the step, `stage(layer, state)` its
    state after (kept by DeltaRows.commit). The step's sequences are its B rows of n_new
    tokens each (`cu` None: a pool step's say where each sequence's rows are), or a draft's
    one sequence of n_new rows of one token. `keep_rows`: the rows (flattened) after
    which the state is kept too (`stage_kept`): a draft's every row but the last, and each
    sequence's row of a checkpoint inside the step (`inside`, their positions)."""

    cu: list[int] | None = None

    def __init__(self, rows: DeltaRows, n_new: int, draft: bool = False) -> None:
        self.start, self.n_new, self.draft = rows.length, n_new, draft
        start = self.start
        self.starts = [start] * (1 if draft else rows.batch)  # each sequence's first position
        if draft:
            self.cu = [0, n_new]
            self.inside = list(range(start + 1, start + n_new))
        else:
            self.inside = sorted(p for p in rows.wanted if start < p < start + n_new)
        # a checkpoint's rows: kept by the conv step (of a long one only its tail stays)
        windows = () if draft else tuple(p - start for p in self.inside)
        self.conv: ConvStep = rows.conv.begin(n_new, draft, windows)
        self._state, self._rows, self._win = rows.state, rows, rows.win
        self.out: torch.Tensor | None = None
        self.win_out: torch.Tensor | None = None
        # a draft through the fused step (StateCache.written_in_place): the conv rows
        # before it, and the step's buffers of its rows' states and carried rows (snaps,
        # wsnaps) and u rows
        self.before: torch.Tensor | None = None
        self.snaps: torch.Tensor | None = None
        self.wsnaps: torch.Tensor | None = None
        self.urows: torch.Tensor | None = None
        layers = rows.state.shape[0]
        self.staged: list[torch.Tensor | None] = [None] * layers
        self.kept: list[torch.Tensor | None] = [None] * layers
        rel = [p - start - 1 for p in self.inside]
        self.keep_rows = sorted(b * n_new + q for b in range(rows.batch) for q in rel) or None
        # the carried rows after the step and after each kept row (none to carry: a
        # Mamba2's, its window empty, staged as it is)
        empty = rows.win.numel() == 0
        self.staged_win: list[torch.Tensor | None] = [w if empty else None for w in rows.win]
        kept_win = rows.win.new_empty(len(self.keep_rows or ()), *rows.win.shape[2:])
        self.kept_win: list[torch.Tensor | None] = [kept_win if empty else None] * layers

    def initial(self, layer: int) -> torch.Tensor:
        return self._state[layer]

    def initial_win(self, layer: int) -> torch.Tensor:
        """A layer's carried rows before the step (B, ...)."""
        return self._win[layer]

    def out_win(self, layer: int) -> torch.Tensor:
        """Where the C road writes a layer's carried rows after the step (fp32): a layer of
        one buffer the step allocates, which commit keeps whole."""
        if self.win_out is None:
            self.win_out = torch.empty_like(self._win, dtype=torch.float32)
        return self.win_out[layer]

    def stage_win(self, layer: int, win: torch.Tensor) -> None:
        self.staged_win[layer] = win

    def stage_kept_win(self, layer: int, wins: torch.Tensor) -> None:
        """The carried rows after the `keep_rows` (one each, (rows, ...))."""
        self.kept_win[layer] = wins

    def wins(self) -> torch.Tensor:
        """The staged carried rows as one tensor (layers, B, ...), as `states`."""
        if any(w is None for w in self.staged_win):
            raise ValueError("a DeltaNet step committed before its carried rows were staged")
        return _joined(self.win_out, self.staged_win, self._win.dtype)

    def kept_wins(self) -> torch.Tensor:
        """The carried rows after the `keep_rows` (layers, keep_rows, ...), as
        `kept_states`."""
        return _kept(self.wsnaps, self.kept_win, self.keep_rows)

    def out_state(self, layer: int) -> torch.Tensor:
        """Where a layer's state after the step may be written (the C road's, fp32): a
        layer of one buffer the step allocates, which commit then keeps whole."""
        if self.out is None:
            spare, self._rows.spare = self._rows.spare, None
            like = self._state
            if (
                spare is not None
                and spare.shape == like.shape
                and spare.dtype == torch.float32
                and spare.is_contiguous()
            ):
                self.out = spare
            else:
                self.out = torch.empty_like(like, dtype=torch.float32)
        return self.out[layer]

    def stage(self, layer: int, state: torch.Tensor) -> None:
        self.staged[layer] = state

    def stage_kept(self, layer: int, states: torch.Tensor) -> None:
        """The states after the `keep_rows` (one each, (rows, nv, dk, dv))."""
        self.kept[layer] = states

    def kept_states(self) -> torch.Tensor:
        """The kept states as one tensor (layers, keep_rows, ...): the fused draft step's
        buffer's rows, else the staged stacked."""
        return _kept(self.snaps, self.kept, self.keep_rows)

    def states(self) -> torch.Tensor:
        """The staged states as one tensor (layers, B, ...): the out buffer where every
        layer wrote into it, else stacked."""
        return _joined(self.out, self.staged, self._state.dtype)


def _joined(out: torch.Tensor | None, staged: list, dtype: torch.dtype) -> torch.Tensor:
    """A step's per-layer tensors as one (layers, ...): its out buffer `out` where every
    layer wrote into it (in `dtype`, the cache's), else the staged stacked."""
    if (
        out is not None
        and out.dtype == dtype
        and all(t is not None and t.data_ptr() == out[i].data_ptr() for i, t in enumerate(staged))
    ):
        return out
    return torch.stack(staged)


def _kept(buf: torch.Tensor | None, kept: list, rows: list[int] | None) -> torch.Tensor:
    """The tensors after a step's kept rows as one (layers, rows, ...): the fused draft
    step's buffer's first rows where it has one, else the staged stacked."""
    if buf is not None:
        return buf[:, : len(rows or ())]
    return torch.stack(kept)


class KernelCall:
    """One recurrent layer of a step (a DeltaStep or a SlotDeltaStep) through its C kernel
    (kvlm_gated_delta, kvlm_mamba2): the states before (`state_in`, None where the step's
    out buffer is that state itself, a pool step's gathered copy), the step's out buffer,
    `out` (the layer's output rows), the sequences' row offsets `cu`, the rows whose state
    is kept (`keep_rows`) and their snapshots' buffer, and for a DeltaNet (`carried`) its
    carried rows before and after (as the states) with each sequence's first position
    `starts` and the kept rows' carried rows; `staged` stages them once it ran."""

    def __init__(self, step: DeltaStep | SlotDeltaStep, slot: int, cu: list[int],
                 out: torch.Tensor, starts: Sequence[int] | None = None) -> None:  # fmt: skip
        self.step, self.slot, self.out, self.sequences = step, slot, out, len(cu) - 1
        self.state, self.state_in = _in_out(step.initial(slot), step.out_state(slot))
        self.offsets = torch.tensor(cu, dtype=torch.int64)
        kept = step.keep_rows
        self.at = torch.tensor(kept, dtype=torch.int64) if kept else None
        self.snaps = None
        if kept:
            self.snaps = self.state.new_empty(len(kept), *self.state.shape[1:])
        self.carried = starts is not None
        if self.carried:  # a DeltaNet's: its carried rows
            self.win, self.win_in = _in_out(step.initial_win(slot), step.out_win(slot))
            self.starts = torch.tensor(starts, dtype=torch.int64)
            self.wsnaps = self.win.new_empty(len(kept or ()), *self.win.shape[1:])

    def args(self) -> tuple:
        """kvlm_gated_delta's: state_in, state, sn, win_in, win, wn2, out, on, cu, cun,
        starts, stn, at, atn, snaps, pn, wsnaps, pwn, S; kvlm_mamba2's: state_in, state,
        sn, out, on, cu, cun, at, atn, snaps, pn, S."""
        at, snaps, state = self.at, self.snaps, self.state
        kept = (None if at is None else at.data_ptr(), 0 if at is None else at.numel(),
                None if snaps is None else snaps.data_ptr(),
                0 if snaps is None else snaps.numel())  # fmt: skip
        head = (_ptr(self.state_in), state.data_ptr(), state.numel())
        if not self.carried:
            return (*head, self.out.data_ptr(), self.out.numel(), self.offsets.data_ptr(),
                    self.offsets.numel(), *kept, self.sequences)  # fmt: skip
        win, ws = self.win, self.wsnaps
        return (*head, _ptr(self.win_in), win.data_ptr(), win.numel(), self.out.data_ptr(),
                self.out.numel(), self.offsets.data_ptr(), self.offsets.numel(),
                self.starts.data_ptr(), self.starts.numel(), *kept,
                ws.data_ptr() if at is not None else None, ws.numel(),
                self.sequences)  # fmt: skip

    def staged(self, rc: int, refused: Callable[[], str]) -> torch.Tensor:
        """The layer's output, its states staged; ValueError(`refused()`, the call's shapes
        in words) where the kernel refused the call (rc != 0)."""
        if rc != 0:
            raise ValueError(refused())
        self.step.stage(self.slot, self.state)
        if self.snaps is not None:
            self.step.stage_kept(self.slot, self.snaps)
        if self.carried:
            self.step.stage_win(self.slot, self.win)
            if self.at is not None:
                self.step.stage_kept_win(self.slot, self.wsnaps)
        return self.out


def _in_out(initial: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A kernel's buffer written in a step (`out`) and what it reads first: None where out
    is `initial` itself (updated in place), else `initial` as contiguous fp32."""
    if out.data_ptr() == initial.data_ptr():
        return out, None
    return out, initial.to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32_over(gathered: torch.Tensor) -> torch.Tensor:
    """Where the C road writes a pool step's tensor of a layer: over its gathered copy
    (the step's own), or a buffer of its shape where that is not fp32 (an fp64 pool)."""
    if gathered.dtype == torch.float32:
        return gathered
    return torch.empty_like(gathered, dtype=torch.float32)


class _StateCacheStep(CacheStep):
    """A StateCache's step: no K/V (a DeltaNet layer attends to nothing); `recurrent` its
    DeltaStep."""

    def __init__(self, cache: StateCache, n_new: int, draft: bool) -> None:
        super().__init__(cache.num_tokens, n_new, cache.batch, cache.spec.device, None, False)
        self.recurrent = cache.rows.begin(n_new, draft)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        raise RuntimeError("a DeltaNet layer has no K/V")  # a bug, not a user error


class StateCache(KVCache):
    """The state of a group of DeltaNet layers (`spec.num_layers` of them, kind `kind`) for
    `spec.batch` sequences: a part of a HybridCache, any mode but off."""

    mode = "state"

    def __init__(self, spec: CacheSpec, kind: RecurrentState) -> None:
        super().__init__(spec)
        self.kind = kind
        self.depth = 0  # hold_rollback's: every DeltaRows this cache makes keeps it
        self.rows = self._new_rows(spec.batch)

    def _new_rows(self, batch: int) -> DeltaRows:
        dtype = state_dtype(self.spec.kv_dtypes[0])
        return DeltaRows(self.kind, self.spec.num_layers, batch, dtype, self.spec.device,
                         self.depth)  # fmt: skip

    @property
    def capacity(self) -> int:
        return sys.maxsize  # a state a sequence: any length

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return _StateCacheStep(self, n_new, draft)

    def _commit(self, step: CacheStep) -> None:
        self.rows.commit(step.recurrent)  # type: ignore[arg-type]

    def hold_rollback(self, n: int) -> None:
        self.depth = self.rows.depth = n

    def checkpoint(self, position: int) -> None:
        self.rows.checkpoint(position)

    def rollback_point(self, keep: int) -> int:
        return self.rows.rollback_point(min(keep, self._length))

    def _check_rollback(self, n: int) -> None:
        if 0 < n < self._length and not self.rows.can_roll_back(n):  # all of them: a reset
            raise InvalidRequestError(f"{NO_ROLLBACK}: {n} of {self._length} tokens back is "
                                      "past the states kept")  # fmt: skip

    def _truncate(self, length: int) -> None:
        if length == 0:
            self.rows = self._new_rows(self.batch)
        else:
            self.rows.rollback(self.rows.length - length)

    def _fork(self, n: int) -> None:
        self.rows.fork(n)

    def kv_views(self, rows: Sequence[int], step: CacheStep | None = None) -> list[StateView]:
        """The state as one view (the fused step's): token i through sequence rows[i], its
        out buffer `step`'s (written_in_place staged it; None without a step)."""
        r, seqs = self.rows, list(rows)
        d: DeltaStep | None = None if step is None else step.recurrent  # type: ignore[attr-defined]
        conv = ConvView(r.conv.rows, seqs, [r.conv.end] * len(seqs))
        win = r.win if r.win.numel() else None  # a DeltaNet's carried rows (a Mamba2: none)
        if d is None:
            return [StateView(conv, r.state, win=win)]
        return [StateView(conv, r.state, d.out, None, d.snaps, d.urows, win, d.win_out,
                          d.wsnaps)]  # fmt: skip

    def written_in_place(self, step: CacheStep) -> None:
        """The fused step reads the states before the step, writes every layer's after into
        the step's out buffer (staged here: commit keeps it) and moves the conv rows on
        itself (commit then only records the positions). A draft's: the state after each
        row but the last into a buffer staged as the kept ones, each row's u into another,
        the rows before it copied off (commit builds each row's window from them)."""
        recurrent: DeltaStep = step.recurrent  # type: ignore[attr-defined]
        self.rows.own_rows()
        recurrent.conv.in_place = True
        carried = self.rows.win.numel() > 0
        for layer in range(len(recurrent.staged)):
            recurrent.stage(layer, recurrent.out_state(layer))
            if carried:
                recurrent.stage_win(layer, recurrent.out_win(layer))
        if recurrent.draft:
            rows, n = self.rows.conv.rows, recurrent.n_new
            recurrent.before = rows.clone()
            recurrent.snaps, wsnaps = self.rows.draft_buffers(n - 1)
            if carried:
                recurrent.wsnaps = wsnaps
            recurrent.urows = rows.new_empty(rows.shape[0], n, rows.shape[3])
            for layer, kept in enumerate(recurrent.snaps):
                recurrent.stage_kept(layer, kept[: n - 1])
                if carried:
                    recurrent.stage_kept_win(layer, wsnaps[layer, : n - 1])

    def _release(self) -> None:  # back to the spec's batch
        self.rows = self._new_rows(self.spec.batch)

    def _export(self) -> dict[str, torch.Tensor]:
        """`conv` (layers, B, L - 1, conv_width), `state` (layers, B, nv, dk, dv), and
        the checkpoints (state_layout): a conversation's turn starts, which its next turn
        goes back to."""
        rows = self.rows
        marks = sorted(rows.marks.items())
        shapes = state_layout(self.kind, self.spec.num_layers, self.batch, 0)
        empty = {k: rows.state.new_empty(v) for k, v in shapes.items()}
        out = {
            "conv": rows.conv.rows,
            "state": rows.state,
            "mark_pos": torch.tensor([p for p, _ in marks], dtype=torch.int64),
            "mark_state": torch.stack([t[0] for _, t in marks]) if marks else empty["mark_state"],
            "mark_conv": torch.stack([t[1] for _, t in marks]) if marks else empty["mark_conv"],
        }
        if "win" in shapes:
            out["win"] = rows.win
            out["mark_win"] = torch.stack([t[2] for _, t in marks]) if marks else empty["mark_win"]
        return out

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        rows = self._new_rows(self.batch)
        dtype, device = rows.state.dtype, self.spec.device
        rows.conv.rows = tensors["conv"].to(dtype=dtype, device=device, copy=True).contiguous()
        rows.conv.end = rows.conv.length = length
        rows.conv.first = length - rows.conv.keep
        rows.state = tensors["state"].to(dtype=dtype, device=device, copy=True)
        if "win" in tensors:  # a DeltaNet's carried rows (a Mamba2 carries none)
            rows.win = tensors["win"].to(dtype=dtype, device=device, copy=True).contiguous()
        none = [rows.win.new_empty(rows.win.shape)] * len(tensors["mark_pos"])  # (empty)
        win = tensors.get("mark_win", none)
        rows.kept = {length: (rows.state, rows.conv.rows, rows.win)}
        marks = zip(tensors["mark_pos"].tolist(), tensors["mark_state"], tensors["mark_conv"],
                    win, strict=True)  # fmt: skip
        rows.marks = {int(p): (st.to(dtype=dtype, device=device, copy=True),
                               cv.to(dtype=dtype, device=device, copy=True).contiguous(),
                               wn.to(dtype=dtype, device=device, copy=True).contiguous())
                      for p, st, cv, wn in marks}  # fmt: skip
        self.rows = rows

    @property
    def nbytes(self) -> int:
        """The rows, the state and the states kept for a rollback (drafts', checkpoints')."""
        rows = self.rows
        pairs = (*rows.kept.values(), *rows.marks.values())
        held = [rows.state, rows.conv.rows, rows.win, *(t for pair in pairs for t in pair)]
        return sum({t.data_ptr(): t.nbytes for t in held}.values())

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        raise TypeError("a state part's plan is its kind's: LayerGroup.sequence_bytes")


@dataclass(slots=True)
class Drafted:
    """What a slot keeps of its last step's draft (a sequence's n rows from `start`) for a
    rollback to one of its rows: `states` (layers, n - 1, nv, dk, dv) the state after each
    row but the last, `conv` (layers, L - 1 + n, conv_width) the rows of positions
    start - (L - 1) .. start + n - 1, `snaps` (position, block) the block-end snapshots
    the step took (forgotten where a rollback goes back before their end)."""

    start: int
    states: torch.Tensor
    conv: torch.Tensor
    snaps: list[tuple[int, int]]
    wins: torch.Tensor  # (layers, n - 1, ...) the carried rows after each row but the last


class StateSlots(Slots):
    """The engine pool's DeltaNet group (kvlm.cache.paged.BlockPool.groups): `slots` slots
    of state, one a sequence (kvlm.cache.slots.Slots), each every DeltaNet layer's
    recurrent state and its convolution's last L - 1 input rows, in kinds.state_dtype:

        state: (layers, slots, value_heads, key_dim, value_dim)
        conv:  (layers, slots, L - 1, conv_width)    positions end - L + 1 .. end - 1

    zeroed when a slot is taken (the state before any token; rows before position 0 read
    as zeros), `end[slot]` the tokens it holds. A state cannot forget tokens: a step must
    start where its slot ends (`SlotDeltaStep`); a trim to fewer tokens than it holds (a
    rejected draft's rows) goes back to the state its last step kept at that row
    (`drafted`), and one further back but 0 is refused.

    Prefix hits (a pool with a prefix cache: `snapshots` > 0): snapshots of the state and
    rows at group 0's block ends, the same two tensors with `snapshots` entries. A step
    takes one at the last block end each sequence passes, for the block ending there
    (`snap_of`; `mark` at seal records the prefix id it was registered under); a hit at p
    restores a slot from the snapshot of the block ending at p (`restore`). A sequence
    holds at most two while it runs, one a role: its prompt's (taken by a step of more
    than one of its tokens: a prompt's last full block) and its answer's (a decode row's:
    each block the answer fills replaces the one before), so a chat's next turn hits at
    the end of the answer's last full block and a regenerated answer at the prompt's;
    once it finishes they are the least recently used's to reuse. A prompt also leaves
    one every `every` tokens it passes (SNAPSHOT_EVERY; role None, held by none), so a
    prompt sharing only its first part hits within it. `snapshots` of them in all (the
    engine's pool: as many as its share of the KV memory holds, kvlm.engine.engine.
    snapshot_plan); a step that finds every one held by a running sequence takes none
    (fewer hits, never a wrong state); one goes with its block when the block is handed
    out again (`forget`)."""

    step_attr = "recurrent"
    what = "DeltaNet states"
    every_end = False  # snapshots at some block ends (a tier asked for each of a hit's)

    def __init__(
        self, spec: CacheSpec, group: LayerGroup, slots: int, block_size: int, snapshots: int = 0
    ) -> None:
        kind = group.kind
        if not isinstance(kind, RecurrentState):
            raise TypeError(f"StateSlots keeps a DeltaNet group, not {kind!r}")
        super().__init__(group, slots, block_size)
        layers = len(group.layers)
        dtype, dev = state_dtype(spec.kv_dtypes[0]), spec.device
        state = kind.state_shape
        rows = (kind.conv_kernel - 1, kind.conv_width)
        self.state = torch.zeros(layers, slots, *state, dtype=dtype, device=dev)
        self.conv = torch.zeros(layers, slots, *rows, dtype=dtype, device=dev)
        self.win = torch.zeros(layers, slots, *kind.window_shape, dtype=dtype, device=dev)
        self.end = [0] * slots
        self.drafted: dict[int, Drafted] = {}  # slot -> its last step's draft, kept
        self.turn_end: dict[int, int] = {}  # slot -> the last block end of its prompt's turn
        # a prompt's shared snapshots: every this many tokens (a multiple of the block size)
        self.every = max(1, SNAPSHOT_EVERY // block_size) * block_size
        # a fused step's drafts between `view` and `written`: each draft's slot's rows
        # before the step, the step's snaps and urows
        self._before: dict[int, torch.Tensor] = {}
        self._drafts: tuple[torch.Tensor | None, ...] = (None, None, None)
        self.draft_bufs, self.win_bufs = DraftBuffers(), DraftBuffers()
        self.snap_state = torch.zeros(layers, snapshots, *state, dtype=dtype, device=dev)
        self.snap_conv = torch.zeros(layers, snapshots, *rows, dtype=dtype, device=dev)
        # a snapshot's carried rows: only where a block end carries some (a block size not
        # a multiple of the rule's chunk); else none, the state at a block end is whole
        self.snap_carries = kind.carries_at(block_size)
        self.snap_win = torch.zeros(layers, snapshots if self.snap_carries else 0,
                                    *kind.window_shape, dtype=dtype, device=dev)  # fmt: skip
        self.snap_of: dict[int, int] = {}  # group 0's block -> the snapshot at its end
        self.snap_id: dict[int, int] = {}  # ... -> the prefix id it held when marked
        self.snap_block = [-1] * snapshots  # snapshot -> its block (-1: none)
        self.snap_owner = [-1] * snapshots  # snapshot -> the slot holding it (-1: none)
        self.held: list[dict[str, int]] = [{} for _ in range(slots)]  # slot: role -> snapshot
        # least recently taken or restored first
        self.snap_order: OrderedDict[int, None] = OrderedDict.fromkeys(range(snapshots))

    @property
    def keep(self) -> int:
        return 0  # no positions: the state

    @property
    def block_nbytes(self) -> int:
        """A slot's bytes (the group's sequence_bytes)."""
        return (self.state.nbytes + self.conv.nbytes + self.win.nbytes) // self.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.state, self.conv, self.win, self.snap_state,
                                      self.snap_conv, self.snap_win))  # fmt: skip

    def commit_memory(self) -> None:
        for t in (self.state, self.conv, self.win, self.snap_state, self.snap_conv,
                  self.snap_win):  # fmt: skip
            t.zero_()

    def _reset(self, slot: int) -> None:
        self.state[:, slot].zero_()
        self.conv[:, slot].zero_()
        self.win[:, slot].zero_()
        self.end[slot] = 0
        self.drafted.pop(slot, None)
        self.turn_end.pop(slot, None)

    def turn(self, slot: int, position: int) -> None:
        """A chat prompt's generation prompt begins at `position`: its prompt snapshot is
        taken at the last block end at most it, not at the prompt's last full block (the
        next turn renders this reply after the generation prompt's opening, which it may
        drop: a snapshot past that point is one no next turn can use)."""
        self.turn_end[slot] = position // self.block_size * self.block_size

    def _copy(self, src: int, dst: int) -> None:
        self.state[:, dst] = self.state[:, src]
        self.conv[:, dst] = self.conv[:, src]
        self.win[:, dst] = self.win[:, src]
        self.end[dst] = self.end[src]
        self.drafted.pop(dst, None)

    def release(self, slot: int) -> None:
        """The slot goes back; the snapshots it took stay, held by no sequence."""
        for idx in self.held[slot].values():
            self.snap_owner[idx] = -1
        self.held[slot] = {}
        self.drafted.pop(slot, None)
        self.turn_end.pop(slot, None)
        super().release(slot)

    def trim(self, table: list[int], num_tokens: int) -> None:
        """To 0: the slot goes back; to a row of its last step's draft: the state kept
        there (a rejected draft's rows); further back: refused (a bug: the engine rolls
        back no more than a draft)."""
        if table and 0 < num_tokens < self.end[table[0]]:
            slot, r = table[0], self.conv.shape[2]
            d = self.drafted.pop(slot, None)
            if d is None or num_tokens <= d.start:
                raise RuntimeError(f"{NO_ROLLBACK}: slot {slot} holds {self.end[slot]} "
                                   f"tokens, trimmed to {num_tokens}")  # fmt: skip
            i = num_tokens - d.start  # the draft's rows kept
            self.state[:, slot] = d.states[:, i - 1]
            self.win[:, slot] = d.wins[:, i - 1]
            self.conv[:, slot] = d.conv[:, i : i + r]
            self.end[slot] = num_tokens
            for position, block in d.snaps:
                if position > num_tokens:  # taken after a rejected row
                    self.forget(block)
        super().trim(table, num_tokens)

    def snapshots_at(
        self, slot: int, start: int, n: int, draft: bool
    ) -> list[tuple[int, str | None]]:
        """The snapshots a step of n tokens of `slot` from `start` takes, (position, role):
        the last block end it passes (its prompt's, a chat prompt's at its turn start at
        most: `turn`; a decode row's or a draft's: its answer's), and a prompt's every
        `every` tokens it passes (role None, at most 8). None without a prefix cache."""
        if not self.holds_ends:
            return []
        b = (start + n) // self.block_size * self.block_size  # the last block end passed
        role = "prompt" if n > 1 and not draft else "answer"
        if role == "prompt" and slot in self.turn_end:  # a chat's: at its turn's start
            b = min(b, self.turn_end[slot])
        out: list[tuple[int, str | None]] = [(b, role)] if b > start else []
        if role == "prompt":  # and every `every` tokens it passes
            ends = range((start // self.every + 1) * self.every, start + n + 1, self.every)
            out += [(e, None) for e in [e for e in ends if e != b][-8:]]
        return out

    def check_start(self, slot: int, start: int) -> None:
        """CacheOverflowError unless a step of `slot` at `start` starts where it ends."""
        if start != self.end[slot]:
            raise CacheOverflowError(
                f"the DeltaNet state of slot {slot} holds {self.end[slot]} tokens; a step at "
                f"{start} cannot start there ({NO_ROLLBACK}: the sequence must be recomputed)"
            )

    # ------------------------------------------------------------------ the fused step

    def view(self, pieces: Sequence[Piece]) -> StateView | None:
        """The slots as the fused step reads and writes them (kvlm.model.fused;
        BlockPool.views): row i through pieces[i]'s slot (a piece a row), the states updated
        in place (the view's out is its state: no copy a step, each sequence's 18-55 MiB at
        1-2B; the C step refuses a bad step before it writes any) and the conv rows
        (ConvRows' layout, a slot a sequence) moved on in place. A sequence of several rows
        (a draft's): the state after each but its last into the view's snaps and every
        row's u into its urows, its slot's rows before the step copied off (`written` keeps
        them as the draft's, for a rollback to one of its rows). None where a piece is more
        than one row (a prompt's: the torch step's)."""
        if any(n != 1 for _, _, n, _ in pieces):
            return None
        seqs = sequences(pieces)
        for slot, start, _, _ in seqs:
            self.check_start(slot, start)
        slots = [p[0] for p in pieces]
        conv = ConvView(self.conv, slots, [self.end[s] for s in slots], self.group.layers)
        self._before = {slot: self.conv[:, slot].clone() for slot, _, n, _ in seqs if n > 1}
        snaps = urows = wsnaps = None
        if self._before:  # the drafts' buffers (a step's few rows: at most MAX_ROWS)
            held = [t for d in self.drafted.values() for t in (d.states, d.wins)]
            drafts = len(pieces) - len(seqs)
            snaps = self.draft_bufs.get(self.state, drafts, held)
            wsnaps = self.win_bufs.get(self.win, drafts, held)
            urows = self.conv.new_empty(self.conv.shape[0], len(pieces), self.conv.shape[3])
        self._drafts = (snaps, urows, wsnaps)
        out = self.state if pieces else None
        carried = self.win.numel() > 0
        win = self.win if carried else None
        return StateView(conv, self.state, out, self.group.layers, snaps, urows, win,
                         win if pieces else None, wsnaps if carried else None)  # fmt: skip

    def written(self, pieces: Sequence[Piece]) -> None:
        """After the fused step ran `pieces` through `view` (their states and conv rows
        moved on in place): each sequence's end, the snapshot of a block end its rows
        reached (snapshots_at: the state after that row, a draft row's from the view's
        snaps) and each draft's states and rows (`drafted`), as SlotDeltaStep.commit keeps
        them."""
        bs, r = self.block_size, self.conv.shape[2]
        snaps, urows, wsnaps = self._drafts
        row = kept = 0  # the sequence's first row of the step; its first of snaps
        for (slot, start, n, table), count in joined(pieces):
            self.drafted.pop(slot, None)  # the last step's draft: past
            draft = count > 1
            # the rows of positions start - (L - 1) .. start + n - 1, a draft's
            rows = torch.cat([self._before[slot], urows[:, row : row + n]], 1) if draft else None  # type: ignore[index]
            taken = []
            for e, role in self.snapshots_at(slot, start, n, draft):
                idx = self.take(table[e // bs - 1], slot, role)
                if idx is None:
                    continue
                taken.append((e, table[e // bs - 1]))
                if e == start + n:  # after its last row: the slot's state
                    self.snap_state[:, idx] = self.state[:, slot]
                    self.snap_conv[:, idx] = self.conv[:, slot]
                    if self.snap_carries:
                        self.snap_win[:, idx] = self.win[:, slot]
                else:  # after a draft row's
                    self.snap_state[:, idx] = snaps[:, kept + e - start - 1]  # type: ignore[index]
                    self.snap_conv[:, idx] = rows[:, e - start : e - start + r]  # type: ignore[index]
                    if self.snap_carries:
                        self.snap_win[:, idx] = wsnaps[:, kept + e - start - 1]  # type: ignore[index]
            if draft:
                states = snaps[:, kept : kept + n - 1]  # type: ignore[index]
                wins = wsnaps[:, kept : kept + n - 1]  # type: ignore[index]
                self.drafted[slot] = Drafted(start, states, rows, taken, wins)  # type: ignore[arg-type]
                kept += n - 1
            self.end[slot] = start + n
            row += n
        self._before, self._drafts = {}, (None, None, None)

    def step(self, pieces: Sequence[Piece]) -> SlotDeltaStep:
        """The DeltaNet state of a pool step whose tokens, flattened, are `pieces`."""
        return SlotDeltaStep(self, pieces)

    # ------------------------------------------------------------------ prefix hits

    @property
    def holds_ends(self) -> bool:
        return self.snap_state.shape[1] > 0

    @property
    def blocks_with_rows(self) -> int:
        """Group 0 blocks whose end state is held (marked: registered)."""
        return len(self.snap_id)

    @property
    def block_rows_nbytes(self) -> int:
        """One snapshot's bytes (every DeltaNet layer's state and rows)."""
        n = self.snap_state.shape[1]
        both = self.snap_state.nbytes + self.snap_conv.nbytes + self.snap_win.nbytes
        return both // n if n else 0

    def has_rows(self, block: int, prefix_id: int) -> bool:
        return prefix_id != 0 and block in self.snap_of and self.snap_id.get(block) == prefix_id

    @property
    def record_parts(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """A snapshot as a tier record's parts: "state" (layers, nv, dk, dv) and "conv"
        (layers, L - 1, conv_width), in the state's dtype."""
        s, c, w = self.snap_state, self.snap_conv, self.snap_win
        parts = {"state": ((s.shape[0], *s.shape[2:]), s.dtype),
                 "conv": ((c.shape[0], *c.shape[2:]), c.dtype)}  # fmt: skip
        if self.snap_carries:  # a block end's carried rows (a block size off the chunk)
            parts["win"] = ((w.shape[0], *w.shape[2:]), w.dtype)
        return parts

    def block_rows(self, block: int) -> dict[str, torch.Tensor]:
        """The snapshot at group 0's `block`'s end as a tier record's parts."""
        idx = self.snap_of[block]
        parts = {"state": self.snap_state[:, idx], "conv": self.snap_conv[:, idx]}
        if self.snap_carries:
            parts["win"] = self.snap_win[:, idx]
        return parts

    def put_block_rows(self, block: int, parts: dict[str, torch.Tensor], prefix_id: int) -> bool:
        """A tier record's state for group 0's `block` (registered under `prefix_id`), in
        the least recently used snapshot no running sequence holds; False when every one
        is held (the hit goes without it)."""
        idx = self.take(block, None, None)  # the block's own, or the LRU unheld one
        if idx is None:
            return False
        dev = self.snap_state.device
        self.snap_state[:, idx] = parts["state"].to(dev)
        self.snap_conv[:, idx] = parts["conv"].to(dev)
        if self.snap_carries:
            self.snap_win[:, idx] = parts["win"].to(dev)
        self.snap_id[block] = prefix_id
        return True

    def take(self, block: int, slot: int | None, role: str | None) -> int | None:
        """The snapshot that will hold the state at `block`'s end, taken by `slot` in
        `role` ("prompt" or "answer"): the block's own if it has one, else the one the slot
        holds in that role (superseded), else the least recently used no slot holds (its
        block's let go). `role` None: held by no slot (one a prompt leaves every
        SNAPSHOT_EVERY tokens, a tier's record); None where every snapshot is held."""
        idx = self.snap_of.get(block)
        if idx is None:
            idx = self.held[slot].get(role) if role and slot is not None else None
            if idx is None:
                idx = next((i for i in self.snap_order if self.snap_owner[i] < 0), None)
                if idx is None:  # every one held: this end goes without
                    return None
            self.forget(self.snap_block[idx])
            self.snap_of[block], self.snap_block[idx] = idx, block
        if role is None:
            self.snap_id.pop(block, None)  # written anew: marked again at its seal
            self.snap_order.move_to_end(idx)
            return idx
        if self.snap_owner[idx] >= 0 and self.snap_owner[idx] != slot:
            held = self.held[self.snap_owner[idx]]
            for r in [r for r, i in held.items() if i == idx]:
                del held[r]
        old = self.held[slot].get(role)
        if old is not None and old != idx:
            self.forget(self.snap_block[old])  # superseded by this one
        self.held[slot][role], self.snap_owner[idx] = idx, slot
        self.snap_id.pop(block, None)  # written anew: marked again at its seal
        self.snap_order.move_to_end(idx)
        return idx

    def mark(self, block: int, prefix_id: int, holder: int | None = None) -> None:
        """`block` was sealed under `prefix_id` with its end state taken by the steps that
        computed it. `holder`: the block the prefix cache finds for that prefix, where it
        is another (the same prefix computed twice) and has none: the snapshot goes to it."""
        if not prefix_id or block not in self.snap_of:
            return
        self.snap_id[block] = prefix_id
        if holder is not None and holder != block and not self.has_rows(holder, prefix_id):
            self.forget(holder)
            idx = self.snap_of.pop(block)
            del self.snap_id[block]
            self.snap_of[holder], self.snap_id[holder], self.snap_block[idx] = (
                idx,
                prefix_id,
                holder,
            )

    def forget(self, block: int) -> None:
        """Group 0's `block` is handed out again (or its snapshot superseded): its snapshot
        is free, reused first."""
        idx = self.snap_of.pop(block, None)
        self.snap_id.pop(block, None)
        if idx is not None:
            self.snap_block[idx] = -1
            owner, self.snap_owner[idx] = self.snap_owner[idx], -1
            if owner >= 0:
                held = self.held[owner]
                for r in [r for r, i in held.items() if i == idx]:
                    del held[r]
            self.snap_order.move_to_end(idx, last=False)

    def restore(self, slot: int, block: int, position: int) -> None:
        """A prefix hit at `position` (group 0's `block` the last of it): the slot's state
        and rows are the snapshot at that block's end."""
        idx = self.snap_of[block]
        self.state[:, slot] = self.snap_state[:, idx]
        self.conv[:, slot] = self.snap_conv[:, idx]
        if self.snap_carries:
            self.win[:, slot] = self.snap_win[:, idx]
        else:  # a block end the rule's chunk ends at too: no rows carried
            self.win[:, slot].zero_()
        self.end[slot] = position
        self.snap_order.move_to_end(idx)


class SlotDeltaStep:
    """A pool step's DeltaNet state (StateSlots), what GatedDeltaNet reads as it reads a
    DeltaStep: its sequences (the pieces joined, `sequences`) in the order the step's
    tokens are flattened, `cu` their row offsets, `conv.taps` each token's taps over its
    slot's rows and the step's, `initial(layer)` the sequences' states (S, nv, dk, dv),
    `stage(layer, state)` them after; `commit()` writes them and each slot's last L - 1
    rows back once the forward has succeeded. A sequence's piece must start where its
    slot ends (CacheOverflowError otherwise: its state is of another length). `keep_rows`:
    the rows after which the state is kept too (`stage_kept`): the last block end a
    sequence passes (a snapshot, for prefix hits) and each row but the last of a draft (a
    sequence of several pieces: its draft rows), which its slot keeps with their conv rows
    until its next step (`StateSlots.drafted`: a rollback to a rejected draft's row)."""

    def __init__(self, slots: StateSlots, pieces: Sequence[Piece]) -> None:
        both = joined(pieces)
        self.seqs, counts = [seq for seq, _ in both], [count for _, count in both]
        self.slots = slots
        self.start = pieces[0][1] if pieces else 0  # the first row's (Transformer checks it)
        r, bs = slots.conv.shape[2], slots.block_size
        cu, taps, kept, offset = [0], [], [], len(self.seqs) * r
        points: set[int] = set()
        self._snaps = []  # (row, s, block, slot, role, position): the snapshots it takes
        self._drafts = []  # (slot, start, n, buf rows): each draft's states and rows kept
        for s, (slot, start, n, table) in enumerate(self.seqs):
            slots.check_start(slot, start)

            def at(q: torch.Tensor, s=s, offset=offset) -> torch.Tensor:
                """buf's rows of the sequence's relative positions q (q >= -(L - 1))."""
                return torch.where(q >= 0, offset + q, s * r + r + q)

            rel = torch.arange(n)
            taps.append(torch.stack([at(rel - r + k) for k in range(r + 1)]))
            kept.append(at(torch.arange(n - r, n)))
            draft = counts[s] > 1
            for e, role in slots.snapshots_at(slot, start, n, draft):
                row = cu[-1] + e - start - 1
                points.add(row)
                self._snaps.append((row, s, table[e // bs - 1], slot, role, e))
            if draft:
                points.update(range(cu[-1], cu[-1] + n - 1))
                self._drafts.append((s, slot, start, n, at(torch.arange(-r, n))))
            cu.append(cu[-1] + n)
            offset += n
        dev = slots.conv.device
        self.cu = cu
        self._slots = torch.tensor([seq[0] for seq in self.seqs], dtype=torch.long, device=dev)
        self._taps = torch.cat(taps, dim=1).to(dev)  # (L, N)
        # the rows commit reads of each layer's buffer, gathered at `taps` (the rest let go
        # there: a prompt chunk's whole buffer would live to commit, every layer's): each
        # sequence's last L - 1, each snapshot's L - 1 before its row, each draft's all
        windows = [self._rows_before(s, row - cu[s] + 1) for row, s, *_ in self._snaps]
        drafts = [rows for *_, rows in self._drafts]
        need = [torch.cat(kept), *windows, *drafts]
        starts = [0]
        for part in need:
            starts.append(starts[-1] + len(part))
        self._need = torch.cat(need).to(dev)
        self._snap_rows = starts[1 : 1 + len(windows)]  # snapshot j's r rows from here
        self._draft_rows = starts[1 + len(windows) : -1]  # draft d's r + n rows from here
        self.conv = self  # the model reads `step.conv.taps`
        self.draft = False  # the pieces say which rows are one sequence
        layers = slots.state.shape[0]
        self.starts = [start for _, start, _, _ in self.seqs]  # each sequence's first position
        self._initial: list[torch.Tensor | None] = [None] * layers
        self._initial_win: list[torch.Tensor | None] = [None] * layers
        self._bufs: list[torch.Tensor | None] = [None] * layers
        self.staged: list[torch.Tensor | None] = [None] * layers
        self.keep_rows = sorted(points) or None
        self._index = {row: i for i, row in enumerate(self.keep_rows or [])}
        self.kept: list[torch.Tensor | None] = [None] * layers
        # the carried rows after the step and after each kept row (none to carry: a
        # Mamba2's, its window empty, staged as gathered)
        empty = slots.win.numel() == 0
        none = slots.win.new_empty(len(self.seqs), *slots.win.shape[2:])
        kept_none = slots.win.new_empty(len(self.keep_rows or ()), *slots.win.shape[2:])
        self.staged_win: list[torch.Tensor | None] = [none if empty else None] * layers
        self.kept_win: list[torch.Tensor | None] = [kept_none if empty else None] * layers

    def taps(self, layer: int, u: torch.Tensor) -> Taps:
        """u (B, T, C) (the step's tokens, flattened in the pieces' order): what its
        convolution's taps read (ConvStep.taps), the rows staged."""
        before = self.slots.conv[layer].index_select(0, self._slots)  # (S, L - 1, C)
        buf = torch.cat([before.flatten(0, 1).to(u.dtype), u.reshape(-1, u.shape[-1])])
        self._bufs[layer] = buf.index_select(0, self._need)  # what commit reads
        return Taps(buf, self._taps, tuple(u.shape))

    def initial(self, layer: int) -> torch.Tensor:
        if self._initial[layer] is None:  # the sequences' states gathered: the step's copy
            self._initial[layer] = self.slots.state[layer].index_select(0, self._slots)
        return self._initial[layer]  # type: ignore[return-value]

    def initial_win(self, layer: int) -> torch.Tensor:
        if self._initial_win[layer] is None:  # the sequences' carried rows gathered
            self._initial_win[layer] = self.slots.win[layer].index_select(0, self._slots)
        return self._initial_win[layer]  # type: ignore[return-value]

    def out_win(self, layer: int) -> torch.Tensor:
        """Where the C road writes a layer's carried rows after the step: over the gathered
        copy, as out_state."""
        return _fp32_over(self.initial_win(layer))

    def stage_win(self, layer: int, win: torch.Tensor) -> None:
        self.staged_win[layer] = win

    def stage_kept_win(self, layer: int, wins: torch.Tensor) -> None:
        self.kept_win[layer] = wins

    def out_state(self, layer: int) -> torch.Tensor:
        """Where the C road writes a layer's states after the step: over the gathered copy
        (the slots' own stay as they were until commit)."""
        return _fp32_over(self.initial(layer))

    def stage(self, layer: int, state: torch.Tensor) -> None:
        self.staged[layer] = state

    def stage_kept(self, layer: int, states: torch.Tensor) -> None:
        """The states after the `keep_rows` (one each, (rows, nv, dk, dv))."""
        self.kept[layer] = states

    def commit(self) -> None:
        """Keep the step's states and each sequence's last L - 1 rows in their slots, the
        snapshots at the block ends the step passed, and each draft's states and rows."""
        if any(t is None for t in (*self.staged, *self._bufs, *self.staged_win)):
            raise ValueError("a DeltaNet step committed before every DeltaNet layer ran")
        if self.keep_rows and any(t is None for t in (*self.kept, *self.kept_win)):
            raise ValueError("a DeltaNet step committed before its kept states were staged")
        slots, r = self.slots, self.slots.conv.shape[2]
        for slot, _, _, _ in self.seqs:
            slots.drafted.pop(slot, None)  # the last step's draft: past
        self._commit_snapshots()
        for (s, slot, start, n, _), o in zip(self._drafts, self._draft_rows, strict=True):
            first = self._index[self.cu[s]]
            states = torch.stack([t[first : first + n - 1] for t in self.kept])  # type: ignore[index]
            wins = torch.stack([t[first : first + n - 1] for t in self.kept_win])  # type: ignore[index]
            conv = torch.stack([b[o : o + r + n] for b in self._bufs])  # type: ignore[index]
            snaps = [(pos, block) for _, q, block, _, _, pos in self._snaps if q == s]
            slots.drafted[slot] = Drafted(start, states, conv.to(slots.conv.dtype), snaps,
                                          wins.to(slots.win.dtype))  # fmt: skip
        for layer, (state, buf) in enumerate(zip(self.staged, self._bufs, strict=True)):
            slots.state[layer].index_copy_(0, self._slots, state.to(slots.state.dtype))  # type: ignore[union-attr]
            win = self.staged_win[layer]
            slots.win[layer].index_copy_(0, self._slots, win.to(slots.win.dtype))  # type: ignore[union-attr]
            rows = buf[: len(self.seqs) * r].view(len(self.seqs), r, -1)  # type: ignore[index]
            slots.conv[layer].index_copy_(0, self._slots, rows.to(slots.conv.dtype))
        for slot, start, n, _ in self.seqs:
            slots.end[slot] = start + n

    def _commit_snapshots(self) -> None:
        slots, r = self.slots, self.slots.conv.shape[2]
        for (row, _, block, slot, role, _), o in zip(self._snaps, self._snap_rows, strict=True):
            idx, i = slots.take(block, slot, role), self._index[row]
            if idx is None:
                continue
            for layer, (kept, buf) in enumerate(zip(self.kept, self._bufs, strict=True)):
                slots.snap_state[layer, idx] = kept[i]  # type: ignore[index]
                slots.snap_conv[layer, idx] = buf[o : o + r]  # type: ignore[index]
                if slots.snap_carries:
                    slots.snap_win[layer, idx] = self.kept_win[layer][i]  # type: ignore[index]

    def _rows_before(self, s: int, local: int) -> torch.Tensor:
        """The buffer's rows (as `taps` builds it, before the gather) of sequence s's last
        L - 1 positions before its relative `local`."""
        r = self.slots.conv.shape[2]
        offset = len(self.seqs) * r + self.cu[s]
        q = torch.arange(local - r, local)
        return torch.where(q >= 0, offset + q, s * r + r + q)
