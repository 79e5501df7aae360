"""One layer's prompt products through the low-bit kernels: M prompt rows rounded to int8
per group of 32 (--prefill-dtype int8, kvlm_qgemm_i8) against each projection of one
block of a GGUF file, GOPS (2 x M x in x out per product), min of 5 after a warm-up.
Figures: docs/BENCHMARKS.md 19.10.

    python benchmarks/bench_prompt_products.py --model FILE [--rows 512] [--layer 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlm import LLM
from kvlm.model.layers import Linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, progress=False, max_context=256)
    block = llm.model.layers[args.layer]
    total_ops, total_s = 0, 0.0
    print("| product | kind | out x in | ms | GOPS |\n| --- | --- | --- | ---: | ---: |")
    for name, mod in block.named_modules():
        if not isinstance(mod, Linear) or mod.kernel != "quant":
            continue
        w = mod.quant
        x = torch.randn(args.rows, w.in_features)
        w.matmul(x, act_int8=True)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            w.matmul(x, act_int8=True)
            times.append(time.perf_counter() - t0)
        s, ops = min(times), 2 * args.rows * w.in_features * w.out_features
        total_ops, total_s = total_ops + ops, total_s + s
        print(f"| {name} | {w.kind} | {w.out_features} x {w.in_features} | {1e3 * s:.2f} | "
              f"{ops / s / 1e9:.0f} |")  # fmt: skip
    print(f"| the block | | | {1e3 * total_s:.1f} | {total_ops / total_s / 1e9:.0f} |")


if __name__ == "__main__":
    main()
