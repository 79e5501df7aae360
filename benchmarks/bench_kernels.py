"""Why kvlm's Linear picks the kernels it does: one decode row through each candidate, and
whether a row's bits hold in a batch and across thread counts.

    python benchmarks/bench_kernels.py --threads 2

For each weight shape of the default model (fused q|k|v, o, fused gate|up, down, lm_head)
and of a 1.7B model (2048 wide), microseconds per product of one row with up to 20
different weights in turn (so the weights come from memory, not cache, as in a real decode
step), for:

- fp32: numpy's OpenBLAS on [in, out] (torch on one thread while it runs); torch matmul on
  [in, out] (MKL); oneDNN with the weight packed once (one row run as two, as Linear does);
- bf16: oneDNN packed (one row as two).

Then, per candidate, the row counts M (of 1..16, 24, 32, 64) at which row 0 of an M-row
product has other bits than row 0 of a 16-row one, and whether 1 and 2 threads give the
same bits: kvlm's contract (a row gets the same tokens alone or batched, whatever the
load) takes a kernel with neither (kvlm.model.layers.Linear).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152), "1.7B gate_up": (2048, 16384),
          "1.7B down": (6144, 2048)}  # fmt: skip
ROWS = [*range(1, 17), 24, 32, 64]


def per_call_us(fn, n_calls: int, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) / n_calls * 1e6


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    x = F.pad(x, (0, 0, 0, 1)) if rows == 1 else x  # one row as two (Linear._onednn)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[:rows].float()


def candidates(w: torch.Tensor) -> dict[str, callable]:
    """name -> product(x [M, K]) -> [M, N] fp32, over one weight w [N, K]."""
    wt = w.t().contiguous()
    npw = wt.numpy()
    pf = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    out = {
        "fp32 OpenBLAS": lambda x: torch.from_numpy(x.numpy() @ npw),
        "fp32 MKL": lambda x: torch.matmul(x, wt),
        "fp32 oneDNN": lambda x: _linear(x, pf),
    }
    try:
        pb = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1)
        out["bf16 oneDNN"] = lambda x: _linear(x.bfloat16(), pb)
    except RuntimeError:  # no oneDNN bf16 on this CPU
        pass
    return out


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return
    for pool in ThreadpoolController().select(internal_api="openblas").lib_controllers:
        pool.set_num_threads(n)  # numpy's OpenBLAS too


def kernels(threads: int) -> None:
    names = list(candidates(torch.zeros(16, 16)))
    print("| shape (in x out) | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    invariance: dict[str, dict[str, str]] = {n: {} for n in names}
    for shape, (i, o) in SHAPES.items():
        n = max(1, min(20, (64 << 20) // (i * o * 4)))
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(o, i, generator=g) / i**0.5 for _ in range(n)]
        x = torch.randn(64, i, generator=g)
        each = [candidates(w) for w in ws]
        cells = []
        for name in names:
            fns = [c[name] for c in each]
            one = x[:1].contiguous()
            if name == "fp32 OpenBLAS":
                torch.set_num_threads(1)  # as kvlm ran it: OpenBLAS owns the cores
            cells.append(per_call_us(lambda fns=fns, one=one: [f(one) for f in fns], n))
            torch.set_num_threads(threads)
            f = fns[0]
            row0 = {m: f(x[:m].contiguous())[0] for m in ROWS}
            moved = [m for m in ROWS if not torch.equal(row0[m], row0[16])]
            _set_threads(1)
            alone1 = f(x[:1].contiguous())[0]
            _set_threads(2)
            alone2 = f(x[:1].contiguous())[0]
            _set_threads(threads)
            same = "same" if torch.equal(alone1, alone2) else "differ"
            invariance[name][shape] = f"M {moved or 'none'}; 1 vs 2 threads {same}"
        print(f"| {shape} ({i}x{o}) | " + " | ".join(f"{v:.0f}" for v in cells) + " |")
    print("\n| kernel | shape | row 0 moves at | threads |")
    print("| --- | --- | --- | --- |")
    for name, by_shape in invariance.items():
        for shape, text in by_shape.items():
            moved, same = text.split("; ")
            print(f"| {name} | {shape} | {moved[2:]} | {same.split()[-1]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    _set_threads(args.threads)
    print(f"one decode row, {args.threads} threads, microseconds per product (numpy "
          f"{np.__version__}, torch {torch.__version__}):\n")  # fmt: skip
    with torch.inference_mode():
        kernels(args.threads)


if __name__ == "__main__":
    main()
