"""A lone stream's first decode steps on an eager GPU road (a hybrid model's pool: no CUDA
graphs): the engine's streams at 8, then 1, then 1 again, each with the CUDA caching
allocator's counters (retries after a failed cudaMalloc, device allocations) after it.
One JSON line a run.

    python benchmarks/gpu_lone_stream.py /tmp/lfm2.gguf

On the H200 (docs/BENCHMARKS.md 26) the first lone stream stepped at 52 ms and the second
at 9.7: the allocator never retried (ruled out); cuDNN's SDPA built a plan for each new key
count, and with it off (kvlm.model.attention.GPU_BACKENDS) both step at 9.3-9.0 ms.
"""

import json
import sys

import torch

from kvlm import LLM
from kvlm.bench import stream_throughput

llm = LLM(model=sys.argv[1], device="cuda", dtype="bf16", progress=False)
llm.runner.one_forward = True
for n in ([8], [1], [1]):
    rows, _ = stream_throughput(llm, n, 64, 128)
    s = torch.cuda.memory_stats()
    free, _ = torch.cuda.mem_get_info()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
    row = rows[0] | {k: s.get(k) for k in keys}
    row |= {"reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 2),
            "free_gb": round(free / 1e9, 2)}  # fmt: skip
    print(json.dumps(row), flush=True)
