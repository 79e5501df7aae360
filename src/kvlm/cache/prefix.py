"""Block tables for many independent sequences on one pool, with prefix caching.

The scheduler's view of the paged pool (kvlm.cache.paged.BlockPool): each sequence owns a
block table; full blocks are keyed by a chained hash so a later request whose tokens start
the same way takes the blocks instead of recomputing them.

    tokens:  [ system prompt ............................ | question ... ]
    blocks:  [ b0: t0-15 ][ b1: t16-31 ][ b2: t32-47 ] [ b3: t48-55 . . ]   block_size 16
    keys:      k0 = H(r, t0-15)     k1 = H(k0, t16-31)   k2 = H(k1, t32-47)   (b3 partial:
               r = root(salt)                                                  no key)

    H(parent, tokens) = sha256(parent (32 bytes) || tokens as uint32 little-endian)
    root(salt)        = sha256("kvlm/prefix/v1" || 0x00)                    no salt
                        sha256("kvlm/prefix/v1" || 0x01 || u32 len || salt as UTF-8)

Every field is fixed-width or length-prefixed, so one byte string is one (parent, tokens)
or one salt. The key is deterministic across processes (Python's hash() is not) and
collision resistant, but it only finds a candidate. The pool numbers every verified
prefix it registers (a prefix id, never reused) and keeps each registered block's tokens
and link: the prefix id of the block before it (none for a first block) and the salt. A
lookup compares both against the chunk asked for and the block the walk matched just
before, so by induction a hit was computed after exactly the requested prefix under the
same salt, whatever the hash does: a collision can never serve another prefix's, or
another tenant's, K/V (vLLM's CVE-2025-25183 was such a collision). A link to a block,
not to its key: two prefixes that collide share a key, never an id. Only full blocks
whose every token has been computed are registered.

A request's `cache_salt` (vLLM's field) enters the root: requests with different salts
never share a block, requests with the same salt (or both without one) do. A salt is a
non-empty string of at most MAX_SALT_CHARS characters; check_salt() says so at the door.

When a sequence ends its blocks go back to the pool tail first, and keep their keys: a
freed block stays findable until the pool hands it out again, which it does least recently
freed first (the pool's free queue). So a shared system prompt survives as long as memory
allows, and the tail of a conversation is evicted before its head.

A lookup never matches the whole prompt: the last token must be fed to get logits, so
matching stops at the last full block before it (vLLM does the same).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlm.cache.base import blocks_for
from kvlm.cache.paged import ALL, BlockPool
from kvlm.cache.tiers import KVTiers, check_digests, salt_field

MAX_SALT_CHARS = 256  # a salt is client input: bounded
_DOMAIN = b"kvlm/prefix/v1"


def check_salt(salt: str | None) -> None:
    """Refuse a cache salt that is not None or a string of 1..MAX_SALT_CHARS characters."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a string, not {type(salt).__name__}")
    if not salt:
        raise ValueError("cache_salt must not be empty (leave it out for no salt)")
    if len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"cache_salt is {len(salt)} characters, at most {MAX_SALT_CHARS}")


def root_key(salt: str | None) -> bytes:
    """The parent key of a chain's first block: the salt, length-prefixed
    (kvlm.cache.tiers.salt_field), under a domain tag."""
    return hashlib.sha256(_DOMAIN + salt_field(salt)).digest()


