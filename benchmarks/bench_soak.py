"""A hostile soak of `kvlm serve`: many clients on loopback for minutes, mixing normal
requests with malformed, oversized, disconnecting, idle and n > 1 ones.

    python benchmarks/bench_soak.py --minutes 10 --clients 16 --json docs/bench-soak.json

What it reports (and exits 1 if any fails):
- the server never exits;
- no valid request gets a 5xx (or a connection error), every invalid one a 4xx;
- greedy requests for the same prompt always get the same text (no request changes
  another's tokens under load);
- at the end, once idle, no KV block is in use and no request is held;
- RSS after warm-up vs at the end (flat: the server keeps nothing per request);
- the worst stall of a normal greedy stream (the longest gap between two of its chunks),
  while hostile grammars, schemas and prompt-scoring requests run beside it: at most
  `--max-stall` seconds (2 s: issue [18]).

The hostile kinds (issue [12]): Lark rule chains, `$ref` chains, wide `anyOf` fan-outs and
deep nesting, near and past kvlm's bounds (each a 400 or an answer, never a crash or a
freeze); `echo` + `logprobs` + `prompt_logprobs: 20` over a ~3,500-token prompt; bodies
over the limit. Issue [18] adds vanishing clients (a stream's reader goes quiet, then the
connection is reset; a whole answer's client reset before it comes) and stored-response
traffic (/v1/responses conversations: pinned blocks, read back, deleted). `--tier trickle`
puts a Redis KV tier behind a loopback proxy that hands its replies back a few bytes at a
time (each read inside the client's socket timeout).

Loopback only; every client loop is bounded by the deadline and a request count.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_server import TrickleProxy, redis_server

KEY = "soak-key"
MODEL = None  # read from /v1/models
GREEDY_PROMPTS = [f"Write one sentence about the number {i}." for i in range(6)]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_kind: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)
    # watched streams: the worst gap between two content chunks once the first has come
    # (a neighbour freezing the engine), and the wait for that first one (queueing and the
    # prompt: how loaded the server is), each in s
    stalls: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    seconds: dict[str, list[float]] = field(default_factory=dict)  # each request's, by kind
    tokens: int = 0

    def record(self, kind: str, status: int | str, ok: bool, note: str = "") -> None:
        with self.lock:
            self.by_kind[kind] += 1
            self.statuses[f"{kind}:{status}"] += 1
            if not ok and len(self.failures) < 50:
                self.failures.append(f"{kind}: {status} {note}"[:300])

    def same_answer(self, prompt: str, text: str) -> bool:
        with self.lock:
            return self.answers.setdefault(prompt, text) == text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: bytes, timeout: float = 300) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    _, text = get(port, "/metrics")
    return {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    }


# ------------------------------------------------------------------------ request kinds


def greedy_chat(port: int, rng: random.Random, tally: Tally) -> None:
    prompt = rng.choice(GREEDY_PROMPTS)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    status, raw = post(port, "/v1/chat/completions", json.dumps(body).encode())
    ok = status == 200
    if ok:
        data = json.loads(raw)
        tally.tokens += data["usage"]["completion_tokens"]
        ok = tally.same_answer(prompt, data["choices"][0]["message"]["content"])
    tally.record("greedy_chat", status, ok, raw[:200].decode(errors="replace"))


def sampled_stream(port: int, rng: random.Random, tally: Tally) -> None:
    body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": rng.randint(8, 40),
            "temperature": 0.8, "top_p": 0.9, "stream": True, "seed": rng.randint(0, 1000),
            "stream_options": {"include_usage": True}}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        lines = [line for line in resp if line.startswith(b"data: ")]
        ok = resp.status == 200 and lines[-1] == b"data: [DONE]\n"
        ok = ok and not any(b'"error"' in line for line in lines)
        tally.record("sampled_stream", resp.status, ok)
    finally:
        conn.close()


def fan_out(port: int, rng: random.Random, tally: Tally) -> None:
    n = rng.randint(2, 4)
    body = {"model": MODEL, "prompt": "A list of fruits:", "max_tokens": 12, "n": n,
            "temperature": 1.0, "seed": rng.randint(0, 10**6)}  # fmt: skip
    status, raw = post(port, "/v1/completions", json.dumps(body).encode())
    ok = status == 200 and len(json.loads(raw)["choices"]) == n
    tally.record("fan_out", status, ok, raw[:200].decode(errors="replace"))


def disconnect(port: int, rng: random.Random, tally: Tally) -> None:
    """A stream the client hangs up on after a few chunks (or before any)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
            "stream": True, "ignore_eos": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    for _ in range(rng.randint(0, 4)):
        resp.readline()
    conn.close()
    tally.record("disconnect", resp.status, resp.status == 200)


