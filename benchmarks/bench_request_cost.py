"""What a guided or penalized request costs per decoded token: the default model, one
stream, greedy, 64 tokens, the three requests taking turns for 5 rounds, medians.

    python benchmarks/bench_request_cost.py
"""

from __future__ import annotations

import statistics

import torch

from kvlm import LLM, SamplingParams
from kvlm.engine.guided import Guide

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 30}}},
    "required": ["items"],
}


def main() -> None:
    torch.set_num_threads(2)
    llm = LLM(progress=False, max_context=512)
    base = {"temperature": 0, "max_tokens": 64, "ignore_eos": True}
    cases = {
        "plain": SamplingParams(**base),
        "penalties+bias": SamplingParams(**base, frequency_penalty=0.5, presence_penalty=0.5,
                                         repetition_penalty=1.1, logit_bias={28: 1.0}),
        "json_schema": SamplingParams(**base, guide=Guide("json_schema", SCHEMA)),
    }  # fmt: skip
    prompt = "List some fruits as JSON."
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(5):
        for name, params in cases.items():  # the requests take turns
            rates[name].append(llm.generate(prompt, params)[0].metrics.decode_tokens_per_s)
    for name, values in rates.items():
        tok_s = statistics.median(values)
        print(f"{name:16} decode {tok_s:6.1f} tok/s  {1e3 / tok_s:5.2f} ms per token")


if __name__ == "__main__":
    main()
