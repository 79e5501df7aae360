"""Memory waste: contiguous (preallocated to the context limit) vs paged, on a mixed workload.

    python benchmarks/bench_waste.py

64 requests with mixed lengths (log-normal prompts and outputs, seeded, as a chat server
sees them), all live at once, at the default model's K/V geometry in fp32. Each request's
cache is the real kvlm cache holding real K/V written through its step (random values:
waste does not depend on them). Waste = 1 - bytes of the tokens held / bytes allocated.

- contiguous: one cache per request, preallocated to the context limit (4096, kvlm's
  default, and 8192, the model's own limit): its nbytes.
- paged: every request in one shared block pool: the blocks they hold.
- fan-out: 8 samples of a 512-token prompt, 128 tokens each (n=8 from one prefill).
- window: bytes after streaming 10,000 tokens through a 4 + 256 window.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from kvlm.cache import CacheSpec, create_cache, planned_nbytes
from kvlm.cache.paged import BlockPool, PagedCache
from kvlm.loading import load_model

REQUESTS = 64


def workload(seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.exp(torch.randn(REQUESTS, generator=g) * 1.0 + math.log(300))
    outputs = torch.exp(torch.randn(REQUESTS, generator=g) * 0.8 + math.log(150))
    return [int(min(4096, max(2, p + o))) for p, o in zip(prompts, outputs, strict=True)]


def fill(cache, n: int, seed: int) -> None:
    """Write n tokens of K/V into every row of `cache`, as one forward would."""
    spec = cache.spec
    g = torch.Generator().manual_seed(seed)
    step = cache.begin(n)
    shape = (cache.batch, spec.num_kv_heads, n, spec.head_dim)
    for layer in range(spec.num_layers):
        step.update(layer, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    cache.commit(step)


def contiguous_waste(spec: CacheSpec, lengths: list[int], context: int) -> dict:
    spec = replace(spec, max_tokens=context)
    held = allocated = 0
    for i, n in enumerate(lengths):  # one at a time: 64 x 360 MiB would not fit here
        cache = create_cache("contiguous", spec)
        fill(cache, n, i)
        held += cache.num_tokens * spec.bytes_per_token
        allocated += cache.nbytes
        assert cache.nbytes == planned_nbytes("contiguous", spec, n, 1)
    return {"allocated": allocated, "held": held}


def paged_waste(spec: CacheSpec, lengths: list[int], block_size: int) -> dict:
    spec = replace(spec, block_size=block_size)
    blocks = sum(math.ceil(n / block_size) for n in lengths)
    pool = BlockPool(spec, blocks)
    caches = []
    for i, n in enumerate(lengths):  # all live at once, in one pool
        cache = PagedCache(spec, pool)
        fill(cache, n, i)
        caches.append(cache)
    held = sum(c.tokens_stored for c in caches) * spec.bytes_per_token
    allocated = sum(c.nbytes for c in caches)
    assert pool.num_used == blocks and pool.num_free == 0
    return {"allocated": allocated, "held": held}


def fan_out(spec: CacheSpec, mode: str, prompt: int = 512, new: int = 128, n: int = 8) -> dict:
    cache = create_cache(mode, replace(spec, max_tokens=4096))
    fill(cache, prompt, 1)
    cache.fork(n)
    for i in range(new):
        fill(cache, 1, 100 + i)
    held = (prompt + n * new) * spec.bytes_per_token  # distinct tokens
    return {"allocated": cache.nbytes, "held": held}


def window_stream(spec: CacheSpec, tokens: int = 10_000) -> dict:
    cache = create_cache("window", replace(spec, window=256, sinks=4))
    start = cache.nbytes
    fill(cache, 512, 0)
    while cache.num_tokens < tokens:
        fill(cache, 64, cache.num_tokens)
    assert cache.nbytes == start
    return {"tokens": cache.num_tokens, "bytes": cache.nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/waste.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    config = load_model().config
    spec = CacheSpec.for_model(config, 8192, torch.float32)
    lengths = workload()
    rows = {
        "contiguous, context 4096": contiguous_waste(spec, lengths, 4096),
        "contiguous, context 8192": contiguous_waste(spec, lengths, 8192),
        **{f"paged, block {bs}": paged_waste(spec, lengths, bs) for bs in (8, 16, 32)},
    }
    fan = {mode: fan_out(spec, mode) for mode in ("contiguous", "paged")}
    window = window_stream(spec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"lengths": lengths, "rows": rows, "fan_out": fan,
                                    "window": window}, indent=1))  # fmt: skip
    mib = 2**20
    total = sum(lengths)
    print(f"{REQUESTS} requests, {total:,} tokens (min {min(lengths)}, median "
          f"{sorted(lengths)[REQUESTS // 2]}, max {max(lengths)}), fp32, SmolLM2-135M "
          f"geometry ({spec.bytes_per_token:,} bytes/token):\n")  # fmt: skip
    print("| cache | allocated (MiB) | tokens held (MiB) | waste |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        waste = 1 - r["held"] / r["allocated"]
        print(f"| {name} | {r['allocated'] / mib:,.1f} | {r['held'] / mib:,.1f} | {waste:.2%} |")
    print("\nFan-out, 8 samples x 128 tokens from one 512-token prompt:\n")
    print("| cache | allocated (MiB) | distinct tokens (MiB) | waste |")
    print("| --- | ---: | ---: | ---: |")
    for mode, r in fan.items():
        waste = 1 - r["held"] / r["allocated"]
        print(f"| {mode} | {r['allocated'] / mib:,.1f} | {r['held'] / mib:,.1f} | {waste:.2%} |")
    print(f"\nwindow (4 sinks + 256): {window['tokens']:,} tokens streamed, cache "
          f"{window['bytes'] / mib:.1f} MiB throughout")  # fmt: skip


if __name__ == "__main__":
    main()
