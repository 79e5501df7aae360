"""The packed weights' products at decode on a GGUF file (BENCHMARKS 24.10, 24.11), one
process, run alone on an idle box:

1. `kinds`: one decode row through every packed weight of each kind in model order (the
   weights from memory, as a decode step reads them), int16 / int8 / fp32 activations, in
   GB/s of the kind's bytes; each of 5 rounds beside a plain read of 512 MiB
   (kvlm.bench.bandwidth_samples); medians.
2. `cached`: one weight of each kind, 2048 wide, multiplied 200 times in a row (L3-resident:
   the kernels' own rate, not the memory's), `--threads` threads; medians of 7.
3. `rows`: every packed weight once in model order (the vocabulary projection's too) at
   1, 2, 4 rows, int16 and int8 activations, in ms; medians of 5, beside the plain read.
4. `experts` (no file): a stack of 32 experts of [2880, 2880] (gpt-oss's expert matrices)
   in each of mxfp4, q4_0 and q8 from random blocks, on huge pages, and in q8_0_rows (Q8_0
   read in place: on ordinary pages, as a file's map holds it), every expert once in
   turn (the stack far larger than the caches: read from memory) at 1 and 4 rows, int16,
   int8 and fp32 activations, in GB/s of the kind's bytes; medians of 5 rounds, each
   beside a plain read of 512 MiB.

    python benchmarks/bench_products.py kinds --gguf q35-2b-q4_k_m.gguf
    python benchmarks/bench_products.py cached --gguf q35-2b-q4_k_m.gguf --threads 1
    python benchmarks/bench_products.py rows --gguf q35-08-q8_0.gguf
    python benchmarks/bench_products.py experts
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kvlm import LLM
from kvlm.bench import bandwidth_samples
from kvlm.model import quant
from kvlm.model.layers import Linear


def parts(llm: LLM, vocabulary: bool | None = None) -> list:
    """The packed weights (QuantWeight parts) of the model's Linears in model order; only
    the vocabulary projection's (True), only the others' (False), or all (None)."""
    out = []
    for m in llm.model.modules():
        mine = vocabulary is None or bool(getattr(m, "vocabulary", False)) == vocabulary
        if isinstance(m, Linear) and m.quant is not None and mine:
            out += m.quant.parts()
    return out


def product(p, x: torch.Tensor, mode: str) -> None:
    p.matmul(x, act_int8=mode != "fp32", act_int16=mode == "int16")


def kinds(llm: LLM) -> None:
    by = collections.defaultdict(list)
    for p in parts(llm):
        by[p.kind].append(p)
    print({k: (len(v), round(sum(p.nbytes for p in v) / 2**20)) for k, v in by.items()},
          "(weights, MiB)")  # fmt: skip
    res = collections.defaultdict(list)
    for _ in range(5):
        res["read"].append(statistics.median(bandwidth_samples(512, 3)))
        for kind, ps in by.items():
            nbytes = sum(p.nbytes for p in ps)
            for mode in ("int16", "int8", "fp32"):
                xs = [torch.randn(1, p.in_features) for p in ps]
                for p, x in zip(ps, xs, strict=True):  # warm
                    product(p, x, mode)
                t = time.perf_counter()
                for p, x in zip(ps, xs, strict=True):
                    product(p, x, mode)
                res[f"{kind} {mode}"].append(nbytes / (time.perf_counter() - t) / 1e9)
    for k, v in res.items():
        print(f"{k}: {statistics.median(v):.1f} GB/s median, rounds {[round(x, 1) for x in v]}")


def cached(llm: LLM) -> None:
    pick = {}
    for p in parts(llm):
        if p.kind not in pick and p.in_features == 2048 and p.nbytes < 12 * 2**20:
            pick[p.kind] = p
    res = collections.defaultdict(list)
    for _ in range(7):
        for kind, p in pick.items():
            for mode in ("int16", "int8"):
                x = torch.randn(1, p.in_features)
                for _ in range(20):
                    product(p, x, mode)
                t = time.perf_counter()
                for _ in range(200):
                    product(p, x, mode)
                res[f"{kind} [{p.out_features}, 2048] {mode}"].append(
                    p.nbytes * 200 / (time.perf_counter() - t) / 1e9
                )
    for k, v in res.items():
        print(f"{k}: {statistics.median(v):.1f} GB/s")


def rows(llm: LLM) -> None:
    ps = parts(llm, False) + parts(llm, True)
    res = collections.defaultdict(list)
    for _ in range(5):
        res["read GB/s"].append(statistics.median(bandwidth_samples(512, 3)))
        for m in (1, 2, 4):
            for mode in ("int16", "int8"):
                xs = [torch.randn(m, p.in_features) for p in ps]
                for p, x in zip(ps, xs, strict=True):
                    product(p, x, mode)
                t = time.perf_counter()
                for p, x in zip(ps, xs, strict=True):
                    product(p, x, mode)
                res[f"{m} rows {mode} ms"].append((time.perf_counter() - t) * 1e3)
    print(f"{sum(p.nbytes for p in ps) / 2**20:.0f} MiB")
    for k, v in res.items():
        print(f"{k}: {statistics.median(v):.1f}")


EXPERTS, EXPERT_SHAPE = 32, (2880, 2880)


def expert_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `kind` as a GGUF file stores them, [n, k / 32 * bytes]: random codes;
    fp16 scales (q4_0, q8) or exponent bytes (mxfp4) of a model's weights' size."""
    per, size = quant.BLOCK_FORMATS[kind]
    b = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    if kind == "mxfp4":
        b[..., 0] = rng.integers(118, 126, (n, k // per), dtype=np.uint8)
    else:
        d = rng.uniform(1e-3, 2e-2, (n, k // per)).astype(np.float16)
        b[..., :2] = d[..., None].view(np.uint8)
    return b.reshape(n, -1)


def experts(threads: int) -> None:
    rng = np.random.default_rng(0)
    n, k = EXPERT_SHAPE
    stacks = {}
    for kind in ("mxfp4", "q4_0", "q8", quant.ROWS_KIND):
        stacks[kind] = [quant.QuantWeight.from_blocks(kind, torch.from_numpy(
            expert_blocks(kind, n, k, rng))) for _ in range(EXPERTS)]  # fmt: skip
    packed = [w for ws in stacks.values() for w in ws if not w.in_place]
    huge = quant.move_to_huge_pages(packed)
    print(
        f"{EXPERTS} experts of {list(EXPERT_SHAPE)}, {threads} threads, huge pages {huge}:",
        {kind: f"{sum(w.nbytes for w in ws) / 2**20:.0f} MiB" for kind, ws in stacks.items()},
    )
    res = collections.defaultdict(list)
    for _ in range(5):
        res["read"].append(statistics.median(bandwidth_samples(512, 3)))
        for kind, ws in stacks.items():
            nbytes = sum(w.nbytes for w in ws)
            for m in (1, 4):
                x = torch.randn(m, k)
                for mode in ("int16", "int8", "fp32"):
                    for w in ws:  # warm
                        product(w, x, mode)
                    t = time.perf_counter()
                    for w in ws:
                        product(w, x, mode)
                    res[f"{kind} {m} row(s) {mode}"].append(
                        nbytes / (time.perf_counter() - t) / 1e9
                    )
    for key, v in res.items():
        print(f"{key}: {statistics.median(v):.1f} GB/s median, rounds {[round(x, 1) for x in v]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["kinds", "cached", "rows", "experts"])
    p.add_argument("--gguf", type=Path, help="the model file (all but `experts`)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "experts":
        experts(args.threads)
        return
    if args.gguf is None:
        p.error(f"{args.what} takes --gguf")
    llm = LLM(str(args.gguf), progress=False)
    {"kinds": kinds, "cached": cached, "rows": rows}[args.what](llm)


if __name__ == "__main__":
    main()