def vanishing(port: int, rng: random.Random, tally: Tally) -> None:
    """A client that stops reading, then vanishes: a long stream whose reader goes quiet
    for seconds (a 4 KiB receive window fills, the server's writes wait) and is then reset
    (no FIN: SO_LINGER 0), or a whole answer whose client is reset before it comes. Its
    blocks and its slot must come back (checked at the end: none held)."""
    stream = rng.random() < 0.7
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300,
                       "stream": stream, "ignore_eos": True}).encode()  # fmt: skip
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(300)
        s.connect(("127.0.0.1", port))
        s.sendall(head + body)
        status = "reset"
        if stream:  # the response head, then silence
            reply = s.recv(64)
            status = reply[9:12].decode(errors="replace") or "closed"
            time.sleep(rng.uniform(2, 8))
        else:
            time.sleep(rng.uniform(0.2, 3))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        s.close()  # with SO_LINGER 0: a reset
    tally.record("vanishing", status, status in ("reset", "200"))


def stored_responses(port: int, rng: random.Random, tally: Tally) -> None:
    """A conversation of stored responses (/v1/responses; each turn's K/V pinned in the
    pool): two or three turns, each naming the one before, the last read back, then each
    deleted, so that nothing is left pinned at the end."""
    prev, made, status, ok, note = None, [], 200, True, ""
    for turn in range(rng.randint(2, 3)):
        body = {"model": MODEL, "input": f"Turn {turn}: name a colour of the sea.",
                "max_output_tokens": 12, "temperature": 0, "store": True}  # fmt: skip
        if prev is not None:
            body["previous_response_id"] = prev
        status, raw = post(port, "/v1/responses", json.dumps(body).encode())
        if status != 200:
            ok, note = False, raw[:200].decode(errors="replace")
            break
        prev = json.loads(raw)["id"]
        made.append(prev)
    if ok and made:
        status, text = get(port, f"/v1/responses/{made[-1]}")
        ok = status == 200 and json.loads(text)["id"] == made[-1]
        note = text[:200]
    for rid in made:
        gone, text = get(port, f"/v1/responses/{rid}", "DELETE")
        if gone != 200:
            ok, status, note = False, gone, text[:200]
    tally.record("stored_responses", status, ok, note)


INVALID = [
    b"{not json",
    b'{"model": "m", "prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "seed": 18446744073709551617, "model": "M"}',
    b'{"model": "M", "prompt": "x", "temperature": 1e-45, "top_p": 1e-300, "n": 99}',
    b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "M", "messages": []}',
    b'{"model": "M", "prompt": [99999999]}',
    b'{"model": "M", "prompt": "x", "stop": ["' + b"y" * 2000 + b'"]}',
    b'{"model": "M", "prompt": "x", "best_of": 3, "logit_bias": {"1": 5}}',
    b'{"model": "M", "prompt": "x", "n": "2"}',
    b"[]",
    b"",
]


def invalid(port: int, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(INVALID).replace(b'"M"', json.dumps(MODEL).encode())
    status, raw = post(port, "/v1/completions" if b"prompt" in body else "/v1/chat/completions",
                       body)  # fmt: skip
    ok = 400 <= status < 500 and b'"error"' in raw
    tally.record("invalid", status, ok, raw[:200].decode(errors="replace"))


def oversized(port: int, rng: random.Random, tally: Tally) -> None:
    """A body over the server's limit, declared by its Content-Length: refused on sight."""
    size = 8 << 20
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % size
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            for _ in range(rng.randint(0, 16)):
                s.sendall(b"x" * 65536)
        except OSError:
            pass  # answered and closed before the body was all sent
        reply = s.recv(4096)
    ok = reply.startswith(b"HTTP/1.1 413")
    tally.record("oversized", reply[9:12].decode(errors="replace") or "closed", ok, str(reply[:80]))


def idle(port: int, rng: random.Random, tally: Tally) -> None:
    """A connection that never sends a whole request head: the server must close it."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        if rng.random() < 0.5:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        ok = s.recv(1024) == b""
    tally.record("idle", "closed" if ok else "answered", ok)


def lark_chain(n: int) -> str:
    """`r0: "a" r1`, ..., a chain of n rules (llguidance's recursion once overflowed here)."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "a"\n'


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 4}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def fan(n: int) -> dict:
    """A wide anyOf of small objects (n=2000 is ~320 KiB of JSON)."""
    return {"anyOf": [{"type": "object", "properties": {f"key_{i}": {"const": f"value_{i}_x"}},
                       "required": [f"key_{i}"], "additionalProperties": False}
                      for i in range(n)]}  # fmt: skip


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# (field, value): each answered 200 (it fits the bounds and compiled) or 400 (refused,
# naming the field), never 5xx, a reset or a dead server
GUIDES = [
    ("guided_grammar", lambda: lark_chain(5000)),
    ("guided_grammar", lambda: lark_chain(50)),
    ("guided_json", lambda: ref_chain(5000)),
    ("guided_json", lambda: ref_chain(20)),
    ("guided_json", lambda: fan(2000)),
    ("guided_json", lambda: nested(300)),
    ("guided_json", lambda: nested(8)),
    ("guided_grammar", lambda: "start: " + "(" * 50_000 + '"a"' + ")" * 50_000),
]


def hostile_guided(port: int, rng: random.Random, tally: Tally) -> None:
    name, make = rng.choice(GUIDES)
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 8, "temperature": 0,
            name: make()}  # fmt: skip
    status, raw = post(port, "/v1/completions", json.dumps(body).encode())
    ok = status == 200 or (status == 400 and b'"error"' in raw)
    tally.record("hostile_guided", status, ok, raw[:200].decode(errors="replace"))


