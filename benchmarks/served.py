"""A `kvlm serve` process on a free 127.0.0.1 port, for the benchmarks that drive one over
HTTP (bench_serve.py, bench_cluster.py): started, waited for, scraped, stopped."""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import subprocess
import sys
import tempfile
import time


class ServeProcess:
    """`kvlm serve ARGS` until stop(). Ready once /health answers 200 and says at least
    `replicas` replicas (a cluster's router knows every replica, else the first requests
    all go to one). `peer` "llama-cpp": llama-cpp-python's OpenAI server on the model of
    ARGS's --model instead (`python -m llama_cpp.server`; ready once /v1/models answers),
    the one that bench_serve.py compares against."""

    def __init__(
        self, serve_args: list[str], replicas: int = 1, timeout: float = 300, peer: str = "kvlm"
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.peer = peer
        if peer == "llama-cpp":
            cmd = [sys.executable, "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port",
                   str(self.port), *llama_cpp_args(serve_args)]  # fmt: skip
        else:
            cmd = [sys.executable, "-c", "from kvlm.cli import main; raise SystemExit(main())",
                   "serve", "--port", str(self.port), *serve_args]  # fmt: skip
        # its log in a file, not a pipe nobody reads while it runs: llama.cpp's load log
        # alone fills a pipe's 64 KiB and the server blocks on its next write
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log,
                                     text=True)  # fmt: skip
        self.replicas = replicas
        deadline = time.time() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise SystemExit(f"kvlm serve {' '.join(serve_args)} did not start: "
                                 f"{self._log_tail()}")  # fmt: skip
            time.sleep(0.5)
        self.model = json.loads(self.get("/v1/models")[1])["data"][0]["id"]

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def _ready(self) -> bool:
        try:
            status, body = self.get("/v1/models" if self.peer == "llama-cpp" else "/health")
        except OSError:
            return False
        return status == 200 and json.loads(body).get("replicas", 1) >= self.replicas

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """/metrics as {series (with its labels): value}."""
        status, text = self.get("/metrics")
        if status != 200:
            raise OSError(f"/metrics: {status}")
        lines = [x for x in text.splitlines() if x and not x.startswith("#")]
        return {k: float(v) for k, v in (x.rsplit(" ", 1) for x in lines)}

    def post_stream(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, object]:
        """A streamed POST: the connection (the caller closes it) and its response."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def llama_cpp_args(serve_args: list[str]) -> list[str]:
    """llama-cpp-python's server flags for `kvlm serve`'s: its model, threads and context
    (--model, --threads, --max-context), the rest dropped; requests queued, not cancelled
    (its default `interrupt_requests` ends a streaming completion when the next request
    comes: of 10 concurrent 64-token streams 9 ended after a token or so)."""
    names = {"--model": "--model", "--threads": "--n_threads", "--max-context": "--n_ctx"}
    out: list[str] = ["--interrupt_requests", "False"]
    for flag, value in itertools.pairwise(serve_args):
        if flag in names:
            out += [names[flag], value]
    if "--threads" in serve_args:
        out += ["--n_threads_batch", serve_args[serve_args.index("--threads") + 1]]
    return out
