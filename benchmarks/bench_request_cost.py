"""What a guided or penalized request costs per decoded token: the default model, one
stream, greedy, 64 tokens, the three requests taking turns for 5 rounds, medians.

    python benchmarks/bench_request_cost.py
"""

import time, torch, statistics

torch.set_num_threads(2)
from kvlm import LLM, SamplingParams
from kvlm.engine.guided import Guide

llm = LLM(progress=False, max_context=512)
schema = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 30}}},
    "required": ["items"],
}
cases = {
    "plain": SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    "penalties+bias": SamplingParams(
        temperature=0,
        max_tokens=64,
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={28: 1.0},
    ),
    "json_schema": SamplingParams(
        temperature=0, max_tokens=64, ignore_eos=True, guide=Guide("json_schema", schema)
    ),
}
prompt = "List some fruits as JSON."
res = {k: [] for k in cases}
for _ in range(5):
    for k, p in cases.items():  # take turns
        out = llm.generate(prompt, p)[0]
        m = out.metrics
        res[k].append((m.decode_tokens_per_s, len(out.outputs[0].token_ids)))
for k, v in res.items():
    print(k, "decode tok/s median", round(statistics.median(x for x, _ in v), 1), "tokens", v[0][1])
