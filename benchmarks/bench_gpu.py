"""kvlm on a CUDA GPU against transformers' fastest path, on the same file and dtype.

    python benchmarks/bench_gpu.py                          # the default model
    python benchmarks/bench_gpu.py default /tmp/q05.gguf    # several models, one run
    python benchmarks/bench_gpu.py --no-hf /tmp/q05.gguf    # kvlm only
    KVLM_CUDA_GRAPHS=0 python benchmarks/bench_gpu.py       # kvlm's eager decode steps

For each model, in one process: kvlm's single-stream decode (a 128-token prompt, 128 new
tokens, the LLM's contiguous cache: CUDA-graph decode steps; median of 3 after a warm-up);
the serving engine's aggregate tokens/s with 1, 8, 32, 64 and 128 requests at once
(64-token prompts, 128 new tokens each, continuous batching over the paged pool), first
with a forward per prompt chunk, then with each step's chunks and decode rows as one
ragged forward (ModelRunner.one_forward), and for each the median time of a step in which
every stream decodes and the share of the HBM bound it reaches: the bytes such a step must
read (every projection weight once, every stream's K/V at the mean context) over
HBM_BYTES_S; and transformers with its static cache, whose decode step `generate` compiles
with torch.compile on CUDA (mode "reduce-overhead": CUDA graphs; a warm-up run of the
same shapes compiles it first; median of 3). bf16 weights and K/V on both. Random-weight
files of real shapes: kvlm.bench.models.write_model.
"""

from __future__ import annotations

import statistics
import sys

from kvlm import LLM
from kvlm.bench import load_hf, prompt_ids, run_hf, run_kvlm, stream_throughput
from kvlm.bench.child import weight_bytes_per_token

STREAMS = [1, 8, 32, 64, 128]
PROMPT, NEW = 64, 128
HBM_BYTES_S = 3.35e12  # an H100 SXM's HBM3, NVIDIA's figure


def median(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def hbm_share(llm: LLM, row: dict) -> float | None:
    """The decode step's HBM bound (weights once, K/V of every stream at the mean
    context) over its measured median time."""
    if "decode_step_ms" not in row:
        return None
    kv = row["streams"] * (PROMPT + NEW // 2) * llm.cache_spec("paged").bytes_per_token
    bound_ms = 1e3 * (weight_bytes_per_token(llm) + kv) / HBM_BYTES_S
    return round(bound_ms / row["decode_step_ms"], 3)


def main(args: list[str]) -> None:
    hf_too = "--no-hf" not in args
    for model in [a for a in args if a != "--no-hf"] or ["default"]:
        path = None if model == "default" else model
        llm = LLM(model=path, device="cuda", dtype="bf16", progress=False, max_context=2048)
        ids = prompt_ids(llm, 128)
        run_kvlm(llm, "contiguous", ids, 16)
        runs = [run_kvlm(llm, "contiguous", ids, 128) for _ in range(3)]
        print(model, "kvlm", median(runs), flush=True)
        for one in (False, True):
            llm.runner.one_forward = one
            stream_throughput(llm, [8], prompt=PROMPT, new=16)  # warm-up: first kernel loads
            rows, _ = stream_throughput(llm, STREAMS, prompt=PROMPT, new=NEW)
            for row in rows:
                row["hbm_share"] = hbm_share(llm, row)
            road = "one forward per step" if one else "a forward per chunk"
            print(model, "streams,", road, rows, flush=True)
        if hf_too:
            hf = load_hf(llm)
            run_hf(hf, ids, 128, True)  # compiles the decode step for these shapes
            runs = [run_hf(hf, ids, 128, True) for _ in range(3)]
            print(model, "hf static+compile", median(runs), flush=True)
            del hf


if __name__ == "__main__":
    main(sys.argv[1:])
