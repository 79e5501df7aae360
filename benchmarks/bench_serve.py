"""Load test of `kvlm serve` on loopback: throughput vs concurrent streams, TTFT with and
without a prefix hit, and a soak run watching memory and errors.

    python benchmarks/bench_serve.py                       # all three phases
    python benchmarks/bench_serve.py --soak-seconds 600    # the 10-minute soak
    python benchmarks/bench_serve.py --phases streams,prefix --json out.json
    python benchmarks/bench_serve.py --phases streams --serve-args "--weights native"
    python benchmarks/bench_serve.py --phases streams --peer llama-cpp --serve-args "--model F"

It starts the server itself on 127.0.0.1 (a free port), with the default model, and talks
raw HTTP + SSE (http.client) so the client costs little CPU beside the server. Everything
is bounded: a fixed number of requests per phase and a time limit for the soak.

- streams: C clients (C = 1, 4, 8, 16), each sending `--requests` completions one after
  another (short distinct prompts, `--max-tokens` tokens each, EOS ignored). Aggregate
  decode tokens/s = generated tokens / wall time of the phase.
- prefix: a 1,024-token prefix (a unique nonce first, so nothing is cached), then a
  question: TTFT of the cold request, then of a second question on the same prefix (its
  blocks are in the prefix cache). Medians over `--rounds` different prefixes.
- soak: C clients for `--soak-seconds`, mixed prompt lengths, a shared system prefix on
  half the requests, one in ten hanging up mid-stream. Samples the server's RSS and
  /metrics every 10 s; reports errors (any non-200 or a stream without [DONE]).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from served import ServeProcess

WORDS = ["river", "stone", "cloud", "garden", "lantern", "harbor", "meadow", "copper",
         "violin", "orchard", "falcon", "winter", "signal", "canyon", "thread", "marble",
         "pepper", "candle", "rocket", "island", "forest", "mirror", "saddle"]  # fmt: skip


@dataclass
class Result:
    ok: bool
    tokens: int
    ttft: float
    total: float
    hung_up: bool = False


class Server(ServeProcess):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(["--threads", str(args.threads), "--max-context", str(args.max_context),
                          "--max-num-seqs", "16", "--max-waiting", "64", "--log-level",
                          "warning", *args.serve_args.split()], peer=args.peer)  # fmt: skip

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stream(self, prompt: str, max_tokens: int, hang_up_after: int | None = None) -> Result:
        """One streamed completion; returns its token count, TTFT and total time."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        t0 = time.perf_counter()
        conn = None
        try:
            conn, resp = self.post_stream("/v1/completions", body)
            if resp.status != 200:
                return Result(False, 0, 0.0, time.perf_counter() - t0)
            ttft, tokens, done = 0.0, 0, False
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):  # the last chunk: the exact token count
                        tokens = chunk["usage"]["completion_tokens"]
                        continue
                    tokens += 1  # a chunk per token, less any held back (decode, stops)
                    if tokens == 1:
                        ttft = time.perf_counter() - t0
                    if hang_up_after is not None and tokens >= hang_up_after:
                        return Result(True, tokens, ttft, time.perf_counter() - t0, True)
            return Result(done, tokens, ttft, time.perf_counter() - t0)
        except OSError:
            return Result(False, 0, 0.0, time.perf_counter() - t0)
        finally:
            if conn is not None:
                conn.close()


def phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def run_client(server: Server, prompts: list[str], max_tokens: int) -> list[Result]:
    return [server.stream(p, max_tokens) for p in prompts]


def phase_streams(server: Server, args: argparse.Namespace) -> list[dict]:
    rows = []
    for clients in args.streams:
        rng = random.Random(clients)
        prompts = [f"{i}: {phrase(rng, 12)}" for i in range(clients * args.requests)]
        server.stream("warm up", 4)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(run_client, server, prompts[c::clients], args.max_tokens)
                       for c in range(clients)]  # fmt: skip
            results = [r for f in futures for r in f.result()]
        wall = time.perf_counter() - t0
        tokens = sum(r.tokens for r in results)
        rows.append({
            "streams": clients,
            "requests": len(results),
            "errors": sum(not r.ok for r in results),
            "tokens": tokens,
            "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "median_ttft_ms": round(statistics.median(r.ttft for r in results) * 1000, 1),
        })  # fmt: skip
        print(f"  {clients:2d} streams: {tokens / wall:7.1f} tok/s", file=sys.stderr)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_one_stream"] = round(row["tokens_per_s"] / base, 2)
    return rows


