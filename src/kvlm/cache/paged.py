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
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from itertools import pairwise

import torch

from kvlm.cache.base import CacheSpec, CacheStep, KVCache, KVPair, blocks_for, causal_mask, visible
from kvlm.cache.registry import PrefixRegistry
from kvlm.cache.storage import Store
from kvlm.errors import CacheOverflowError

ALL = slice(None)
# Default pool: room for this many full-length sequences. The pool is reserved, not
# touched: a block's memory is committed when it is first allocated (and zeroed).
DEFAULT_POOL_SEQUENCES = 8


class BlockPool:
    """Fixed-size K/V blocks with reference counts and a FIFO free queue."""

    def __init__(self, spec: CacheSpec, num_blocks: int, scratch: bool | None = None) -> None:
        """`scratch` (default: on a GPU): one more block, never handed out: where the
        padding rows of a captured decode batch write (kvlm.model.graphs), so they never
        touch a sequence's blocks."""
        self.block_size = spec.block_size
        self.num_blocks = num_blocks
        if scratch is None:
            scratch = spec.device.type == "cuda"
        self.scratch = num_blocks if scratch else None
        stored = num_blocks + (self.scratch is not None)
        shape = (spec.num_layers, 2, stored, spec.num_kv_heads, spec.block_size, spec.head_dim)
        # Uninitialised: allocate() zeroes a block before handing it out, so gathered slots
        # past a sequence's end hold zeros, never NaN garbage that 0 * NaN would spread.
        self.store = Store(shape, spec.dtype, spec.device, zero=False)
        if self.scratch is not None:
            self.store.zero_((ALL, ALL, self.scratch))
        self.refs = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # The prefix cache's index of full blocks (kvlm.cache.registry): a freed block stays
        # findable until allocate() hands it out again.
        self.prefix = PrefixRegistry(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def block_nbytes(self) -> int:
        return self.store.nbytes // self.store.values.shape[2]

    def allocate(self) -> int:
        if not self.free_queue:
            raise CacheOverflowError(f"the KV block pool is full ({self.num_blocks} blocks)")
        block, _ = self.free_queue.popitem(last=False)  # the least recently freed
        self.prefix.forget(block)  # evicted from the prefix cache, if it was there
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
        shared = start // bs < len(table) and self.refs[table[start // bs]] > 1
        return new + shared

    def grow(self, table: list[int], start: int, n_new: int) -> None:
        """Make positions start..start + n_new - 1 this table's alone: the shared block
        that `start` falls in is copied (copy on write), fresh blocks are appended."""
        bs = self.block_size
        i = start // bs
        if i < len(table) and self.refs[table[i]] > 1:
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
            self.release(table.pop())

    def fork(self, table: list[int]) -> list[int]:
        """A second table over the same blocks."""
        for block in table:
            self.share(block)
        return list(table)


class _PagedStep(CacheStep):
    """A step that writes each token at its block and slot of a pool's store."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        self._write(layer, k, v)
        return self._gather(layer, 0, k.dtype), self._gather(layer, 1, v.dtype)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, Hkv, T, D) at each token's block and slot."""
        k = self._keys_in(k)
        # (layer, K/V, block[B,T], :, slot[B,T]) addresses (B, T, heads, D)
        self.store.put((layer, 0, self.write_blocks, ALL, self.write_slots), k.transpose(1, 2))
        self.store.put((layer, 1, self.write_blocks, ALL, self.write_slots), v.transpose(1, 2))

    def _gather(self, layer: int, kv: int, dtype: torch.dtype) -> torch.Tensor:
        blocks = self.store.get((layer, kv, self.read_tables), dtype)  # (B, nb, H, bs, D)
        rows = blocks.transpose(1, 2).flatten(2, 3)  # (B, H, nb * bs, D)
        return rows[:, :, : self.n_keys]  # the partial last block's tail is cut, not masked


class PagedCache(KVCache):
    mode = "paged"

    def __init__(self, spec: CacheSpec, pool: BlockPool | None = None) -> None:
        super().__init__(spec)
        default = blocks_for(spec.max_tokens, spec.block_size) * DEFAULT_POOL_SEQUENCES
        self.pool = pool or BlockPool(spec, spec.num_blocks or default)
        self.tables: list[list[int]] = [[] for _ in range(spec.batch)]

    # ------------------------------------------------------------------ capacity

    def _blocks_to_add(self, n_new: int) -> int:
        """Blocks the next step of n_new tokens takes from the pool: new blocks, plus the
        copies of shared partial blocks it writes into. Of r rows sharing a partial block,
        r - 1 copy it and the last writes in place, unless someone outside this cache also
        holds it, in which case all r copy."""
        bs = self.spec.block_size
        need = blocks_for(self.num_tokens + n_new, bs)
        total = sum(need - len(table) for table in self.tables)
        if self.num_tokens % bs:
            sharers = Counter(table[-1] for table in self.tables)
            for block, rows in sharers.items():
                if self.pool.refs[block] > 1:
                    total += rows if self.pool.refs[block] > rows else rows - 1
        return total

    def would_overflow(self, n_new: int) -> bool:
        return super().would_overflow(n_new) or self._blocks_to_add(n_new) > self.pool.num_free

    def _overflow_message(self, n_new: int) -> str:
        if self.num_tokens + n_new > self.capacity:
            return super()._overflow_message(n_new)
        return (
            f"the KV block pool is out of blocks: this step needs {self._blocks_to_add(n_new)}, "
            f"{self.pool.num_free} of {self.pool.num_blocks} are free"
        )

    # ------------------------------------------------------------------ the forward

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        start = self.num_tokens
        for table in self.tables:
            self.pool.grow(table, start, n_new)
        if draft:  # the sequence's tokens as rows of one token, at consecutive positions
            tables, starts, n = self.tables * n_new, list(range(start, start + n_new)), 1
        else:  # every row's n_new tokens from start
            tables, starts, n = self.tables, [start] * self.batch, n_new
        step = TableStep(self.pool, self.spec, tables, starts, n)
        step.start, step.n_new = start, n_new  # what commit reads
        return step

    # ------------------------------------------------------------------ lifetime

    def _truncate(self, length: int) -> None:
        for table in self.tables:
            self.pool.trim(table, length)

    def _release(self) -> None:
        self._truncate(0)
        self.tables = [[] for _ in range(self.spec.batch)]

    def _fork(self, n: int) -> None:
        self.tables = [
            table if i == 0 else self.pool.fork(table) for table in self.tables for i in range(n)
        ]

    def _export(self) -> dict[str, torch.Tensor]:
        tables = torch.tensor(self.tables, dtype=torch.long)  # (B, blocks), blocks may be 0
        raw = self.pool.store.raw((ALL, ALL, tables.to(self.spec.device)))
        # (L, 2, B, nb, H, bs[, D]) -> (L, 2, B, H, nb * bs[, D]), cut to the tokens held
        n = self.num_tokens
        return {name: t.transpose(3, 4).flatten(4, 5)[:, :, :, :, :n] for name, t in raw.items()}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        bs = self.spec.block_size
        need = self.batch * blocks_for(length, bs)
        if need > self.pool.num_free:  # refuse before taking any: a partial take would leak
            raise CacheOverflowError(
                f"{self.batch} rows of {length} tokens need {need} blocks, the pool has "
                f"{self.pool.num_free} free"
            )
        self.tables = [
            [self.pool.allocate() for _ in range(blocks_for(length, bs))] for _ in range(self.batch)
        ]
        if length == 0:
            return
        pos = torch.arange(length)
        tables = torch.tensor(self.tables, dtype=torch.long)
        blocks = tables[:, pos // bs].to(self.spec.device)  # (B, n)
        slots = (pos % bs).expand(self.batch, length).to(self.spec.device)
        # (L, 2, block[B,n], H, slot[B,n]) addresses (B, n, L, 2, H[, D])
        raw = {k: t.permute(2, 4, 0, 1, 3, *range(5, t.dim())) for k, t in tensors.items()}
        self.pool.store.put_raw((ALL, ALL, blocks, ALL, slots), raw)

    # ------------------------------------------------------------------ accounting

    @property
    def blocks_used(self) -> int:
        """Distinct blocks this cache references (shared ones once)."""
        return len({b for table in self.tables for b in table})

    @property
    def nbytes(self) -> int:
        return self.blocks_used * self.pool.block_nbytes

    @property
    def tokens_stored(self) -> int:
        """Distinct token slots holding data: a shared prefix counts once."""
        bs, filled = self.spec.block_size, {}
        for table in self.tables:
            for j, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(bs, self.num_tokens - j * bs))
        return sum(filled.values())

    @property
    def waste(self) -> float:
        """Fraction of the allocated slots that hold no token (partial last blocks)."""
        slots = self.blocks_used * self.spec.block_size
        return 0.0 if slots == 0 else 1 - self.tokens_stored / slots

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        blocks = batch * blocks_for(tokens, spec.block_size)
        return blocks * spec.block_size * spec.bytes_per_token


class Int8PagedCache(PagedCache):
    """`int8`: the paged layout with int8 codes and a per-token step and zero point
    (kvlm.cache.storage).

    The factory gives it an int8 spec whatever --kv-dtype says; `--kv paged --kv-dtype
    int8` is the same cache, and contiguous and window take --kv-dtype int8 too.
    """

    mode = "int8"


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
    ) -> None:
        device, bs = spec.device, pool.block_size
        n_keys = max(starts) + n_new
        pos = torch.tensor(starts)[:, None] + torch.arange(n_new)  # (B, T)
        CacheStep.__init__(self, 0, n_new, len(tables), device, None, False)
        self.positions = pos.to(device)
        self.starts, self.n_keys, self.windows = starts, n_keys, spec.layer_windows
        self.use_window(spec.sliding_window)
        width = blocks_for(n_keys, bs)
        # Pad short tables with their own last block: its slots hold finite values (never
        # an unallocated block's garbage, which 0 * NaN would carry through the mask).
        padded = torch.tensor([t[:width] + t[-1:] * (width - len(t[:width])) for t in tables])
        self.write_blocks = padded.gather(1, pos // bs).to(device)  # (B, T)
        self.write_slots = (pos % bs).to(device)  # (B, T)
        self.read_tables = padded.to(device)  # (B, width); the padding is masked or not read
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
    ) -> None:
        device, bs = spec.device, pool.block_size
        n = sum(lengths)
        CacheStep.__init__(self, 0, n, 1, device, None, False)
        pos, write_b, read_b, read_s, cu_q, cu_k = [], [], [], [], [0], [0]
        for table, start, length in zip(tables, starts, lengths, strict=True):
            end = start + length
            if blocks_for(end, bs) > len(table):
                raise ValueError(f"a table of {len(table)} blocks cannot hold {end} tokens")
            span = range(start, end)
            pos.extend(span)
            write_b.extend(table[p // bs] for p in span)
            read_b.extend(table[p // bs] for p in range(end))
            read_s.extend(p % bs for p in range(end))
            cu_q.append(cu_q[-1] + length)
            cu_k.append(cu_k[-1] + end)
        positions = torch.tensor(pos, dtype=torch.long)
        self.positions = positions[None].to(device)  # (1, N)
        self.write_blocks = torch.tensor(write_b, dtype=torch.long)[None].to(device)
        self.write_slots = (positions % bs)[None].to(device)
        self.read_blocks = torch.tensor(read_b, dtype=torch.long, device=device)
        self.read_slots = torch.tensor(read_s, dtype=torch.long, device=device)
        self.segments = Segments(cu_q, cu_k, spec.sliding_window, device)
        self.logit_rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
        self.windows = spec.layer_windows
        self._over(pool.store)

    def use_window(self, window: int | None) -> None:
        self.segments = replace(self.segments, window=window)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        """k, v (1, Hkv, N, D): stored; returns every sequence's keys packed, (Tk, Hkv, D)."""
        self._write(layer, k, v)
        read = (self.read_blocks, ALL, self.read_slots)
        keys = self.store.get((layer, 0, *read), k.dtype)
        return keys, self.store.get((layer, 1, *read), v.dtype)
