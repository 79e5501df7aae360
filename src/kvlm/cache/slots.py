"""A layer group of the engine's pool whose layers keep a fixed state a sequence, not rows
per token (kvlm.cache.kinds.STATE_KINDS): a short convolution's last input rows
(kvlm.cache.conv.ConvSlots), a gated DeltaNet's recurrent state and conv rows
(kvlm.cache.recurrent.StateSlots). Such a group's units are slots, one a sequence from
admission to its finish or preemption (kvlm.cache.prefix.BlockManager), a fork's copied.

A slot is a table of one entry in BlockTable.others (its group's), so the block-table
calls of kvlm.cache.prefix reach it as they reach a windowed group's table: `grow` (the
slot taken when the table is empty), `trim` (to 0: the slot goes back), `fork` (a copy),
`slide` (nothing). A prefix hit needs the state at the hit's end: a group that keeps it
for group 0's blocks says so (`holds_ends`, `has_rows`); one that keeps none never lets a
hit through (BlockManager._match cuts the hit back to nothing)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from kvlm.cache.groups import LayerGroup
from kvlm.errors import CacheOverflowError

# A pool step's piece of rows: (the sequence's slot, its first position, its tokens, its
# table of group 0's blocks), in the order the step's tokens are flattened
Piece = tuple[int, int, int, Sequence[int]]


def sequences(pieces: Sequence[Piece]) -> list[Piece]:
    """Pieces as sequences: consecutive pieces of one slot at consecutive positions (a
    sequence's draft rows) joined into one."""
    return [seq for seq, _ in joined(pieces)]


def joined(pieces: Sequence[Piece]) -> list[tuple[Piece, int]]:
    """`sequences(pieces)`, each with the number of pieces it joins."""
    seqs: list[list] = []
    for slot, start, n, table in pieces:
        last = seqs[-1] if seqs else None
        if last is not None and last[0] == slot and last[1] + last[2] == start:
            last[2] += n
            last[4] += 1
        else:
            seqs.append([slot, start, n, table, 1])
    return [((s[0], s[1], s[2], s[3]), s[4]) for s in seqs]


class Slots:
    """The slots of a state group (the module docstring): `num_blocks` of them (the
    group's units, as a block pool counts them). A subclass holds the state: `_reset` a
    slot taken, `_copy` a fork's, `step(pieces)` a pool step's view of it, `nbytes`,
    `block_nbytes` (a slot's), `keep`, `commit_memory`; `step_attr` names the pool step's
    attribute the model reads it from (CacheStep.conv or .recurrent)."""

    step_attr: ClassVar[str]
    what: ClassVar[str]  # what the slots hold, for an error
    # whether a group that keeps the state at group 0's block ends keeps it at every one
    # (a conv group's rows) or at some (a DeltaNet group's snapshots)
    every_end: ClassVar[bool] = True

    def __init__(self, group: LayerGroup, slots: int, block_size: int) -> None:
        self.group, self.kind, self.block_size = group, group.kind, block_size
        self.num_blocks = slots
        self.refs = [0] * slots
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(slots))

    # ------------------------------------------------------------------ as a group

    @property
    def window(self) -> None:
        return None  # no attention mask of its own

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # ------------------------------------------------------------------ slots

    def allocate(self) -> int:
        if not self.free_queue:
            raise CacheOverflowError(f"the {self.what}' {self.num_blocks} slots are all taken")
        slot, _ = self.free_queue.popitem(last=False)
        self.refs[slot] = 1
        self._reset(slot)
        return slot

    def release(self, slot: int) -> None:
        if self.refs[slot] <= 0:
            raise RuntimeError(f"double free of {self.what} slot {slot}")
        self.refs[slot] = 0
        self.free_queue[slot] = None

    def _reset(self, slot: int) -> None:
        raise NotImplementedError

    def _copy(self, src: int, dst: int) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ as a block table

    def grow_cost(self, table: list[int], start: int, n_new: int) -> int:
        return 0 if table else 1

    def grow(self, table: list[int], start: int, n_new: int) -> None:
        if not table:
            table.append(self.allocate())

    def trim(self, table: list[int], num_tokens: int) -> None:
        """To 0 tokens: the slot goes back."""
        if num_tokens == 0 and table:
            self.release(table.pop())

    def fork(self, table: list[int]) -> list[int]:
        """A second sequence with a copy of the slot's state."""
        if not table:
            return []
        dst = self.allocate()
        self._copy(table[0], dst)
        return [dst]

    def slide(self, table: list[int], end: int) -> int:
        return 0  # a slot is a fixed state: nothing leaves it

    # ------------------------------------------------------------------ prefix hits
    # (none kept here: a subclass that keeps the state at group 0's block ends overrides)

    @property
    def holds_ends(self) -> bool:
        return False

    @property
    def blocks_with_rows(self) -> int:
        return 0

    @property
    def block_rows_nbytes(self) -> int:
        return 0

    def has_rows(self, block: int, prefix_id: int) -> bool:
        return False

    def mark(self, block: int, prefix_id: int, holder: int | None = None) -> None:
        return None

    def forget(self, block: int) -> None:
        return None

    def turn(self, slot: int, position: int) -> None:
        """The slot's sequence is a chat prompt whose generation prompt begins at
        `position` (a group that keeps the state at some block ends takes its prompt's
        there, StateSlots; one that keeps every end has nothing to do)."""
        return None