SCORED = " ".join(f"word{i % 97}" for i in range(1200))  # ~3,500 tokens of the default model


def scoring(port: int, rng: random.Random, tally: Tally) -> None:
    """lm-eval's loglikelihood request, at its most expensive: the whole prompt scored."""
    body = {"model": MODEL, "prompt": SCORED, "max_tokens": 1, "echo": True, "logprobs": 5,
            "prompt_logprobs": 20, "temperature": 0}  # fmt: skip
    status, raw = post(port, "/v1/completions", json.dumps(body).encode())
    ok = status == 200 and len(json.loads(raw)["choices"][0]["prompt_logprobs"]) > 1000
    tally.record("scoring", status, ok, raw[:200].decode(errors="replace"))


def watched_stream(port: int, rng: random.Random, tally: Tally) -> None:
    """A normal greedy stream: the same text every time; its longest gap between two content
    chunks after the first (the stall a neighbour caused) and its wait for the first one
    (admission, queueing and prefill under load) recorded apart."""
    prompt = rng.choice(GREEDY_PROMPTS)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "temperature": 0, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        text, first, last, worst = "", None, 0.0, 0.0
        for line in resp:
            now = time.perf_counter()
            choices = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else []
            if choices and choices[0]["delta"].get("content"):
                text += choices[0]["delta"]["content"]
                if first is None:
                    first = now - sent
                else:
                    worst = max(worst, now - last)
                last = now
        ok = resp.status == 200 and tally.same_answer("stream:" + prompt, text)
        with tally.lock:
            tally.stalls.append(round(worst, 3))
            if first is not None:
                tally.firsts.append(round(first, 3))
        tally.record("watched_stream", resp.status, ok, text[:100])
    finally:
        conn.close()


KINDS = [(greedy_chat, 4), (sampled_stream, 3), (fan_out, 2), (disconnect, 2), (invalid, 4),
         (oversized, 1), (idle, 1), (hostile_guided, 2), (scoring, 1),
         (watched_stream, 3), (vanishing, 2), (stored_responses, 2)]  # fmt: skip


def client(port: int, seed: int, deadline: float, limit: int, tally: Tally) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS, strict=True)
    for _ in range(limit):
        if time.time() > deadline:
            return
        kind = rng.choices(kinds, weights)[0]
        began = time.perf_counter()
        try:
            kind(port, rng, tally)
        except (OSError, http.client.HTTPException, ValueError, IndexError) as exc:
            tally.record(kind.__name__, type(exc).__name__, False, str(exc))
        with tally.lock:
            tally.seconds.setdefault(kind.__name__, []).append(time.perf_counter() - began)


