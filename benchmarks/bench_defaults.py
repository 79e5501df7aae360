"""How far the default numerics (the fast path, kvlm.defaults) move greedy decoding from the
fp32 reference (--exact), on the tests' kind of prompts: teacher-forced agreement (the
reference's argmax on the same prefix), the worst rank of a chosen token, and how many
whole answers come out identical. Also the choices the defaults did not make: the
vocabulary projection on int8 activations / bf16 prompt products.

    python benchmarks/bench_defaults.py --tokens 48
"""

from __future__ import annotations

import argparse

import torch

from kvlm import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
]


def score(llm: LLM, ref: LLM, n: int) -> dict:
    agree = total = worst = same = 0
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for prompt in PROMPTS:
        ids = ref.encode(prompt, chat=True)
        ours = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
        theirs = ref.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
        same += ours == theirs
        forced = ref.runner.logits(ids + ours[:-1], ref.new_cache("off"))[len(ids) - 1 :]
        chosen = torch.tensor(ours)
        rank = (forced > forced.gather(-1, chosen[:, None])).sum(-1)
        agree += int((rank == 0).sum())
        total += len(ours)
        worst = max(worst, int(rank.max()))
    return {"agreement": agree / total, "worst_rank": worst, "identical": f"{same}/{len(PROMPTS)}"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--model", default=None)
    p.add_argument("--runs", default=None, help="names of the runs, separated by ; (default: all)")
    args = p.parse_args()
    ref = LLM(model=args.model, progress=False, max_context=512, exact=True)
    runs = {
        "native, fp32 activations and prompt products": dict(
            weights="native", activations="fp32", prefill_dtype="fp32"
        ),
        "defaults": {},
        "defaults, head on int8 activations": {"head_int8": True},
        "defaults, head on bf16 prompt products": {"head_bf16": True},
        "defaults, bf16 KV": {"kv_dtype": "bf16"},
        "defaults, fp16 KV": {"kv_dtype": "fp16"},
        "defaults, bf16 prompt products": {"prefill_dtype": "bf16"},
        "defaults, int8 prompt products": {"prefill_dtype": "int8"},
    }
    chosen = None if args.runs is None else args.runs.split(";")
    for name, kw in runs.items():
        if chosen is not None and name not in chosen:
            continue
        head_int8, head_bf16 = kw.pop("head_int8", False), kw.pop("head_bf16", False)
        llm = LLM(model=args.model, progress=False, max_context=512, **kw)
        if head_int8:
            llm.model.lm_head.act_int8 = True
        if head_bf16:
            llm.model.lm_head.prefill_bf16 = True
        d = llm.describe()
        print(f"{name} ({d['weights']}, act {d['activations']}, prefill {d['prefill_dtype']}, "
              f"KV {d['kv_dtype']}): "
              f"{score(llm, ref, args.tokens)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
