"""kvlm on a CUDA GPU against transformers' fastest path, on the same file and dtype.

    python benchmarks/bench_gpu.py                          # the default model
    python benchmarks/bench_gpu.py default /tmp/q05.gguf    # several models, one run
    python benchmarks/bench_gpu.py --no-hf /tmp/q05.gguf    # kvlm only
    KVLM_CUDA_GRAPHS=0 python benchmarks/bench_gpu.py       # kvlm's eager decode steps
    python benchmarks/bench_gpu.py --no-hf --streams 1,64,128 --roads one --profile 64 q05.gguf

For each model, in one process: kvlm's single-stream decode (a 128-token prompt, 128 new
tokens, the LLM's contiguous cache: CUDA-graph decode steps; median of 3 after a warm-up);
the serving engine's aggregate tokens/s with 1, 8, 32, 64 and 128 requests at once
(64-token prompts, 128 new tokens each, continuous batching over the paged pool), first
with a forward per prompt chunk, then with each step's chunks and decode rows as one
ragged forward (ModelRunner.one_forward), and for each the median time of a step in which
every stream decodes and the share of the HBM bound it reaches: the bytes such a step must
read (every projection weight once, every stream's K/V at the mean context) over the
GPU's HBM bandwidth (HBM); and transformers with its static cache, whose decode step
`generate` compiles
with torch.compile on CUDA (mode "reduce-overhead": CUDA graphs; a warm-up run of the
same shapes compiles it first; median of 3). bf16 weights and K/V on both. Random-weight
files of real shapes: kvlm.bench.models.write_model.

`--moe FILE`: a mixture-of-experts GGUF (e.g. `python benchmarks/make_models.py --out
/tmp/moe --shapes qwen3-30b-a3b-8l --types Q8_0`) with every routed expert on the GPU, with
half the expert layers' in host memory and with all of them (--cpu-experts 0, half, all):
per road one JSON line of the load time, single-stream decode (a 128-token prompt, 64 new
tokens, median of 3 after a warm-up) and torch.cuda.max_memory_allocated; a road whose
load and runs would pass `--moe-seconds` (default 300) after those before is skipped
(said in its line). `--device cpu` checks the road on the CPU (in bf16, so the hop runs).

`--profile N[,N...]`: torch's profiler over 10 engine steps of N streams all decoding (one
forward per step): the GPU kernels a step and their time, the ten costliest by name; then
the host's side of 10 more (cProfile: wall time a step, the costliest functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time

from kvlm import LLM
from kvlm.bench import load_hf, prompt_ids, run_hf, run_kvlm, stream_throughput
from kvlm.bench.child import weight_bytes_per_token

STREAMS = [1, 8, 32, 64, 128]
PROMPT, NEW = 64, 128
# the HBM's bandwidth by NVIDIA's figures: an H100 SXM's HBM3, an H200's HBM3e
HBM = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bytes_s() -> float:
    import torch

    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM.items() if key in name), HBM["H100"])


def median(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def hbm_share(llm: LLM, row: dict) -> float | None:
    """The decode step's HBM bound (weights once, K/V of every stream at the mean
    context) over its measured median time."""
    if "decode_step_ms" not in row:
        return None
    kv = row["streams"] * (PROMPT + NEW // 2) * llm.cache_spec("paged").bytes_per_token
    bound_ms = 1e3 * (weight_bytes_per_token(llm) + kv) / hbm_bytes_s()
    return round(bound_ms / row["decode_step_ms"], 3)


def profile_step(llm: LLM, n: int, steps: int = 10) -> dict:
    """GPU kernels and their time in a step of n streams all decoding (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvlm import SamplingParams
    from kvlm.engine.engine import Engine, EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig

    engine = Engine(llm, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=n)))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"p{i}", prompt_ids(llm, PROMPT + i), params)
    while not (engine.last_plan and not engine.last_plan.prefill):
        engine.step()  # until every stream decodes
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    # the host's side of the same steps: wall time a step and Python's costliest functions
    # by their own time (cProfile's overhead inflates the sum, not the order)
    host = cProfile.Profile()
    t = time.perf_counter()
    host.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    host.disable()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    stats = pstats.Stats(host).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, _)
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
    host_top = [(f"{f.rsplit('/', 1)[-1]}:{line}:{name}", v[1] // steps,
                 round(v[2] / steps * 1e3, 3)) for (f, line, name), v in own]  # fmt: skip
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:60], []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    while engine.has_work():
        engine.step()
    return {
        "kernels_per_step": round(len(kernels) / steps, 1),
        "gpu_ms_per_step": round(sum(e.device_time for e in kernels) / steps / 1e3, 3),
        "top": [(name, len(t) // steps, round(sum(t) / steps / 1e3, 3)) for name, t in top],
        "profiled_step_ms": round(wall_ms, 3),
        "host_top": host_top,
    }


def moe_host(path: str, seconds: float, device: str = "cuda", roads: str = "0,half,all") -> None:
    """--moe: one JSON line per road (--moe-roads: --cpu-experts 0, half the expert layers,
    all)."""
    import torch

    cuda, start, took = device == "cuda", time.perf_counter(), 0.0
    roads = [None if r == "half" else r if r == "all" else int(r) for r in roads.split(",")]
    layers: list[int] = []  # the expert layers, read by the first road
    for n in roads:
        spent = time.perf_counter() - start
        if spent + took > seconds:  # the last road's time again would pass the budget
            print(json.dumps({"cpu_experts": n, "skipped": f"{spent:.0f} s of {seconds:.0f}"}))
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        llm = LLM(model=path, device=device, dtype="bf16", progress=False, max_context=512,
                  cpu_experts=n if n is not None else max(1, len(layers) // 2))  # fmt: skip
        load = time.perf_counter() - t
        layers = llm.config.expert_layers
        ids = prompt_ids(llm, 128)
        run_kvlm(llm, "contiguous", ids, 8)  # warm-up
        runs = [run_kvlm(llm, "contiguous", ids, 64) for _ in range(3)]
        peak = torch.cuda.max_memory_allocated() if cuda else None
        row = {"cpu_experts": llm.cpu_experts, "of": len(layers), "load_s": round(load, 2),
               "graphs": llm.runner.graphs is not None}  # fmt: skip
        print(json.dumps(row | median(runs) | {"max_memory_allocated": peak}), flush=True)
        took = time.perf_counter() - t
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["default"])
    ap.add_argument("--no-hf", action="store_true", help="kvlm only")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)))
    ap.add_argument("--roads", choices=["both", "one"], default="both")
    ap.add_argument("--profile", default="", metavar="N[,N...]")
    ap.add_argument("--moe", metavar="FILE", help="experts on the GPU against in host memory")
    ap.add_argument("--moe-seconds", type=float, default=300)
    ap.add_argument("--device", default="cuda", help="with --moe: cpu checks the road")
    ap.add_argument("--moe-roads", default="0,half,all", help="with --moe: the --cpu-experts")
    args = ap.parse_args(argv)
    if args.moe:
        moe_host(args.moe, args.moe_seconds, args.device, args.moe_roads)
        return
    streams = [int(x) for x in args.streams.split(",")]
    for model in args.models:
        path = None if model == "default" else model
        llm = LLM(model=path, device="cuda", dtype="bf16", progress=False, max_context=2048)
        ids = prompt_ids(llm, 128)
        run_kvlm(llm, "contiguous", ids, 16)
        runs = [run_kvlm(llm, "contiguous", ids, 128) for _ in range(3)]
        print(model, "kvlm", median(runs), flush=True)
        for one in (False, True) if args.roads == "both" else (True,):
            llm.runner.one_forward = one
            stream_throughput(llm, [8], prompt=PROMPT, new=16)  # warm-up: first kernel loads
            rows, _ = stream_throughput(llm, streams, prompt=PROMPT, new=NEW)
            for row in rows:
                row["hbm_share"] = hbm_share(llm, row)
            road = "one forward per step" if one else "a forward per chunk"
            print(model, "streams,", road, rows, flush=True)
        for n in [int(v) for v in args.profile.split(",") if v]:
            print(model, "profile", n, profile_step(llm, n), flush=True)
        if not args.no_hf:
            hf = load_hf(llm)
            run_hf(hf, ids, 128, True)  # compiles the decode step for these shapes
            runs = [run_hf(hf, ids, 128, True) for _ in range(3)]
            print(model, "hf static+compile", median(runs), flush=True)
            del hf


if __name__ == "__main__":
    main(sys.argv[1:])
