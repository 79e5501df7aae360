"""One layer's prompt attention on the CPU: kvlm's C kernel in fp32 (kvlm_attend) against
the two bf16 roads of rounded prompt products (kvlm.model.attention.attend(bf16_from=0)):
torch's flash attention over q, k, v rounded to bf16 (casts included; taken with AMX) and
kvlm_attend's bf16 pairs (vdpbf16ps; taken on AVX512-BF16 without AMX, "-" where the CPU
has none); 14 query heads over 2 K/V heads of 64 (the Qwen2.5-0.5B shape), min of 5 after
a warm-up. Figures: docs/BENCHMARKS.md 19.8, 19.10.

    python benchmarks/bench_prompt_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from unittest.mock import patch

import torch

from kvlm import kernels
from kvlm.cache.base import causal_mask
from kvlm.model.attention import _attend_kernel, attend

SHAPES = [(32, 32), (128, 128), (256, 256), (512, 512), (1024, 1024), (512, 4096),
          (512, 16384), (8192, 8192)]  # fmt: skip
H, HKV, D = 14, 2, 64


def best_ms(fn, args: tuple, n: int = 5, **kw) -> float:
    fn(*args, **kw)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*args, **kw)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    print("| queries x keys | kvlm_attend fp32 ms | torch bf16 flash ms (with the casts) | x "
          "| kvlm_attend bf16 pairs ms | x |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for T, S in SHAPES:
        q, k, v = torch.randn(1, H, T, D), torch.randn(1, HKV, S, D), torch.randn(1, HKV, S, D)
        mask, causal = causal_mask(S - T, T, S, None, q.device)  # a chunk after a prefix
        fp32 = best_ms(_attend_kernel, (q, k, v, mask, causal))
        with patch.object(kernels, "has_amx", lambda: True):  # torch's road
            bf16 = best_ms(attend, (q, k, v, mask, causal), bf16_from=0)
        if _attend_kernel(q, k, v, mask, causal, bf16_row=0) is None:
            pairs = "- | -"
        else:
            ms = best_ms(_attend_kernel, (q, k, v, mask, causal), bf16_row=0)
            pairs = f"{ms:.2f} | {fp32 / ms:.2f}"
        print(f"| {T:,} x {S:,} | {fp32:.2f} | {bf16:.2f} | {fp32 / bf16:.2f} | {pairs} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
