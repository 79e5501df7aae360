"""`kvlm serve` against careless and hostile clients: a real server process on 127.0.0.1
(the default model, `--weights native` so decoding is fast), raw HTTP and sockets.

Every case checks three things: the bad request gets a clear answer (an OpenAI error body
naming the field, or a sane result), the server stays up, and nothing it holds leaks. The
last test runs the hostile requests beside normal streams and holds those to the tokens
they get alone.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import serving
from serving import kvlm_serve

pytestmark = pytest.mark.slow

KEY = "hostile-key"
MAX_SEQS = 4
MAX_BODY = 256 * 1024
IDLE_S = 2.0
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--api-key", KEY, "--max-context", "512", "--max-num-seqs", str(MAX_SEQS),
                    "--max-waiting", "16", "--threads", "2", "--weights", "native",
                    "--max-body", str(MAX_BODY), "--idle-timeout", str(IDLE_S),
                    "--log-level", "warning") as (port, proc):  # fmt: skip
        yield port, proc
    assert proc.returncode is not None


def request(
    port: int, method: str, path: str, body: bytes | dict | None = None, key: str | None = KEY
) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode(errors="replace")


def completion(port: int, **fields) -> tuple[int, dict]:
    return request(port, "POST", "/v1/completions", {"model": MODEL, **fields})


def chat(port: int, content: str, **fields) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    return request(port, "POST", "/v1/chat/completions", body)


def metrics(port: int) -> dict[str, float]:
    return serving.metrics(port, KEY)


def wait_idle(port: int, timeout: float = 60) -> dict[str, float]:
    return serving.wait_idle(port, KEY, timeout)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def assert_alive(port: int) -> None:
    assert request(port, "GET", "/health") == (200, {"status": "ok"})


def assert_error(status: int, body: dict, want: int, param: str | None = None) -> None:
    assert status == want, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param, body


# ------------------------------------------------------------------------ field ranges


@pytest.mark.parametrize("seed", [2**64, 2**64 + 1, 2**63, -(2**63) - 1, 10**40])
def test_a_seed_past_64_bits_is_a_400_not_an_exit(server, seed):
    port, proc = server
    status, body = completion(port, prompt="Hi", max_tokens=2, temperature=1, seed=seed)
    assert_error(status, body, 400, "seed")
    assert proc.poll() is None
    assert_alive(port)


# Each test below asks its greedy answer twice and compares against the second: that one
# is a prefix-cache hit, as the sampled requests after it are, so all feed the same prompt
# rows. A hit feeds fewer of them, and the defaults' bf16 prompt products (oneDNN, on a CPU
# with AMX) give a row other last bits at another row count: the first answer may differ.


def test_a_tiny_top_p_samples_the_best_token(server):
    port, _ = server
    completion(port, prompt="The capital of France is", max_tokens=8, temperature=0)
    greedy = completion(port, prompt="The capital of France is", max_tokens=8, temperature=0)
    for top_p in (1e-300, 5e-324, 1e-45):
        status, body = completion(
            port, prompt="The capital of France is", max_tokens=8, temperature=1.0,
            top_p=top_p, seed=1,
        )  # fmt: skip
        assert status == 200, body
        assert body["choices"][0]["text"] == greedy[1]["choices"][0]["text"]


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-7])
def test_a_tiny_temperature_is_greedy(server, temperature):
    port, _ = server
    chat(port, "Name a colour.", max_tokens=12, temperature=0)
    want = chat(port, "Name a colour.", max_tokens=12, temperature=0)[1]
    status, body = chat(port, "Name a colour.", max_tokens=12, temperature=temperature, seed=3)
    assert status == 200, body
    assert body["choices"][0]["message"] == want["choices"][0]["message"]


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    port, _ = server
    raw = (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
        % MODEL.encode()
    )
    status, body = request(port, "POST", "/v1/chat/completions", raw)
    assert_error(status, body, 400, "messages.0.content")
    raw = b'{"model": "%s", "prompt": "\\udfff", "max_tokens": 2}' % MODEL.encode()
    assert_error(*request(port, "POST", "/v1/completions", raw), 400, "prompt")
    raw = b'{"model": "%s", "prompt": "x", "stop": ["\\ud83d"]}' % MODEL.encode()
    assert_error(*request(port, "POST", "/v1/completions", raw), 400, "stop.0")
    assert_alive(port)


def test_n_counts_against_the_seats_and_the_pool(server):
    port, _ = server
    status, body = completion(port, prompt="Hi", max_tokens=2, n=MAX_SEQS + 1)
    assert_error(status, body, 400, "n")
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(metrics(port)["kvlm_requests_running"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(
                lambda i: completion(port, prompt=f"Story {i}:", max_tokens=24, n=MAX_SEQS,
                                     temperature=0.8, seed=i, ignore_eos=True),
                range(4),
            ))  # fmt: skip
    finally:
        stop.set()
        watcher.join()
    for status, body in runs:
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == list(range(MAX_SEQS))
        assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert max(seen) <= MAX_SEQS  # 16 rows asked for, never more than the seats at once
    wait_idle(port)


def test_stop_strings_are_bounded(server):
    port, _ = server
    status, body = completion(port, prompt="Hi", max_tokens=2, stop=["x" * 1025])
    assert_error(status, body, 400, "stop.0")
    status, body = completion(port, prompt="Hi", max_tokens=2, stop=["", "a"])
    assert_error(status, body, 400, "stop.0")
    long_stop = "never appears " * 70  # 980 characters: allowed, and searched cheaply
    status, body = completion(port, prompt="Count: 1, 2, 3,", max_tokens=200, stop=[long_stop],
                              ignore_eos=True)  # fmt: skip
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- size, time


def send_raw(port: int, head: bytes, pieces) -> bytes:
    """Send a request head and body pieces until the server answers; return the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            for piece in pieces:
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered (and closed) before the body was all sent
        return s.recv(65536)


