"""KV tiers below the block pool: a local directory and Redis, asked before recomputing.

    admission:  pool hit  b0 b1 | miss b2 ... -> tiers.fetch(b2..): disk, then Redis
                                                -> verified blocks loaded into the pool
    seal:       a block newly full of computed tokens -> copy -> writer thread -> every tier

Write-through, not write-on-evict: a block goes to the tiers when it is sealed (registered
in the pool's prefix cache), as LMCache stores on compute. So a block the pool still holds
is already on disk when the server restarts, and already in Redis when another replica asks
for it; a block the pool evicts is there too. The engine thread only copies the block's
bytes (a memcpy of one block, ~0.4 MiB on the default model) into a bounded queue; the
writer thread encodes and writes them. A full queue drops the write (counted), so a slow
tier never stalls a step.

Reads are synchronous at admission, once per request: the keys of a prompt's blocks
follow from its tokens alone (kvlm.cache.prefix), so each tier is asked for all the blocks
past the pool's hit at once (Redis: one pipeline), and the longest run of verified blocks
is loaded. A tier that raises (down, full, timed out: Redis is asked with a 0.25 s socket
timeout) is skipped for RETRY_S seconds with one warning, and counted: the request
recomputes, the client never sees an error.

Keys and what a record must match before its K/V is used:

    namespace = sha256(model fingerprint, numerics, device, storage dtype, block geometry)
    record    = MAGIC | u32 header length | header JSON | K/V bytes as the pool stores them
    header    = {ns, key (the chain key), salt, tokens (the block's ids), check}
    check     = BLAKE2b over the salt and every token id from the first to this block's last

The namespace keeps two models, two numerics or two geometries apart (their K/V differ);
the chain key (sha256, with the salt in its root) finds a record; the check, a second hash
family over the whole prefix, verifies it was computed after exactly this prefix under this
salt: a block is only used when its tokens, salt and check all match, so serving another
prefix's or another tenant's K/V takes colliding sha256 and BLAKE2b at once. The byte
sizes are known from the geometry: a record of any other size is refused before its K/V is
read (a file or a Redis value cannot make kvlm allocate more than one block).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import torch

from kvlm.errors import InvalidRequestError

log = logging.getLogger("kvlm.tiers")

MAGIC = b"KVLMBLK1"
MAX_HEADER = 1 << 16  # bytes of header JSON a record may carry
RETRY_S = 10.0  # a tier that failed is skipped this long
WRITE_QUEUE_BLOCKS = 512  # blocks waiting for the writer; more are dropped
DEFAULT_DISK_SIZE = 10 << 30
DEFAULT_REDIS_TTL = 24 * 3600
_CHECK_DOMAIN = b"kvlm/tier-check/v1"


def namespace(*parts: object) -> str:
    """The hex sha256 of what makes two pools' K/V interchangeable."""
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()


def check_digests(tokens: Sequence[int], salt: str | None, block_size: int, stop: int) -> list:
    """The check of blocks 0..stop-1: BLAKE2b-256 over the salt (length-prefixed) and
    the tokens up to each block's end, as uint32 little-endian."""
    h = hashlib.blake2b(_CHECK_DOMAIN, digest_size=32)
    raw = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
    h.update(b"\x00" if salt is None else b"\x01" + len(raw).to_bytes(4, "little") + raw)
    out = []
    for i in range(stop):
        h.update(struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size]))
        out.append(h.copy().digest())
    return out


@dataclass(slots=True)
class TierStats:
    hits: int = 0  # blocks found, verified and loaded
    misses: int = 0  # blocks asked for and not there (or refused)
    refused: int = 0  # records found that did not verify
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    errors: int = 0  # calls that raised (tier down, full, timed out)
    read_seconds: float = 0.0
    reads: int = 0  # lookups (one per request that reached this tier)
    write_seconds: float = 0.0
    up: bool = True


