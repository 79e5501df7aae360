"""Forward at position 1024 vs 16, per KV cache dtype, in interleaved rounds.

`kvlm bench` measures this once per run; on a noisy machine one measurement can land in a
slow or fast spell for one position. This repeats kvlm.bench.position_cost round by round
over the cache dtypes (every other setting as given) and prints each round and the median.

    python benchmarks/bench_position.py --threads 2 --kv-dtypes int8,bf16,fp32 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics

from kvlm import LLM
from kvlm.bench import position_cost


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-dtypes", default="int8,bf16,fp32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--weights", default="native")
    p.add_argument("--activations", default="int8")
    p.add_argument("--prefill-dtype", default="bf16")
    args = p.parse_args()
    llms = {
        kv: LLM(
            progress=False, threads=args.threads, weights=args.weights, kv_dtype=kv,
            activations=args.activations, prefill_dtype=args.prefill_dtype,
        )
        for kv in args.kv_dtypes.split(",")
    }  # fmt: skip
    ratios: dict[str, list[float]] = {kv: [] for kv in llms}
    for r in range(args.rounds):
        for kv, llm in llms.items():
            cost = position_cost(llm, "contiguous", positions=(16, 1024), repeats=3)
            ratios[kv].append(cost["ratio"])
            print(f"round {r + 1} {kv}: {cost['16']:.2f} ms at 16, {cost['1024']:.2f} ms at "
                  f"1024 = {cost['ratio']:.2f}x", flush=True)  # fmt: skip
    print("\n| cache | ratio per round | median |\n| --- | --- | ---: |")
    for kv, rs in ratios.items():
        print(f"| {kv} | {', '.join(f'{x:.2f}' for x in rs)} | {statistics.median(rs):.2f}x |")


if __name__ == "__main__":
    main()
