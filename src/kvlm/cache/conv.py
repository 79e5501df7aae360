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

The engine's pool keeps the conv group as `ConvSlots` (one of kvlm.cache.paged.BlockPool's
groups): a slot of rows per sequence, not per block, and each sealed block's end rows for
the prefix cache:

    rows: (conv layers, slots * keep + 1, H)   slot s's position p at row s * keep + p % keep
                                                (a ring per slot); the last row zeros: every
                                                position before 0
    ends: (conv layers, blocks * (L - 1), H)   group 0's block b's last L - 1 positions' rows,
                                                held while b is registered (`ends_of`)

A pool step's `SlotStep` hands the model every row's taps (its window before its start
from its slot, then its own rows), whatever the layout: rows of a table step (a sequence's
draft rows, consecutive, are one sequence to the convolution) or a ragged step's
sequences; the runner keeps what it staged (`commit`) only once the forward succeeded, so a
step run again piece by piece reads the rows it read the first time. The fused C step
reads and writes the rings in place instead (`view`: a ConvView of this layout, kernels/
conv.c's CONV_SLOTS; each row's u written at its position's ring row once its logits are
made), and `written` then does the rest of what `commit` does: the ends moved on, each
sealed block's end rows copied from the ring.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from kvlm.cache.base import CacheSpec, CacheStep, ConvView, KVCache, KVPair, Taps
from kvlm.cache.groups import LayerGroup
from kvlm.cache.kinds import CONV_ROW_DTYPE, RING_SLACK, ConvWindow
from kvlm.cache.slots import Piece, Slots, sequences
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

    def begin(self, n_new: int, draft: bool = False, windows_at: tuple[int, ...] = ()) -> ConvStep:
        """The step of `n_new` tokens after the `length` the sequences hold (`draft`: fed
        as n_new rows of one token, one sequence to the convolution; `windows_at`: the step's
        positions, relative to its start, whose rows before it the step keeps)."""
        return ConvStep(self, self.length, n_new, draft, windows_at)

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
    """One forward's view of the conv rows: `taps(slot, u)` stages conv layer `slot`'s new
    rows u (B, T, H), kept only by `ConvRows.commit`, and gives the L rows each of them
    reads, the L - 1 rows before `start` first. `draft`: the step's tokens come as rows of
    one token (n, 1, H), one sequence's (ShortConv hands them over as (1, n, H))."""

    draft: bool

    def __init__(
        self, rows: ConvRows, start: int, n_new: int, draft: bool = False,
        windows_at: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        self.start, self.n_new, self.draft = start, n_new, draft
        self.in_place = False  # the rows moved on by the fused step (ConvCache.written_in_place)
        behind = rows.end - start  # 0, or up to slack after a rollback
        keep, r = rows.keep, rows.kind.rows
        self._keep, self._r = keep, r
        self._before = rows.rows[:, :, keep - behind - r : keep - behind]
        self.staged: list[torch.Tensor | None] = [None] * rows.rows.shape[0]
        # the L - 1 rows before each of these positions of the step (relative to start),
        # kept for a state's checkpoint there (kvlm.cache.recurrent.DeltaRows)
        self.windows_at = windows_at
        self.windows: list[dict[int, torch.Tensor]] = [{} for _ in self.staged]
        self._tap_index: tuple[tuple[int, int, int], torch.Tensor] | None = None

    def taps(self, layer: int, u: torch.Tensor) -> Taps:
        """u (B, T, H): the rows conv layer `layer` (its index among the conv layers) adds
        this step, staged (of a long step only the last `keep`, copied: commit keeps no
        more, and a view would hold the whole product it was cut from until then; a
        draft's all). Returns what the kernel's taps read (Taps), tap k at row t: the
        input row at position start + t - (L - 1) + k (those before `start` the
        window's)."""
        b, t, width = u.shape
        self.staged[layer] = u if self.draft or t <= self._keep else u[:, -self._keep :].clone()
        seq = torch.cat([self._before[layer].to(u.dtype), u], dim=1)  # (B, L - 1 + T, H)
        for q in self.windows_at:  # seq's rows q .. q + L - 2: positions start + q - (L - 1) ..
            self.windows[layer][q] = seq[:, q : q + self._r].clone()
        n = seq.shape[1]  # output (b, t)'s tap k: row b n + t + k of the rows
        if self._tap_index is None or self._tap_index[0] != (b, t, n):  # a step's layers': one
            first = (torch.arange(b)[:, None] * n + torch.arange(t)[None]).reshape(-1)
            index = first[None] + torch.arange(n - t + 1)[:, None]
            self._tap_index = ((b, t, n), index.to(u.device))
        return Taps(seq.reshape(-1, width), self._tap_index[1], tuple(u.shape))


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

    def kv_views(self, rows: Sequence[int], step: CacheStep | None = None) -> list[ConvView]:
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


class ConvSlots(Slots):
    """The engine pool's conv group (kvlm.cache.paged.BlockPool.groups; the module
    docstring's picture): `slots` rows slots, one a sequence from admission to its finish
    or preemption (BlockManager), a fork's copied (kvlm.cache.slots.Slots: a slot is a
    table of one entry in BlockTable.others); and, where `blocks` > 0 (a pool with prefix
    caching), the end rows of each of group 0's `blocks` blocks, which a prefix hit at that
    block's end restores a slot from. A trim to fewer tokens (a draft's rejected rows)
    leaves the ring as it is: the next step reads the rows before its start, held within
    the slack (SlotStep refuses a read past it)."""

    step_attr = "conv"
    what = "conv rows"

    def __init__(
        self, spec: CacheSpec, group: LayerGroup, slots: int, blocks: int, block_size: int
    ) -> None:
        kind = group.kind
        if not isinstance(kind, ConvWindow):
            raise TypeError(f"ConvSlots keeps a conv group, not {kind!r}")
        super().__init__(group, slots, block_size)
        self.ring = kind.keep  # rows a slot keeps: L - 1 + RING_SLACK
        self.zero_row = slots * self.ring
        layers, dev = len(group.layers), spec.device
        self.rows = torch.zeros(layers, slots * self.ring + 1, kind.width, dtype=CONV_ROW_DTYPE,
                                device=dev)  # fmt: skip
        self.ends = torch.zeros(layers, blocks * kind.rows, kind.width, dtype=CONV_ROW_DTYPE,
                                device=dev)  # fmt: skip
        # per group 0 block: the prefix id (kvlm.cache.registry) it held when its end rows
        # were kept (0: none); its rows are good while it holds that id
        self.ends_of = [0] * blocks
        # per slot: one past the furthest position written, and the first position held
        # (positions before 0 are held: the zero row)
        self.end = [0] * slots
        self.first = [0] * slots

    # ------------------------------------------------------------------ as a group

    @property
    def keep(self) -> int:
        return self.ring

    @property
    def block_nbytes(self) -> int:
        """A slot's bytes (the group's sequence_bytes)."""
        return self.rows[:, : self.ring].nbytes

    @property
    def block_rows_nbytes(self) -> int:
        """One group 0 block's end rows (every conv layer's L - 1 rows)."""
        return self.ends.shape[0] * self.kind.rows * self.ends.shape[2] * self.ends.element_size()

    @property
    def holds_ends(self) -> bool:
        return self.ends.shape[1] > 0

    @property
    def blocks_with_rows(self) -> int:
        """Group 0 blocks whose end rows are held (while they stay registered)."""
        return sum(1 for p in self.ends_of if p)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.ends.nbytes

    def commit_memory(self) -> None:
        """Touch every page now (a server's pool is committed at start)."""
        self.rows.zero_()
        self.ends.zero_()

    # ------------------------------------------------------------------ slots

    def _reset(self, slot: int) -> None:
        self.end[slot], self.first[slot] = 0, -self.ring

    def _copy(self, src: int, dst: int) -> None:
        ring = self.ring
        self.rows[:, dst * ring : (dst + 1) * ring] = self.rows[:, src * ring : (src + 1) * ring]
        self.end[dst], self.first[dst] = self.end[src], self.first[src]

    def ring_rows(self, slot: int | np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rows of `slot` (or each position's slot) holding `positions` (the zero row for
        those before 0), on the host."""
        return np.where(positions >= 0, slot * self.ring + positions % self.ring, self.zero_row)

    def _ring(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """`ring_rows` on the rows' device."""
        rows = self.ring_rows(slot, positions.numpy())
        return torch.from_numpy(rows.astype(np.int64)).to(self.rows.device)

    # ------------------------------------------------------------------ prefix hits

    def has_rows(self, block: int, prefix_id: int) -> bool:
        """Whether group 0's `block`, registered under `prefix_id`, has its end rows here."""
        return prefix_id != 0 and self.holds_ends and self.ends_of[block] == prefix_id

    def mark(self, block: int, prefix_id: int, holder: int | None = None) -> None:
        """`block` was sealed under `prefix_id` (registered) with its end rows written by
        the steps that computed it (SlotStep.commit). `holder`: the block the prefix cache
        finds for that prefix, where it is another (the same prefix computed twice) and
        has no rows: it gets these (a tier-loaded block's, say)."""
        if not self.holds_ends or not prefix_id:
            return
        self.ends_of[block] = prefix_id
        if holder is not None and holder != block and not self.has_rows(holder, prefix_id):
            r = self.kind.rows
            self.ends[:, holder * r : (holder + 1) * r] = self.ends[:, block * r : (block + 1) * r]
            self.ends_of[holder] = prefix_id

    def forget(self, block: int) -> None:
        """Group 0's `block` is handed out again: its end rows go with its prefix."""
        self.ends_of[block] = 0

    def block_rows(self, block: int) -> dict[str, torch.Tensor]:
        """A block's end rows as a tier record's parts: "rows" (conv layers, L - 1, H)."""
        r = self.kind.rows
        return {"rows": self.ends[:, block * r : (block + 1) * r]}

    def put_block_rows(self, block: int, parts: dict[str, torch.Tensor], prefix_id: int) -> bool:
        """A tier record's end rows for group 0's `block` (registered under `prefix_id`)."""
        r = self.kind.rows
        self.ends[:, block * r : (block + 1) * r] = parts["rows"].to(self.ends.device)
        self.ends_of[block] = prefix_id
        return True

    def restore(self, slot: int, block: int, position: int) -> None:
        """A prefix hit at `position` (group 0's `block` the last of it): the slot's rows
        before it are that block's end rows."""
        r = self.kind.rows
        pos, src = torch.arange(position - r, position), torch.arange(block * r, (block + 1) * r)
        held = pos >= 0  # (those before 0 read as the zero row)
        rows = self.ends.index_select(1, src[held].to(self.ends.device))
        self.rows.index_copy_(1, self._ring(slot, pos[held]), rows)
        self.end[slot], self.first[slot] = position, position - r

    def step(self, pieces: Sequence[Piece]) -> SlotStep:
        """The conv rows of a pool step whose tokens, flattened, are `pieces` in order."""
        return SlotStep(self, pieces)

    # ------------------------------------------------------------------ the fused step

    def view(self, pieces: Sequence[Piece]) -> ConvView | None:
        """The rings as the fused step reads and writes them (kvlm.model.fused; BlockPool.
        views): a ConvView of the slots' layout, its row i through pieces[i]'s slot (one
        token a piece, a sequence's draft rows consecutive), each sequence's rows before
        its start checked as SlotStep checks them (CacheOverflowError past the slack).
        None for a run of more than RING_SLACK + 1 rows (the torch step's): the end rows of
        a block it seals could leave the ring before `written` copies them."""
        seqs = sequences(pieces)
        if any(n > self.ring - self.kind.rows + 1 for _, _, n, _ in seqs):
            return None
        for slot, start, _, _ in seqs:
            _check(self, slot, start)
        slots = [p[0] for p in pieces]
        return ConvView(self.rows, slots, [self.end[s] for s in slots], self.group.layers,
                        self.ring)  # fmt: skip

    def written(self, pieces: Sequence[Piece]) -> None:
        """After the fused step wrote `pieces`' rows into the rings (their positions' rows,
        once its logits were made): each sequence's end moved on, and each block boundary
        it passed has the L - 1 rows before it copied from the ring into that block's end
        rows, as SlotStep.commit writes them."""
        r, bs = self.kind.rows, self.block_size
        for slot, start, n, table in sequences(pieces):
            if self.holds_ends:
                for b in range(-(-(start + 1) // bs) * bs, start + n + 1, bs):
                    rows = self.rows.index_select(1, self._ring(slot, torch.arange(b - r, b)))
                    block = table[b // bs - 1]
                    self.ends[:, block * r : (block + 1) * r] = rows
            self.end[slot] = max(self.end[slot], start + n)
            self.first[slot] = max(self.first[slot], self.end[slot] - self.ring)


class SlotStep:
    """A pool step's conv rows (ConvSlots): the step's tokens flattened in order are
    pieces (a slot, its first position, its tokens, its group 0 table); consecutive pieces
    of one slot at consecutive positions (a sequence's draft rows) are one sequence to the
    convolution. `taps(layer, u)` gives every token's taps, `commit()` keeps the new rows
    (the ring's last `keep` of each sequence, and the end rows of each block boundary the
    step passes), once the forward has succeeded.

        buf:  [ seq 0's L - 1 rows before | seq 1's ... | u of every token, flattened ]
        tap k of a token at position p of sequence s: buf's row for position p - (L - 1) + k
    """

    draft = False  # ShortConv: the pieces say which rows are one sequence

    def __init__(self, slots: ConvSlots, pieces: Sequence[Piece]) -> None:
        self.slots = slots
        self.start = pieces[0][1] if pieces else 0  # the first row's (Transformer checks it)
        self.seqs = sequences(pieces)
        for slot, start, _, _ in self.seqs:
            _check(slots, slot, start)
        # every index of the step computed on the host with numpy, all sequences at once,
        # and moved to the rows' device in one copy (a step of 64 sequences had made ~700
        # small torch tensors on the host, a tenth of an eager GPU step)
        r, ring, n_seq = slots.kind.rows, slots.ring, len(self.seqs)
        slot, start, n = (np.array([q[i] for q in self.seqs], dtype=np.int64).reshape(-1)
                          for i in range(3))  # fmt: skip
        offset = n_seq * r + np.cumsum(n) - n  # buf's row of each sequence's first token's u
        seq = np.arange(n_seq)

        def at(s: np.ndarray, q: np.ndarray) -> np.ndarray:
            """buf's rows of positions q of sequences s (q >= start - (L - 1))."""
            return np.where(q >= start[s], offset[s] + q - start[s], s * r + r + q - start[s])

        back = np.repeat(start, r) + np.tile(np.arange(-r, 0), n_seq)  # the rows before each
        before = slots.ring_rows(np.repeat(slot, r), back)
        tok = np.repeat(seq, n)  # each token's sequence, tokens in order
        rel = start[tok] + np.arange(len(tok)) - np.repeat(offset - n_seq * r, n)
        taps = np.stack([at(tok, rel - r + k) for k in range(r + 1)])  # (L, N)
        keep = np.minimum(n, ring)  # each sequence's last rows the ring keeps
        s_kept = np.repeat(seq, keep)
        kept = (np.repeat(start + n - keep, keep) + np.arange(len(s_kept))
                - np.repeat(np.cumsum(keep) - keep, keep))  # fmt: skip
        ends, ends_src = [], []
        if slots.holds_ends:
            bs = slots.block_size
            for i, (_, st, m, table) in enumerate(self.seqs):
                for b in range(-(-(st + 1) // bs) * bs, st + m + 1, bs):
                    ends.append(table[b // bs - 1] * r + np.arange(r))
                    ends_src.append(at(np.full(r, i), np.arange(b - r, b)))
        parts = [
            before,
            taps.reshape(-1),
            slots.ring_rows(slot[s_kept], kept),
            at(s_kept, kept),
            *(np.concatenate(e) if e else np.zeros(0, np.int64) for e in (ends, ends_src)),
        ]
        flat = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(slots.rows.device)
        (self._before, taps_flat, self._ring, self._ring_src, self._ends,
         self._ends_src) = flat.split([len(x) for x in parts])  # fmt: skip
        self._taps = taps_flat.view(r + 1, -1)
        self.staged: list[torch.Tensor | None] = [None] * slots.rows.shape[0]

    def taps(self, layer: int, u: torch.Tensor) -> Taps:
        """u (B, T, H) (the step's tokens, flattened in the pieces' order): the rows conv
        layer `layer` adds, staged; returns what its kernel's taps read (ConvStep.taps)."""
        flat = u.reshape(-1, u.shape[-1])  # (N, H)
        before = self.slots.rows[layer].index_select(0, self._before).to(u.dtype)
        buf = torch.cat([before, flat])  # (sequences * (L - 1) + N, H)
        self.staged[layer] = buf
        return Taps(buf, self._taps, tuple(u.shape))

    def commit(self) -> None:
        """Keep the step's rows: each sequence's last `keep` in its slot's ring, each block
        boundary's L - 1 in that block's end rows."""
        if any(buf is None for buf in self.staged):
            raise ValueError("a conv step committed before every conv layer ran")
        slots = self.slots
        for layer, buf in enumerate(self.staged):
            rows = buf.to(CONV_ROW_DTYPE)  # type: ignore[union-attr]
            slots.rows[layer].index_copy_(0, self._ring, rows.index_select(0, self._ring_src))
            if len(self._ends):
                slots.ends[layer].index_copy_(0, self._ends, rows.index_select(0, self._ends_src))
        for slot, start, n, _ in self.seqs:
            slots.end[slot] = max(slots.end[slot], start + n)
            slots.first[slot] = max(slots.first[slot], slots.end[slot] - slots.ring)


def _check(slots: ConvSlots, slot: int, start: int) -> None:
    """The rows before `start` must be the slot's: not past what it wrote, and within what
    its ring still holds (a rollback within the slack)."""
    first_read = start - slots.kind.rows
    if start > slots.end[slot] or (first_read >= 0 and first_read < slots.first[slot]):
        raise CacheOverflowError(
            f"the conv rows of slot {slot} hold positions {slots.first[slot]} .. "
            f"{slots.end[slot] - 1}; a step at {start} reads from {first_read} (a rollback "
            f"past the {RING_SLACK} rows of slack: the sequence must be recomputed)"
        )
