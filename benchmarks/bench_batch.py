"""Decode step time of the serving engine by batch size, for the two fp32 weight layouts.

    python benchmarks/bench_batch.py --threads 2

B sequences of one prompt (plus a distinct last token) decode together through
`Engine.step`; the median step time over the steady part gives aggregate tokens/s.

- default: the layout single-stream decode uses (fp32 [in, out]; one row to OpenBLAS,
  more rows to MKL, which repacks the weight on every multi-row call);
- packed: oneDNN's packed layout, what `Engine` switches to (`pack_for_batches`).
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
    args = p.parse_args()
    llm = LLM(progress=False, max_context=1024, threads=args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for layout in ("default", "packed"):
        if layout == "default":  # keep Engine from repacking, to measure the old layout
            pack, llm.model.pack_for_batches = llm.model.pack_for_batches, lambda: None
        else:
            llm.model.pack_for_batches = pack
        for b in batches:
            ms = step_ms(llm, b, args.tokens)
            rows.append((layout, b, ms, b / ms * 1000))
            print(f"{layout:8s} B={b:2d}  step {ms:6.1f} ms  {b / ms * 1000:6.1f} tok/s")
    print(
        "\n| layout | batch | step ms | tok/s | vs batch 1 |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for layout, b, ms, tps in rows:
        base = next(r[3] for r in rows if r[0] == layout and r[1] == batches[0])
        print(f"| {layout} | {b} | {ms:.1f} | {tps:.1f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
