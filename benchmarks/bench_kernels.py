"""Why kvlm's Linear picks the kernels it does: one decode row through each candidate.

    python benchmarks/bench_kernels.py --threads 2

For each weight shape of the default model (fused q|k|v, o, fused gate|up, down, lm_head),
microseconds per product of one row with 20 different weights in turn (so the weights come
from memory, not cache, as in a real decode step), for:

- fp32: torch `F.linear` on [out, in]; torch matmul on [in, out] (MKL); numpy's BLAS on
  [in, out] (OpenBLAS), with torch on one thread as kvlm runs it;
- bf16: `F.linear`; oneDNN with the weight packed once.

Then one whole decode step of the default model in fp32 at 512 tokens of context, with
kvlm's kernel and with KVLM_CPU_BLAS-style torch-only matmuls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}  # fmt: skip


def per_call_us(fn, n_calls: int, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) / n_calls * 1e6


def kernels(threads: int) -> None:
    print("| shape (in x out) | fp32 F.linear | fp32 MKL [in,out] | fp32 OpenBLAS | "
          "bf16 F.linear | bf16 oneDNN packed |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (i, o) in SHAPES.items():
        n = 1 if name == "lm_head" else 20
        g = torch.Generator().manual_seed(0)
        w = [torch.randn(o, i, generator=g) for _ in range(n)]
        x = torch.randn(1, i, generator=g)
        row = _row(w, x, n, threads)
        cells = " | ".join(f"{v:.0f}" for v in row)
        print(f"| {name} ({i}x{o}) | {cells} |")


def _row(w: list[torch.Tensor], x: torch.Tensor, n: int, threads: int) -> list[float]:
    """One table row: each candidate kernel over the same n weights (one row of x)."""
    wt = [a.t().contiguous() for a in w]
    row = [per_call_us(lambda: [F.linear(x, a) for a in w], n)]
    row.append(per_call_us(lambda: [x @ a for a in wt], n))
    npw, npx = [a.numpy() for a in wt], x.numpy()
    torch.set_num_threads(1)  # as kvlm runs it: OpenBLAS owns the cores
    row.append(per_call_us(lambda: [npx @ a for a in npw], n))
    torch.set_num_threads(threads)
    wb, xb = [a.bfloat16() for a in w], x.bfloat16()
    row.append(per_call_us(lambda: [F.linear(xb, a) for a in wb], n))
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(a, 1) for a in wb]
    except RuntimeError:  # no oneDNN bf16 on this CPU
        return [*row, float("nan")]
    lin = torch.ops.mkldnn._linear_pointwise
    row.append(per_call_us(lambda: [lin(xb, p, None, "none", [], "") for p in packed], n))
    return row


def decode_step(threads: int) -> None:
    from kvlm import LLM
    from kvlm.model.layers import Linear

    llm = LLM(progress=False, max_context=1024, threads=threads)
    runner, cache = llm.runner, llm.cache
    linears = [m for m in llm.model.modules() if isinstance(m, Linear)]
    blas = [m._blas for m in linears]

    def step_ms() -> float:
        cache.reset()
        runner.forward(list(range(100, 612)), cache)
        for _ in range(5):
            runner.forward([5], cache)
        times = []
        for _ in range(60):
            t = time.perf_counter()
            runner.forward([5], cache)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    def use_blas(on: bool) -> None:
        for m, b in zip(linears, blas, strict=True):
            m._blas = b if on else None

    results: dict[str, list[float]] = {"kvlm (OpenBLAS one-row)": [], "torch/MKL only": []}
    for _ in range(3):  # alternate, so drift hits both
        use_blas(True)
        results["kvlm (OpenBLAS one-row)"].append(step_ms())
        time.sleep(1.0)
        use_blas(False)
        results["torch/MKL only"].append(step_ms())
        time.sleep(1.0)
    use_blas(True)
    step_context = llm.model.step_context
    llm.model.step_context = lambda rows: nullcontext()  # both thread pools at full width
    results["OpenBLAS, torch left at all threads"] = [step_ms()]
    llm.model.step_context = step_context
    print("\n| fp32 decode step, 512-token context | ms (median of runs of 60 steps) | runs |")
    print("| --- | ---: | --- |")
    for name, runs in results.items():
        print(f"| {name} | {statistics.median(runs):.1f} | {', '.join(f'{r:.1f}' for r in runs)} |")
    time.sleep(1.0)
    prefill_after_decode(runner, cache)


def prefill_after_decode(runner, cache) -> None:
    """OpenBLAS's workers spin ~0.1 s after a call: a prefill right after decode shares
    the cores with them."""
    ids = list(range(100, 140))

    def prefill_ms(pause: float) -> float:
        times = []
        for _ in range(7):
            cache.reset()
            runner.forward(ids, cache)
            for _ in range(10):
                runner.forward([5], cache)
            time.sleep(pause)
            cache.reset()
            t = time.perf_counter()
            runner.forward(ids, cache)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    print("\n| 40-token prefill (fp32) | ms (median of 7) |")
    print("| --- | ---: |")
    print(f"| right after 10 decode steps | {prefill_ms(0.0):.0f} |")
    print(f"| 0.5 s after them | {prefill_ms(0.5):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"one decode row, {args.threads} threads, microseconds per product:\n")
    with torch.inference_mode():
        kernels(args.threads)
    decode_step(args.threads)


if __name__ == "__main__":
    main()
