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
import logging
import struct
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from kvlm.cache.base import blocks_for
from kvlm.cache.paged import ALL, FREED, BlockPool, window_blocks
from kvlm.cache.slots import Slots
from kvlm.cache.tiers import KVTiers, check_digests, salt_field
from kvlm.errors import CacheOverflowError

log = logging.getLogger("kvlm.tiers")

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
    """One sequence's blocks, the keys of those that are full and sealed, and its salt; on
    a hybrid pool also its table of each other layer group (`others[g - 1]`, group g of
    kvlm.cache.paged.BlockPool.groups: FREED where a block has left a window; a conv
    group's or a DeltaNet group's, the sequence's one slot: kvlm.cache.slots)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    salt: str | None = None
    others: list[list[int]] = field(default_factory=list)


# A state group's records a tier lookup asks at once, latest block first, where only some
# blocks have one (StateSlots.every_end False): BlockManager._fetch_rows
SPARSE_ASK = 8


def checks_of(tokens: Sequence[int], salt: str | None, block_size: int, want: list[int]) -> list:
    """The tier checks (check_digests) of blocks `want` (ascending), one pass over the
    tokens."""
    digests = check_digests(tokens, salt, block_size, want[-1] + 1)
    return [digests[i] for i in want]


# a lookup in the tiers as the engine thread runs it: each yield a wait, off the thread
Steps = Generator[Future, list, int]


class TierFetch:
    """A prompt's lookup in the KV tiers under way (BlockManager.start_fetch). Its steps
    run on the engine thread (taking and filling blocks); between them it waits for the
    tiers' lookup thread, and the engine thread does not: poll() goes on only when the
    awaited answer is in. The request waits meanwhile (its step goes on for everyone
    else), at most the tiers' deadlines (kvlm.cache.tiers)."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self.waiting: Future | None = None  # the lookup awaited (None once done)
        self.loaded = 0  # blocks loaded, once done
        self._next(None)

    def poll(self) -> bool:
        """Whether it is done: its blocks are in the pool (or none came)."""
        while self.waiting is not None and self.waiting.done():
            try:
                found = self.waiting.result()
            except Exception:  # a bug on the lookup thread: the request recomputes
                log.exception("a KV tier lookup failed")
                found = []
            self._next(found)
        return self.waiting is None

    def cancel(self) -> None:
        """The request left: let go of what it held (the lookup's answer is dropped)."""
        self._steps.close()
        self.waiting = None

    def _next(self, found: list | None) -> None:
        try:
            self.waiting = self._steps.send(found)
        except StopIteration as stop:
            self.waiting, self.loaded = None, stop.value


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cached blocks
    # a hybrid pool's admissions whose global layers' blocks matched (window_lookups), and
    # of those, the ones whose hit was cut short because the windowed layers' blocks before
    # the hit had been handed out again, or a conv group held no end rows of the hit's
    # last block (window_cut; the tokens lost: window_cut_tokens)
    window_lookups: int = 0
    window_cut: int = 0
    window_cut_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class Hit:
    """A prefix-cache match: group 0's blocks and keys, each other group's table at the
    hit (FREED, then the blocks of the window before it), and how many of the blocks
    group 0 matched were given up because another group lacked their window (`cut`)."""

    blocks: list[int]
    keys: list[bytes]
    others: list[list[int]]
    cut: int = 0


