"""A real `kvlm serve` process on 127.0.0.1 for the server tests, and what they read off it."""

from __future__ import annotations

import http.client
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# Ports for the servers the tests start, taken below the kernel's ephemeral range
# (32768-60999) and above Ray's worker ports (10002-19999): what the kernel hands out for
# a bind to port 0 (Ray's own servers, starting while a kvlm serve loads) cannot be one.
TEST_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port free now, from TEST_PORTS, at a random place (other test runs pick too)."""
    for port in random.sample(TEST_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
            return port
    raise RuntimeError("no free port in TEST_PORTS")


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (Linux's
    PR_SET_PDEATHSIG), so a killed pytest leaves no server, and no Ray cluster of one (a
    server stops its cluster on SIGTERM), running behind it."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def kvlm_serve(*args: str, start_timeout: float = 180) -> Iterator[tuple[int, subprocess.Popen]]:
    """`kvlm serve ARGS` on a free port; yields (port, process) once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-c", "from kvlm.cli import main; raise SystemExit(main())",
           "serve", "--port", str(port), *args]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The output goes to a file, not a pipe nobody reads while the test runs: a chatty server
    # (a cluster relays every Ray worker's log) would fill a pipe and stall on its writes.
    # proc.stdout reads that file from its start.
    with tempfile.TemporaryFile() as log, open(f"/proc/self/fd/{log.fileno()}", "rb") as out:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_end_with_parent)  # fmt: skip
        proc.stdout = out
        try:
            deadline = time.time() + start_timeout
            while not _healthy(port):
                if proc.poll() is not None:
                    pytest.fail(f"server exited: {proc.stdout.read().decode()}")
                if time.time() > deadline:
                    pytest.fail("server did not start")
                time.sleep(0.05)  # a refused connect costs ~nothing; ~80 starts a run
            yield port, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                tail = out.read().decode(errors="replace")[-2000:]
                # not a failure of the test that ran on it, but a shutdown past its bound:
                # in pytest's warnings summary, with what the server last said
                warnings.warn(f"kvlm serve {args} outlived SIGTERM by 20 s; killed. Its "
                              f"log ends:\n{tail}", stacklevel=1)  # fmt: skip


def openai_client(port: int, key: str = "unused"):
    """The official openai client on a `kvlm serve` at this port (no retries: a test sees
    every answer)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


# two chat questions a real serve answers at once (chats_at_once), beside the LLM's answers
QUESTIONS = ["Name a city in France.", "Count to ten, please, one number at a time."]


def chats_alone(llm, questions: list[str], max_tokens: int) -> list[str]:
    """What `llm` answers each question alone, as chats_at_once asks it (greedy,
    ignore_eos): the server's answers must be these."""
    from kvlm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    return [llm.generate(prompt_token_ids=[c], sampling_params=params)[0].outputs[0].text
            for c in chats]  # fmt: skip


def chats_at_once(port: int, key: str, questions: list[str], max_tokens: int) -> list[str]:
    """Each question asked as one chat completion (greedy, ignore_eos), all at once (a
    thread each, started together), through the openai client; the answers in order."""
    import threading

    client = openai_client(port, key)
    model = client.models.list().data[0].id
    got: dict[int, str] = {}
    start = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        start.wait()
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": questions[i]}],
            max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        got[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return [got.get(i) for i in range(len(questions))]


def _healthy(port: int) -> bool:
    try:
        return get(port, "/health")[0] == 200
    except OSError:
        return False


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def metrics(port: int, key: str) -> dict[str, float]:
    status, text = get(port, "/metrics", {"Authorization": f"Bearer {key}"})
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(port: int, key: str, timeout: float = 60) -> dict[str, float]:
    """Wait until no block is referenced (but those pinned for stored responses) and no
    request held; return the metrics."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(port, key)
        pinned = m.get("kvlm_kv_blocks_pinned", 0)
        if m["kvlm_kv_blocks_used"] == pinned and m["kvlm_requests_held"] == 0:
            return m
        time.sleep(0.2)
    pytest.fail(f"blocks still held: {metrics(port, key)}")
