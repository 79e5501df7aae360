"""Decode speed per K/V dtype at long contexts: one contiguous cache per dtype, filled with
CONTEXT tokens (in chunks of 1,024), then 16 one-token steps on the decode path (the fused
C step where it applies) and a rollback of them, the dtypes taking turns for --rounds
rounds; medians in tokens/s, and the bytes a step reads (the projections' weights and
the context's K/V) per second beside a plain read of memory (a sum over 256 MiB, medians
of 6 taken before and after) in the same run, and each dtype's median over the rounds of
its rate over the first dtype's in the same round.

    python benchmarks/bench_kv_decode.py [--model FILE] --contexts 512,4096,8000
        [--dtypes fp16,int8,q4] [--activations auto|int8,int16,...] [--rounds 3]
        [--threads 2] [--fill prompt|random]

--activations: each K/V dtype under each of these (--activations of kvlm; a column each,
"dtype activations").

--fill random writes random K/V rows (normal, through the store's own rounding) straight
into the cache instead of running the prompt: seconds instead of minutes at 32k on two
cores, and the same decode work (the step reads every row whatever its values); the
tokens/s are the decode step's, not a model's answers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlm import LLM
from kvlm.bench import bandwidth_samples
from kvlm.bench.child import weight_bytes_per_token
from kvlm.cache.storage import ALL

STEPS = 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="512,4096,8000")
    p.add_argument("--dtypes", default="fp16,int8,q4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fill", choices=("prompt", "random"), default="prompt")
    p.add_argument("--activations", default="auto")
    args = p.parse_args()
    acts = args.activations.split(",")
    variants = {
        (f"{d} {a}" if len(acts) > 1 else d): (d, a) for d in args.dtypes.split(",") for a in acts
    }
    dtypes = list(variants)
    plain = bandwidth_samples(256, 3)
    print("| context | " + " | ".join(f"{d} tok/s (GB/s)" for d in dtypes) + " | decode step |")
    print("| ---: |" + " ---: |" * len(dtypes) + " --- |")
    for ctx in (int(c) for c in args.contexts.split(",")):
        llms = {name: LLM(args.model, progress=False, kv_dtype=d, activations=a,
                          max_context=ctx + STEPS + 8, threads=args.threads)
                for name, (d, a) in variants.items()}  # fmt: skip
        ids = [(7 * i) % 5000 + 100 for i in range(ctx)]
        caches = {}
        for d, llm in llms.items():
            caches[d] = llm.new_cache("contiguous")
            if args.fill == "random":
                fill_random(caches[d], ctx)
                continue
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
        cells = []
        for d, llm in llms.items():
            rate = statistics.median(rates[d])
            read = weight_bytes_per_token(llm) + ctx * llm.cache_spec("contiguous").bytes_per_token
            cells.append(f"{rate:.1f} ({read * rate / 1e9:.1f})")
        print(f"| {ctx:,} | " + " | ".join(cells) + f" | {step} |", flush=True)
        first = dtypes[0]
        ratios = []  # each round's rates side by side: the ratio a noisy box keeps best
        for d in dtypes[1:]:
            pairs = zip(rates[d], rates[first], strict=True)
            ratios.append(f"{d} {statistics.median(r / f for r, f in pairs):.2f}x")
        if ratios:
            print(f"  {ctx:,}: median of the rounds' ratios to {first}: " + ", ".join(ratios))
    plain += bandwidth_samples(256, 3)
    print(f"plain read: {statistics.median(plain):.1f} GB/s (median of {len(plain)})")


def fill_random(cache, n: int) -> None:
    """Rows 0 .. n-1 of every layer's K and V: normal values, stored as the store stores
    them (rounded, or quantized per row/group)."""
    g = torch.Generator().manual_seed(0)
    store = cache.store
    layers, _, batch, heads, _, dim = store.shape
    for layer in range(layers):
        for kv in (0, 1):
            x = torch.randn(batch, heads, n, dim, generator=g)
            store.put((layer, kv, ALL, ALL, slice(0, n)), x)
    cache._length = n  # the rows are there: what a prompt of n tokens would have left


if __name__ == "__main__":
    main()