def block_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a full block: sha256 of its parent's key (32 bytes) and its token ids as
    uint32 little-endian. A token id outside [0, 2**32) raises struct.error."""
    return hashlib.sha256(parent + _packer(len(tokens))(*tokens)).digest()


@functools.cache
def _packer(n: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{n}I").pack


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks, the keys of those that are full and sealed, and its salt."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    salt: str | None = None


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Allocates, shares, copies-on-write and frees blocks of many sequences on one pool."""

    def __init__(
        self, pool: BlockPool, prefix_caching: bool = True, tiers: KVTiers | None = None
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.prefix_caching = prefix_caching
        self.tiers = tiers if prefix_caching else None  # kvlm.cache.tiers
        self.stats = PrefixStats()

    # ------------------------------------------------------------------ admission

    def match(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True
    ) -> tuple[list[int], list[bytes]]:
        """Blocks (and their keys) of the longest cached prefix of `tokens` under `salt`,
        full blocks only, never covering the last token. `reuse` False: none (a request
        that needs every prompt row's logits computes them all)."""
        check_salt(salt)
        if not self.prefix_caching or not reuse:
            return [], []
        bs, key, parent = self.block_size, root_key(salt), None
        blocks, keys = [], []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(key, chunk)
            block = self.pool.prefix.lookup(key, chunk, parent, salt)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = block
        return blocks, keys

    def fetch(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Ask the tiers for the blocks of `tokens` past the pool's hit, and load the
        longest verified run of them into free blocks, registered as if computed here: the
        next match() finds them. They wait in the free queue (the last to be evicted)
        until allocate() takes them. Returns the blocks loaded."""
        if self.tiers is None:
            return 0
        bs = self.block_size
        hit, keys = self.match(tokens, salt)
        full = (len(tokens) - 1) // bs
        for block in hit:  # held while loading, so allocate() cannot evict them
            self.pool.revive(block)
        # every block loaded takes a free one; the request needs them all anyway
        room = min(full, len(hit) + self.pool.num_free)
        if room <= len(hit):
            for block in reversed(hit):
                self.pool.release(block)
            return 0
        chunks = [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(hit), room)]
        new_keys, key = [], keys[-1] if keys else root_key(salt)
        for chunk in chunks:
            key = block_key(key, chunk)
            new_keys.append(key)
        checks = check_digests(tokens, salt, bs, room)[len(hit) :]
        loaded = self.tiers.fetch(new_keys, chunks, checks)
        held, parent = list(hit), hit[-1] if hit else None
        for key, chunk, (tier, parts) in zip(new_keys, chunks, loaded, strict=False):
            block = self.pool.allocate()
            self.pool.store.put_raw((ALL, ALL, block), parts)
            self.pool.prefix.register(block, key, chunk, parent, salt)
            self.pool.prefix.block_tier[block] = tier
            held.append(block)
            parent = block
        for block in reversed(held):  # tail first, as free() does
            self.pool.release(block)
        return len(loaded)

    def blocks_to_admit(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True
    ) -> int:
        """Free blocks that allocate(tokens, salt) would take: new ones, plus cached ones
        that sit in the free queue (taking them back also takes them out of the free
        count)."""
        return self._admit_cost(len(tokens), self.match(tokens, salt, reuse)[0])

    def _admit_cost(self, num_tokens: int, hit: list[int]) -> int:
        revived = sum(1 for b in hit if self.pool.refs[b] == 0)
        return blocks_for(num_tokens, self.block_size) - len(hit) + revived

    def can_admit(
        self, tokens: Sequence[int], reserve: int = 0, salt: str | None = None, reuse: bool = True
    ) -> bool:
        return self.blocks_to_admit(tokens, salt, reuse) <= self.pool.num_free - reserve

    def allocate(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True
    ) -> tuple[BlockTable, int]:
        """Blocks for all of `tokens`: cached prefix blocks (of the same salt) shared, the
        rest fresh. Returns the table and how many leading tokens are already computed."""
        hit, keys = self.match(tokens, salt, reuse)
        if self._admit_cost(len(tokens), hit) > self.pool.num_free:
            raise RuntimeError("allocate() without room: check can_admit() first")
        for block in hit:
            self.pool.revive(block)
            self.pool.prefix.block_hits[block] += 1
        table = BlockTable(list(hit), keys, salt)
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
        return self.pool.grow_cost(table.blocks, num_tokens, 1) <= self.pool.num_free

    def append_slot(self, table: BlockTable, num_tokens: int) -> None:
        """Make position `num_tokens` writable by this sequence alone."""
        self.pool.grow(table.blocks, num_tokens, 1)

    def seal(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> None:
        """Register every block that is now full of computed tokens, under the table's
        salt."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        first, stop, checks = len(table.hashes), num_computed // bs, None
        for i in range(first, stop):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(table.hashes[-1] if i else root_key(table.salt), chunk)
            parent = table.blocks[i - 1] if i else None
            block = table.blocks[i]
            self.pool.prefix.register(block, key, chunk, parent, table.salt)
            table.hashes.append(key)
            if self.tiers is not None and self.pool.prefix.cached.get(key) == block:
                if checks is None:
                    checks = check_digests(tokens, table.salt, bs, stop)
                parts = self.pool.store.raw((ALL, ALL, block))
                self.tiers.offer(key, chunk, checks[i], parts)

    # ------------------------------------------------------------------ lifetime

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table over the same blocks (parallel samples of one prompt)."""
        return BlockTable(self.pool.fork(table.blocks), list(table.hashes), table.salt)

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Drop the blocks past the first `num_tokens` positions (rejected draft tokens):
        released tail first, never sealed (only computed tokens' blocks are)."""
        self.pool.trim(table.blocks, num_tokens)
        del table.hashes[len(table.blocks) :]

    def pin(self, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """Hold the blocks of the longest cached prefix of `tokens` (a stored conversation:
        its last token not computed) so that eviction passes them by; unpin() lets go."""
        blocks, _ = self.match(tokens, salt)
        for block in blocks:
            self.pool.revive(block)
        return blocks

    def unpin(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):  # tail first, as free() does
            self.pool.release(block)

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks, tail first: its last blocks are evicted first."""
        self.trim(table, 0)
