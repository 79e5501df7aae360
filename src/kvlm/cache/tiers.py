"""KV tiers below the block pool: a local directory and Redis, asked before recomputing.

    admission:  pool hit  b0 b1 | miss b2 ... -> tiers.fetch(b2..): disk, then Redis, each
                on its reader thread within its deadline -> verified blocks into the pool
    seal:       a block newly full of computed tokens -> copy -> writer thread -> every tier

Write-through, not write-on-evict: a block goes to the tiers when it is sealed (registered
in the pool's prefix cache), as LMCache stores on compute. So a block the pool still holds
is already on disk when the server restarts, and already in Redis when another replica asks
for it; a block the pool evicts is there too. The engine thread only copies the block's
bytes (a memcpy of one block, ~0.4 MiB on the default model) into a bounded queue; the
writer thread encodes and writes them. A full queue drops the write (counted), so a slow
tier never stalls a step; closing waits for the queue at most CLOSE_FLUSH_S.

Reads happen at admission, once per request: the keys of a prompt's blocks follow from its
tokens alone (kvlm.cache.prefix), so each tier is asked for all the blocks past the pool's
hit at once (Redis: one pipeline), and the longest run of verified blocks is loaded. The
engine thread never waits for a lookup: it starts one on the tiers' lookup thread
(fetch_later) and steps on; the request waits in the queue until its blocks are in, and
is admitted then with whatever came (kvlm.cache.prefix.TierFetch). The lookup thread asks
each tier on the tier's own reader thread and waits for it at most the tier's
deadline (kvlm.cache.tier_stores: 1 s disk, 0.5 s Redis, `?deadline=S`) plus 1 s per
DEADLINE_BYTES_PER_S asked: a socket timeout bounds one read, not a reply trickled a few
bytes per read. A tier that raises or misses
its deadline is skipped for RETRY_S seconds with one warning, counted (errors, timeouts)
and shown down in /metrics: the request recomputes, the client never sees an error.

Trust nothing read: anyone who can write to a tier (a local user for a directory, any
client of a Redis) can put any bytes under any name. So every record carries a MAC under
the server's key (kvlm.cache.tier_key), which never goes into a tier:

    name    = kvlm:<namespace[:32]>:<chain key hex>
    record  = MAGIC | tag (32 bytes) | K/V bytes as the pool stores them (values, scales)
    tag     = HMAC-SHA256(key, DOMAIN | namespace | chain key | check | block's tokens
                                | K/V bytes)
    check   = BLAKE2b over the salt (length-prefixed) and every token id from the first to
              this block's last

The namespace keeps two models, two numerics or two geometries apart (their K/V differ);
the chain key (sha256, with the salt in its root) finds a record; the check, a second hash
family over the whole prefix and the salt, ties the tag to exactly this prefix under this
salt. Nothing but the K/V bytes is stored: the tag is recomputed from what the request
itself holds (its tokens, its salt) and compared in constant time, so the record carries
neither token ids nor the salt, and a record made without the key (an old unkeyed one, one
built from another tenant's K/V, one under another server's key) or changed in any byte is
refused and counted, never used. The byte size is known from the geometry: a record of any
other size is refused before its tag is computed (a file or a Redis value cannot make kvlm
allocate more than one block).

What the key does not do: it does not hide K/V contents (or, from the names, which chain
keys are stored) from whoever can read the tier. docs/API.md "KV tiers: trust" says who may
write to each tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvlm.cache.tier_stores import (
    DEFAULT_DISK_SIZE,
    DEFAULT_REDIS_TTL,
    DiskTier,
    RedisTier,
    Tier,
    check_tier,
    parse_tier,
)

__all__ = [
    "DEFAULT_DISK_SIZE", "DEFAULT_REDIS_TTL", "DiskTier", "KVTiers", "RedisTier", "Tier",
    "TierStats", "check_digests", "check_tier", "namespace", "parse_tier",
]  # fmt: skip

log = logging.getLogger("kvlm.tiers")

MAGIC = b"KVLMBLK2"
TAG_BYTES = 32  # HMAC-SHA256
RETRY_S = 10.0  # a tier that failed is skipped this long
WRITE_QUEUE_BLOCKS = 512  # blocks waiting for the writer; more are dropped
CLOSE_FLUSH_S = 2.0  # how long closing waits for queued writes before dropping them
# A lookup's deadline grows by 1 s per this many bytes asked: a 2,048-token prompt on the
# default model asks 45 MiB, which a loaded 2-core box read from Redis in 0.3-0.4 s (a
# fixed 0.5 s would turn such hits into timeouts), while a reply trickled at a few KB/s
# still runs out of time.
DEADLINE_BYTES_PER_S = 32 << 20
_CHECK_DOMAIN = b"kvlm/tier-check/v1"
_TAG_DOMAIN = b"kvlm/tier-record/v2"


def namespace(*parts: object) -> str:
    """The hex sha256 of what makes two pools' K/V interchangeable."""
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()


