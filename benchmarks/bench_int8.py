"""int8 KV cache quality on the default model: agreement and drift against fp32.

    python benchmarks/bench_int8.py --threads 2

1. For five chat prompts, 256 greedy tokens with `--kv int8`; at every step the fp32
   oracle (`--kv off`, one teacher-forced forward) scores the same prefix: greedy
   agreement and logit drift (kvlm.engine.verify). Cache bytes against `--kv paged` fp32
   holding the same tokens.
2. Why asymmetric per-token int8 with rotated K (kvlm.cache.storage): the same agreement
   on three prompts with each candidate quantizer swapped into the cache, and, on real
   K/V of the model, the relative error of per-token, rotated per-token and KIVI-style
   per-channel int8 (groups of 16 tokens) on K, V and the attention scores q.k.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvlm import LLM
from kvlm.cache import base as cache_base
from kvlm.cache import planned_nbytes, storage
from kvlm.engine.verify import verify_mode

PROMPTS = [
    "Tell me a story about a lighthouse keeper and a storm.",
    "Explain how photosynthesis works, step by step.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "What are the main causes of the French Revolution?",
    "Describe a day in the life of a honeybee.",
]


def agreement(llm: LLM, steps: int, prompts: list[str] = PROMPTS) -> list[dict]:
    fp32_spec = llm.cache_spec("paged")
    rows = []
    for prompt in prompts:
        ids = llm.encode(prompt, chat=True)
        q = verify_mode(llm, ids, "int8", steps)
        # the same tokens in an fp32 paged cache: the same blocks, 4-byte values
        fp32 = planned_nbytes("paged", fp32_spec, len(ids) + q.steps - 1, 1)
        rows.append({"prompt": prompt[:40], **q.to_dict(), "bytes_ratio": q.kv_bytes / fp32})
        print(f"  {prompt[:40]!r}: agreement {q.agreement:.2%}, max drift "
              f"{q.max_logit_drift:.3f}", flush=True)  # fmt: skip
    return rows


def _sym_per_token(x):
    s = (x.detach().float().abs().amax(-1) / 127).half()
    q = torch.round(x.float() / s.float().clamp_min(6e-5)[..., None]).clamp(-127, 127)
    return q.to(torch.int8), torch.stack([s, torch.zeros_like(s)], -1)


def _sym_dequant(q, p, dtype):
    return (q.float() * p[..., 0:1].float()).to(dtype)


def _sym_groups_32(x):
    xs = x.detach().float().unflatten(-1, (2, -1))  # two groups of head_dim / 2
    s = (xs.abs().amax(-1) / 127).half()
    q = torch.round(xs / s.float().clamp_min(6e-5)[..., None]).clamp(-127, 127)
    return q.flatten(-2).to(torch.int8), s


def _sym_groups_dequant(q, p, dtype):
    return (q.float().unflatten(-1, (2, -1)) * p.float()[..., None]).flatten(-2).to(dtype)


QUANTIZERS = {  # (quantize, dequantize, rotate K); each keeps 2 fp16 parameters per row
    "symmetric per token": (_sym_per_token, _sym_dequant, False),
    "symmetric per 32 channels": (_sym_groups_32, _sym_groups_dequant, False),
    "asymmetric per token": (storage.quantize, storage.dequantize, False),
    "asymmetric per token, K rotated (kvlm)": (storage.quantize, storage.dequantize, True),
}
COMPARE_PROMPTS = [PROMPTS[1], PROMPTS[3], PROMPTS[4]]


def compare_quantizers(llm: LLM, steps: int) -> dict[str, list[tuple[float, float]]]:
    """Swap each quantizer (and the key rotation) into the cache for a run (this script
    only: module attributes are patched and restored)."""
    saved = storage.quantize, storage.dequantize, cache_base.key_rotation
    results = {}
    try:
        for name, (quant, dequant, rotate) in QUANTIZERS.items():
            storage.quantize, storage.dequantize = quant, dequant
            cache_base.key_rotation = saved[2] if rotate else _identity
            rows = agreement(llm, steps, COMPARE_PROMPTS)
            results[name] = [(r["agreement"], r["mean_logit_drift"]) for r in rows]
    finally:
        storage.quantize, storage.dequantize, cache_base.key_rotation = saved
    return results


def _identity(head_dim: int) -> torch.Tensor:
    return torch.eye(head_dim)


def k_scales(llm: LLM) -> dict:
    ids = llm.encode(" ".join(PROMPTS), chat=True)
    cache = llm.new_cache("contiguous")
    llm.runner.forward(ids, cache)
    n = cache.num_tokens - cache.num_tokens % 16
    k, v = (cache.store.values[:, i, 0, :, :n] for i in (0, 1))  # (L, H, n, D)

    def per_token(x):  # kvlm's: asymmetric, one step and zero point per token and head
        return storage.dequantize(*storage.quantize(x), torch.float32)

    def per_channel(x, g=16):  # KIVI's K: asymmetric, per channel over groups of g tokens
        xs = x.reshape(*x.shape[:2], -1, g, x.shape[-1]).transpose(-1, -2)  # tokens last
        return (
            storage.dequantize(*storage.quantize(xs), torch.float32)
            .transpose(-1, -2)
            .reshape(x.shape)
        )

    def rotated(x):  # kvlm's K: per token in the basis x R, read back through R^T
        r = storage.key_rotation(x.shape[-1])
        return per_token(x @ r) @ r.T

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    q = k[:, :, -32:]  # the model's own keys as stand-in queries: same channels, same scale
    scores = q @ k.transpose(-1, -2)
    return {
        "tokens": n,
        "K_per_token": rel(per_token(k), k),
        "K_rotated": rel(rotated(k), k),
        "K_per_channel": rel(per_channel(k), k),
        "V_per_token": rel(per_token(v), v),
        "V_rotated": rel(rotated(v), v),
        "V_per_channel": rel(per_channel(v), v),
        "qk_per_token": rel(q @ per_token(k).transpose(-1, -2), scores),
        "qk_rotated": rel(q @ rotated(k).transpose(-1, -2), scores),
        "qk_per_channel": rel(q @ per_channel(k).transpose(-1, -2), scores),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench-out/int8.json"))
    args = ap.parse_args()
    llm = LLM(progress=False, threads=args.threads, max_context=1024)
    print(f"int8 vs fp32, {len(PROMPTS)} prompts x {args.steps} greedy tokens:", flush=True)
    rows = agreement(llm, args.steps)
    print("quantizers, 2 prompts:", flush=True)
    variants = compare_quantizers(llm, args.steps)
    scales = k_scales(llm)
    result = {"rows": rows, "quantizers": variants, "scales": scales}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    steps = sum(r["steps"] for r in rows)
    agree = sum(r["agreement"] * r["steps"] for r in rows) / steps
    print("\n| prompt | steps | greedy agreement | first disagreement | max logit drift | "
          "mean drift | int8 / fp32 bytes |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['prompt']}... | {r['steps']} | {r['agreement']:.2%} | "
              f"{r['first_disagreement']} | {r['max_logit_drift']:.3f} | "
              f"{r['mean_logit_drift']:.4f} | {r['bytes_ratio']:.3f} |")  # fmt: skip
    print(f"| **all** | {steps} | **{agree:.2%}** | | "
          f"{max(r['max_logit_drift'] for r in rows):.3f} | "
          f"{statistics.mean(r['mean_logit_drift'] for r in rows):.4f} | "
          f"{rows[0]['bytes_ratio']:.3f} |")  # fmt: skip
    print(f"\nQuantizers, greedy agreement (mean logit drift) over {args.steps} tokens:\n")
    print("| quantizer | " + " | ".join(f"{p[:24]}..." for p in COMPARE_PROMPTS) + " | mean |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, pairs in variants.items():
        cells = " | ".join(f"{a:.2%} ({d:.3f})" for a, d in pairs)
        mean = statistics.mean(a for a, _ in pairs)
        print(f"| {name} | {cells} | {mean:.2%} |")
    s = scales
    print(f"\nRelative error of int8 on real K/V ({s['tokens']} tokens, all layers):\n")
    print("| | per token | per token, rotated (kvlm's K) | per channel, groups of 16 (KIVI) |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("K", "V", "qk"):
        label = "q.k scores" if name == "qk" else name
        print(f"| {label} | {s[name + '_per_token']:.2e} | {s[name + '_rotated']:.2e} | "
              f"{s[name + '_per_channel']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
