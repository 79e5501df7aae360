"""Block tables for many independent sequences on one pool, with prefix caching.

The scheduler's view of the paged pool (kvlm.cache.paged.BlockPool): each sequence owns a
block table; full blocks are keyed by a chained hash so a later request whose tokens start
the same way takes the blocks instead of recomputing them.

    tokens:  [ system prompt ............................ | question ... ]
    blocks:  [ b0: t0-15 ][ b1: t16-31 ][ b2: t32-47 ] [ b3: t48-55 . . ]   block_size 16
    hashes:    h0 = H(None, t0-15)   h1 = H(h0, t16-31)   h2 = H(h1, t32-47)   (b3 partial:
                                                                              no hash)

A block's hash covers everything before it, so equal hashes mean equal prefixes, and the
token ids stored beside the hash confirm it (a hash collision can never serve another
prefix's K/V). Only full blocks whose every token has been computed are registered.

When a sequence ends its blocks go back to the pool tail first, and keep their hashes: a
freed block stays findable until the pool hands it out again, which it does least recently
freed first (the pool's free queue). So a shared system prompt survives as long as memory
allows, and the tail of a conversation is evicted before its head.

A lookup never matches the whole prompt: the last token must be fed to get logits, so
matching stops at the last full block before it (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlm.cache.base import blocks_for
from kvlm.cache.paged import BlockPool


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The key of a full block: its tokens and (through `parent`) every token before it."""
    return hash((parent, tokens))


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks, and the hashes of those that are full and registered."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Allocates, shares, copies-on-write and frees blocks of many sequences on one pool."""

    def __init__(self, pool: BlockPool, prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.prefix_caching = prefix_caching
        self.stats = PrefixStats()

    # ------------------------------------------------------------------ admission

    def match(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) of the longest cached prefix of `tokens`, full blocks
        only, never covering the last token."""
        if not self.prefix_caching:
            return [], []
        bs, parent = self.block_size, None
        blocks, hashes = [], []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(parent, chunk)
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def blocks_to_admit(self, tokens: Sequence[int]) -> int:
        """Free blocks that allocate(tokens) would take: new ones, plus cached ones that sit
        in the free queue (taking them back also takes them out of the free count)."""
        hit, _ = self.match(tokens)
        revived = sum(1 for b in hit if self.pool.refs[b] == 0)
        return blocks_for(len(tokens), self.block_size) - len(hit) + revived

    def can_admit(self, tokens: Sequence[int], reserve: int = 0) -> bool:
        return self.blocks_to_admit(tokens) <= self.pool.num_free - reserve

    def allocate(self, tokens: Sequence[int]) -> tuple[BlockTable, int]:
        """Blocks for all of `tokens`: cached prefix blocks shared, the rest fresh. Returns
        the table and how many leading tokens are already computed."""
        if not self.can_admit(tokens):
            raise RuntimeError("allocate() without room: check can_admit() first")
        hit, hashes = self.match(tokens)
        for block in hit:
            self.pool.revive(block)
        table = BlockTable(list(hit), list(hashes))
        need = blocks_for(len(tokens), self.block_size)
        table.blocks += [self.pool.allocate() for _ in range(need - len(hit))]
        cached = len(hit) * self.block_size
        self.stats.queries += len(tokens)
        self.stats.hits += cached
        return table, cached

    # ------------------------------------------------------------------ decode

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether the token at position `num_tokens` can be written: it needs a new block
        when it starts one, or a copy when its block is shared."""
        return self._append_cost(table, num_tokens) <= self.pool.num_free

    def append_slot(self, table: BlockTable, num_tokens: int) -> None:
        """Make position `num_tokens` writable by this sequence alone."""
        bs = self.block_size
        if num_tokens // bs >= len(table.blocks):
            table.blocks.append(self.pool.allocate())
        else:
            last = table.blocks[-1]
            if self.pool.refs[last] > 1:  # copy on write
                table.blocks[-1] = self.pool.allocate()
                self.pool.copy(last, table.blocks[-1])
                self.pool.release(last)

    def _append_cost(self, table: BlockTable, num_tokens: int) -> int:
        if num_tokens // self.block_size >= len(table.blocks):
            return 1
        return 1 if self.pool.refs[table.blocks[-1]] > 1 else 0

    def seal(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> None:
        """Register every block that is now full of computed tokens."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.hashes), num_computed // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(table.hashes[-1] if table.hashes else None, chunk)
            self.pool.register(table.blocks[i], h, chunk)
            table.hashes.append(h)

    # ------------------------------------------------------------------ lifetime

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table over the same blocks (parallel samples of one prompt)."""
        for block in table.blocks:
            self.pool.share(block)
        return BlockTable(list(table.blocks), list(table.hashes))

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks, tail first: its last blocks are evicted first."""
        for block in reversed(table.blocks):
            self.pool.release(block)
        table.blocks.clear()
        table.hashes.clear()