class Tier:
    """One store of encoded blocks by name. get_many and put may raise: KVTiers counts it
    and skips the tier for a while."""

    name = "tier"

    def get_many(self, names: list[str], limit: int) -> list[bytes | None]:
        """The records stored under `names`, None where absent; at most `limit` bytes of
        each (a longer record reads as `limit + 1` bytes or more and is refused)."""
        raise NotImplementedError

    def put(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class DiskTier(Tier):
    """A directory of one file per block, least recently used first out past `max_bytes`.
    Files are written to a temporary name and renamed, so a reader (or a restart after a
    crash) sees a whole record or none. A hit touches the file's mtime, and the start-up
    scan orders files by it: the LRU order survives a restart. One server per directory:
    two would each keep their own (approximate) account of its size."""

    name = "disk"

    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_DISK_SIZE) -> None:
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # the writer thread and admission both touch _files
        self._files: OrderedDict[str, int] = OrderedDict()
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut off by a crash
        found = [(p.stat().st_mtime, p.name, p.stat().st_size) for p in self.root.glob("*.kvb")]
        for _, name, size in sorted(found):
            self._files[name] = size
        self.nbytes = sum(self._files.values())

    def get_many(self, names: list[str], limit: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        for name in names:
            path = self.root / f"{name}.kvb"
            try:
                with open(path, "rb") as f:
                    data = f.read(limit + 1)
            except FileNotFoundError:
                out.append(None)
                continue
            os.utime(path)
            with self._lock:
                if name + ".kvb" in self._files:
                    self._files.move_to_end(name + ".kvb")
            out.append(data)
        return out

    def put(self, name: str, data: bytes) -> None:
        path = self.root / f"{name}.kvb"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            self.nbytes += len(data) - self._files.pop(path.name, 0)
            self._files[path.name] = len(data)
            while self.nbytes > self.max_bytes and len(self._files) > 1:
                old, size = self._files.popitem(last=False)
                (self.root / old).unlink(missing_ok=True)
                self.nbytes -= size


class RedisTier(Tier):
    """Blocks in a Redis server, shared by every replica that names it, each key expiring
    after `ttl` seconds (0: never; then the server's maxmemory policy bounds it)."""

    name = "redis"

    def __init__(self, url: str, ttl: int = DEFAULT_REDIS_TTL, timeout: float = 0.25) -> None:
        try:
            import redis
        except ImportError as exc:
            raise InvalidRequestError(
                '--kv-tier redis:// needs the Redis client: pip install -e ".[cluster]"'
            ) from exc
        self.url, self.ttl = url, ttl
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def get_many(self, names: list[str], limit: int) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, limit)  # inclusive: limit + 1 bytes at most
        return [v or None for v in pipe.execute()]

    def put(self, name: str, data: bytes) -> None:
        self.client.set(name, data, ex=self.ttl or None)

    def close(self) -> None:
        self.client.close()


def parse_tier(spec: str) -> Tier:
    """The tier `spec` names: `disk:PATH[:SIZE]` or `redis://HOST:PORT[/DB][?ttl=SECONDS]`."""
    kind, args = check_tier(spec)
    return kind(*args)


def check_tier(spec: str) -> tuple[type[Tier], tuple]:
    """The tier class and arguments `spec` names, refused with a clear message when it is
    not one (before a server loads its model)."""
    from kvlm.cache.memory import parse_size

    if spec.startswith(("redis://", "rediss://", "unix://")):
        url = urlsplit(spec)
        query = parse_qs(url.query)
        try:
            ttl = int(query.pop("ttl", [DEFAULT_REDIS_TTL])[0])
        except ValueError as exc:
            raise InvalidRequestError(f"--kv-tier {spec}: ttl must be whole seconds") from exc
        if ttl < 0:
            raise InvalidRequestError(f"--kv-tier {spec}: ttl must be >= 0")
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        return RedisTier, (url._replace(query=rest).geturl(), ttl)
    if spec.startswith("disk:"):
        path, _, size = spec[5:].partition(":")
        if not path:
            raise InvalidRequestError("--kv-tier disk:PATH[:SIZE] needs a path")
        try:
            max_bytes = parse_size(size) if size else DEFAULT_DISK_SIZE
        except ValueError as exc:
            raise InvalidRequestError(f"--kv-tier {spec}: {exc}") from exc
        return DiskTier, (Path(path).expanduser(), max_bytes)
    raise InvalidRequestError(
        f"unknown KV tier {spec!r}: use disk:PATH[:SIZE] or redis://HOST:PORT"
    )


@dataclass(slots=True)
class _Write:
    key: bytes
    tokens: tuple[int, ...]
    salt: str | None
    check: bytes
    parts: dict[str, torch.Tensor]
    to: tuple[str, ...] | None = None  # the tiers to write (None: every one)