def phase_prefix(server: Server, args: argparse.Namespace) -> dict:
    from kvlm.loading import load_model

    tokenizer = load_model(None).tokenizer
    cold, warm = [], []
    for r in range(args.rounds):
        rng = random.Random(1000 + r)
        prefix = f"Document {rng.random():.12f}. "
        while len(tokenizer.encode(prefix)) < args.prefix_tokens:
            prefix += phrase(rng, 20) + ". "
        ids = tokenizer.encode(prefix)[: args.prefix_tokens]
        prefix = tokenizer.decode(ids)
        a = server.stream(prefix + "\nQuestion: which word comes first?", 1)
        b = server.stream(prefix + "\nQuestion: which word is the longest?", 1)
        cold.append(a.ttft)
        warm.append(b.ttft)
        print(f"  round {r}: cold {a.ttft * 1000:.0f} ms, hit {b.ttft * 1000:.0f} ms",
              file=sys.stderr)  # fmt: skip
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix_tokens": args.prefix_tokens, "rounds": args.rounds,
            "cold_ttft_ms": round(c * 1000, 1), "hit_ttft_ms": round(w * 1000, 1),
            "hit_over_cold": round(w / c, 3),
            "cold_all_ms": [round(x * 1000) for x in cold],
            "hit_all_ms": [round(x * 1000) for x in warm]}  # fmt: skip


def phase_soak(server: Server, args: argparse.Namespace) -> dict:
    system = "You are a careful assistant. " + phrase(random.Random(7), 150)
    end = time.time() + args.soak_seconds
    samples, results = [], []

    def client(c: int) -> None:
        rng = random.Random(c)
        while time.time() < end:
            prompt = phrase(rng, rng.randint(5, 300))
            if rng.random() < 0.5:
                prompt = system + "\n" + prompt
            hang = rng.randint(1, 20) if rng.random() < 0.1 else None
            results.append(server.stream(prompt, rng.randint(8, 128), hang_up_after=hang))

    with ThreadPoolExecutor(args.soak_clients + 1) as pool:
        futures = [pool.submit(client, c) for c in range(args.soak_clients)]
        while time.time() < end:
            m = server.metrics()
            samples.append(
                {
                    "t": round(args.soak_seconds - (end - time.time())),
                    "rss_mib": round(server.rss_mib(), 1),
                    "blocks_used": m["kvlm_kv_blocks_used"],
                    "running": m["kvlm_requests_running"],
                    "tokens_per_s": round(m["kvlm_generation_tokens_per_second"], 1),
                }
            )
            print(f"  {samples[-1]}", file=sys.stderr)
            time.sleep(min(10, max(0.1, end - time.time())))
        for f in futures:
            f.result()
    time.sleep(1)
    m = server.metrics()
    rss = [s["rss_mib"] for s in samples]
    minute = max(1, len(rss) // max(1, args.soak_seconds // 60))
    return {"seconds": args.soak_seconds, "clients": args.soak_clients,
            "requests": len(results), "errors": sum(not r.ok for r in results),
            "hang_ups": sum(r.hung_up for r in results),
            "tokens": sum(r.tokens for r in results),
            "rss_first_minute_mib": max(rss[:minute]), "rss_last_minute_mib": max(rss[-minute:]),
            "rss_max_mib": max(rss),
            "blocks_used_at_end": m["kvlm_kv_blocks_used"],
            "engine_errors": m["kvlm_engine_errors_total"],
            "aborted": m["kvlm_requests_aborted_total"],
            "prefix_hit_rate": round(m["kvlm_prefix_cache_hit_rate"], 3),
            "samples": samples}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="streams,prefix,soak")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 8, 16])  # fmt: skip
    p.add_argument("--requests", type=int, default=2, help="per client, streams phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--soak-seconds", type=int, default=600)
    p.add_argument("--soak-clients", type=int, default=8)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--peer", choices=("kvlm", "llama-cpp"), default="kvlm",
                   help="llama-cpp: llama-cpp-python's server on --serve-args's --model, "
                   "its threads and context (the streams phase)")  # fmt: skip
    p.add_argument("--serve-args", default="", help="more `kvlm serve` flags, e.g. "
                   "'--weights native --activations int8 --kv-dtype int8'")  # fmt: skip
    args = p.parse_args()
    phases = args.phases.split(",")
    server = Server(args)
    out: dict = {"model": server.model, "threads": args.threads, "cpu_count": os.cpu_count()}
    try:
        if "streams" in phases:
            print("streams", file=sys.stderr)
            out["streams"] = phase_streams(server, args)
        if "prefix" in phases:
            print("prefix", file=sys.stderr)
            out["prefix"] = phase_prefix(server, args)
        if "soak" in phases:
            print("soak", file=sys.stderr)
            out["soak"] = phase_soak(server, args)
    finally:
        server.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
