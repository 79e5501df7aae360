"""oneDNN's bf16 GEMM and the row counts it meets (docs/BENCHMARKS.md 12.1).

oneDNN builds a primitive (JIT code) for each GEMM shape it meets and keeps it. Prompt
chunks of every row count grew `kvlm serve` ~50 MiB a minute under a varied load; kvlm
pads the rows (kvlm.model.quant.onednn_rows). Two measurements, each in its own process:

    python benchmarks/bench_onednn_rows.py rss            # rows 1..599 as they are
    python benchmarks/bench_onednn_rows.py rss --padded   # padded by onednn_rows
    python benchmarks/bench_onednn_rows.py ttft           # LLM.generate, padded or not

`rss`: the process's RSS growth over bf16 products of 1..599 rows by four weights of the
default model's shapes (and after malloc_trim). `ttft`: the default model's time to first
token for prompts of 100, 500 and 2,000 tokens, rounds taking turns with the padding on
and off (onednn_rows replaced by the identity), medians.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def rss(padded: bool) -> None:
    import torch

    from kvlm.model.quant import onednn_rows

    torch.set_num_threads(2)
    shapes = [(1536, 576), (576, 576), (576, 1536), (3072, 576)]
    weights = [torch.randn(o, i).bfloat16() for o, i in shapes]
    xs = {i: torch.randn(700, i).bfloat16() for _, i in shapes}
    before = rss_mib()
    for m in range(1, 600):
        rows = onednn_rows(m) if padded else m
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]][:rows], w)
    grew = rss_mib() - before
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"rows 1..599 {'padded' if padded else 'as they are'}: RSS grew {grew} MiB, "
          f"{rss_mib() - before} MiB after malloc_trim")  # fmt: skip


def ttft(rounds: int) -> None:
    from kvlm import LLM, SamplingParams
    from kvlm.model import quant

    llm = LLM(progress=False, max_context=4096)
    one = SamplingParams(temperature=0, max_tokens=1)
    padding = quant.onednn_rows
    got: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for mode in ("unpadded", "padded"):
            quant.onednn_rows = padding if mode == "padded" else (lambda m: m)
            for n in (100, 500, 2000):
                ids = [(i * 37) % 30000 + 100 for i in range(n)]
                t = time.perf_counter()
                llm.generate(prompt_token_ids=[ids], sampling_params=one)
                got.setdefault((mode, n), []).append(time.perf_counter() - t)
    print(f"{llm.numerics}")
    for (mode, n), times in sorted(got.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{n:5d} tokens {mode:9s} median {statistics.median(times):.3f} s "
              f"({', '.join(f'{t:.3f}' for t in times)})")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["rss", "ttft"])
    ap.add_argument("--padded", action="store_true", help="rss: pad the rows")
    ap.add_argument("--rounds", type=int, default=3, help="ttft: rounds taking turns")
    args = ap.parse_args()
    rss(args.padded) if args.what == "rss" else ttft(args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
