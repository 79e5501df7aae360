"""kvlm on a CUDA GPU against transformers' fastest path, on the same file and dtype.

    python benchmarks/bench_gpu.py                          # the default model
    python benchmarks/bench_gpu.py default /tmp/q05.gguf    # several models, one run
    KVLM_CUDA_GRAPHS=0 python benchmarks/bench_gpu.py       # kvlm's eager decode steps

For each model, in one process: kvlm's single-stream decode (a 128-token prompt, 128 new
tokens, the LLM's contiguous cache: CUDA-graph decode steps; median of 3 after a warm-up),
the serving engine's aggregate tokens/s with 1, 8, 32 and 64 requests at once (64-token
prompts, 128 new tokens each, continuous batching over the paged pool), and transformers
with its static cache, whose decode step `generate` compiles with torch.compile on CUDA
(mode "reduce-overhead": CUDA graphs; a warm-up run of the same shapes compiles it first;
median of 3). bf16 weights and K/V on both. Random-weight files of real shapes:
`python -c "from kvlm.bench.models import write_model; ..."` (kvlm.bench.models).
"""

from __future__ import annotations

import statistics
import sys

from kvlm import LLM
from kvlm.bench import load_hf, prompt_ids, run_hf, run_kvlm, stream_throughput


def median(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def main(models: list[str]) -> None:
    for model in models or ["default"]:
        path = None if model == "default" else model
        llm = LLM(model=path, device="cuda", dtype="bf16", progress=False, max_context=2048)
        ids = prompt_ids(llm, 128)
        run_kvlm(llm, "contiguous", ids, 16)
        runs = [run_kvlm(llm, "contiguous", ids, 128) for _ in range(3)]
        print(model, "kvlm", median(runs), flush=True)
        rows = stream_throughput(llm, [1, 8, 32, 64], prompt=64, new=128)
        print(model, "streams", rows, flush=True)
        hf = load_hf(llm)
        run_hf(hf, ids, 128, True)  # compiles the decode step for these shapes
        runs = [run_hf(hf, ids, 128, True) for _ in range(3)]
        print(model, "hf static+compile", median(runs), flush=True)
        del hf


if __name__ == "__main__":
    main(sys.argv[1:])
