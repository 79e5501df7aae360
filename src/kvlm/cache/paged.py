"""`paged`: a pool of fixed-size blocks, per-sequence block tables, reference counts.

    pool values: (layers, 2, num_blocks, kv_heads, block_size, head_dim)

    sequence 0 table: [ 7 | 2 | 9 ]      block_size 4, 10 tokens: 9 is partial
    sequence 1 table: [ 7 | 2 | 4 ]      forked from 0: shares 7 and 2 (ref 2 each)

    block 7: [t0 t1 t2 t3]  block 2: [t4 t5 t6 t7]  block 9: [t8 t9 .  .]  <- partial,
                                                                   slots 10, 11 masked

A sequence only owns whole blocks as it needs them, so the waste is at most one partial
block per sequence (vLLM's < 4% figure) instead of a buffer sized for the longest
possible sequence. Blocks are shared by reference count: fork(n) copies a table, not the
tokens. Writing into a block someone else also references copies it first (copy on write).

The free queue is first-in first-out over block ids (an ordered dict, so a block can also
be taken out of its middle): a freed block goes to the back, allocation takes from the
front. A sequence's blocks are freed tail first, so its last (least shareable) blocks are
reused before its first ones: the order prefix reuse will want.

Attention reads a sequence by gathering its blocks into (B, kv_heads, S, head_dim); that
is a copy per layer per step, the price of not being contiguous.

A hybrid model (layers with a window W and layers that see everything,
kvlm.cache.groups.layer_groups) gets one block table per layer group, as vLLM's hybrid
KV cache manager does:

    group 0  the layers that see everything   BlockPool (the pool's face: store, refs)
    group 1  the layers with a window W       pool.groups[1], a BlockPool of its own
    group g  (each other kind's layers)       pool.groups[g]
    layer i  -> pool.layer_at[i] = (group, index of the layer inside its group's store)

    sequence, group 0:  [ 7 | 2 | 9 | 4 | 11 ]       every block kept
    sequence, group 1:  [ - | - | - | 5 | 3  ]       FREED (-1): left the window, released

A sequence's table of a windowed group has one entry per block of the sequence, like the
global group's, and the entries whose every position is older than `keep` (W +
RING_SLACK, the ring's slack: a rollback never needs a freed block) behind the sequence's
end are released to that group's free queue (`slide`), where they stay findable by the
prefix cache until handed out again. Each group's store is [its layers, 2, its blocks,
kv_heads, block_size, head_dim]: layer i's K/V is reached through its group's block table,
the block size and its group's store (a freed entry is read as the row's first live
block: the window masks it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import torch

from kvlm.cache.base import (
    CacheSpec,
    CacheStep,
    ConvView,
    KVCache,
    KVPair,
    KVView,
    StateView,
    blocks_for,
    causal_mask,
    visible,
)
from kvlm.cache.conv import ConvSlots
from kvlm.cache.groups import LayerGroup, layer_at, layer_groups, layout_extra
from kvlm.cache.hybrid import group_prefix, group_tensors, ring_spec
from kvlm.cache.kinds import ConvWindow, RecurrentState
from kvlm.cache.recurrent import StateSlots
from kvlm.cache.registry import PrefixRegistry
from kvlm.cache.slots import Slots
from kvlm.cache.storage import Store
from kvlm.errors import CacheOverflowError, InvalidRequestError

ALL = slice(None)
# Default pool: room for this many full-length sequences. The pool is reserved, not
# touched: a block's memory is committed when it is first allocated (and zeroed).
DEFAULT_POOL_SEQUENCES = 8
# A windowed group's table entry whose block has left the window and gone back to the pool
FREED = -1


def window_blocks(keep: int, block_size: int, step_tokens: int) -> int:
    """The most blocks one sequence holds in a windowed group that keeps `keep` positions
    behind its end (W + RING_SLACK) while a step of `step_tokens` tokens runs: those
    positions, the step's own, and one block more where they straddle a block boundary."""
    return blocks_for(keep + step_tokens, block_size) + 1