# --------------------------------------------------------------------------- the run


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_server(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    # --log-level info: the engine says what each new longest step held. The log goes to a
    # file (a pipe nobody reads while the clients run would fill and stall the server).
    cmd = [sys.executable, "-m", "kvlm.cli", "serve", "--port", str(port), "--api-key", KEY,
           "--log-level", "info", "--max-body", "1MiB", "--idle-timeout", "5",
           *extra, *args.serve_args.split()]  # fmt: skip
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the process, at exit)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    proc.log = log
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited: {server_log(proc)[-2000:]}")
        try:
            if get(port, "/health")[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start")


def server_log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")


def soak(args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as stack:
        extra = []
        if args.tier in ("redis", "trickle"):
            redis = stack.enter_context(redis_server())
            target = redis.port
            if args.tier == "trickle":  # every reply a few bytes at a time
                target = stack.enter_context(TrickleProxy(redis.port, 64, 0.1)).port
            extra = ["--kv-tier", f"redis://127.0.0.1:{target}"]
        return _soak(args, extra)


def _soak(args: argparse.Namespace, extra: list[str]) -> dict:
    global MODEL
    proc, port = start_server(args, extra)
    MODEL = json.loads(get(port, "/v1/models")[1])["data"][0]["id"]
    tally, samples = Tally(), []
    t0 = time.time()
    deadline = t0 + 60 * args.minutes
    threads = [
        threading.Thread(target=client, args=(port, seed, deadline, args.max_requests, tally))
        for seed in range(args.clients)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append((round(time.time() - t0, 1), rss_kib(proc.pid), proc.poll() is None))
        time.sleep(5)
    for t in threads:
        t.join()
    alive = proc.poll() is None
    idle_at = time.time()
    while alive and time.time() - idle_at < 120:
        m = metrics(port)
        if m["kvlm_kv_blocks_used"] == 0 and m["kvlm_requests_held"] == 0:
            break
        time.sleep(0.5)
    final = metrics(port) if alive else {}
    rss_end = rss_kib(proc.pid) if alive else 0
    proc.terminate()
    proc.wait(timeout=30)
    # the engine's longest steps, each logged with what it held (kvlm.engine.engine)
    longest = [line.split("kvlm.engine: ", 1)[-1] for line in server_log(proc).splitlines()
               if "longest engine step" in line]  # fmt: skip
    warm = [r for t, r, _ in samples if t >= 60 * args.minutes * 0.2] or [samples[-1][1]]
    return {
        "minutes": args.minutes, "clients": args.clients, "serve_args": args.serve_args,
        "requests": sum(tally.by_kind.values()), "by_kind": dict(tally.by_kind),
        "statuses": dict(sorted(tally.statuses.items())), "failures": tally.failures,
        "completion_tokens_greedy": tally.tokens, "server_alive": alive,
        "server_exits": 0 if all(a for _, _, a in samples) and alive else 1,
        "blocks_used_at_end": final.get("kvlm_kv_blocks_used"),
        "blocks_pinned_at_end": final.get("kvlm_kv_blocks_pinned"),
        "requests_held_at_end": final.get("kvlm_requests_held"),
        "engine_errors": final.get("kvlm_engine_errors_total"),
        "preemptions": final.get("kvlm_preemptions_total"),
        # each kind's requests: median and worst seconds, from sending to the last byte
        "seconds_by_kind": {k: [round(statistics.median(v), 2), round(max(v), 2)]
                            for k, v in sorted(tally.seconds.items())},
        # the longest engine step: a stream's gap past it was not the engine's doing
        "engine_step_s_max": final.get("kvlm_engine_step_seconds_max"),
        "engine_steps": final.get("kvlm_engine_steps_total"),
        "engine_step_s_total": final.get("kvlm_engine_step_seconds_total"),
        "longest_steps": longest[-5:],
        "rss_mib_after_warmup": round(warm[0] / 1024, 1), "rss_mib_end": round(rss_end / 1024, 1),
        "rss_mib_max": round(max(r for _, r, _ in samples) / 1024, 1),
        "stall_s_worst": max(tally.stalls, default=None),
        "stall_s_p99": sorted(tally.stalls)[int(0.99 * (len(tally.stalls) - 1))]
        if tally.stalls else None,
        "stall_s_median": sorted(tally.stalls)[len(tally.stalls) // 2] if tally.stalls else None,
        "first_content_s_worst": max(tally.firsts, default=None),
        "first_content_s_median": sorted(tally.firsts)[len(tally.firsts) // 2]
        if tally.firsts else None,
        "tier": args.tier, "tier_metrics": {k: v for k, v in final.items() if "kv_tier" in k},
        "rss_samples": samples,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=100_000, help="per client, a bound")
    ap.add_argument(
        "--tier",
        choices=("none", "redis", "trickle"),
        default="trickle",
        help="a Redis KV tier under the server, straight or behind a trickling proxy",
    )
    ap.add_argument("--serve-args", default="", help='more kvlm serve flags: "--weights native"')
    ap.add_argument("--max-stall", type=float, default=2.0,
                    help="the worst gap a watched stream may have, s")  # fmt: skip
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    result = soak(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=1))
    idle = result["blocks_used_at_end"] == 0 and result["requests_held_at_end"] == 0
    ok = result["server_exits"] == 0 and not result["failures"] and idle
    stall = result["stall_s_worst"]
    ok = ok and (stall is None or stall <= args.max_stall)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
