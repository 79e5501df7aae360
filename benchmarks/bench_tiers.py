"""TTFT of a request whose long prefix is cold, in the pool, on the disk tier, in Redis.

Each round: a fresh 2,048-token prefix (a shared system prompt) and a short question.

    cold   a fresh engine, no tier: the whole prompt computed
    pool   the same engine, a second question: the prefix's blocks from its own pool
    disk   a fresh engine (a restarted server) on the disk tier the first one wrote, with
           the tier's files dropped from the page cache first (posix_fadvise DONTNEED), so
           the blocks come off the disk, not out of memory
    redis  a fresh engine (another replica) on the Redis server the first one wrote to

TTFT = time from add_request to the first token event (the engine, no HTTP). Tokens are
checked equal across the four. Medians over --rounds; the target is a tier hit at most
25% of cold.

    python benchmarks/bench_tiers.py [--model FILE] [--prefix 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from redis_server import redis_server

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POOL = 128 << 20  # bytes of KV pool per engine: room for the prompt, quick to commit


def ttft(engine: Engine, ids: list[int], rid: str) -> tuple[float, list[int], int]:
    start = time.perf_counter()
    engine.add_request(rid, ids, PARAMS)
    first, tokens, cached = None, [], 0
    while engine.has_work():
        for ev in engine.step():
            if first is None and ev.token_ids:
                first = time.perf_counter() - start
                cached = ev.cached_tokens
            tokens += ev.token_ids
    return first, tokens, cached


def drop_page_cache(path: Path) -> None:
    for f in path.glob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(model=args.model, progress=False, max_context=args.prefix + 128)
    tok = llm.tokenizer
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                       if ln.startswith("Model name")), platform.processor())  # fmt: skip
    n = llm.numerics
    print(f"model {llm.model_name}, prefix {args.prefix} tokens, CPU {model_name}, "
          f"{os.cpu_count()} threads, weights {n.weights}, KV {n.kv_dtype}")  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ("cold", "pool", "disk", "redis")}
    cached: dict[str, int] = {}
    with redis_server() as redis, tempfile.TemporaryDirectory() as disk:
        tiers = (f"disk:{disk}", redis.url)
        for r in range(args.rounds):
            words = " ".join(f"note{r}_{i}" for i in range(args.prefix))
            prefix = tok.encode(words)[: args.prefix]
            ask = [prefix + tok.encode(f" Question {q} of round {r}: why?") for q in range(4)]
            cold = Engine(llm, EngineConfig(kv_memory=POOL, kv_tiers=tiers))
            t, want, _ = ttft(cold, ask[0], f"cold{r}")
            times["cold"].append(t)
            t, pool_tokens, cached["pool"] = ttft(cold, ask[1], f"pool{r}")
            times["pool"].append(t)
            cold.close()  # every block written to disk and Redis
            for name, spec, q in (("disk", tiers[0], 2), ("redis", tiers[1], 3)):
                if name == "disk":
                    drop_page_cache(Path(disk))
                fresh = Engine(llm, EngineConfig(kv_memory=POOL, kv_tiers=(spec,)))
                t, _, cached[name] = ttft(fresh, ask[q], f"{name}{r}")
                times[name].append(t)
                fresh.close()
                # the same question as the cold run: the same tokens from tier blocks
                again = Engine(llm, EngineConfig(kv_memory=POOL, kv_tiers=(spec,)))
                assert ttft(again, ask[0], "check")[1] == want, f"{name}: tokens differ"
                again.close()
            del pool_tokens
    cold = statistics.median(times["cold"])
    print(f"\n| source of the {args.prefix}-token prefix | TTFT median (ms) | of cold | "
          "cached tokens |")  # fmt: skip
    print("| --- | ---: | ---: | ---: |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / cold:.1%} | {cached.get(name, 0)} |")
    print("\nper round (ms): " + "; ".join(
        f"{k} " + "/".join(f"{t * 1e3:.0f}" for t in v) for k, v in times.items()))  # fmt: skip


if __name__ == "__main__":
    main()