def salt_field(salt: str | None) -> bytes:
    """A cache salt as the hashes take it: 0x00 for none, else 0x01, its UTF-8 length
    (uint32 little-endian) and its UTF-8. surrogatepass: a JSON string may carry a lone
    surrogate; the encoding stays one-to-one."""
    if salt is None:
        return b"\x00"
    raw = salt.encode("utf-8", "surrogatepass")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def check_digests(tokens: Sequence[int], salt: str | None, block_size: int, stop: int) -> list:
    """The check of blocks 0..stop-1: BLAKE2b-256 over the salt (length-prefixed) and
    the tokens up to each block's end, as uint32 little-endian."""
    h = hashlib.blake2b(_CHECK_DOMAIN + salt_field(salt), digest_size=32)
    out = []
    for i in range(stop):
        h.update(struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size]))
        out.append(h.copy().digest())
    return out


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # blocks found, verified and loaded
    misses: int = 0  # blocks asked for and not there (or refused)
    refused: int = 0  # records found that did not verify (or were not regular files)
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    errors: int = 0  # calls that raised or missed their deadline (tier down, full, slow)
    timeouts: int = 0  # lookups past the tier's deadline (counted in errors too)
    read_seconds: float = 0.0
    reads: int = 0  # lookups (one per request that reached this tier)
    write_seconds: float = 0.0
    up: bool = True


