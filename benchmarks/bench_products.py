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

    python benchmarks/bench_products.py kinds --gguf q35-2b-q4_k_m.gguf
    python benchmarks/bench_products.py cached --gguf q35-2b-q4_k_m.gguf --threads 1
    python benchmarks/bench_products.py rows --gguf q35-08-q8_0.gguf
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from kvlm import LLM
from kvlm.bench import bandwidth_samples
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["kinds", "cached", "rows"])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(str(args.gguf), progress=False)
    {"kinds": kinds, "cached": cached, "rows": rows}[args.what](llm)


if __name__ == "__main__":
    main()
