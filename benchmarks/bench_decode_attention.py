"""A decoded row's attention on the CPU, one call: torch's SDPA, kvlm_attend's prompt kernel
and kvlm_attend_row, medians of 100 interleaved calls, and the largest difference from SDPA.

    python benchmarks/bench_decode_attention.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from kvlm.model.attention import _attend_kernel


def main() -> None:
    torch.manual_seed(0)
    for keys in (64, 512, 2048):
        for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
            q = torch.randn(1, heads, 1, dim)
            k, v = torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
            roads = {
                "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True
                ),
                "prompt kernel": lambda q=q, k=k, v=v: _attend_kernel(q, k, v, None, False),
                "row kernel": lambda q=q, k=k, v=v: _attend_kernel(
                    q, k, v, None, False, decode=True
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in roads}
            for _ in range(100):
                for name, road in roads.items():
                    t = time.perf_counter()
                    road()
                    times[name].append(time.perf_counter() - t)
            diff = (roads["sdpa"]() - roads["row kernel"]()).abs().max().item()
            cells = ", ".join(f"{n} {statistics.median(t) * 1e6:.0f} us" for n, t in times.items())
            print(f"S={keys} heads={heads} D={dim}: {cells}; max diff vs sdpa {diff:.1e}")


if __name__ == "__main__":
    main()