class _Reader:
    """A tier's reader thread: one lookup at a time, waited for with a deadline. Daemon: a
    read stuck in the kernel (a hung network filesystem) cannot hold up the process's
    exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.last: Future | None = None
        threading.Thread(target=self._loop, name=f"kvlm-tier-{name}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        self.last = Future()
        self._jobs.put((self.last, fn, args))
        return self.last

    @property
    def busy(self) -> bool:
        return self.last is not None and not self.last.done()

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiter, whatever it is
                future.set_exception(exc)


@dataclass(slots=True)
class _Write:
    key: bytes
    tokens: tuple[int, ...]
    check: bytes
    parts: dict[str, torch.Tensor]
    to: tuple[str, ...] | None = None  # the tiers to write (None: every one)
    group: int = 0  # the pool's layer group (kvlm.cache.paged.BlockPool.groups)


@dataclass
class KVTiers:
    """The tiers of one pool, in the order they are asked, with their reader threads and
    writer thread. `key` signs every record (kvlm.cache.tier_key.load_tier_key)."""

    tiers: list[Tier]
    ns: str
    parts: dict[str, tuple[tuple[int, ...], torch.dtype]]  # a block's shape and dtype per part
    key: bytes = field(repr=False, default=b"")
    # a hybrid pool's other layer groups (kvlm.cache.paged): each group's (namespace, parts),
    # group g >= 1 at groups[g - 1]. A group's records are named and tagged under its own
    # namespace, so one group's record can never be read as another's.
    groups: list[tuple[str, dict]] = field(default_factory=list)
    stats: dict[str, TierStats] = field(init=False)
    dropped: int = 0  # writes refused by a full queue, or left when closing

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("KVTiers needs a key of at least 16 bytes (kvlm.cache.tier_key)")
        self.stats = {t.name: TierStats() for t in self.tiers}
        self._down_until = dict.fromkeys(self.stats, 0.0)
        self._readers = {t.name: _Reader(t.name) for t in self.tiers}
        self._lookups = _Reader("lookups")  # fetch_later's: waits for the readers
        self._layouts = [(self.ns, self.parts), *self.groups]
        self._sizes = [{k: math.prod(shape) * dt.itemsize for k, (shape, dt) in parts.items()}
                       for _, parts in self._layouts]  # fmt: skip
        self._queue: queue.Queue[_Write | None] = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kvlm-tiers", daemon=True)
        self._writer.start()

    @property
    def record_limit(self) -> int:
        """The size of every record of this geometry (group 0's)."""
        return self.record_size(0)

    def record_size(self, group: int) -> int:
        """The size of every record of layer group `group`."""
        return len(MAGIC) + TAG_BYTES + sum(self._sizes[group].values())

    def _name(self, key: bytes, group: int = 0) -> str:
        return f"kvlm:{self._layouts[group][0][:32]}:{key.hex()}"

    def _tag(
        self, key: bytes, tokens: tuple[int, ...], check: bytes, payload, group: int = 0
    ) -> bytes:
        mac = hmac.new(self.key, _TAG_DOMAIN, hashlib.sha256)
        mac.update(self._layouts[group][0].encode())  # 64 hex digits; fields of fixed length
        mac.update(key)
        mac.update(check)
        mac.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
        mac.update(payload)
        return mac.digest()

    # ------------------------------------------------------------------ reads

    def fetch(
        self, keys: list[bytes], chunks: list[tuple[int, ...]], checks: list[bytes],
        group: int = 0, run: bool = True,
    ) -> list:  # fmt: skip
        """The K/V of the longest run of blocks `keys` (in chain order) of layer group
        `group` found in some tier and verified, with the name of the tier each came from;
        each tier is asked for the blocks the tiers before it lacked. A tier's hits are
        the blocks of the run it served, its misses the blocks it lacked. `run` False:
        every block's, None where none was found (a group whose records some blocks have:
        a DeltaNet's state snapshots)."""
        found: list[tuple[str, dict[str, torch.Tensor]] | None] = [None] * len(keys)
        for tier in self.tiers:
            want = [i for i, f in enumerate(found) if f is None]
            if not want or not self._usable(tier):
                continue
            records = self._lookup(tier, [self._name(keys[i], group) for i in want], group)
            if records is None:
                continue
            stats = self.stats[tier.name]
            for i, data in zip(want, records, strict=True):
                if data is None:
                    stats.misses += 1
                    continue
                stats.bytes_read += len(data) if isinstance(data, bytes) else 0
                parts = self._decode(data, keys[i], chunks[i], checks[i], group)
                if parts is None:
                    stats.refused += 1
                    stats.misses += 1
                else:
                    found[i] = (tier.name, parts)
        served: list = []
        names = [t.name for t in self.tiers]
        for i, entry in enumerate(found):
            if entry is None:
                if run:
                    break
                served.append(None)
                continue
            self.stats[entry[0]].hits += 1
            served.append(entry)
            lacked = tuple(names[: names.index(entry[0])])
            if lacked:  # promoted: the tiers asked first hold it next time (Redis -> disk)
                self._queue_write(_Write(keys[i], chunks[i], checks[i], entry[1], lacked, group))
        return served

    def fetch_later(
        self, keys: list[bytes], chunks: list[tuple[int, ...]],
        checks: Callable[[], list[bytes]], group: int = 0, run: bool = True,
    ) -> Future:  # fmt: skip
        """fetch() run on the tiers' lookup thread, its checks made there too (`checks()`):
        the engine thread starts it at admission and goes on stepping (kvlm.cache.prefix.
        TierFetch); the future's answer is fetch()'s, within the tiers' deadlines."""
        return self._lookups.submit(lambda: self.fetch(keys, chunks, checks(), group, run))

    def _lookup(self, tier: Tier, names: list[str], group: int = 0) -> list | None:
        """`tier.get_many(names)` run on the tier's reader thread, waited for at most the
        tier's deadline; None (the tier marked down) when it raised, answered out of
        shape or ran past the deadline (then it is cut short where the tier can be)."""
        stats, reader = self.stats[tier.name], self._readers[tier.name]
        if reader.busy:  # the lookup that missed its deadline last time is still stuck
            stats.timeouts += 1
            self._failed(tier, TimeoutError("its previous lookup has not returned"))
            return None
        start = time.perf_counter()
        limit = self.record_size(group)
        deadline = tier.deadline + len(names) * limit / DEADLINE_BYTES_PER_S
        future = reader.submit(tier.get_many, names, limit)
        try:
            records = future.result(timeout=deadline)
        except Exception as exc:
            err = exc
            if not future.done():
                tier.abort()
                stats.timeouts += 1
                err = TimeoutError(
                    f"no answer to {len(names)} lookups within its deadline ({deadline:.2f} s)"
                )
            self._failed(tier, err)
            return None
        finally:
            stats.read_seconds += time.perf_counter() - start
            stats.reads += 1
        if not isinstance(records, list) or len(records) != len(names):
            self._failed(tier, ValueError(f"{len(names)} records asked, {records!r:.60} answered"))
            return None
        return records

    def _decode(
        self, data: object, key: bytes, tokens: tuple[int, ...], check: bytes, group: int = 0
    ) -> dict[str, torch.Tensor] | None:
        """The parts of record `data` if its tag is the one this server makes for this
        block (the group's namespace, chain key, prefix check, tokens, bytes); else None."""
        if not isinstance(data, bytes) or len(data) != self.record_size(group):
            return None
        view = memoryview(data)
        head = len(MAGIC) + TAG_BYTES
        tag = self._tag(key, tokens, check, view[head:], group)
        if not hmac.compare_digest(view[:head], MAGIC + tag):
            return None
        out, offset = {}, head
        for part, (shape, dtype) in self._layouts[group][1].items():
            size = self._sizes[group][part]
            buf = bytearray(view[offset : offset + size])
            out[part] = torch.frombuffer(buf, dtype=dtype).view(shape)
            offset += size
        return out

    # ------------------------------------------------------------------ writes

    def offer(
        self, key: bytes, tokens: tuple[int, ...], check: bytes, parts: dict[str, torch.Tensor],
        group: int = 0,
    ) -> None:  # fmt: skip
        """Queue a sealed block of layer group `group` for every tier (its parts copied
        now: the pool may hand the block out again before the writer reaches it); a full
        queue drops it."""
        copy = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in parts.items()}
        self._queue_write(_Write(key, tokens, check, copy, group=group))

    def _queue_write(self, write: _Write) -> None:
        try:
            self._queue.put_nowait(write)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done (a server stopping; tests)."""
        done = self._queue.all_tasks_done  # queue.Queue.join()'s condition, with a timeout
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def close(self, timeout: float = CLOSE_FLUSH_S) -> None:
        """Write what is queued for at most `timeout` s, drop the rest (counted), and close
        the tiers (a Redis connection stuck mid-write is cut)."""
        if not self.flush(timeout):
            left = 0
            with contextlib.suppress(queue.Empty):
                while True:
                    self._queue.get_nowait()
                    self._queue.task_done()
                    left += 1
            self.dropped += left
            log.warning("KV tiers: %d queued block writes dropped at close", left)
        with contextlib.suppress(queue.Full):  # the writer is stuck in a put: abort ends it
            self._queue.put_nowait(None)
        for tier in self.tiers:
            tier.abort()
        self._writer.join(timeout=1)
        for reader in [*self._readers.values(), self._lookups]:
            reader.stop()
        for tier in self.tiers:
            tier.close()

    def _encode(self, w: _Write) -> bytes:
        names = self._layouts[w.group][1]
        body = b"".join(w.parts[k].view(torch.uint8).numpy().tobytes() for k in names)
        return MAGIC + self._tag(w.key, w.tokens, w.check, body, w.group) + body

    def _write_loop(self) -> None:
        while True:
            w = self._queue.get()
            if w is None:
                self._queue.task_done()
                return
            try:
                data = self._encode(w)
                for tier in self.tiers:
                    if (w.to is not None and tier.name not in w.to) or not self._usable(tier):
                        continue
                    stats, start = self.stats[tier.name], time.perf_counter()
                    try:
                        tier.put(self._name(w.key, w.group), data)
                    except Exception as exc:
                        self._failed(tier, exc)
                        continue
                    stats.write_seconds += time.perf_counter() - start
                    stats.writes += 1
                    stats.bytes_written += len(data)
            except Exception:  # never let the writer die: the next block is written
                log.exception("KV tier write failed")
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------------ health

    def _usable(self, tier: Tier) -> bool:
        stats = self.stats[tier.name]
        if not stats.up and time.monotonic() >= self._down_until[tier.name]:
            stats.up = True  # try again
        return stats.up

    def _failed(self, tier: Tier, exc: BaseException) -> None:
        stats = self.stats[tier.name]
        stats.errors += 1
        if stats.up:
            log.warning(
                "KV tier %s failed (%s: %s); skipping it for %.0f s, requests recompute",
                tier.name, type(exc).__name__, exc, RETRY_S,
            )  # fmt: skip
        stats.up = False
        self._down_until[tier.name] = time.monotonic() + RETRY_S