def test_a_body_over_the_limit_is_a_413_and_costs_nothing(server):
    port, proc = server
    before = rss_kib(proc.pid)
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    size = 20 << 20  # 20 MB, as declared by its Content-Length: refused before it arrives
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + auth + b"Content-Length: %d\r\n\r\n" % size)  # fmt: skip
    reply = send_raw(port, head, (b"x" * 65536 for _ in range(size // 65536)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"error"' in reply
    # the same without a Content-Length (chunked): refused as it arrives
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + auth + b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
    reply = send_raw(port, head, (chunk for _ in range(320)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert rss_kib(proc.pid) - before < 100 * 1024  # no lasting growth from either
    assert_alive(port)


def test_a_prompt_too_long_for_the_context_is_refused(server):
    port, _ = server
    text = "word " * (MAX_BODY // 5 - 100)  # under the body limit, far over 512 tokens
    status, body = completion(port, prompt=text, max_tokens=1)
    assert_error(status, body, 400, "prompt")
    assert body["error"]["code"] == "context_length_exceeded"
    status, body = chat(port, text, max_tokens=1)
    assert_error(status, body, 400)
    assert body["error"]["code"] == "context_length_exceeded"
    assert_alive(port)


def test_an_idle_connection_is_closed(server):
    port, _ = server
    # (the socket's own timeout, 10x the server's, fails the test if it is never closed)
    with socket.create_connection(("127.0.0.1", port), timeout=IDLE_S * 10) as s:
        assert s.recv(1024) == b""  # nothing sent: closed by the server
    with socket.create_connection(("127.0.0.1", port), timeout=IDLE_S * 10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        assert s.recv(1024) == b""
    assert_alive(port)


def test_a_body_that_stops_arriving_is_a_408(server):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=IDLE_S * 10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"mo'
        )
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert_alive(port)


# ------------------------------------------------------------------------------ the key


def test_metrics_need_the_key(server):
    port, _ = server
    status, body = request(port, "GET", "/metrics", key=None)
    assert_error(status, body, 401)
    status, body = request(port, "GET", "/metrics", key="hostile-kez")
    assert_error(status, body, 401)
    assert request(port, "GET", "/metrics")[0] == 200
    assert request(port, "GET", "/health", key=None)[0] == 200  # load balancers
    assert request(port, "GET", "/openapi.json", key=None)[0] == 200


# ------------------------------------------------------------------- beside normal ones


HOSTILE = [
    lambda p: completion(p, prompt="Hi", seed=2**64 + 5, temperature=1),
    lambda p: completion(p, prompt="Tell me", max_tokens=30, temperature=1, top_p=1e-300),
    lambda p: chat(p, "Hello", max_tokens=30, temperature=1e-45),
    lambda p: request(p, "POST", "/v1/chat/completions",
                      b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    lambda p: completion(p, prompt="x" * (MAX_BODY + 10)),
    lambda p: completion(p, prompt="Once", max_tokens=40, n=MAX_SEQS, temperature=0.9, seed=4),
    lambda p: completion(p, prompt="Hi", stop=["y" * 5000]),
    lambda p: request(p, "POST", "/v1/completions", b"{not json"),
    lambda p: request(p, "POST", "/v1/completions", {"model": MODEL, "prompt": [10**9]}),
    lambda p: request(p, "GET", "/v1/models", key="wrong"),
]  # fmt: skip


def stream_tokens(port: int, prompt: str, max_tokens: int) -> list[str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200
    tokens = []
    for line in resp:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0]["logprobs"]["tokens"]
    conn.close()
    return tokens


def test_hostile_requests_beside_normal_streams_change_nothing(server):
    port, proc = server
    prompts = [f"Write a short note about the number {i}." for i in range(3)]
    alone = [stream_tokens(port, p, 48) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        normal = [pool.submit(stream_tokens, port, p, 48) for p in prompts]
        hostile = [pool.submit(h, port) for h in HOSTILE for _ in range(2)]
        results = [h.result() for h in hostile]
        together = [f.result() for f in normal]
    assert together == alone
    for status, body in results:
        assert status < 500, body  # each got its own answer: none a server error
    assert proc.poll() is None
    m = wait_idle(port)
    assert m["kvlm_engine_errors_total"] == 0
