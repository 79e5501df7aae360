"""A Ray cluster of two nodes on this machine for the cluster tests: `ray start --head` and
`ray start --address`, each its own process group, temporary directory and ports.

What Ray allows for two nodes on one host (Ray 2.x, read off `ray start` and tried):
- `--temp-dir` may be given per node: each node keeps its sockets, logs and session
  directory (named after the cluster's session) under its own, and nothing goes to
  /tmp/ray. Paths of Unix sockets must stay under ~107 bytes: the directories are short
  ones in /tmp, not pytest's.
- every port can be chosen: free ones picked here, `--min/max-worker-port 0` lets the
  OS pick each worker's. The dashboard process starts even with --include-dashboard=false
  (it serves the job API), on 8265 unless told: a free port too.
- the node address cannot be loopback: Ray turns 127.0.0.1 into the host's own address
  for a cluster (only RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps it on 127.0.0.1, and it
  then refuses a second node). The clients here still use 127.0.0.1: the GCS listens on
  every address.

Each node is stopped by its own process group, SIGTERM then SIGKILL, and the worker
processes its raylet started (each in a session of its own) by their pids. Never
`ray stop`: it stops every Ray process on the machine, other tests' included.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from serving import free_port

STARTED = "Ray runtime started."  # what `ray start` prints once its node is up
TERM_WAIT_S = 3.0  # SIGTERM, then SIGKILL: a test's cluster has nothing to save
KILL_WAIT_S = 10.0


@dataclass
class RayNode:
    """One `ray start --block` process (the leader of its process group)."""

    proc: subprocess.Popen
    temp_dir: Path
    log: Path

    def processes(self) -> list[psutil.Process]:
        """This node's processes: `ray start`, its raylet (and GCS on the head), and the
        workers the raylet started."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def titled(self, prefix: str) -> list[psutil.Process]:
        """This node's live processes whose title starts with `prefix` (Ray titles each
        actor's worker `ray::<Class>...`)."""
        found = []
        for p in self.processes():
            try:
                if p.name().startswith(prefix) and _running(p):
                    found.append(p)
            except psutil.Error:  # gone meanwhile
                pass
        return found

    def wait_started(self, deadline: float) -> None:
        while STARTED not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"ray start did not start a node:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.25)

    def terminate(self) -> list[psutil.Process]:
        """SIGTERM this node's process group; returns its processes, seen just before."""
        seen = self.processes()
        _signal_group(self.proc.pid, signal.SIGTERM)
        return seen

    def kill(self, seen: list[psutil.Process]) -> list[str]:
        """After terminate(): SIGKILL the group past TERM_WAIT_S, then whatever is left of
        `seen` by pid (workers have sessions of their own). Returns the titles of those
        still alive after that (none, unless the machine is wedged)."""
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=TERM_WAIT_S)
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=KILL_WAIT_S)
        for p in seen:
            with suppress(psutil.Error):
                p.kill()  # psutil checks that the pid was not reused
        return gone(seen, KILL_WAIT_S)


def gone(processes: list[psutil.Process], timeout: float) -> list[str]:
    """Wait (bounded) for `processes` to end; the titles of those still running. A zombie
    has ended (a worker whose raylet died waits for whoever adopts it to reap it)."""
    deadline = time.time() + timeout
    while (alive := [p for p in processes if _running(p)]) and time.time() < deadline:
        time.sleep(0.1)
    return [p.name() for p in alive]


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


@dataclass
class RayCluster:
    head: RayNode
    second: RayNode
    address: str  # the GCS, HOST:PORT, for `--ray-address`

    @property
    def nodes(self) -> tuple[RayNode, RayNode]:
        return self.head, self.second


def _ports() -> list[str]:
    """Every port a node opens, free ones (a worker's: the OS picks it)."""
    flags = ["--node-manager-port", "--object-manager-port", "--metrics-export-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port"]  # fmt: skip
    return [a for flag in flags for a in (flag, str(free_port()))] + [
        "--min-worker-port", "0", "--max-worker-port", "0",
    ]  # fmt: skip


def _start_node(temp_dir: Path, role: list[str], cpus: int) -> RayNode:
    temp_dir.mkdir()
    log = temp_dir / "ray-start.log"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
           "--temp-dir", str(temp_dir), "--num-cpus", str(cpus), "--num-gpus", "0",
           "--object-store-memory", str(80 << 20),
           "--include-log-monitor", "false", "--disable-usage-stats", *_ports(), *role]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return RayNode(proc, temp_dir, log)


def _stop(nodes: list[RayNode]) -> None:
    """Both nodes at once: SIGTERM, then SIGKILL (bounded), then check by pid."""
    seen = [node.terminate() for node in nodes]
    alive = [title for node, procs in zip(nodes, seen, strict=True) for title in node.kill(procs)]
    assert not alive, f"processes of a Ray node outlived SIGKILL: {alive}"


@contextmanager
def ray_cluster(cpus: int = 1, start_timeout: float = 120) -> Iterator[RayCluster]:
    """A head and a second node of `cpus` CPUs each; yields once both say they are up.
    Both stopped on leaving."""
    port = free_port()
    nodes: list[RayNode] = []
    # Ray turns token authentication on when ~/.ray/auth_token exists (an in-process
    # ray.init, as tests/test_cluster.py's replicas run, writes one), and a node or a
    # driver that reads the mode otherwise is refused ("InvalidAuthToken"): every process
    # of this cluster, the nodes and the `kvlm serve` that joins them, says the same.
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # short: Unix socket paths under the session directory must stay within ~107 bytes
    temp_root = Path(tempfile.mkdtemp(prefix="kvlm-ray-", dir="/tmp"))
    try:
        head_role = ["--head", "--port", str(port), "--include-dashboard", "false",
                     "--dashboard-port", str(free_port()),
                     "--ray-client-server-port", str(free_port())]  # fmt: skip
        deadline = time.time() + start_timeout
        nodes.append(_start_node(temp_root / "head", head_role, cpus))
        # The second node only once the head is up: its ports are picked free now, and a
        # port picked while the head had not bound its own yet could be the GCS port (seen
        # in a full run: the second node met another service there, "InvalidAuthToken").
        nodes[0].wait_started(deadline)
        second_role = ["--address", f"127.0.0.1:{port}"]
        nodes.append(_start_node(temp_root / "second", second_role, cpus))
        nodes[1].wait_started(deadline)
        yield RayCluster(nodes[0], nodes[1], f"127.0.0.1:{port}")
    finally:
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        try:
            _stop(nodes)
        finally:
            shutil.rmtree(temp_root, ignore_errors=True)
