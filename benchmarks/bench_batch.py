"""Decode step time of the serving engine by batch size.

    python benchmarks/bench_batch.py --threads 2 --weights f32

B sequences of one prompt (plus a distinct last token) decode together through
`Engine.step`; the median step time over the steady part gives aggregate tokens/s. The
weights as `--weights` (f32: the dense road, oneDNN's packed layout; the default: the
file's own low-bit blocks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine


def step_ms(llm: LLM, batch: int, tokens: int) -> float:
    engine = Engine(llm)
    ids = llm.tokenizer.encode("Tell me a long story about a dragon who")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [*ids, i], params)
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        events = engine.step()
        if len(events) == batch:  # a pure decode step of every sequence
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--weights", default="auto")
    args = p.parse_args()
    llm = LLM(progress=False, max_context=1024, threads=args.threads, weights=args.weights)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for b in batches:
        ms = step_ms(llm, b, args.tokens)
        rows.append((b, ms, b / ms * 1000))
        print(f"B={b:2d}  step {ms:6.1f} ms  {b / ms * 1000:6.1f} tok/s")
    print("\n| batch | step ms | tok/s | vs batch 1 |\n| ---: | ---: | ---: | ---: |")
    for b, ms, tps in rows:
        print(f"| {b} | {ms:.1f} | {tps:.1f} | {tps / rows[0][2]:.2f}x |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
