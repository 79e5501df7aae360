"""A `kvlm serve` process on a free 127.0.0.1 port, for the benchmarks that drive one over
HTTP (bench_serve.py, bench_cluster.py): started, waited for, scraped, stopped."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time


class ServeProcess:
    """`kvlm serve ARGS` until stop(). Ready once /health answers 200 and says at least
    `replicas` replicas (a cluster's router knows every replica, else the first requests
    all go to one)."""

    def __init__(self, serve_args: list[str], replicas: int = 1, timeout: float = 300) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-c", "from kvlm.cli import main; raise SystemExit(main())",
               "serve", "--port", str(self.port), *serve_args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)  # fmt: skip
        self.replicas = replicas
        deadline = time.time() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise SystemExit(f"kvlm serve {' '.join(serve_args)} did not start: "
                                 f"{self.proc.stderr.read()[-2000:]}")  # fmt: skip
            time.sleep(0.5)
        self.model = json.loads(self.get("/v1/models")[1])["data"][0]["id"]

    def _ready(self) -> bool:
        try:
            status, body = self.get("/health")
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
