"""Where the tiers' records live: a private directory, a Redis server. A store hands back
bytes and knows nothing of what they mean; kvlm.cache.tiers verifies every record.

What a store does about what it reads, since anyone who can write to it may have put
anything there:

    disk   the directory is the user's and no one else may write it (else refused at
           start-up with one line); it is opened once and every name is resolved in it
           (no path is followed twice); records are written 0600 to a temporary file made
           exclusively (O_EXCL | O_NOFOLLOW, a random name) and renamed into place; a
           record is opened O_NOFOLLOW | O_NONBLOCK and used only if fstat says it is a
           regular file (a symlink, FIFO, device or directory under a record's name is
           NOT_A_RECORD: refused, never followed, never waited on); at most `limit` + 1
           bytes are read
    redis  every reply that is not a string (an error, a number, a list) is NOT_A_RECORD;
           a reply the client cannot parse raises (the tier is marked down); the client
           never retries on its own (the caller's deadline decides)

Reads run on a tier's own thread under a deadline for the whole lookup (kvlm.cache.tiers):
`deadline` is that bound, set per tier with `?deadline=SECONDS` in its spec.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from kvlm.errors import InvalidRequestError

DEFAULT_DISK_SIZE = 10 << 30
DEFAULT_REDIS_TTL = 24 * 3600
DISK_DEADLINE_S = 1.0  # a whole lookup of the disk tier (a request's blocks)
REDIS_DEADLINE_S = 0.5  # a whole lookup of Redis (one pipeline)
REDIS_SOCKET_TIMEOUT_S = 0.25  # one read or connect of the Redis client
NOT_A_RECORD = b""  # what a store returns for something under a record's name it refused


class Tier:
    """One store of encoded blocks by name. get_many and put may raise: KVTiers counts it
    and skips the tier for a while."""

    name = "tier"
    deadline = DISK_DEADLINE_S

    def get_many(self, names: list[str], limit: int) -> list[bytes | None]:
        """The records stored under `names`, None where absent, NOT_A_RECORD where what is
        there cannot be a record; at most `limit` + 1 bytes of each (a longer record is
        refused by its size)."""
        raise NotImplementedError

    def put(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Cut short a get_many running on another thread that is past its deadline."""

    def close(self) -> None:
        pass


def open_private_dir(path: Path, create: bool = True) -> int | None:
    """A descriptor of directory `path` (made 0700 if absent and `create`), checked to be
    the user's and writable by no one else: whoever can write to it could swap records,
    plant links or FIFOs under their names, or fill it. None when absent and not `create`.
    InvalidRequestError (one line) when it is not private."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)  # the umask can only narrow it
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        raise InvalidRequestError(f"KV tier directory {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not you (uid {os.getuid()}); use your own"
    elif st.st_mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[st.st_mode & 0o022]
        problem = f"is writable by {who}, who could plant records; fix with chmod go-w {path}"
    else:
        return fd
    os.close(fd)
    raise InvalidRequestError(f"KV tier directory {path} {problem}")


class DiskTier(Tier):
    """A private directory of one file per block, least recently used first out past
    `max_bytes`. Files are written to a temporary name and renamed, so a reader (or a
    restart after a crash) sees a whole record or none. A hit touches the file's mtime,
    and the start-up scan orders files by it: the LRU order survives a restart. One server
    per directory: two would each keep their own (approximate) account of its size."""

    name = "disk"

    def __init__(
        self,
        path: str | Path,
        max_bytes: int = DEFAULT_DISK_SIZE,
        deadline: float = DISK_DEADLINE_S,
    ) -> None:
        self.root = Path(path)
        self.max_bytes, self.deadline = max_bytes, deadline
        self._dir = open_private_dir(self.root)
        self._lock = threading.Lock()  # the writer thread and the reader both touch _files
        found = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if entry.name.endswith(".tmp") and not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry.name, dir_fd=self._dir)  # a write cut off by a crash
                elif entry.name.endswith(".kvb") and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, entry.name, st.st_size))
        self._files = OrderedDict((name, size) for _, name, size in sorted(found))
        self.nbytes = sum(self._files.values())

    def get_many(self, names: list[str], limit: int) -> list[bytes | None]:
        return [self._read(f"{name}.kvb", limit) for name in names]

    def _read(self, file: str, limit: int) -> bytes | None:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(file, flags, dir_fd=self._dir)
        except FileNotFoundError:
            return None
        except OSError:  # ELOOP: a symlink; ENXIO: a socket; EACCES ...
            return NOT_A_RECORD
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, device, directory
                return NOT_A_RECORD
            chunks, left = [], limit + 1
            while left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
            with contextlib.suppress(OSError):  # a read-only folder still serves reads
                os.utime(fd)  # the LRU order, kept across restarts
        finally:
            os.close(fd)
        with self._lock:
            if file in self._files:
                self._files.move_to_end(file)
        return b"".join(chunks)

    def put(self, name: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return  # a record larger than the whole tier is not kept
        file = f"{name}.kvb"
        tmp = f"{file}.{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self._dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            # rename() replaces whatever is at `file` (a link, not its target)
            os.replace(tmp, file, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except BaseException:
            os.unlink(tmp, dir_fd=self._dir)
            raise
        with self._lock:
            self.nbytes += len(data) - self._files.pop(file, 0)
            self._files[file] = len(data)
            while self.nbytes > self.max_bytes and len(self._files) > 1:
                old, size = self._files.popitem(last=False)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old, dir_fd=self._dir)
                self.nbytes -= size

    def close(self) -> None:
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1


class RedisTier(Tier):
    """Blocks in a Redis server, shared by every replica that names it, each key expiring
    after `ttl` seconds (0: never; then the server's maxmemory policy bounds it)."""

    name = "redis"

    def __init__(
        self, url: str, ttl: int = DEFAULT_REDIS_TTL, deadline: float = REDIS_DEADLINE_S
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise InvalidRequestError(
                '--kv-tier redis:// needs the Redis client: pip install -e ".[cluster]"'
            ) from exc
        self.url, self.ttl, self.deadline = url, ttl, deadline
        timeout = min(REDIS_SOCKET_TIMEOUT_S, deadline)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )

    def get_many(self, names: list[str], limit: int) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, limit)  # inclusive: limit + 1 bytes at most
        replies = pipe.execute(raise_on_error=False)
        if not isinstance(replies, list) or len(replies) != len(names):
            raise ValueError(f"Redis answered {len(names)} GETRANGEs with {type(replies).__name__}")
        # GETRANGE of a missing key is b""; an error (WRONGTYPE), a number, a list: refused
        return [(r or None) if isinstance(r, bytes) else NOT_A_RECORD for r in replies]

    def put(self, name: str, data: bytes) -> None:
        self.client.set(name, data, ex=self.ttl or None)

    def abort(self) -> None:
        # shuts the sockets down under the reader: its recv() returns at once
        self.client.connection_pool.disconnect()

    def close(self) -> None:
        self.client.close()


