"""Decode tok/s on one K/V dtype (default q4), the default model: a 128-token prompt then 128
greedy tokens, single stream (LLM.generate, one prompt) and 4 streams (one generate call:
the batch engine, the fused step's 4-row batches), after a warm-up of each; 3 rounds, one
JSON line (medians, every sample). Run each tree in fresh processes, alternating:

    for r in 1 2 3; do for t in /work/main /work/wt-rot; do
        PYTHONPATH=$t/src python benchmarks/bench_rotation_decode.py q4; done; done
"""

import json
import statistics
import sys

import torch

from kvlm import LLM, SamplingParams

kv = sys.argv[1] if len(sys.argv) > 1 else "q4"
torch.set_num_threads(2)
P = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
WARM = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm = LLM(progress=False, kv_dtype=kv, threads=2, max_context=512)
ids = [[(7 * i + 13 * s) % 5000 + 100 for i in range(128)] for s in range(4)]
for n in (1, 4):
    llm.generate(prompt_token_ids=ids[:n], sampling_params=WARM, use_tqdm=False)
one, four = [], []
for _ in range(3):
    o = llm.generate(prompt_token_ids=ids[:1], sampling_params=P, use_tqdm=False)[0]
    one.append(o.metrics.decode_tokens_per_s)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=P, use_tqdm=False)
    toks = sum(o.metrics.decode_tokens for o in outs)
    four.append(toks / max(o.metrics.decode_ms for o in outs) * 1000)
print(json.dumps({"one": statistics.median(one), "four": statistics.median(four),
                  "one_all": one, "four_all": four}))  # fmt: skip
