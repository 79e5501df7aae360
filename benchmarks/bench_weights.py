"""Weight formats: decode speed, TTFT and fidelity against fp32 on the default model.

    python benchmarks/bench_weights.py --threads 2 --formats fp32,int8,native,native:bf16,native:i8

For each format: TTFT of a 512-token prompt, decode tokens/s over 128 greedy tokens (median
of the prompts), and fidelity: at every step of the format's greedy run, the fp32 model's
argmax on the same prefix (one teacher-forced forward of the fp32 model, so a miss does
not cascade), reported as agreement, and whether the run passes issue [1]'s top-5 rule.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvlm import LLM, SamplingParams

PROMPTS = [
    "Tell me a story about a lighthouse keeper and a storm.",
    "Explain how photosynthesis works, step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--formats", default="fp32,int8")
    args = p.parse_args()
    ref = LLM(progress=False, threads=args.threads, max_context=1024)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=5)
    long_ids = ref.tokenizer.encode(" ".join(PROMPTS * 40))[:512]
    rows = []
    for fmt in args.formats.split(","):
        # options after the format: "bf16" = bf16 prefill products, "i8" = int8
        # activations, "kvbf16" / "kvint8" = a bf16 / int8 KV cache (native:bf16:i8:kvbf16)
        weights, *opts = fmt.split(":")
        llm = ref if fmt == "fp32" else LLM(
            progress=False, max_context=1024, weights=weights,
            prefill_dtype="bf16" if "bf16" in opts else "fp32",
            activations="int8" if "i8" in opts else "fp32",
            kv_dtype=next((o[2:] for o in opts if o.startswith("kv")), None),
        )  # fmt: skip
        llm.generate(prompt_token_ids=[long_ids[:32]], sampling_params=params)  # warm up
        ttft = llm.generate(prompt_token_ids=[long_ids], sampling_params=params)[0]
        speeds, agree, top5 = [], [], True
        for prompt in PROMPTS:
            ids = llm.encode(prompt, chat=True)
            out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
            speeds.append(out.metrics.decode_tokens_per_s)
            logits = ref.runner.logits(ids + out.token_ids[:-1], ref.new_cache("off"))
            ref_next = torch.argmax(logits[len(ids) - 1 :], dim=-1).tolist()
            hits = [a == b for a, b in zip(out.token_ids, ref_next, strict=True)]
            agree.append(sum(hits) / len(hits))
            for i, hit in enumerate(hits):
                if not hit:
                    ref_top = torch.topk(logits[len(ids) - 1 + i], 5).indices.tolist()
                    top5 &= out.token_ids[i] in ref_top and ref_next[i] in out.logprobs[i].top
                    break
        rows.append((fmt, ttft.metrics.ttft_ms, statistics.median(speeds), agree, top5))
        print(f"{fmt}: TTFT {ttft.metrics.ttft_ms:.0f} ms, decode {statistics.median(speeds):.1f}"
              f" tok/s, agreement {[f'{a:.1%}' for a in agree]}", flush=True)  # fmt: skip
    base = rows[0][2]
    print("\n| weights | TTFT 512 (ms) | decode tok/s | vs fp32 | greedy agreement with fp32 "
          "| top-5 rule |\n| --- | ---: | ---: | ---: | ---: | --- |")  # fmt: skip
    for fmt, ttft, speed, agree, top5 in rows:
        print(f"| {fmt} | {ttft:.0f} | {speed:.1f} | {speed / base:.2f}x | "
              f"{statistics.mean(agree):.1%} ({', '.join(f'{a:.1%}' for a in agree)}) | "
              f"{'pass' if top5 else 'FAIL'} |")  # fmt: skip


if __name__ == "__main__":
    main()
