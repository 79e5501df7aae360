"""kvlm vs Hugging Face transformers on the same GGUF, same dtype, same run.

    python benchmarks/bench_core.py --threads 2 --dtype fp32 --rounds 3

1. TTFT for a 512-token prompt and decode tokens/s over 128 new tokens (greedy, EOS
   ignored), kvlm (contiguous cache) and transformers (its default DynamicCache), in
   alternating rounds; medians and the ratio of medians.
2. kvlm's per-forward milliseconds over 256 new tokens with each cache mode: without a
   cache the forward grows with the sequence, with one it stays flat.

Writes JSON to --out and prints markdown tables. Run it alone: two CPU-heavy processes
at once on a 2-core machine slow torch down by an order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvlm import LLM, SamplingParams
from kvlm.bench.child import _Clock
from kvlm.loading.default import default_model_path

TEXT = (
    "The KV cache stores the keys and values of every token already processed, which turns "
    "generation from reprocessing the whole sequence for every new token into processing one "
    "token and attending over the cache. Prefill runs the whole prompt at once; decode runs "
    "one token per step. "
)


# Pause between engines: OpenBLAS's worker threads spin for a moment after kvlm's last
# decode step, and must not eat into the next engine's measurement.
IDLE_S = 1.0


def prompt_ids(llm: LLM, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += llm.tokenizer.encode(TEXT, add_special_tokens=False)
    return ids[:n]


def kvlm_run(llm: LLM, ids: list[int], new: int) -> dict:
    llm.cache.reset()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    out = llm.stream(ids, params).run()
    assert len(out.token_ids) == new
    return {
        "ttft_ms": out.metrics.ttft_ms,
        "decode_tok_s": out.metrics.decode_tokens_per_s,
        "token_ids": out.token_ids,
    }


def hf_run(model, ids: list[int], new: int) -> dict:
    clock = _Clock()
    start = time.perf_counter()
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        streamer=clock,
    )
    t = clock.times
    return {
        "ttft_ms": (t[0] - start) * 1000,
        "decode_tok_s": (len(t) - 1) / (t[-1] - t[0]),
        "token_ids": out[0, len(ids) :].tolist(),
    }


def compare(args, llm: LLM, hf) -> dict:
    ids = prompt_ids(llm, args.prompt_tokens)
    rounds: dict[str, list[dict]] = {"kvlm": [], "hf": []}
    kvlm_run(llm, ids[:64], 8)  # warm-up both
    hf_run(hf, ids[:64], 8)
    for r in range(args.rounds):
        rounds["kvlm"].append(kvlm_run(llm, ids, args.new_tokens + 1))
        time.sleep(IDLE_S)
        rounds["hf"].append(hf_run(hf, ids, args.new_tokens + 1))
        time.sleep(IDLE_S)
        print(
            f"  round {r + 1}: kvlm {rounds['kvlm'][-1]['decode_tok_s']:.1f} tok/s, "
            f"hf {rounds['hf'][-1]['decode_tok_s']:.1f} tok/s",
            flush=True,
        )
    med = {
        who: {k: statistics.median(x[k] for x in runs) for k in ("ttft_ms", "decode_tok_s")}
        for who, runs in rounds.items()
    }
    same = rounds["kvlm"][0]["token_ids"] == rounds["hf"][0]["token_ids"]
    return {
        "median": med,
        "runs": {
            w: [{k: v for k, v in x.items() if k != "token_ids"} for x in rs]
            for w, rs in rounds.items()
        },
        "decode_ratio": med["kvlm"]["decode_tok_s"] / med["hf"]["decode_tok_s"],
        "ttft_ratio": med["kvlm"]["ttft_ms"] / med["hf"]["ttft_ms"],
        "identical_tokens": same,
    }


def per_forward(args, llm: LLM) -> dict:
    ids = llm.encode("Tell me a long story about a lighthouse keeper.", chat=True)
    curves = {}
    for mode in args.modes:
        time.sleep(IDLE_S)
        llm.cache = llm.new_cache(mode)
        params = SamplingParams(temperature=0, max_tokens=args.curve_tokens, ignore_eos=True)
        out = llm.stream(ids, params).run()
        curves[mode] = out.metrics.per_forward_ms
        print(
            f"  {mode}: {sum(curves[mode]) / 1000:.1f} s for {len(curves[mode])} forwards",
            flush=True,
        )
    llm.cache = llm.new_cache("contiguous")
    return {"prompt_tokens": len(ids), "per_forward_ms": curves}


def markdown(result: dict) -> str:
    c = result["compare"]
    med = c["median"]
    lines = [
        f"| engine ({result['dtype']}) | TTFT {result['prompt_tokens']}-token prompt (ms) "
        f"| decode tok/s ({result['new_tokens']} new) |",
        "| --- | ---: | ---: |",
        f"| kvlm (contiguous) | {med['kvlm']['ttft_ms']:.0f} | {med['kvlm']['decode_tok_s']:.1f} |",
        f"| HF transformers | {med['hf']['ttft_ms']:.0f} | {med['hf']['decode_tok_s']:.1f} |",
        f"| **kvlm / HF** | {c['ttft_ratio']:.2f}x | **{c['decode_ratio']:.2f}x** |",
        "",
        f"Greedy tokens identical to HF's: {c['identical_tokens']}.",
        "",
    ]
    curves = result["per_forward"]["per_forward_ms"]
    steps = [s for s in (16, 64, 128, 192, 256) if all(s <= len(v) for v in curves.values())]
    lines += [
        f"Per-forward ms around generated token n (median of n-4..n+4; prompt "
        f"{result['per_forward']['prompt_tokens']} tokens, whose prefill is forward 1):",
        "",
        "| kv mode | prefill | " + " | ".join(f"n={s}" for s in steps) + " | n=256 / n=16 |",
        "| --- | ---: | " + " | ".join("---:" for _ in steps) + " | ---: |",
    ]
    for mode, ms in curves.items():
        around = {s: statistics.median(ms[max(1, s - 5) : s + 4]) for s in steps}
        cells = " | ".join(f"{around[s]:.1f}" for s in steps)
        lines.append(
            f"| {mode} | {ms[0]:.0f} | {cells} | {around[steps[-1]] / around[steps[0]]:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--curve-tokens", type=int, default=256)
    ap.add_argument("--modes", nargs="+", default=["off", "basic", "contiguous"])
    ap.add_argument("--skip-curve", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench-out/core.json"))
    ap.add_argument("--report", type=Path, help="only print the tables of an earlier --out")
    args = ap.parse_args()
    if args.report:
        print(markdown(json.loads(args.report.read_text())))
        return

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    llm = LLM(dtype=args.dtype, max_context=1024, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    result = {
        "model": path.name,
        "dtype": args.dtype,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
    }
    print(f"kvlm vs HF, {args.dtype}, {args.threads} threads:", flush=True)
    result["compare"] = compare(args, llm, hf)
    del hf
    if not args.skip_curve:
        print("per-forward curve:", flush=True)
        result["per_forward"] = per_forward(args, llm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.skip_curve:
        print(markdown(result))
    else:
        print(json.dumps(result["compare"]["median"], indent=1), result["compare"]["decode_ratio"])


if __name__ == "__main__":
    main()
