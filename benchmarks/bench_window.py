"""Endless streams through the window cache: RoPE positions inside the cache (StreamingLLM,
the default) against absolute positions, past the model's trained context.

    python benchmarks/bench_window.py --threads 2 --tokens 32768 --json window.json

The text: Python's own documentation prose, shipped with CPython (pydoc_data.topics, every
topic in sorted key order: ~465k characters, ~113k tokens for SmolLM2), fed teacher-forced
in chunks of --chunk tokens through a window cache (--sinks + --window slots) in each
position mode. Per segment of the trained context (8192 tokens for the default model: 0-8k
inside it, 8-16k up to twice it, ...):

- ppl: perplexity of the text (exp of the mean NLL of each next token), top1: how often the
  argmax is the text's next token;
- ref_agree, ref_logit_diff: at --samples evenly spaced positions per segment, StreamingLLM's
  "sliding window with re-computation" reference -- a fresh cache fed the sinks and the
  last W tokens up to that position, at positions 0..S+W-1, never past the trained range --
  how often each mode's argmax equals the reference's, and the mean over the samples of the
  mean |logit - reference logit| over the vocabulary. ref_top1: the reference's own top1.

--decode-cost instead times one decode step past the wrap, per storage dtype and mode: the
price of rotating every key at read, and for int8 of turning K back from the Hadamard basis.

--trained N is for testing only: it pretends the trained context is N tokens, so a short
run crosses it (segments of N tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvlm import LLM
from kvlm.cache import create_cache
from kvlm.cache.storage import key_rotation
from kvlm.dtypes import parse_kv_dtype
from kvlm.model.layers import apply_rope

MODES = ("absolute", "cache")


def text_ids(llm: LLM, tokens: int) -> list[int]:
    """The first tokens + 1 tokens of the documentation text (+1: the last one's target)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    ids = llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    if len(ids) <= tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {tokens} + 1")
    return ids[: tokens + 1]


def window_cache(llm: LLM, positions: str, kv_dtype: str):
    spec = llm.cache_spec("window")
    return create_cache(
        "window", replace(spec, dtype=parse_kv_dtype(kv_dtype), window_positions=positions)
    )


def sample_positions(tokens: int, segment: int, samples: int, first: int) -> list[int]:
    """`samples` query positions spread evenly over each segment, from `first` on (before
    the window fills, the reference is the plain prefix and agrees trivially)."""
    out = []
    for start in range(0, tokens, segment):
        lo, hi = max(start, first), min(start + segment, tokens) - 1
        if lo <= hi:
            n = min(samples, hi - lo + 1)
            out += sorted({round(lo + (hi - lo) * (i + 0.5) / n) for i in range(n)})
    return out


@torch.inference_mode()
def stream(llm: LLM, ids: list[int], positions: str, args, keep: set[int]) -> dict:
    """Teacher-forced pass over ids through a window cache: per-token NLL and top-1 hit, and
    the logits at the positions in `keep`."""
    cache = window_cache(llm, positions, args.kv_dtype)
    n = len(ids) - 1
    nll, hit, kept = torch.empty(n), torch.empty(n, dtype=torch.bool), {}
    t0 = time.perf_counter()
    for start in range(0, n, args.chunk):
        end = min(start + args.chunk, n)
        logits = llm.runner.logits(ids[start:end], cache)  # (T, V)
        target = torch.tensor(ids[start + 1 : end + 1])
        nll[start:end] = F.cross_entropy(logits, target, reduction="none")
        hit[start:end] = logits.argmax(-1) == target
        for p in keep.intersection(range(start, end)):
            kept[p] = logits[p - start].clone()
        if (end // args.chunk) % 64 == 0:
            rate = end / (time.perf_counter() - t0)
            print(f"  {positions}: {end}/{n} tokens, {rate:.0f} tok/s", flush=True)
    return {"nll": nll, "hit": hit, "logits": kept, "seconds": time.perf_counter() - t0}


@torch.inference_mode()
def references(llm: LLM, ids: list[int], samples: list[int], args) -> dict[int, torch.Tensor]:
    """Sliding window with re-computation: the kept tokens from scratch, at 0..S+W-1."""
    s, w = args.sinks, args.window
    spec = replace(
        llm.cache_spec("contiguous"), dtype=parse_kv_dtype(args.kv_dtype), max_tokens=s + w
    )
    cache = create_cache("contiguous", spec)
    out = {}
    for p in samples:
        kept = ids[:s] + ids[max(s, p - w + 1) : p + 1] if p >= s else ids[: p + 1]
        cache.reset()
        out[p] = llm.runner.forward(kept, cache).clone()
    return out


def segment_table(ids, runs, refs, samples, tokens: int, segment: int) -> list[dict]:
    target = torch.tensor(ids[1:])
    rows = []
    for start in range(0, tokens, segment):
        end = min(start + segment, tokens)
        ps = [p for p in samples if start <= p < end]
        row = {"segment": f"{start}-{end}", "samples": len(ps)}
        if ps:
            row["ref_top1"] = statistics.fmean(
                float(int(refs[p].argmax()) == int(target[p])) for p in ps
            )
        for mode, run in runs.items():
            stats = {
                "ppl": math.exp(float(run["nll"][start:end].mean())),
                "top1": float(run["hit"][start:end].float().mean()),
            }
            if ps:
                got = [run["logits"][p] for p in ps]
                stats["ref_agree"] = statistics.fmean(
                    float(int(g.argmax()) == int(refs[p].argmax()))
                    for g, p in zip(got, ps, strict=True)
                )
                stats["ref_logit_diff"] = statistics.fmean(
                    float((g - refs[p]).abs().mean()) for g, p in zip(got, ps, strict=True)
                )
            row[mode] = stats
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| segment | mode | ppl | top-1 | = reference | mean abs logit diff |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        for mode in MODES:
            r = row[mode]
            agree = f"{r['ref_agree']:.1%}" if "ref_agree" in r else "-"
            diff = f"{r['ref_logit_diff']:.3f}" if "ref_logit_diff" in r else "-"
            print(
                f"| {row['segment']} | {mode} | {r['ppl']:.2f} | {r['top1']:.1%} | {agree} "
                f"| {diff} |"
            )


def quality(llm: LLM, args) -> dict:
    trained = args.trained or llm.config.max_position_embeddings
    ids = text_ids(llm, args.tokens)
    samples = sample_positions(args.tokens, trained, args.samples, args.sinks + args.window)
    print(
        f"{args.tokens} tokens, trained context {trained}, window {args.sinks} + "
        f"{args.window}, chunk {args.chunk}, {len(samples)} reference samples",
        flush=True,
    )
    runs = {mode: stream(llm, ids, mode, args, set(samples)) for mode in MODES}
    t0 = time.perf_counter()
    refs = references(llm, ids, samples, args)
    ref_seconds = time.perf_counter() - t0
    rows = segment_table(ids, runs, refs, samples, args.tokens, trained)
    print_table(rows)
    seconds = {mode: round(run["seconds"], 1) for mode, run in runs.items()}
    print(f"\nstream seconds {seconds}, reference {ref_seconds:.1f} s", flush=True)
    return {
        "trained": trained,
        "segments": rows,
        "seconds": {**seconds, "reference": round(ref_seconds, 1)},
    }


@torch.inference_mode()
def decode_cost(llm: LLM, args) -> dict:
    """ms per decode step past the wrap, per storage dtype and mode, in interleaved rounds;
    and the two per-layer operations the in-cache mode adds, timed alone."""
    ids = text_ids(llm, args.sinks + args.window + 64 + args.steps)
    prefill = args.sinks + args.window + 64
    times: dict[str, list[float]] = {}
    caches = {}
    for kv_dtype in args.kv_dtypes.split(","):
        for mode in MODES:
            cache = caches[kv_dtype, mode] = window_cache(llm, mode, kv_dtype)
            for start in range(0, prefill, args.chunk):
                llm.runner.forward(ids[start : min(start + args.chunk, prefill)], cache)
    for _ in range(args.rounds):
        for (kv_dtype, mode), cache in caches.items():
            snap = cache.snapshot()
            t0 = time.perf_counter()
            for t in range(prefill, prefill + args.steps):
                llm.runner.forward([ids[t]], cache)
            times.setdefault(f"{kv_dtype} {mode}", []).append(
                (time.perf_counter() - t0) * 1e3 / args.steps
            )
            cache.restore(snap)
    result = {key: round(statistics.median(v), 3) for key, v in times.items()}
    for key, ms in result.items():
        print(f"  {key}: {ms:.2f} ms per decode step (median of {args.rounds} rounds)")
    result.update(_op_costs(llm, args))
    return result


def _op_costs(llm: LLM, args) -> dict:
    c = llm.config
    keys = torch.randn(1, c.num_kv_heads, args.sinks + args.window + 1, c.head_dim)
    pos = torch.arange(keys.shape[2])
    r = key_rotation(c.head_dim)

    def per_call_us(fn, n: int = 2000) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n

    cos_sin = llm.model.rope.for_keys(pos, keys.dtype)
    rope_us = per_call_us(lambda: apply_rope(keys, *llm.model.rope.for_keys(pos, keys.dtype)))
    read_us = per_call_us(lambda: apply_rope(keys, *cos_sin))
    back_us = per_call_us(lambda: keys @ r.T)
    print(
        f"  per layer, {keys.shape[2]} keys: RoPE at read {read_us:.1f} us (cos/sin, once "
        f"per step: {rope_us - read_us:.1f} us), int8 turn back k R^T {back_us:.1f} us; "
        f"x {c.num_layers} layers"
    )
    return {
        "rope_read_us_per_layer": round(read_us, 1),
        "cos_sin_us_per_step": round(rope_us - read_us, 1),
        "int8_turn_back_us_per_layer": round(back_us, 1),
        "layers": c.num_layers,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--chunk", type=int, default=32, help="tokens per teacher-forced forward")
    p.add_argument("--samples", type=int, default=32, help="reference positions per segment")
    p.add_argument("--kv-dtype", default="fp32")
    p.add_argument("--weights", default=None, help="as kvlm --weights (default: fp32)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--trained",
        type=int,
        default=None,
        help="TESTING ONLY: pretend the trained context is N tokens",
    )
    p.add_argument("--decode-cost", action="store_true", help="time decode steps instead")
    p.add_argument("--kv-dtypes", default="fp32,bf16,int8", help="--decode-cost dtypes")
    p.add_argument("--steps", type=int, default=32, help="--decode-cost steps per round")
    p.add_argument("--rounds", type=int, default=5, help="--decode-cost rounds")
    args = p.parse_args()
    llm = LLM(
        model=args.model,
        threads=args.threads,
        weights=args.weights,
        progress=False,
        max_context=args.sinks + args.window,
    )
    llm.cache_options = replace(llm.cache_options, window=args.window, sinks=args.sinks)
    result = {
        "model": llm.model_name,
        "weights": args.weights or "fp32",
        "kv_dtype": args.kv_dtype,
        "tokens": args.tokens,
        "window": args.window,
        "sinks": args.sinks,
        "chunk": args.chunk,
        "threads": torch.get_num_threads(),
    }
    if args.decode_cost:
        result["decode_cost"] = decode_cost(llm, args)
    else:
        result.update(quality(llm, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
