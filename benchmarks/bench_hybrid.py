"""A hybrid model's cache against one that keeps every layer whole: decode ms/token at a
context of N tokens, and the K/V bytes (docs/BENCHMARKS.md, "Gemma 3 and the hybrid cache").

    python benchmarks/bench_hybrid.py MODEL.gguf --contexts 512,4096,16384 --steps 16

MODEL: a Gemma-3-shaped GGUF (kvlm.bench.models: `write_model("gemma-3-270m", "Q4_K_M",
out, kvlm.loading.default.default_model_path())`). One LLM, two caches per context: the
`contiguous` cache kvlm makes for the model (kvlm.cache.hybrid.HybridCache: the whole
layers, and the windowed ones in a ring) and a ContiguousCache keeping every layer whole
(the windows applied in its masks); each prefilled in 512-token chunks, then one-token
steps taking turns, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlm import LLM
from kvlm.cache.contiguous import ContiguousCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    llm = LLM(model=args.model, progress=False, max_context=max(contexts) + args.steps + 8)
    print("decode step:", llm.describe()["decode_step"])
    for ctx in contexts:
        hybrid = llm.new_cache("contiguous")
        caches = {"hybrid": hybrid, "whole": ContiguousCache(hybrid.spec)}
        for name, cache in caches.items():
            t = time.time()
            for a in range(0, ctx, 512):
                llm.runner.forward(list(range(1000 + a, 1000 + min(ctx, a + 512))), cache)
            mib = cache.nbytes / 2**20
            print(f"  ctx {ctx} {name}: prefill {time.time() - t:.1f} s, K/V {mib:.1f} MiB")
        times: dict[str, list[float]] = {name: [] for name in caches}
        for i in range(args.steps):
            for name, cache in caches.items():
                t = time.perf_counter()
                llm.runner.forward([5 + i], cache)
                times[name].append(time.perf_counter() - t)
        for name, took in times.items():
            ms = statistics.median(took) * 1000
            print(f"ctx {ctx} {name}: decode median {ms:.1f} ms/token over {args.steps}")


if __name__ == "__main__":
    main()