class BlockManager:
    """Allocates, shares, copies-on-write and frees blocks of many sequences on one pool.

    On a hybrid pool (a table per layer group, kvlm.cache.paged) a prefix hit at position p
    needs group 0's blocks up to p and each windowed group's blocks of [p - W, p): the
    window the next query reads. A windowed group's blocks are allocated a step at a time
    (`prepare`, `append_slot`) and let go of once they leave the window (`seal`), so one
    sequence holds at most window_blocks(W + RING_SLACK, block_size, step_tokens) of them;
    `step_tokens` is the most tokens one step feeds a sequence (a prefill chunk, a draft).

    A conv group (kvlm.cache.conv.ConvSlots) keeps a slot of rows a sequence: taken at
    admission (`allocate`), back at its finish or preemption (`free`), copied by `fork`; a
    hit at p needs the rows before p, the end rows of group 0's block ending at p, which
    `seal` marks held as it registers a block (the steps wrote them): the hit is the longest
    p whose rows are held (sglang's mamba radix cache, vLLM's hybrid manager). A DeltaNet
    group (kvlm.cache.recurrent.StateSlots) keeps a slot of state a sequence the same way
    and no state at block ends yet: no hit reaches a model with one."""

    def __init__(
        self,
        pool: BlockPool,
        prefix_caching: bool = True,
        tiers: KVTiers | None = None,
        step_tokens: int = 1,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.prefix_caching = prefix_caching
        self.tiers = tiers if prefix_caching else None  # kvlm.cache.tiers
        self.stats = PrefixStats()
        self.step_tokens = step_tokens

    @property
    def others(self) -> list[BlockPool | Slots]:
        """A hybrid pool's layer groups after group 0, each window's and a conv group's
        (none for one group)."""
        return self.pool.groups[1:]

    def sequence_blocks(self, group: BlockPool) -> int:
        """The most blocks of windowed `group` one sequence holds during a step."""
        return window_blocks(group.keep, group.block_size, self.step_tokens)

    # ------------------------------------------------------------------ admission

    def match(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True
    ) -> tuple[list[int], list[bytes]]:
        """Blocks (and their keys) of the longest cached prefix of `tokens` under `salt`,
        full blocks only, never covering the last token, whose every windowed group holds
        the window before it. `reuse` False: none (a request that needs every prompt row's
        logits computes them all)."""
        hit = self._match(tokens, salt, reuse)
        return hit.blocks, hit.keys

    def _walk(
        self, tokens: Sequence[int], salt: str | None, reuse: bool = True
    ) -> tuple[list[int], list[bytes]]:
        """Group 0's blocks and keys of the longest cached prefix of `tokens`."""
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

    def _match(self, tokens: Sequence[int], salt: str | None, reuse: bool = True) -> Hit:
        """The longest hit: group 0's walk, cut back to the longest prefix whose window
        every windowed group still holds and whose last block's end rows every conv group
        holds (its table at the hit: empty, the slot is taken at admission)."""
        blocks, keys = self._walk(tokens, salt, reuse)
        if not self.others or not blocks:
            return Hit(blocks, keys, [[] for _ in self.others])
        found = [None if isinstance(g, Slots) else
                 self._window_blocks(g, tokens, salt, blocks, keys)
                 for g in self.others]  # fmt: skip
        bs, h, ids = self.block_size, len(blocks), self.pool.prefix.prefix_id
        while h > 0:
            tables = []
            for group, have in zip(self.others, found, strict=True):
                if isinstance(group, Slots):
                    if not group.has_rows(blocks[h - 1], ids[blocks[h - 1]]):
                        break
                    tables.append([])
                    continue
                lo = max(0, h * bs - group.window) // bs
                if any(b is None for b in have[lo:h]):
                    break
                tables.append([FREED] * lo + have[lo:h])
            else:
                return Hit(blocks[:h], keys[:h], tables, len(blocks) - h)
            h -= 1
        return Hit([], [], [[] for _ in self.others], len(blocks))

    def _window_blocks(
        self, group: BlockPool, tokens: Sequence[int], salt: str | None, blocks: list[int],
        keys: list[bytes],
    ) -> list[int | None]:  # fmt: skip
        """For each block of group 0's hit, the windowed group's block computed after the
        same prefix (linked to group 0's block there), or None."""
        bs, out = self.block_size, [None] * len(blocks)
        for i in range(len(blocks) - 1, -1, -1):
            link = (self.pool.prefix.prefix_id[blocks[i]], salt)
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            out[i] = group.prefix.lookup_linked(keys[i], chunk, link)
        return out

    def fetch(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """start_fetch(), waited for here: the blocks loaded (tests, a caller with nothing
        else to do)."""
        job = self.start_fetch(tokens, salt)
        if job is None:
            return 0
        while not job.poll():
            wait([job.waiting])
        return job.loaded

    def start_fetch(self, tokens: Sequence[int], salt: str | None = None) -> TierFetch | None:
        """Ask the tiers for the blocks of `tokens` past the pool's hit: the lookup runs
        on the tiers' lookup thread, and TierFetch.poll(), on the engine thread, loads the
        longest verified run of them into free blocks once it is back, registered as if
        computed here: the next match() finds them. They wait in the free queue (the last
        to be evicted) until allocate() takes them. On a hybrid pool, then each windowed
        group's blocks of the window before the hit the tiers can serve, so a tier hit
        obeys the rule a pool hit does. None without tiers."""
        if self.tiers is None:
            return None
        return TierFetch(self._fetch_steps(tokens, salt))

    def _fetch_steps(self, tokens: Sequence[int], salt: str | None) -> Steps:
        loaded = yield from self._fetch_group0(tokens, salt)
        if self.others:
            blocks, keys = self._walk(tokens, salt)
            for g, group in enumerate(self.others, start=1):
                if isinstance(group, Slots):
                    loaded += yield from self._fetch_rows(g, group, tokens, salt, blocks, keys)
                else:
                    loaded += yield from self._fetch_window(g, group, tokens, salt, blocks, keys)
        return loaded

    def _fetch_group0(self, tokens: Sequence[int], salt: str | None) -> Steps:
        bs = self.block_size
        hit, keys = self._walk(tokens, salt)
        full = (len(tokens) - 1) // bs
        # held while the lookup runs and the blocks load, so nothing evicts them
        for block in hit:
            self.pool.revive(block)
        held, loaded = list(hit), []
        try:
            # every block loaded takes a free one; the request needs them all anyway
            room = min(full, len(hit) + self.pool.num_free)
            if room <= len(hit):
                return 0
            chunks = [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(hit), room)]
            new_keys, key = [], keys[-1] if keys else root_key(salt)
            for chunk in chunks:
                key = block_key(key, chunk)
                new_keys.append(key)
            skip = len(hit)
            loaded = yield self.tiers.fetch_later(
                new_keys, chunks, lambda: check_digests(tokens, salt, bs, room)[skip:]
            )
            loaded = loaded[: self.pool.num_free]  # the pool may have given some out since
            parent = hit[-1] if hit else None
            for key, chunk, (tier, parts) in zip(new_keys, chunks, loaded, strict=False):
                block = self.pool.allocate()
                held.append(block)
                self.pool.store.put_raw((ALL, ALL, block), parts)
                self.pool.prefix.register(block, key, chunk, parent, salt)
                self.pool.prefix.block_tier[block] = tier
                parent = block
        finally:  # also when the request leaves while it waits (TierFetch.cancel)
            for block in reversed(held):  # tail first, as free() does
                self.pool.release(block)
        return len(loaded)

    def _fetch_window(
        self, g: int, group: BlockPool, tokens: Sequence[int], salt: str | None,
        blocks: list[int], keys: list[bytes],
    ) -> Steps:  # fmt: skip
        """Load windowed group g's blocks of the window before group 0's hit (`blocks`)
        that the pool lacks, from the tiers (the group's own records), linked as seal()
        links them. The ones it has are held while loading, and group 0's hit too."""
        bs = self.block_size
        lo = max(0, len(blocks) * bs - group.window) // bs
        have = self._window_blocks(group, tokens, salt, blocks, keys)
        held = [b for b in have[lo:] if b is not None]
        for block in held:
            group.revive(block)
        for block in blocks:
            self.pool.revive(block)
        loaded = []
        try:
            want = [i for i in range(lo, len(blocks)) if have[i] is None][: group.num_free]
            if not want:
                return 0
            chunks = {i: tuple(tokens[i * bs : (i + 1) * bs]) for i in want}
            loaded = yield self.tiers.fetch_later(
                [keys[i] for i in want], [chunks[i] for i in want],
                lambda: checks_of(tokens, salt, bs, want), g,
            )  # fmt: skip
            loaded = loaded[: group.num_free]
            for i, (tier, parts) in zip(want, loaded, strict=False):
                block = group.allocate()
                held.append(block)
                group.store.put_raw((ALL, ALL, block), parts)
                link = (self.pool.prefix.prefix_id[blocks[i]], salt)
                group.prefix.register_linked(block, keys[i], chunks[i], link)
                group.prefix.block_tier[block] = tier
        finally:
            for block in held:
                group.release(block)
            for block in reversed(blocks):
                self.pool.release(block)
        return len(loaded)

    def _fetch_rows(
        self, g: int, group: Slots, tokens: Sequence[int], salt: str | None,
        blocks: list[int], keys: list[bytes],
    ) -> Steps:  # fmt: skip
        """Load state group g's end state of group 0's hit (`blocks`) where the pool lacks
        it, from the tiers (the group's own record of a block), so a tier hit restores the
        sequence's state as a pool hit does: a conv group's end rows of the hit's last
        block (every block has them); a DeltaNet group's snapshot at the latest block end
        past the last one the pool holds that a tier has (some blocks have one: the hit is
        cut back to it, BlockManager._match). The blocks are held while they load."""
        if not blocks or not group.holds_ends:
            return 0
        ids, bs = self.pool.prefix.prefix_id, self.block_size
        have = [i for i, b in enumerate(blocks) if group.has_rows(b, ids[b])]
        if have and have[-1] == len(blocks) - 1:
            return 0
        # a DeltaNet's records: asked for latest first, SPARSE_ASK blocks a lookup, so that
        # the records before the latest found (a state each, ~19 MiB for a 0.8B hybrid's
        # shape) are not read for nothing
        lo = len(blocks) - 1 if group.every_end else (have[-1] + 1 if have else 0)
        step = 1 if group.every_end else SPARSE_ASK
        for hi in range(len(blocks), lo, -step):
            want = list(range(max(lo, hi - step), hi))
            held_as = [ids[blocks[i]] for i in want]
            for i in want:
                self.pool.revive(blocks[i])
            try:
                chunks = [tuple(tokens[i * bs : (i + 1) * bs]) for i in want]
                found = yield self.tiers.fetch_later(
                    [keys[i] for i in want], chunks,
                    lambda want=want: checks_of(tokens, salt, bs, want), g, run=False,
                )  # fmt: skip
                for i, was, entry in reversed(list(zip(want, held_as, found, strict=True))):
                    if entry is not None and ids[blocks[i]] == was:  # the latest found
                        return int(group.put_block_rows(blocks[i], entry[1], was))
            finally:
                for i in reversed(want):
                    self.pool.release(blocks[i])
        return 0

    def blocks_to_admit(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True
    ) -> int:
        """Free blocks of group 0 that allocate(tokens, salt) would take: new ones, plus
        cached ones that sit in the free queue (taking them back also takes them out of
        the free count)."""
        return self._admit_cost(len(tokens), self.match(tokens, salt, reuse)[0])

    def _admit_cost(self, num_tokens: int, hit: list[int]) -> int:
        revived = sum(1 for b in hit if self.pool.refs[b] == 0)
        return blocks_for(num_tokens, self.block_size) - len(hit) + revived

    def can_admit(
        self, tokens: Sequence[int], reserve: int = 0, salt: str | None = None, reuse: bool = True
    ) -> bool:
        """Whether group 0 has the request's blocks and `reserve` more free, and each
        windowed group the cached blocks it takes back and a sequence's most
        (sequence_blocks)."""
        hit = self._match(tokens, salt, reuse)
        if self._admit_cost(len(tokens), hit.blocks) > self.pool.num_free - reserve:
            return False
        for group, table in zip(self.others, hit.others, strict=True):
            if isinstance(group, Slots):  # a slot of rows
                if not group.num_free:
                    return False
                continue
            revived = sum(1 for b in table if b != FREED and group.refs[b] == 0)
            if revived + self.sequence_blocks(group) > group.num_free:
                return False
        return True

    def allocate(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True,
        turn_start: int | None = None,
    ) -> tuple[BlockTable, int]:  # fmt: skip
        """Blocks for all of `tokens`: cached prefix blocks (of the same salt) shared, the
        rest fresh (a windowed group's: as each step needs them, `prepare`). Returns the
        table and how many leading tokens are already computed. `turn_start`: where a
        chat prompt's generation prompt begins (a state group's prompt snapshot is taken
        at the last block end at most it: `Slots.turn`)."""
        hit = self._match(tokens, salt, reuse)
        if self._admit_cost(len(tokens), hit.blocks) > self.pool.num_free:
            raise RuntimeError("allocate() without room: check can_admit() first")
        for group, blocks in zip(self.pool.groups, [hit.blocks, *hit.others], strict=True):
            for block in blocks:
                if block != FREED:
                    group.revive(block)
                    group.prefix.block_hits[block] += 1
        table = BlockTable(list(hit.blocks), hit.keys, salt, [list(t) for t in hit.others])
        need = blocks_for(len(tokens), self.block_size)
        table.blocks += [self.pool.allocate() for _ in range(need - len(hit.blocks))]
        cached = len(hit.blocks) * self.block_size
        for group, slots in zip(self.others, table.others, strict=True):
            if isinstance(group, Slots):  # its slot, its rows at the hit
                slots.append(group.allocate())
                if hit.blocks:
                    group.restore(slots[0], hit.blocks[-1], cached)
                if turn_start is not None:
                    group.turn(slots[0], turn_start)
        self.stats.queries += len(tokens)
        self.stats.hits += cached
        if self.others and (hit.blocks or hit.cut):
            self.stats.window_lookups += 1
            self.stats.window_cut += hit.cut > 0
            self.stats.window_cut_tokens += hit.cut * self.block_size
        return table, cached

    # ------------------------------------------------------------------ decode

    def _tables(self, table: BlockTable) -> list[tuple[BlockPool, list[int]]]:
        """(group's pool, the sequence's table in it) of each layer group."""
        return list(zip(self.pool.groups, [table.blocks, *table.others], strict=True))

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether the token at position `num_tokens` can be written: it needs a new block
        when it starts one, or a copy when its block is shared, in every layer group."""
        return all(group.grow_cost(blocks, num_tokens, 1) <= group.num_free
                   for group, blocks in self._tables(table))  # fmt: skip

    def append_slot(self, table: BlockTable, num_tokens: int) -> None:
        """Make position `num_tokens` writable by this sequence alone."""
        self.prepare(table, num_tokens, 1)

    def prepare(self, table: BlockTable, start: int, n: int) -> None:
        """Make positions start..start + n - 1 writable by this sequence alone, in every
        layer group (a prompt chunk's: group 0 holds the whole prompt's blocks from
        admission, a windowed group takes them here)."""
        for group, blocks in self._tables(table):
            if group.grow_cost(blocks, start, n) > group.num_free:
                raise CacheOverflowError(
                    f"a KV layer group (window {group.window}) is out of blocks: "
                    f"{group.num_free} of {group.num_blocks} free"
                )
            group.grow(blocks, start, n)

    def seal(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> None:
        """Register every block that is now full of computed tokens, under the table's
        salt, in every layer group (a windowed group's linked to group 0's block at the
        same place); then a windowed group lets go of the blocks that left its window."""
        if self.prefix_caching:
            self._register(table, tokens, num_computed)
        for group, blocks in self._tables(table)[1:]:
            group.slide(blocks, num_computed)

    def _register(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> None:
        bs, pool = self.block_size, self.pool
        first, stop, checks = len(table.hashes), num_computed // bs, None
        for i in range(first, stop):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(table.hashes[-1] if i else root_key(table.salt), chunk)
            block = table.blocks[i]
            pool.prefix.register(block, key, chunk, table.blocks[i - 1] if i else None, table.salt)
            table.hashes.append(key)
            link, holder = (pool.prefix.prefix_id[block], table.salt), pool.prefix.cached.get(key)
            offers = [(0, pool, block)] if holder == block else []
            for g, (group, blocks) in enumerate(self._tables(table)[1:], start=1):
                if isinstance(group, Slots):  # group 0's block's end rows, now held
                    had = holder is not None and group.has_rows(holder, link[0])
                    group.mark(block, link[0], holder)
                    if holder is not None and not had and group.has_rows(holder, link[0]):
                        offers.append((g, group, holder))
                    continue
                if link[0] and blocks[i] != FREED:
                    group.prefix.register_linked(blocks[i], key, chunk, link)
                if group.prefix.cached.get(key) == blocks[i] != FREED:
                    offers.append((g, group, blocks[i]))
            if self.tiers is None or not offers:
                continue
            if checks is None:
                checks = check_digests(tokens, table.salt, bs, stop)
            for g, group, held in offers:
                parts = (group.block_rows(held) if isinstance(group, Slots)
                         else group.store.raw((ALL, ALL, held)))  # fmt: skip
                self.tiers.offer(key, chunk, checks[i], parts, group=g)

    # ------------------------------------------------------------------ lifetime

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table over the same blocks (parallel samples of one prompt)."""
        others = [g.fork(t) for g, t in zip(self.others, table.others, strict=True)]
        return BlockTable(self.pool.fork(table.blocks), list(table.hashes), table.salt, others)

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Drop the blocks past the first `num_tokens` positions (rejected draft tokens):
        released tail first, never sealed (only computed tokens' blocks are)."""
        for group, blocks in self._tables(table):
            group.trim(blocks, num_tokens)
        del table.hashes[len(table.blocks) :]

    def pin(self, tokens: Sequence[int], salt: str | None = None) -> list[list[int]]:
        """Hold the blocks of the longest cached prefix of `tokens` (a stored conversation:
        its last token not computed) so that eviction passes them by, each layer group's
        (a hybrid pool's windowed groups: the window before the hit); unpin() lets go."""
        hit = self._match(tokens, salt)
        held = [[b for b in blocks if b != FREED] for blocks in [hit.blocks, *hit.others]]
        for group, blocks in zip(self.pool.groups, held, strict=True):
            for block in blocks:
                group.revive(block)
        return held

    def unpin(self, held: Sequence[Sequence[int]]) -> None:
        for group, blocks in zip(self.pool.groups, held, strict=True):
            for block in reversed(blocks):  # tail first, as free() does
                group.release(block)

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks, tail first: its last blocks are evicted first."""
        self.trim(table, 0)