class BlockPool:
    """Fixed-size K/V blocks with reference counts and a FIFO free queue."""

    def __init__(
        self,
        spec: CacheSpec,
        num_blocks: int,
        scratch: bool | None = None,
        group_blocks: Sequence[int] | None = None,
        group: LayerGroup | None = None,
        end_rows: bool = True,
        snapshots: int = 0,
    ) -> None:
        """`scratch` (default: on a GPU): one more block, never handed out: where the
        padding rows of a captured decode batch write (kvlm.model.graphs), so they never
        touch a sequence's blocks. A `spec` whose layers come in groups (kvlm.cache.groups:
        a hybrid model's): this pool holds the first group, the layers that see everything
        (num_blocks), `groups[g]` group g (a BlockPool of `group` g, group_blocks[g - 1]
        blocks, default num_blocks; a conv group's ConvSlots, group_blocks[g - 1] slots,
        and with `end_rows` (a pool that keeps a prefix cache) each of this pool's blocks'
        end rows: kvlm.cache.conv; a recurrent group's StateSlots, group_blocks[g - 1] slots
        of state and with `end_rows` `snapshots` snapshots of the state at block ends,
        kvlm.cache.recurrent: the engine's kvlm.engine.engine.snapshot_plan)."""
        kinds = layer_groups(spec)
        self.group = group or kinds[0]  # the layers this pool's store holds, their kind
        self.groups: list[BlockPool | Slots] = [self]
        self.layer_at = layer_at(kinds)  # layer -> (its group, its index in the group's store)
        if group is None:
            blocks = group_blocks or [num_blocks] * (len(kinds) - 1)
            for g, n in zip(kinds[1:], blocks, strict=True):
                if isinstance(g.kind, ConvWindow):
                    ends = num_blocks if end_rows else 0
                    self.groups.append(ConvSlots(spec, g, n, ends, spec.block_size))
                elif isinstance(g.kind, RecurrentState):  # and snapshots of the state
                    snaps = snapshots if end_rows else 0
                    self.groups.append(StateSlots(spec, g, n, spec.block_size, snaps))
                else:
                    self.groups.append(BlockPool(spec, n, scratch, group=g))
        spec = self.group.spec(spec)
        self.block_size = spec.block_size
        self.num_blocks = num_blocks
        if scratch is None:
            scratch = spec.device.type == "cuda"
        self.scratch = num_blocks if scratch else None
        stored = num_blocks + (self.scratch is not None)
        shape = (spec.num_layers, 2, stored, spec.num_kv_heads, spec.block_size, spec.head_dim)
        # Uninitialised: allocate() zeroes a block before handing it out, so gathered slots
        # past a sequence's end hold zeros, never NaN garbage that 0 * NaN would spread.
        self.store = spec.store(shape, zero=False)
        if self.scratch is not None:
            self.store.zero_((ALL, ALL, self.scratch))
        self.refs = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # The prefix cache's index of full blocks (kvlm.cache.registry): a freed block stays
        # findable until allocate() hands it out again.
        self.prefix = PrefixRegistry(num_blocks)
        # the state groups that keep this pool's blocks' end rows or state (group 0's pool)
        self._ends = [g for g in self.groups[1:] if isinstance(g, Slots) and g.holds_ends]

    @property
    def window(self) -> int | None:
        """This group's attention window (None: everything)."""
        return self.group.kind.window

    @property
    def keep(self) -> int | None:
        """Positions a sequence keeps in this group behind its end (None: every one)."""
        return self.group.kind.keep

    @property
    def hybrid(self) -> bool:
        """Whether this pool keeps a table per layer group (a hybrid model's)."""
        return len(self.groups) > 1

    @property
    def used_nbytes(self) -> int:
        """Bytes of the blocks in use, every group's."""
        return sum(g.num_used * g.block_nbytes for g in self.groups)

    @property
    def total_nbytes(self) -> int:
        """Bytes of every group's store (a state group's slots, a conv group's end rows)."""
        return sum(g.nbytes for g in self.groups)

    @property
    def nbytes(self) -> int:
        """Bytes of this group's store."""
        return self.store.nbytes

    @property
    def conv(self) -> ConvSlots | None:
        """The conv group's slots, if the model has conv layers (kvlm.cache.conv)."""
        return next((g for g in self.groups if isinstance(g, ConvSlots)), None)

    def commit_memory(self) -> None:
        """Touch every page of this group's store now (a server commits its pool at start)."""
        self.store.zero_((ALL,))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def block_nbytes(self) -> int:
        return self.store.nbytes // self.store.shape[2]

    def allocate(self) -> int:
        if not self.free_queue:
            raise CacheOverflowError(f"the KV block pool is full ({self.num_blocks} blocks)")
        block, _ = self.free_queue.popitem(last=False)  # the least recently freed
        self.prefix.forget(block)  # evicted from the prefix cache, if it was there
        for group in self._ends:  # and the conv rows or state at its end with it
            group.forget(block)
        self.refs[block] = 1
        self.store.zero_((ALL, ALL, block))
        return block

    def revive(self, block: int) -> None:
        """Take a block found in the prefix cache: shared if in use, else out of the free
        queue (from wherever it sits) with its contents as they are."""
        if self.refs[block] == 0:
            del self.free_queue[block]
        self.refs[block] += 1

    def share(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise RuntimeError(f"share of free block {block}")
        self.refs[block] += 1

    def release(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise RuntimeError(f"double free of block {block}")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_queue[block] = None

    def copy(self, src: int, dst: int) -> None:
        self.store.put_raw((ALL, ALL, dst), self.store.raw((ALL, ALL, src)))

    # ------------------------------------------------------------------ block tables
    # Every block table grows, shrinks and forks here: a PagedCache's rows and the
    # engine's sequences (kvlm.cache.prefix.BlockManager, which adds the prefix cache).

    def grow_cost(self, table: list[int], start: int, n_new: int) -> int:
        """Free blocks grow(table, start, n_new) takes."""
        bs = self.block_size
        new = max(0, blocks_for(start + n_new, bs) - len(table))
        i = start // bs
        shared = i < len(table) and table[i] != FREED and self.refs[table[i]] > 1
        return new + shared

    def grow(self, table: list[int], start: int, n_new: int) -> None:
        """Make positions start..start + n_new - 1 this table's alone: the shared block
        that `start` falls in is copied (copy on write), fresh blocks are appended."""
        bs = self.block_size
        i = start // bs
        if i < len(table) and table[i] != FREED and self.refs[table[i]] > 1:
            shared = table[i]
            table[i] = self.allocate()
            self.copy(shared, table[i])
            self.release(shared)
        while len(table) < blocks_for(start + n_new, bs):
            table.append(self.allocate())

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` positions, tail first: a
        sequence's last (least shareable) blocks are the first evicted."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(table) > keep:
            block = table.pop()
            if block != FREED:
                self.release(block)

    def fork(self, table: list[int]) -> list[int]:
        """A second table over the same blocks."""
        for block in table:
            if block != FREED:
                self.share(block)
        return list(table)

    def slide(self, table: list[int], end: int) -> int:
        """A windowed group's table of a sequence `end` tokens long: release the blocks
        whose every position is more than `keep` behind the end (FREED in the table; they
        stay findable in the prefix cache until handed out again). The FREED entries are
        always a prefix of the table. Returns the blocks released."""
        if self.keep is None:
            return 0
        i = min(len(table), max(0, end - self.keep) // self.block_size)
        released = 0
        while i > 0 and table[i - 1] != FREED:
            i -= 1
            self.release(table[i])
            table[i] = FREED
            released += 1
        return released

    def views(
        self, tables: Sequence[Sequence[Sequence[int]]], starts: Sequence[int] = ()
    ) -> list[KVView | ConvView | StateView] | None:
        """The pool's K/V as views for a step of a token a row (KVCache.kv_views; the fused
        step's): `tables[g][b]`, row b's table of layer group g (one group; a hybrid pool's
        others too, each its layers in their store's order, a block that left the window
        read as the row's first live one: `readable`, never within the window the step
        reads), row b at starts[b]; a conv group's rows its slots' rings (ConvSlots.view:
        row b through its slot, tables[g][b]'s one entry), a recurrent group's its slots'
        states and rows (StateSlots.view); None where a group has no view for these rows,
        and `stepped` after the step. No tables: what each group declares, for
        FusedDecoder.pool_why_not."""
        if not self.hybrid:
            return [KVView(self.store, tables[0], self.block_size)]
        views: list[KVView | ConvView | StateView] = []
        for g, (group, rows) in enumerate(zip(self.groups, tables, strict=True)):
            if isinstance(group, (ConvSlots, StateSlots)):
                view = group.view(_pieces(rows, starts, tables[0]))
                if view is None:
                    return None
                views.append(view)
                continue
            rows = [readable(list(t), len(t)) for t in rows] if g else rows
            views.append(KVView(group.store, rows, self.block_size, 0, group.group.layers,
                                group.window or 0))  # fmt: skip
        return views

    def stepped(self, tables: Sequence[Sequence[Sequence[int]]], starts: Sequence[int]) -> None:
        """After the fused step wrote a step's rows through `views(tables, starts)` (its K/V
        as it ran, a conv group's rows once its logits were made, a recurrent group's
        states in place): each conv group's slots moved on (ConvSlots.written: what
        SlotStep.commit does on the torch step), each recurrent group's ends and
        snapshots (StateSlots.written)."""
        for group, rows in zip(self.groups, tables, strict=True):
            if isinstance(group, (ConvSlots, StateSlots)):
                group.written(_pieces(rows, starts, tables[0]))

    def first_live(self, table: list[int]) -> int:
        """The index of a table's first block not FREED (len(table) when none is)."""
        i = 0
        while i < len(table) and table[i] == FREED:
            i += 1
        return i


@dataclass(slots=True)
class _Part:
    """One layer group's face in a pool step: its store, where the step's tokens go in it,
    and what each row reads (a TableStep's (B, width) tables; a RaggedStep's blocks)."""

    store: Store
    write_blocks: torch.Tensor
    read: torch.Tensor


def _pieces(slots: Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence) -> list:
    """A step of a token a row as a conv group's pieces (kvlm.cache.conv.Piece): row b's
    slot (its table's one entry), start, 1 token, its table of group 0."""
    return [(t[0], s, 1, table) for t, s, table in zip(slots, starts, tables, strict=True)]


def readable(table: list[int], width: int) -> list[int]:
    """A row's table as a step reads it, `width` blocks: a FREED entry (a windowed group's
    block that left the window) read as the row's first live block, a short table padded
    with its own last block. Either way slots of finite values (never an unallocated
    block's garbage, which 0 * NaN would carry through the mask), masked or not read."""
    row = table[:width]
    if row and row[0] == FREED:
        live = next(b for b in row if b != FREED)
        row = [live if b == FREED else b for b in row]
    return row + row[-1:] * (width - len(row))


class _PagedStep(CacheStep):
    """A step that writes each token at its block and slot of a pool's stores: one `_Part`
    per layer group, layer i in part layer_at[i][0] at index layer_at[i][1]."""

    parts: list[_Part | None]  # None: a state group's (its rows are `conv`'s, no K/V)
    layer_at: list[tuple[int, int]]

    def _slot_rows(self, group: Slots, slots: Sequence[list[int]], pieces: list) -> None:
        """A state group's part: each row's slot (its table's one entry), its rows through
        the step's `conv` (a conv group's: kvlm.cache.conv.SlotStep) or `recurrent` (a
        DeltaNet group's: kvlm.cache.recurrent.SlotDeltaStep), read by those layers."""
        step = group.step([(t[0], *piece) for t, piece in zip(slots, pieces, strict=True)])
        setattr(self, group.step_attr, step)
        self.parts.append(None)

    def commit_rows(self) -> None:
        """Keep the state the forward staged (the K/V went to their blocks as it ran; the
        state waits for its success, so a step run again reads what it read first)."""
        for step in (self.conv, self.recurrent):
            if step is not None:
                step.commit()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        group, index = self.layer_at[layer]
        part = self.parts[group]
        assert part is not None, "a conv layer has no K/V"
        self._write(part, index, k, v)
        return self._gather(part, index, 0, k.dtype), self._gather(part, index, 1, v.dtype)

    def _write(self, part: _Part, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, Hkv, T, D) at each token's block and slot."""
        k, v = self._keys_in(k), self._values_in(v)
        # (layer, K/V, block[B,T], :, slot[B,T]) addresses (B, T, heads, D)
        where = (part.write_blocks, ALL, self.write_slots)
        part.store.put((index, 0, *where), k.transpose(1, 2))
        part.store.put((index, 1, *where), v.transpose(1, 2))

    def _gather(self, part: _Part, index: int, kv: int, dtype: torch.dtype) -> torch.Tensor:
        blocks = part.store.get((index, kv, part.read), dtype)  # (B, nb, H, bs, D)
        rows = blocks.transpose(1, 2).flatten(2, 3)  # (B, H, nb * bs, D)
        return rows[:, :, : self.n_keys]  # the partial last block's tail is cut, not masked


class PagedCache(KVCache):
    """Rows on a BlockPool, a block table per row and per layer group (one group, or a
    hybrid model's groups: a windowed group's blocks slide out after each commit, and a
    rollback may go back RING_SLACK tokens, as the hybrid ring's does). Files of a hybrid
    model's paged cache hold the `groups` layout (kvlm.cache.hybrid): the whole layers'
    rows, and each window's last W + RING_SLACK positions as a ring."""

    mode = "paged"
    fused_step = True
    pool_mode = "paged"

    def __init__(self, spec: CacheSpec, pool: BlockPool | None = None) -> None:
        super().__init__(spec)
        default = blocks_for(spec.max_tokens, spec.block_size) * DEFAULT_POOL_SEQUENCES
        self.pool = pool or BlockPool(spec, spec.num_blocks or default)
        # [group][row]: each row's block table in each layer group; group 0 is `tables`
        self.group_tables: list[list[list[int]]] = [[] for _ in self.pool.groups]
        self._new_tables(spec.batch)
        # per group: the first position it was given (a file's ring holds only the last)
        self._held_from = [0] * len(self.pool.groups)
        if self.pool.hybrid:
            self.layout = "groups"  # type: ignore[misc] - an instance's layout, not its class's

    @property
    def tables(self) -> list[list[int]]:
        """Each row's block table of group 0 (every layer, or the ones that see everything)."""
        return self.group_tables[0]

    def _new_tables(self, rows: int) -> None:
        self.group_tables = [[[] for _ in range(rows)] for _ in self.pool.groups]

    def _groups(self):
        """(group's pool, its rows' tables) of each layer group."""
        return zip(self.pool.groups, self.group_tables, strict=True)

    # ------------------------------------------------------------------ capacity

    def _blocks_to_add(self, n_new: int) -> list[int]:
        """Blocks the next step of n_new tokens takes from each group's pool: new blocks,
        plus the copies of shared partial blocks it writes into. Of r rows sharing a
        partial block, r - 1 copy it and the last writes in place, unless someone outside
        this cache also holds it, in which case all r copy."""
        bs = self.spec.block_size
        need = blocks_for(self.num_tokens + n_new, bs)
        totals = []
        for pool, tables in self._groups():
            total = sum(need - len(table) for table in tables)
            if self.num_tokens % bs:
                sharers = Counter(table[-1] for table in tables)
                for block, rows in sharers.items():
                    if pool.refs[block] > 1:
                        total += rows if pool.refs[block] > rows else rows - 1
            totals.append(total)
        return totals

    def would_overflow(self, n_new: int) -> bool:
        return super().would_overflow(n_new) or any(
            n > g.num_free
            for n, g in zip(self._blocks_to_add(n_new), self.pool.groups, strict=True)
        )

    def _overflow_message(self, n_new: int) -> str:
        if self.num_tokens + n_new > self.capacity:
            return super()._overflow_message(n_new)
        need = self._blocks_to_add(n_new)
        g = next(i for i, g in enumerate(self.pool.groups) if need[i] > g.num_free)
        group = self.pool.groups[g]
        which = f" (layer group {g}, window {group.window})" if self.pool.hybrid else ""
        return (
            f"the KV block pool is out of blocks{which}: this step needs {need[g]}, "
            f"{group.num_free} of {group.num_blocks} are free"
        )

    # ------------------------------------------------------------------ the forward

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        start = self.num_tokens
        for pool, tables in self._groups():
            for table in tables:
                pool.grow(table, start, n_new)
        rows = self.group_tables
        if draft:  # the sequence's tokens as rows of one token, at consecutive positions
            rows, starts, n = [t * n_new for t in rows], list(range(start, start + n_new)), 1
        else:  # every row's n_new tokens from start
            starts, n = [start] * self.batch, n_new
        step = TableStep(self.pool, self.spec, rows[0], starts, n, rows[1:])
        step.start, step.n_new = start, n_new  # what commit reads
        step.draft = draft
        return step

    def _commit(self, step: CacheStep) -> None:
        """A windowed group lets go of the blocks that left its window (a draft check's
        from its start: the rows it rejects are rolled back next)."""
        end = step.start if getattr(step, "draft", False) else step.start + step.n_new
        for pool, tables in list(self._groups())[1:]:
            for table in tables:
                pool.slide(table, end)

    def _check_rollback(self, n: int) -> None:
        """A windowed group must still hold what the next query reads (W - 1 positions)."""
        length = self.num_tokens - n
        if not self.tables or length == 0:
            return
        for g, (pool, tables) in enumerate(self._groups()):
            needed = pool.group.kind.first_read(length)
            held = max(self._held_from[g], pool.first_live(tables[0]) * pool.block_size)
            if needed < held:
                raise InvalidRequestError(
                    f"cannot roll back {n} tokens: the windowed layers have let go of "
                    f"position {needed}, which the next query would need"
                )

    # ------------------------------------------------------------------ lifetime

    def _truncate(self, length: int) -> None:
        for pool, tables in self._groups():
            for table in tables:
                pool.trim(table, length)
        if length == 0:
            self._held_from = [0] * len(self._held_from)

    def _release(self) -> None:
        self._truncate(0)
        self._new_tables(self.spec.batch)

    def _fork(self, n: int) -> None:
        self.group_tables = [
            [table if i == 0 else pool.fork(table) for table in tables for i in range(n)]
            for pool, tables in self._groups()
        ]

    def _export(self) -> dict[str, torch.Tensor]:
        """One group's rows as the dense layout; a hybrid pool's groups as the `groups`
        layout: the whole group's rows, each window's as a ring (kvlm.cache.hybrid's)."""
        if not self.pool.hybrid:
            return self._export_dense(self.pool, self.tables, self.num_tokens)
        out = {}
        for g, (pool, tables) in enumerate(self._groups()):
            if pool.keep is None:
                part = self._export_dense(pool, tables, self.num_tokens)
            else:
                part = self._export_ring(g)
            out.update({group_prefix(g) + name: t for name, t in part.items()})
        return out

    def _export_dense(self, pool: BlockPool, rows: list[list[int]], n: int) -> dict:
        tables = torch.tensor(rows, dtype=torch.long)  # (B, blocks), blocks may be 0
        raw = pool.store.raw((ALL, ALL, tables.to(self.spec.device)))
        # (L, 2, B, nb, H, bs[, D]) -> (L, 2, B, H, nb * bs[, D]), cut to the tokens held
        return {name: t.transpose(3, 4).flatten(4, 5)[:, :, :, :, :n] for name, t in raw.items()}

    def _export_ring(self, g: int) -> dict[str, torch.Tensor]:
        """Windowed group g as kvlm.cache.hybrid's ring: W + RING_SLACK slots, position
        p in slot p % (W + RING_SLACK), each slot's position (-1: empty)."""
        group, rows, n, bs = (
            self.pool.groups[g],
            self.group_tables[g],
            self.num_tokens,
            self.spec.block_size,
        )
        first = max(
            n - group.keep, self._held_from[g], group.first_live(rows[0]) * bs if rows[0] else 0
        )
        pos = torch.arange(max(0, first), n)
        tables = torch.tensor([[max(b, 0) for b in t] for t in rows], dtype=torch.long)
        index = (
            ALL,
            ALL,
            tables[:, pos // bs].to(self.spec.device),
            ALL,
            (pos % bs).to(self.spec.device),
        )
        slots, dev = pos % group.keep, self.spec.device
        ring = {}
        for name, t in group.store.raw(index).items():  # (B, m, L, 2, H[, D])
            shape = (t.shape[2], t.shape[3], self.batch, t.shape[4], group.keep, *t.shape[5:])
            ring[name] = torch.zeros(shape, dtype=t.dtype, device=dev)
            ring[name][:, :, :, :, slots.to(dev)] = t.permute(2, 3, 0, 4, 1, *range(5, t.dim()))
        slot_pos = torch.full((group.keep,), -1, dtype=torch.long, device=dev)
        slot_pos[slots.to(dev)] = pos.to(dev)
        return {**ring, "slot_pos": slot_pos}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Each group's rows (a ring's: the positions its slot_pos names) into blocks of
        its own, FREED before the first block a ring holds."""
        bs, total = self.spec.block_size, blocks_for(length, self.spec.block_size)
        parts = [group_tensors(tensors, g) for g in range(len(self.pool.groups))]
        if not self.pool.hybrid:
            parts = [tensors]
        held, counts = [], []
        for part in parts:
            slot_pos = part.get("slot_pos")
            pos = torch.arange(length) if slot_pos is None else slot_pos[slot_pos >= 0].cpu()
            held.append(pos)
            counts.append(total - (int(pos.min()) // bs if len(pos) else total))
        for pool, count in zip(self.pool.groups, counts, strict=True):
            if self.batch * count > pool.num_free:  # refused before any is taken: no leak
                raise CacheOverflowError(
                    f"{self.batch} rows of {length} tokens need {self.batch * count} blocks, "
                    f"the pool has {pool.num_free} free"
                )
        self.group_tables = [
            [[FREED] * (total - count) + [pool.allocate() for _ in range(count)]
             for _ in range(self.batch)]
            for pool, count in zip(self.pool.groups, counts, strict=True)
        ]  # fmt: skip
        for g, (part, pos) in enumerate(zip(parts, held, strict=True)):
            slot_pos = part.pop("slot_pos", None)
            if slot_pos is not None:  # (L, 2, B, H, m[, D]): the ring's slots in position order
                self._held_from[g] = int(pos.min()) if len(pos) else length
                slots = (pos % slot_pos.numel()).to(slot_pos.device)
                part = {k: t[:, :, :, :, slots] for k, t in part.items()}
            self._put(self.pool.groups[g], self.group_tables[g], pos, part)

    def _put(
        self, pool: BlockPool, rows: list[list[int]], pos: torch.Tensor, tensors: dict
    ) -> None:
        """Write dense rows (L, 2, B, H, len(pos)[, D]) at positions `pos` through `rows`."""
        if len(pos) == 0:
            return
        bs = self.spec.block_size
        tables = torch.tensor(rows, dtype=torch.long)
        blocks = tables[:, pos // bs].to(self.spec.device)  # (B, n)
        slots = (pos % bs).expand(self.batch, len(pos)).to(self.spec.device)
        # (L, 2, block[B,n], H, slot[B,n]) addresses (B, n, L, 2, H[, D])
        raw = {k: t.permute(2, 4, 0, 1, 3, *range(5, t.dim())) for k, t in tensors.items()}
        pool.store.put_raw((ALL, ALL, blocks, ALL, slots), raw)

    def _layout_extra(self) -> dict[str, int]:
        return layout_extra(tuple(pool.group for pool in self.pool.groups))

    def kv_views(self, rows: Sequence[int], step: CacheStep | None = None) -> list[KVView]:
        """The pool's views (BlockPool.views) over these rows' tables."""
        return self.pool.views([[t[r] for r in rows] for t in self.group_tables])

    # ------------------------------------------------------------------ accounting

    @property
    def blocks_used(self) -> int:
        """Distinct blocks this cache references (shared ones once), every group's."""
        return sum(
            len({b for t in tables for b in t if b != FREED}) for _, tables in self._groups()
        )

    @property
    def nbytes(self) -> int:
        return sum(len({b for t in tables for b in t if b != FREED}) * pool.block_nbytes
                   for pool, tables in self._groups())  # fmt: skip

    @property
    def tokens_stored(self) -> int:
        """Distinct token slots of group 0 holding data: a shared prefix counts once."""
        bs, filled = self.spec.block_size, {}
        for table in self.tables:
            for j, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(bs, self.num_tokens - j * bs))
        return sum(filled.values())

    @property
    def waste(self) -> float:
        """Fraction of group 0's allocated slots that hold no token (partial last blocks)."""
        slots = len({b for t in self.tables for b in t}) * self.spec.block_size
        return 0.0 if slots == 0 else 1 - self.tokens_stored / slots

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return sum(n for _, n, _ in cls.planned_groups(spec, tokens, batch))

    @classmethod
    def planned_groups(cls, spec: CacheSpec, tokens: int, batch: int) -> list[tuple]:
        """(the group's spec, bytes, tokens each sequence keeps) of each layer group of
        `batch` sequences of `tokens` tokens, each group's bytes its kind's
        (LayerGroup.planned_bytes): a windowed group keeps at most
        window_blocks(W + RING_SLACK, block_size, 0) blocks between steps."""
        whole, bs, out = blocks_for(tokens, spec.block_size), spec.block_size, []
        for group in layer_groups(spec):
            keep = group.kind.keep
            blocks = whole if keep is None else min(whole, window_blocks(keep, bs, 0))
            # a windowed group's part is planned as the ring a row cache would keep it in
            part = group.spec(spec) if keep is None else ring_spec(spec, group)
            kept = tokens if keep is None else blocks * bs
            out.append((part, batch * group.planned_bytes(spec, blocks * bs), kept))
        return out


class Int8PagedCache(PagedCache):
    """`int8`: the paged layout with int8 codes and a per-token step and zero point
    (kvlm.cache.storage).

    The factory gives it an int8 spec whatever --kv-dtype says; `--kv paged --kv-dtype
    int8` is the same cache, and contiguous and window take --kv-dtype int8 too.
    """

    mode = "int8"
    pool_mode = "int8"


class TableStep(_PagedStep):
    """One forward over sequences of different lengths that live in one pool (the
    scheduler's batch): row b feeds `n_new` tokens at positions starts[b].. through its
    own block table. The pool allocator (kvlm.cache.prefix) has made every written slot
    exclusively the row's.

        row 0 (start 5):  k0 k1 k2 k3 k4 [k5] .  .       keys gathered from its table,
        row 1 (start 2):  k0 k1 [k2] .  .  .  .  .       padded to the longest row;
                                                         a row's padding is masked, or
                                                         not read (CPU: CacheStep.rows)
    """

    def __init__(
        self,
        pool: BlockPool,
        spec: CacheSpec,
        tables: list[list[int]],
        starts: list[int],
        n_new: int,
        others: Sequence[Sequence[list[int]]] = (),
    ) -> None:
        """`tables`: each row's table of the pool's group 0; `others`: a hybrid pool's
        other groups', group by group (others[g - 1][b]: row b's table of group g)."""
        device, bs = spec.device, pool.block_size
        n_keys = max(starts) + n_new
        pos = torch.tensor(starts)[:, None] + torch.arange(n_new)  # (B, T)
        CacheStep.__init__(self, 0, n_new, len(tables), device, None, False)
        self.positions = pos.to(device)
        self.starts, self.n_keys, self.kinds = starts, n_keys, spec.layer_kinds
        self.use_window(spec.sliding_window)
        width = blocks_for(n_keys, bs)
        self.parts, self.layer_at = [], pool.layer_at
        for group, rows in zip(pool.groups, [tables, *others], strict=True):
            if isinstance(group, Slots):
                pieces = [(s, n_new, t) for s, t in zip(starts, tables, strict=True)]
                self._slot_rows(group, rows, pieces)
                continue
            padded = torch.tensor([readable(t, width) for t in rows])  # (B, width)
            write = padded.gather(1, pos // bs).to(device)  # (B, T)
            self.parts.append(_Part(group.store, write, padded.to(device)))
        whole = self.parts[0]  # group 0's (never a conv group)
        self.write_blocks = whole.write_blocks  # (B, T)
        self.write_slots = (pos % bs).to(device)  # (B, T)
        self.read_tables = whole.read  # (B, width); the padding is masked or not read
        self._over(pool.store)

    def use_window(self, window: int | None) -> None:
        starts, n_new, n_keys, device = self.starts, self.n_new, self.n_keys, self.positions.device
        self.mask, self.is_causal, self.rows = None, False, None
        if len(set(starts)) == 1:  # rows of one length: the cheap exact forms of the mask
            self.mask, self.is_causal = causal_mask(starts[0], n_new, n_keys, window, device)
        elif device.type != "cpu":  # one call over keys padded to the longest row, masked
            # (B, 1, T, S): row b's query at position p sees its keys 0..p (within window)
            q = self.positions[:, :, None]
            keys = torch.arange(n_keys, device=device)[None, None, :]
            self.mask = visible(q, keys, window)[:, None]
        else:  # each row over its own keys
            self.rows = [(s + n_new, *causal_mask(s, n_new, s + n_new, window, device))
                         for s in starts]  # fmt: skip


@dataclass(slots=True)
class Segments:
    """Where each sequence of a ragged forward sits: its queries are rows cu_q[i]..cu_q[i+1]
    of the flattened tokens, its keys rows cu_k[i]..cu_k[i+1] of the packed keys (its
    tokens 0..start+n-1, in order: the last n are the ones it feeds)."""

    cu_q: list[int]
    cu_k: list[int]
    window: int | None
    device: torch.device
    _tensors: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.cu_q) - 1

    def span(self, i: int) -> tuple[int, int]:
        """Sequence i's (start, n): the position of its first query and how many."""
        n = self.cu_q[i + 1] - self.cu_q[i]
        return self.cu_k[i + 1] - self.cu_k[i] - n, n

    def mask(self, i: int) -> tuple[torch.Tensor | None, bool]:
        """Sequence i's causal (and window) mask over its keys, as causal_mask gives it."""
        start, n = self.span(i)
        return causal_mask(start, n, start + n, self.window, self.device)

    @staticmethod
    def longest(cu: list[int]) -> int:
        """The most queries (cu_q) or keys (cu_k) of one sequence."""
        return max(b - a for a, b in pairwise(cu))

    def cu(self, which: str) -> torch.Tensor:
        """cu_q or cu_k as an int32 device tensor (made once per step)."""
        t = self._tensors.get(which)
        if t is None:
            values = self.cu_q if which == "q" else self.cu_k
            t = self._tensors[which] = torch.tensor(values, dtype=torch.int32, device=self.device)
        return t


class RaggedStep(_PagedStep):
    """One forward over sequences that each feed their own number of tokens, in one pool:
    a step's prompt chunks and its decode rows together (vLLM's and SGLang's mixed batch).
    The tokens are flattened into one row of N, so every projection reads the weights once
    for the whole step; attention runs per sequence over its own keys (`segments`):

        tokens:  [ p0 p1 p2 p3 | d0 | d1 | q0 q1 ]   a 4-token chunk, two decode rows, a
        keys:    [ .. seq A .. | .. B .. | .. C .. | .. D .. ]   2-token chunk; each
                                                     sequence's keys gathered in order

    update() stores the step's K/V through each token's table, then returns the packed
    keys (Tk, Hkv, D) of every sequence (kvlm.model.attention.attend_ragged reads them
    with `segments`). `logit_rows`: the rows whose logits the caller wants (each
    sequence's last, or all of a scored chunk's)."""

    def __init__(
        self,
        pool: BlockPool,
        spec: CacheSpec,
        tables: list[list[int]],
        starts: list[int],
        lengths: list[int],
        logit_rows: list[int],
        others: Sequence[Sequence[list[int]]] = (),
    ) -> None:
        """`others`: a hybrid pool's other groups' tables, as TableStep's."""
        device, bs = spec.device, pool.block_size
        n = sum(lengths)
        CacheStep.__init__(self, 0, n, 1, device, None, False)
        pos, read_s, cu_q, cu_k = [], [], [0], [0]
        for table, start, length in zip(tables, starts, lengths, strict=True):
            end = start + length
            if blocks_for(end, bs) > len(table):
                raise ValueError(f"a table of {len(table)} blocks cannot hold {end} tokens")
            pos.extend(range(start, end))
            read_s.extend(p % bs for p in range(end))
            cu_q.append(cu_q[-1] + length)
            cu_k.append(cu_k[-1] + end)
        self.parts, self.layer_at = [], pool.layer_at
        for group, rows in zip(pool.groups, [tables, *others], strict=True):
            if isinstance(group, Slots):
                self._slot_rows(group, rows, list(zip(starts, lengths, tables, strict=True)))
                continue
            write_b, read_b = [], []
            for table, start, length in zip(rows, starts, lengths, strict=True):
                table = readable(table, blocks_for(start + length, bs))
                write_b.extend(table[p // bs] for p in range(start, start + length))
                read_b.extend(table[p // bs] for p in range(start + length))
            self.parts.append(_Part(
                group.store, torch.tensor(write_b, dtype=torch.long)[None].to(device),
                torch.tensor(read_b, dtype=torch.long, device=device)))  # fmt: skip
        positions = torch.tensor(pos, dtype=torch.long)
        self.positions = positions[None].to(device)  # (1, N)
        whole = self.parts[0]  # group 0's (never a conv group)
        self.write_blocks = whole.write_blocks
        self.write_slots = (positions % bs)[None].to(device)
        self.read_blocks = whole.read
        self.read_slots = torch.tensor(read_s, dtype=torch.long, device=device)
        self.segments = Segments(cu_q, cu_k, spec.sliding_window, device)
        self.logit_rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
        self.kinds = spec.layer_kinds
        self._over(pool.store)

    def use_window(self, window: int | None) -> None:
        self.segments = replace(self.segments, window=window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        """k, v (1, Hkv, N, D): stored; returns every sequence's keys packed, (Tk, Hkv, D)."""
        group, index = self.layer_at[layer]
        part = self.parts[group]
        assert part is not None, "a conv layer has no K/V"
        self._write(part, index, k, v)
        read = (part.read, ALL, self.read_slots)
        keys = part.store.get((index, 0, *read), k.dtype)
        return keys, part.store.get((index, 1, *read), v.dtype)