@dataclass
class KVTiers:
    """The tiers of one pool, in the order they are asked, with their writer thread."""

    tiers: list[Tier]
    ns: str
    parts: dict[str, tuple[tuple[int, ...], torch.dtype]]  # a block's shape and dtype per part
    stats: dict[str, TierStats] = field(init=False)
    dropped: int = 0  # writes refused by a full queue

    def __post_init__(self) -> None:
        self.stats = {t.name: TierStats() for t in self.tiers}
        self._down_until = dict.fromkeys(self.stats, 0.0)
        self._sizes = {
            k: int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
            for k, (shape, dt) in self.parts.items()
        }
        self._queue: queue.Queue[_Write | None] = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = threading.Thread(target=self._write_loop, name="kvlm-tiers", daemon=True)
        self._writer.start()

    @property
    def payload_bytes(self) -> int:
        return sum(self._sizes.values())

    def _name(self, key: bytes) -> str:
        return f"kvlm:{self.ns[:32]}:{key.hex()}"

    # ------------------------------------------------------------------ reads

    def fetch(
        self, keys: list[bytes], chunks: list[tuple[int, ...]], salt: str | None, checks: list
    ) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """The K/V of the longest run of blocks `keys` (in chain order) found in some tier
        and verified, with the name of the tier each came from; each tier is asked for the
        blocks the tiers before it lacked. A tier's hits are the blocks of the run it
        served, its misses the blocks it lacked."""
        found: list[tuple[str, dict[str, torch.Tensor]] | None] = [None] * len(keys)
        for tier in self.tiers:
            want = [i for i, f in enumerate(found) if f is None]
            if not want or not self._usable(tier):
                continue
            stats, start = self.stats[tier.name], time.perf_counter()
            try:
                records = tier.get_many([self._name(keys[i]) for i in want], self.record_limit)
            except Exception as exc:
                self._failed(tier, exc)
                continue
            stats.read_seconds += time.perf_counter() - start
            stats.reads += 1
            for i, data in zip(want, records, strict=True):
                if data is None:
                    stats.misses += 1
                    continue
                stats.bytes_read += len(data)
                parts = self._decode(data, keys[i], chunks[i], salt, checks[i])
                if parts is None:
                    stats.refused += 1
                    stats.misses += 1
                else:
                    found[i] = (tier.name, parts)
        run: list[tuple[str, dict[str, torch.Tensor]]] = []
        names = [t.name for t in self.tiers]
        for i, entry in enumerate(found):
            if entry is None:
                break
            self.stats[entry[0]].hits += 1
            run.append(entry)
            lacked = tuple(names[: names.index(entry[0])])
            if lacked:  # promoted: the tiers asked first hold it next time (Redis -> disk)
                self._queue_write(_Write(keys[i], chunks[i], salt, checks[i], entry[1], lacked))
        return run

    @property
    def record_limit(self) -> int:
        """The largest record a block of this geometry can be."""
        return len(MAGIC) + 4 + MAX_HEADER + self.payload_bytes

    def _decode(
        self, data: bytes, key: bytes, tokens: tuple[int, ...], salt: str | None, check: bytes
    ) -> dict[str, torch.Tensor] | None:
        head = len(MAGIC) + 4
        if len(data) < head or data[: len(MAGIC)] != MAGIC:
            return None
        (n,) = struct.unpack_from("<I", data, len(MAGIC))
        if n > MAX_HEADER or len(data) != head + n + self.payload_bytes:
            return None
        try:
            meta = json.loads(data[head : head + n])
        except ValueError:
            return None
        want = {"ns": self.ns, "key": key.hex(), "salt": salt, "tokens": list(tokens),
                "check": check.hex()}  # fmt: skip
        if not isinstance(meta, dict) or meta != want:
            return None
        out, offset = {}, head + n
        for part, (shape, dtype) in self.parts.items():
            size = self._sizes[part]
            buf = bytearray(data[offset : offset + size])
            out[part] = torch.frombuffer(buf, dtype=dtype).view(shape)
            offset += size
        return out

    # ------------------------------------------------------------------ writes

    def offer(
        self,
        key: bytes,
        tokens: tuple[int, ...],
        salt: str | None,
        check: bytes,
        parts: dict[str, torch.Tensor],
    ) -> None:
        """Queue a sealed block for every tier (its parts copied now: the pool may hand the
        block out again before the writer reaches it); a full queue drops it."""
        copy = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in parts.items()}
        self._queue_write(_Write(key, tokens, salt, check, copy))

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

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout=2)
        for tier in self.tiers:
            tier.close()

    def _encode(self, w: _Write) -> bytes:
        meta = {"ns": self.ns, "key": w.key.hex(), "salt": w.salt, "tokens": list(w.tokens),
                "check": w.check.hex()}  # fmt: skip
        header = json.dumps(meta, separators=(",", ":")).encode()
        body = b"".join(w.parts[k].view(torch.uint8).numpy().tobytes() for k in self.parts)
        return MAGIC + struct.pack("<I", len(header)) + header + body

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
                        tier.put(self._name(w.key), data)
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

    def _failed(self, tier: Tier, exc: Exception) -> None:
        stats = self.stats[tier.name]
        stats.errors += 1
        if stats.up:
            log.warning(
                "KV tier %s failed (%s: %s); skipping it for %.0f s, requests recompute",
                tier.name, type(exc).__name__, exc, RETRY_S,
            )  # fmt: skip
        stats.up = False
        self._down_until[tier.name] = time.monotonic() + RETRY_S