def parse_tier(spec: str) -> Tier:
    """The tier `spec` names: `disk:PATH[:SIZE][?deadline=S]` or
    `redis://HOST:PORT[/DB][?ttl=SECONDS][&deadline=S]`."""
    kind, args = check_tier(spec)
    return kind(*args)


def check_tier(spec: str) -> tuple[type[Tier], tuple]:
    """The tier class and arguments `spec` names, refused with a clear message when it is
    not one, or names a directory that is not private (before a server loads its model)."""
    from kvlm.cache.memory import parse_size

    if spec.startswith(("redis://", "rediss://", "unix://")):
        url = urlsplit(spec)
        query = parse_qs(url.query)
        ttl = _number(spec, query, "ttl", DEFAULT_REDIS_TTL, int, "whole seconds")
        deadline = _number(spec, query, "deadline", REDIS_DEADLINE_S, float, "seconds")
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        return RedisTier, (url._replace(query=rest).geturl(), ttl, deadline)
    if spec.startswith("disk:"):
        body, _, rest = spec[5:].partition("?")
        query = parse_qs(rest)
        deadline = _number(spec, query, "deadline", DISK_DEADLINE_S, float, "seconds")
        if query:
            raise InvalidRequestError(f"--kv-tier {spec}: unknown option {next(iter(query))!r}")
        path, _, size = body.partition(":")
        if not path:
            raise InvalidRequestError("--kv-tier disk:PATH[:SIZE] needs a path")
        try:
            max_bytes = parse_size(size) if size else DEFAULT_DISK_SIZE
        except ValueError as exc:
            raise InvalidRequestError(f"--kv-tier {spec}: {exc}") from exc
        root = Path(path).expanduser()
        fd = open_private_dir(root, create=False)  # an unsafe one is refused now, not later
        if fd is not None:
            os.close(fd)
        return DiskTier, (root, max_bytes, deadline)
    raise InvalidRequestError(
        f"unknown KV tier {spec!r}: use disk:PATH[:SIZE] or redis://HOST:PORT"
    )


def _number(spec: str, query: dict, key: str, default, kind: type, unit: str):
    """Option `key` popped from a spec's query, a number >= 0 (> 0 for a deadline)."""
    try:
        value = kind(query.pop(key, [default])[0])
    except ValueError:
        raise InvalidRequestError(f"--kv-tier {spec}: {key} must be {unit}") from None
    if value < 0:
        raise InvalidRequestError(f"--kv-tier {spec}: {key} must be >= 0")
    if key == "deadline" and not 0 < value < float("inf"):
        raise InvalidRequestError(f"--kv-tier {spec}: deadline must be > 0 seconds")
    return value
