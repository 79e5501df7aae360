"""The sampler's cost per token on the default model's real next-token distributions.

Records the logits of a few sampled chat answers, then times kvlm's Sampler against the
textbook way it used to run (mask below the k-th logit, sort the vocabulary for top-p,
torch.multinomial), alternating the two in rounds over the same logits. Both draw from the
same distribution; the kept sets are the same (tests/test_sampling.py checks that).

    python benchmarks/bench_sampling.py --threads 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from kvlm import LLM
from kvlm.engine.sampling import Sampler, SamplingParams, _top_p_filter

PROMPTS = [
    "Write a short story about a dragon.",
    "List five fruits and what they taste like.",
    "Explain how a KV cache works.",
]
CONFIGS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.0, "top_p": 0.95},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.8},
]


class Textbook(Sampler):
    """Mask, sort, torch.multinomial: the sampler before the inverse-CDF draw."""

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        x = logits / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -math.inf)
        if p.top_p < 1.0:
            x = _top_p_filter(x, p.top_p)
        return int(torch.multinomial(torch.softmax(x, -1), 1, generator=self.generator))


def record_logits(llm: LLM, tokens: int) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    sampler_call = Sampler.__call__

    def keep(self: Sampler, logits: torch.Tensor) -> int:
        seen.append(logits.detach().clone())
        return sampler_call(self, logits)

    Sampler.__call__ = keep  # type: ignore[method-assign]
    try:
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=i)
            llm.stream(llm.encode(prompt, chat=True), params).run()
    finally:
        Sampler.__call__ = sampler_call  # type: ignore[method-assign]
    return seen


def per_token_us(sampler: Sampler, logits: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for x in logits:
        sampler(x)
    return (time.perf_counter() - t0) / len(logits) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=60, help="sampled tokens per prompt")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    llm = LLM(progress=False, threads=args.threads, weights="native")
    logits = record_logits(llm, args.tokens)
    print(f"{len(logits)} next-token distributions over {logits[0].numel()} tokens\n")
    print("| sampling | textbook (us/token) | kvlm (us/token) | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    for config in CONFIGS:
        times: dict[str, list[float]] = {"textbook": [], "kvlm": []}
        for _ in range(args.rounds):
            for name, cls in (("textbook", Textbook), ("kvlm", Sampler)):
                times[name].append(per_token_us(cls(SamplingParams(seed=0, **config)), logits))
        old, new = (statistics.median(times[k]) for k in ("textbook", "kvlm"))
        label = ", ".join(f"{k}={v}" for k, v in config.items())
        print(f"| {label} | {old:.0f} | {new:.0f} | {old / new:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
