"""`kvlm serve --replicas 2` against one replica, prefix-aware routing against round-robin,
on a multi-tenant workload that shares system prompts.

    python benchmarks/bench_cluster.py                          # 8 tenants x 4 questions
    python benchmarks/bench_cluster.py --tenants 4 --questions 3 --system-tokens 256

Each tenant has its own system prompt of `--system-tokens` tokens (its name first, so no
two tenants share a block); each asks `--questions` short questions, every request a
streamed chat completion of `--max-tokens` tokens. The requests are shuffled (seeded) and
sent by `--clients` concurrent clients, against four servers started here in turn on
127.0.0.1 (a free port each, the default model):

    1 replica            kvlm serve --threads 2 (the whole machine: one engine)
    2 replicas, prefix   kvlm serve --replicas 2 --threads 1 (--routing prefix)
      ... unbounded      the same, --route-balance 2: no bound on load with 2 replicas
    2 replicas, rr       kvlm serve --replicas 2 --threads 1 --routing round-robin

and prints one markdown row each: throughput (completion tokens over the wall time of the
workload), mean TTFT (to the first content chunk), and the prefix-cache hit rate over the
workload (prompt tokens served from cache over those looked up, summed over the replicas by
the cluster's /metrics). What to expect: a tenant's first request computes its system
prompt, its others reuse it where they land on a replica that holds it. Prefix routing
sends a tenant to one replica (one miss per tenant), unless the bound on load spills it to
the other; round-robin spreads each tenant over both (up to a miss per tenant and
replica). With Q questions per tenant the hit rates on the cacheable part tend to (Q-1)/Q
and (Q-2)/Q, a ratio that grows as Q shrinks or replicas are added.
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

CONFIGS = {  # name: (what the table calls it, `kvlm serve` flags)
    "single": ("1 replica", ["--threads", "2"]),
    "prefix": ("2 replicas, prefix", ["--replicas", "2", "--threads", "1"]),
    "prefix-unbounded": ("2 replicas, prefix, --route-balance 2",
                         ["--replicas", "2", "--threads", "1", "--route-balance", "2"]),
    "round-robin": ("2 replicas, round-robin",
                    ["--replicas", "2", "--threads", "1", "--routing", "round-robin"]),
}  # fmt: skip
WORDS = ["river", "stone", "cloud", "garden", "lantern", "harbor", "meadow", "copper",
         "violin", "orchard", "falcon", "winter", "signal", "canyon", "thread", "marble",
         "pepper", "candle", "rocket", "island", "forest", "mirror", "saddle"]  # fmt: skip
QUESTIONS = ["When do you open?", "Where are you?", "What do you sell?", "Who works there?",
             "Can I pay by card?", "Do you deliver?", "Is there parking?",
             "Who founded it?"]  # fmt: skip


@dataclass
class Result:
    ok: bool
    tokens: int
    ttft: float


class Server(ServeProcess):
    """`kvlm serve ARGS` on a free port, until stop(), ready once every replica is up."""

    def __init__(self, serve_args: list[str], max_context: int) -> None:
        flags = dict(zip(serve_args[::2], serve_args[1::2], strict=False))
        super().__init__(["--max-context", str(max_context), "--log-level", "warning",
                          *serve_args], replicas=int(flags.get("--replicas", 1)))  # fmt: skip

    def chat(self, system: str, question: str, max_tokens: int) -> Result:
        """One streamed chat completion: its completion tokens and TTFT."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}  # fmt: skip
        t0 = time.perf_counter()
        conn = None
        try:
            conn, resp = self.post_stream("/v1/chat/completions", body)
            ttft, tokens, done = 0.0, 0, False
            for line in resp if resp.status == 200 else ():
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif (
                        chunk["choices"]
                        and chunk["choices"][0]["delta"].get("content")
                        and not ttft
                    ):
                        ttft = time.perf_counter() - t0
            return Result(done, tokens, ttft)
        except OSError:
            return Result(False, 0, 0.0)
        finally:
            if conn is not None:
                conn.close()


def system_prompts(tenants: int, tokens: int) -> list[str]:
    """A system prompt per tenant, `tokens` long under the default model's tokenizer."""
    from kvlm.loading import load_model

    tokenizer = load_model(None).tokenizer
    prompts = []
    for t in range(tenants):
        rng = random.Random(t)
        text = f"You are the assistant of tenant {t}, the {rng.choice(WORDS)} company."
        while len(tokenizer.encode(text)) < tokens:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(16)) + "."
        prompts.append(tokenizer.decode(tokenizer.encode(text)[:tokens]))
    return prompts


def run(name: str, args: argparse.Namespace, work: list[tuple[str, str]]) -> dict:
    label, flags = CONFIGS[name]
    server = Server(flags, args.max_context)
    try:
        server.chat("You are terse.", "Warm up.", 4)  # first-request costs, off the clock
        before = server.metrics()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda w: server.chat(*w, args.max_tokens), work))
        wall = time.perf_counter() - t0
        after = server.metrics()
    finally:
        server.stop()

    def delta(key: str) -> float:
        return after[key] - before[key]

    tokens = sum(r.tokens for r in results)
    row = {
        "config": label,
        "requests": len(results),
        "errors": sum(not r.ok for r in results),
        "tokens_per_s": tokens / wall,
        "mean_ttft_s": statistics.mean(r.ttft for r in results if r.ok),
        "hit_rate": delta("kvlm_prefix_cache_hits_total")
        / max(1.0, delta("kvlm_prefix_cache_queries_total")),
        "prompt_tokens_computed": delta("kvlm_prompt_tokens_computed_total"),
        "seconds": wall,
    }
    print(f"  {label}: {row}", file=sys.stderr)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| configuration | requests (errors) | tokens/s | mean TTFT (s) | prefix hit rate "
             "| prompt tokens computed | wall (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    lines += [f"| {r['config']} | {r['requests']} ({r['errors']}) | {r['tokens_per_s']:.1f} | "
              f"{r['mean_ttft_s']:.2f} | {r['hit_rate']:.3f} | "
              f"{r['prompt_tokens_computed']:,.0f} | {r['seconds']:.1f} |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--questions", type=int, default=4, help="per tenant (at most 8)")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=32, help="per answer")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--configs", default=",".join(CONFIGS), help="of " + ",".join(CONFIGS))
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    systems = system_prompts(args.tenants, args.system_tokens)
    work = [(s, q) for s in systems for q in QUESTIONS[: args.questions]]
    random.Random(0).shuffle(work)  # tenants interleaved, as they arrive
    rows = [run(name, args, work) for name in args.configs.split(",")]
    print(f"{args.tenants} tenants x {args.questions} questions, {args.system_tokens}-token "
          f"system prompts, {args.clients} clients, {args.max_tokens} tokens per answer; "
          f"{os.cpu_count()} CPUs\n")  # fmt: skip
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
