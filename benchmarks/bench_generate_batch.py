"""LLM.generate with several prompts, and single-stream decode around it.

    python benchmarks/bench_generate_batch.py

- batched: 8 prompts x 32 tokens through one generate call (the batch engine) against the
  same 8 one by one, and whether their tokens are the same;
- single stream, 32 greedy tokens, alternating round by round in one process: the OpenBLAS
  layout (`stream`, which generate used before it packed the weights), generate on an LLM
  that never ran a batch (packed, no engine), generate on an LLM after a batched call.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlm import LLM, SamplingParams

torch.set_num_threads(2)
P = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPT = "Tell me a long story about a dragon who"


def main() -> None:
    ref = LLM(progress=False, max_context=1024)  # OpenBLAS: stream only
    solo = LLM(progress=False, max_context=1024)  # generate, one prompt only: packed
    llm = LLM(progress=False, max_context=1024)  # generate, after a batched generate
    for x in (solo, llm):
        x.generate(PROMPT, P)
    ref.stream(ref.tokenizer.encode(PROMPT), P).run()
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    t = time.perf_counter()
    outs = llm.generate(prompts, P, use_tqdm=False)
    batched = time.perf_counter() - t
    t = time.perf_counter()
    alone = [llm.generate(p, P)[0] for p in prompts]
    one_by_one = time.perf_counter() - t
    same = [o.token_ids for o in outs] == [o.token_ids for o in alone]
    print(f"8 x 32 tokens: batched {8 * 32 / batched:.1f} tok/s, one by one "
          f"{8 * 32 / one_by_one:.1f} tok/s, same tokens: {same}")  # fmt: skip
    res: dict[str, list[float]] = {"openblas stream": [], "packed, no engine": [],
                                   "packed, after batch": []}  # fmt: skip
    for _ in range(8):
        res["openblas stream"].append(
            ref.stream(ref.tokenizer.encode(PROMPT), P).run().metrics.decode_tokens_per_s
        )
        res["packed, no engine"].append(solo.generate(PROMPT, P)[0].metrics.decode_tokens_per_s)
        res["packed, after batch"].append(llm.generate(PROMPT, P)[0].metrics.decode_tokens_per_s)
    for k, v in res.items():
        print(f"{k:22s} median {statistics.median(v):5.1f}  best {max(v):5.1f} tok/s")


if __name__ == "__main__":
    main()
