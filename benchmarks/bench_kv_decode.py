"""Decode speed per K/V dtype at long contexts: one contiguous cache per dtype, filled with
CONTEXT tokens (in chunks of 1,024), then 16 one-token steps on the decode path (the fused
C step where it applies) and a rollback of them, the dtypes taking turns for --rounds
rounds; medians in tokens/s.

    python benchmarks/bench_kv_decode.py [--model FILE] --contexts 512,4096,8000
        [--dtypes fp16,int8,q4] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlm import LLM

STEPS = 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="512,4096,8000")
    p.add_argument("--dtypes", default="fp16,int8,q4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    print("| context | " + " | ".join(f"{d} tok/s" for d in dtypes) + " | decode step |")
    print("| ---: |" + " ---: |" * len(dtypes) + " --- |")
    for ctx in (int(c) for c in args.contexts.split(",")):
        llms = {d: LLM(args.model, progress=False, kv_dtype=d, max_context=ctx + STEPS + 8,
                       threads=args.threads) for d in dtypes}  # fmt: skip
        ids = [(7 * i) % 5000 + 100 for i in range(ctx)]
        caches = {}
        for d, llm in llms.items():
            caches[d] = llm.new_cache("contiguous")
            for s in range(0, ctx, 1024):
                llm.runner.forward(ids[s : s + 1024], caches[d])
        rates: dict[str, list[float]] = {d: [] for d in dtypes}
        for _ in range(args.rounds):
            for d, llm in llms.items():
                start = time.perf_counter()
                for i in range(STEPS):
                    llm.runner.forward([100 + i], caches[d])
                rates[d].append(STEPS / (time.perf_counter() - start))
                caches[d].rollback(STEPS)
        step = llms[dtypes[0]].runner.fused_reason or "fused C step"
        print(f"| {ctx:,} | " + " | ".join(f"{statistics.median(rates[d]):.1f}" for d in dtypes)
              + f" | {step} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
