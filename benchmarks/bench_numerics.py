"""The rounding behind the test suite's tolerances (tests/numerics.py), on the default model.

    python benchmarks/bench_numerics.py --threads 2

1. Chunked vs one-shot prefill: each fp32 path's error against the same model in fp64
   (`LLM(dtype="fp64")`, the exact result), and the fp64 paths' distance from each other,
   against 2^-29 of the fp32 error. int8 in fp32 is shown too: there a code on a rounding
   boundary can take the other side, which is why the suite holds int8 chunking to
   exactness in fp64 and to the top-k rule in fp32.
2. The fused decode step vs the torch model (`--weights native`), against the fp64 model
   with the same weights, per cache dtype: the ratio each test bounds.
Figures depend on the CPU (its kernels' summation orders); the ratios are what the tests
hold, so they must stay within the factors in tests/numerics.py on every CPU.
"""

from __future__ import annotations

import argparse

import torch

from kvlm import LLM
from kvlm.llm import CacheOptions

PROMPT = "Tell me a short story about a lighthouse keeper and a storm."


def chunked(llm: LLM, ids: list[int], mode: str, chunk: int) -> torch.Tensor:
    cache = llm.new_cache(mode)
    for start in range(0, len(ids), chunk):
        out = llm.runner.forward(ids[start : start + chunk], cache)
    return out.double()


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def prefill_table() -> None:
    opts = CacheOptions(window=256, sinks=4)
    l32 = LLM(progress=False, max_context=512, cache_options=opts)
    l64 = LLM(progress=False, max_context=512, cache_options=opts, dtype="fp64")
    ids = l32.encode(PROMPT * 3, chat=True)
    exact = chunked(l64, ids, "paged", len(ids))
    err32 = err(chunked(l32, ids, "paged", len(ids)), exact)
    print(f"prompt {len(ids)} tokens; one-shot fp32 error vs fp64: {err32:.3g}")
    head = "| mode | chunk | fp32 chunked error | / one-shot's | fp64 chunked - one-shot |"
    print(head + " / (2^-29 fp32) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, chunk in [("contiguous", 1), ("contiguous", 16), ("paged", 7), ("window", 7),
                        ("int8", 1), ("int8", 7), ("int8", 16)]:  # fmt: skip
        e32 = err(chunked(l32, ids, mode, chunk), exact)
        d64 = err(chunked(l64, ids, mode, chunk), chunked(l64, ids, mode, len(ids)))
        print(f"| {mode} | {chunk} | {e32:.3g} | {e32 / err32:.2f} | {d64:.3g} | "
              f"{d64 / (err32 * 2**-29):.2f} |")  # fmt: skip


def fused_table() -> None:
    exact_llm = LLM(progress=False, max_context=1024, weights="native", dtype="fp64")
    print("\n| KV | prompt | fused error | torch error | fused / torch |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kv in ("fp32", "bf16", "int8"):
        llm = LLM(progress=False, max_context=512, weights="native", kv_dtype=kv)
        for prompt, steps in [("The history of the city of Paris begins", 32),
                              (" ".join(f"item {i}," for i in range(70)), 6)]:  # fmt: skip
            ids = llm.encode(prompt)
            tokens, fused, ref = _steps(llm, ids, steps)
            exact = exact_llm.runner.logits(ids + tokens, exact_llm.new_cache("off"))[len(ids) :]
            ef, et = err(fused, exact), err(ref, exact)
            print(f"| {kv} | {len(ids)} | {ef:.3g} | {et:.3g} | {ef / et:.2f} |")


def _steps(llm: LLM, ids: list[int], steps: int):
    runner = llm.runner
    fc, tc = llm.new_cache("contiguous"), llm.new_cache("contiguous")
    token = int(runner.forward(ids, fc).argmax())
    runner.forward(ids, tc)
    tokens, fused, ref, reason = [], [], [], runner.fused_reason
    for _ in range(steps):
        tokens.append(token)
        fused.append(runner.forward([token], fc))
        runner.fused_reason = "off"
        ref.append(runner.forward([token], tc))
        runner.fused_reason = reason
        token = int(fused[-1].argmax())
    return tokens, torch.stack(fused), torch.stack(ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prefill_table()
    fused_table()


if __name__ == "__main__":
    main()
