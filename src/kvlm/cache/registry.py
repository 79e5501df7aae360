"""The prefix cache's index: which full K/V blocks of a BlockPool (kvlm.cache.paged) hold
which prefix, and how to find one by its chained key (kvlm.cache.prefix computes the keys,
BlockManager registers and looks up).

A full block is registered under its chained key (a sha256 digest of its tokens after its
parent's), with its tokens and its link: its parent's prefix id and the chain's salt. A
lookup compares tokens and link, never the key alone, so a key collision can never serve
another prefix's (or another salt's) K/V. A freed block keeps its entry, and stays
findable, until the pool hands it out again (`forget`).
"""

from __future__ import annotations

# A registered block's link to what precedes it: (its parent's prefix id, or None for the
# first block of a chain; the chain's cache salt, or None).
Link = tuple[int | None, str | None]


class PrefixRegistry:
    """Per block of a pool: its key, tokens, link and verified prefix id; key -> block."""

    def __init__(self, num_blocks: int) -> None:
        self.cached: dict[bytes, int] = {}  # key -> block, the first holder of the key
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_parent: list[Link | None] = [None] * num_blocks
        # The verified prefix a block's K/V was computed after (through its own tokens): 0
        # for none. A holder of a key gets a fresh id; a block that sealed the same tokens
        # after the same link as the holder (two requests computed one prefix at once) gets
        # the holder's, so the blocks sealed after it still link up. Ids are never reused.
        self.prefix_id: list[int] = [0] * num_blocks
        self._last_prefix_id = 0
        # For the pictures (kvlm.cache.view): admissions that took a registered block from
        # the cache, and the tier a block was loaded from (kvlm.cache.tiers), until forgotten.
        self.block_hits: list[int] = [0] * num_blocks
        self.block_tier: list[str | None] = [None] * num_blocks
        self.evictions = 0  # registered blocks handed out again

    def register(
        self, block: int, key: bytes, tokens: tuple[int, ...], parent: int | None, salt: str | None
    ) -> None:
        """Make a full block findable by its chained key. `parent` is the block before it in
        its sequence (None for the first). The first holder of a key wins; a block after a
        parent that holds no verified prefix is not registered (no lookup could reach it,
        and it would keep the key from a block that can be reached)."""
        link = self._link(parent, salt)
        if link is not None:
            self.register_linked(block, key, tokens, link)

    def register_linked(self, block: int, key: bytes, tokens: tuple[int, ...], link: Link) -> None:
        """register() with its link given: a hybrid pool's windowed group links a block to
        the prefix id of the global group's block at the same place (and the salt), since
        the block before it in its own group may have left the window."""
        if self.prefix_id[block]:
            return
        holder = self.cached.get(key)
        if holder is not None:
            if self.block_tokens[holder] == tokens and self.block_parent[holder] == link:
                self.prefix_id[block] = self.prefix_id[holder]  # the same prefix, computed twice
            return
        self._last_prefix_id += 1
        self.prefix_id[block] = self._last_prefix_id
        self.cached[key] = block
        self.block_hash[block] = key
        self.block_tokens[block] = tokens
        self.block_parent[block] = link

    def lookup(
        self, key: bytes, tokens: tuple[int, ...], parent: int | None, salt: str | None
    ) -> int | None:
        """The cached block holding exactly `tokens` right after block `parent` (the block
        this lookup's caller matched just before; None for the first), under `salt`, or
        None. The key only finds a candidate: its tokens and its link are compared, so by
        induction a hit was computed after exactly the caller's prefix, and a key collision
        can never serve another prefix's (or another salt's) K/V."""
        block = self.cached.get(key)
        if block is None or self.block_tokens[block] != tokens:
            return None
        prefix = None if parent is None else self.prefix_id[parent]  # inline _link: hot
        return block if prefix != 0 and self.block_parent[block] == (prefix, salt) else None

    def lookup_linked(self, key: bytes, tokens: tuple[int, ...], link: Link) -> int | None:
        """lookup() with the link given (a windowed group's, register_linked)."""
        block = self.cached.get(key)
        if block is None or self.block_tokens[block] != tokens:
            return None
        return block if self.block_parent[block] == link else None

    def _link(self, parent: int | None, salt: str | None) -> Link | None:
        """What a block after `parent` records: the parent's prefix id (None for the first
        block of a chain) and the salt; None when the parent holds no verified prefix."""
        if parent is None:
            return None, salt
        prefix = self.prefix_id[parent]
        return (prefix, salt) if prefix else None

    def forget(self, block: int) -> None:
        """Drop a block from the prefix cache (evicted, or about to be overwritten)."""
        self.prefix_id[block] = 0
        self.block_hits[block] = 0
        self.block_tier[block] = None
        key = self.block_hash[block]
        if key is None:
            return
        self.evictions += 1  # only allocate() forgets: the block was free
        del self.cached[key]
        self.block_hash[block] = None
        self.block_tokens[block] = None
        self.block_parent[block] = None
