"""`kvlm bench`: kvlm and its peers on the same model file and prompts, in one run.

    for each prompt length (128, 512, 2048 by default), for each engine:
        TTFT, prefill tokens/s, decode tokens/s over `new_tokens` greedy tokens (EOS off)
    plus this machine's memory bandwidth and the decode bound it sets for kvlm's weights
    (weight bytes read per token / bandwidth), and kvlm's share of that bound.

Engines: kvlm with each chosen cache mode; Hugging Face transformers loading the same file
(its default DynamicCache, and its static cache) when `transformers` is installed; llama.cpp
through `llama-cpp-python` when installed (a GGUF model only; it builds from source, so it
is an optional extra). A peer that is not installed is listed under "skipped". Runs are
sequential and alone: two CPU-heavy engines at once distort each other.

Plots (`plots=DIR`, matplotlib): per-forward latency vs position with and without the cache
(the seeds' headline: flat vs growing), decode tokens/s vs prompt length per engine, and
the engine's block map at the busiest step of the streams run (kvlm.cache.plots).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvlm import LLM, SamplingParams, kernels
from kvlm.bench.child import (
    metrics_row,
    new_llamacpp,
    proc_mib,
    run_hf,
    run_kvlm,
    run_llamacpp,
    weight_bytes_per_token,
)
from kvlm.settings import table

# The quality benchmarks' long real text: the GPL-3, as Debian ships it (~8k tokens of
# English prose; benchmarks/bench_kv_quality.py, bench_attention_quality.py)
QUALITY_TEXT = Path("/usr/share/common-licenses/GPL-3")

FILLER = (
    "The KV cache stores the keys and values of every token already processed, so decoding "
    "runs one token against the cache instead of the whole sequence again. "
)


@dataclass(slots=True)
class BenchConfig:
    prompts: list[int] = field(default_factory=lambda: [128, 512, 2048])
    new_tokens: int = 128
    modes: list[str] = field(default_factory=lambda: ["contiguous"])
    peers: list[str] = field(default_factory=lambda: ["hf", "hf-static", "llama.cpp"])
    rounds: int = 1
    plots: str | None = None  # folder for PNGs
    streams: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # [] skips
    speculative: Any = None  # a SpeculativeConfig: rows "kvlm+<method>" beside the plain ones


PEERS = ("hf", "hf-static", "llama.cpp")


def lockstep_logprobs(
    llms: dict[str, LLM], ids: Sequence[int], chunk: int, stop: int | None = None
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """ids fed in chunks of `chunk` tokens (those starting before `stop`, default all)
    through one contiguous cache per LLM, every LLM the same chunk in turn (the prompt
    path: a chunk's rows attend over every earlier chunk's K/V as its cache stores them):
    per chunk, its start and each LLM's log-probabilities of its positions (fp64, chunk x
    vocabulary). Only one chunk's are held at a time."""
    caches = {k: llm.new_cache("contiguous") for k, llm in llms.items()}
    for start in range(0, len(ids) if stop is None else stop, chunk):
        part = list(ids[start : start + chunk])
        yield start, {k: torch.log_softmax(llm.runner.logits(part, caches[k]).double(), dim=-1)
                      for k, llm in llms.items()}  # fmt: skip


def prompt_ids(llm: Any, n: int) -> list[int]:
    """The first `n` tokens of FILLER repeated, in the tokenizer of `llm` (an LLM or a
    loaded model file)."""
    ids = llm.tokenizer.encode(FILLER, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def run_kvlm_speculative(llm: LLM, ids: list[int], new: int, spec: Any) -> dict[str, float]:
    """The same request on the engine's pool with speculative decoding: run_kvlm's
    figures, and the drafts' acceptance."""
    from kvlm.engine.batch import Stream
    from kvlm.engine.engine import Engine, EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig

    # one stream, two seats (a hybrid's recurrent state a seat would fill 256 MiB at the
    # default 16; one seat's cap of one whole context would leave no block in reserve)
    engine = Engine(llm, EngineConfig(num_blocks=None, kv_memory=256 << 20,
                                      prefix_caching=False, speculative=spec,
                                      scheduler=SchedulerConfig(max_num_seqs=2)))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    m, st = Stream(engine, ids, params).run().metrics, engine.stats.spec
    return metrics_row(m) | {
        "acceptance": st.acceptance,
        "tokens_per_forward": st.tokens_per_forward,
        "mean_accepted": st.accepted / st.steps if st.steps else 0.0,
    }


def load_hf(llm: LLM) -> Any:
    """transformers on the same file and dtype, or None when it is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    path = llm.loaded.path
    folder, kw = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=llm.dtype, **kw)
    return model.to(llm.device).eval()  # on kvlm's device: a GPU run compares GPU with GPU


def load_llamacpp(llm: LLM, n_ctx: int) -> Any:
    """llama.cpp on the same GGUF, or None when llama-cpp-python is not installed."""
    path = llm.loaded.path
    if not path.is_file():
        return None
    gpu_layers = -1 if llm.device.type == "cuda" else 0  # all of them, where its build can
    try:
        return new_llamacpp(str(path), n_ctx, torch.get_num_threads(), gpu_layers)
    except ImportError:
        return None


def bandwidth_samples(mib: int, reps: int, device: torch.device | None = None) -> list[float]:
    """Read bandwidth in GB/s of the memory the weights live in, `reps` times (after one
    warm-up): a multi-threaded sum over a buffer of `mib` MiB, far larger than caches, on
    huge pages where the OS has them (on a GPU, a sum over its own memory)."""
    gpu = device is not None and device.type == "cuda"
    x = None if gpu else kernels.huge_page_buffer(mib * 2**20)  # as kvlm's weights are
    if x is None:
        x = torch.ones(mib * 2**20 // 4, device=device)
    else:
        x = x.view(torch.float32).fill_(1.0)

    def read() -> None:
        x.sum()
        if gpu:
            torch.cuda.synchronize(device)

    read()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        read()
        out.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return out


def probed(run: Callable[[], dict], device: torch.device | None = None) -> dict:
    """`run()`'s row with `bandwidth_gb_s`, the median of 6 short reads around it: this
    machine's reads come in bursts (single sums of 50+ GB/s between runs of 30-35) that a
    run of 128 tokens does not ride."""
    before = bandwidth_samples(256, 3, device)
    row = run()
    row["bandwidth_gb_s"] = statistics.median(before + bandwidth_samples(256, 3, device))
    return row


def position_cost(
    llm: LLM, mode: str, positions: tuple[int, ...] = (16, 1024), repeats: int = 3
) -> dict:
    """Median ms of a decode forward at each position (16 steps after a prompt of that
    length, `repeats` times, positions interleaved so a noisy spell hits all of them): the
    cache's promise is that the cost barely grows with the position."""
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        for pos in positions:
            if pos + 17 > llm.max_context:
                continue
            samples.setdefault(str(pos), []).extend(_decode_ms(llm, mode, prompt_ids(llm, pos), 17))
    out = {pos: round(statistics.median(ms), 3) for pos, ms in samples.items()}
    if len(out) == len(positions):
        out["ratio"] = round(out[str(positions[-1])] / out[str(positions[0])], 3)
    return out


def memory_waste(llm: LLM, modes: list[str], requests: int = 64) -> list[dict]:
    """KV bytes each cache mode allocates for a mixed workload (lognormal prompt + output
    lengths around 300 + 150 tokens, capped at the context) against the bytes the tokens
    need: what a fixed-size cache wastes and what blocks save."""
    from kvlm.cache import planned_nbytes

    g = torch.Generator().manual_seed(0)
    lengths = (torch.exp(torch.randn(requests, generator=g) * 0.9 + 6.0)).long()
    lengths = lengths.clamp(2, llm.max_context).tolist()
    rows = []
    for mode in modes:
        spec = llm.cache_spec(mode)
        planned = sum(planned_nbytes(mode, spec, n, 1) for n in lengths)
        kept = [min(n, spec.window + spec.sinks) if mode == "window" else n for n in lengths]
        needed = sum(kept) * spec.bytes_per_token  # window: what it keeps, by design
        rows.append({
            "mode": mode, "allocated_mib": round(planned / 2**20, 1),
            "needed_mib": round(needed / 2**20, 1),
            "waste": round(1 - needed / planned, 4) if planned else 0.0,
        })  # fmt: skip
    return rows


def stream_throughput(
    llm: LLM, streams: list[int], prompt: int = 64, new: int = 64, capture: bool = False
) -> tuple[list[dict], dict | None]:
    """Aggregate tokens/s of the serving engine (continuous batching over the paged pool)
    with n requests at once, from admission to the last token (the 64-token prefills
    included). Runs last: the engine repacks fp32 weights for batches.

    With `capture`, also the pool's block map (Engine.kv_view, what the server's /v1/kv
    returns) at the step of the most blocks in use during the run of the most streams,
    when every stream holds its blocks; the time taken to capture it is left out of the
    rate."""
    from kvlm.engine.engine import Engine, EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig

    room = llm.max_context - max(streams)  # prompts differ by up to one token per stream
    prompt, new = min(prompt, max(1, room // 2)), min(new, max(2, room // 2))
    engine = Engine(llm, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(streams))))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    rows, view, most = [], None, 0
    for n in streams:
        for i in range(n):
            # one filler text cut at different lengths: the streams share its leading
            # blocks through the prefix cache (the shared cells of block_map.png)
            ids = prompt_ids(llm, prompt + i)
            engine.add_request(f"s{n}-{i}", ids, params)
        start, tokens, aside, decode_steps = time.perf_counter(), 0, 0.0, []
        while engine.has_work():
            t0 = time.perf_counter()
            tokens += sum(len(o.token_ids) for o in engine.step())
            batch = engine.last_plan
            if batch and not batch.prefill and len(batch.decode) == n:  # every stream decoding
                decode_steps.append(time.perf_counter() - t0)
            if capture and n == max(streams) and engine.pool.num_used > most:
                t0 = time.perf_counter()
                view, most = engine.kv_view(), engine.pool.num_used
                aside += time.perf_counter() - t0
        elapsed = time.perf_counter() - start - aside
        row = {"streams": n, "tokens": tokens, "tok_s": round(tokens / elapsed, 1)}
        if decode_steps:  # a step of all n rows decoding, nothing prefilling
            row["decode_step_ms"] = round(1e3 * statistics.median(decode_steps), 3)
        rows.append(row)
    return rows, view


def bench(llm: LLM, config: BenchConfig) -> dict[str, Any]:
    limit = max(config.prompts) + config.new_tokens
    if limit > llm.max_context:
        raise ValueError(f"the longest prompt + new tokens ({limit}) exceed --max-context")
    peers, skipped, loaded_mib = _load_peers(llm, config.peers, limit + 8)
    rows = _measure(llm, config, _runners(llm, config, peers))
    # the best of 7 reads: the bound is what the memory can deliver, and on a shared machine
    # a slow run says more about the neighbours (two runs here read 26 and 57 GB/s as
    # medians of 5)
    bandwidth = max(bandwidth_samples(512, 7, llm.device))
    per_token = weight_bytes_per_token(llm)
    forwards = per_forward_curves(llm, config)
    positions = {mode: position_cost(llm, mode) for mode in config.modes}
    waste = memory_waste(llm, ["contiguous", "paged", "int8", "window"])
    streams, kv_view = [], None
    if config.streams:
        streams, kv_view = stream_throughput(llm, config.streams, capture=bool(config.plots))
    result = {
        "model": llm.model_name,
        "describe": llm.describe(),
        # the user's count, or the engine's own (kvlm.engine.threads): where it ended
        "threads": llm.threads or f"measured: {torch.get_num_threads()} at the end",
        "new_tokens": config.new_tokens,
        "bandwidth_gb_s": round(bandwidth, 2),
        "weight_bytes_per_token": per_token,
        "decode_bound_tok_s": round(bandwidth * 1e9 / per_token, 1),
        "rows": rows,
        "ratios": _ratios(rows),
        "per_forward_ms": forwards,
        "position_cost_ms": positions,
        "memory_waste": waste,
        "streams": streams,
        "loaded_rss_mib": loaded_mib,
        "skipped": skipped,
    }
    if config.plots:
        result["plots"] = plot(result, config.plots, kv_view)
    return result


def _load_peers(llm: LLM, names: list[str], n_ctx: int) -> tuple[dict, dict, dict]:
    """Each peer's model (None: not installed), why a peer is skipped, and the RSS each
    load added."""
    loaders = {"hf": lambda: load_hf(llm), "llama.cpp": lambda: load_llamacpp(llm, n_ctx)}
    peers, skipped, loaded_mib = {}, {}, {}
    for name in dict.fromkeys(p.removesuffix("-static") for p in names):
        before = proc_mib("VmRSS")
        try:
            peers[name] = loaders[name]()
            grew = proc_mib("VmRSS") - before
            if not math.isnan(grew):
                loaded_mib[name] = round(grew, 1)
        except Exception as exc:  # a peer that cannot read this file is reported, not fatal
            skipped[name] = f"failed to load: {exc}"
        else:
            if peers[name] is None:
                skipped[name] = "not installed"
    return peers, skipped, loaded_mib


def _runners(llm: LLM, config: BenchConfig, peers: dict) -> list[tuple[str, Callable]]:
    """(engine, run(ids, new_tokens) -> its row) of each engine, in the rows' order."""
    runners = [(f"kvlm-{m}", partial(run_kvlm, llm, m)) for m in config.modes]
    if config.speculative is not None:
        run = partial(run_kvlm_speculative, llm, spec=config.speculative)
        runners.append((f"kvlm+{config.speculative.method}", run))
    for p in config.peers:
        model = peers.get(p.removesuffix("-static"))
        if model is not None and p == "llama.cpp":
            runners.append((p, partial(run_llamacpp, model)))
        elif model is not None:
            runners.append((p, partial(run_hf, model, static=p == "hf-static")))
    return runners


def _measure(llm: LLM, config: BenchConfig, runners: list[tuple[str, Callable]]) -> list[dict]:
    """A row per prompt length and engine: the medians of its `rounds` runs; a kvlm row
    also the bound at the bandwidth of its runs' own minute (it swings from ~28 to ~53
    GB/s on this shared machine; the header's probe is the best moment of the whole run),
    without and with the K/V reads (the cache is read every token too)."""
    warm = prompt_ids(llm, 16)
    rows, total, done = [], len(config.prompts) * len(runners) * config.rounds, 0
    for n in config.prompts:
        ids = prompt_ids(llm, n)
        for engine, runner in runners:
            once = partial(_run_once, runner, warm, ids, config.new_tokens, llm.device)
            runs = []
            for _ in range(config.rounds):
                done += 1
                print(f"[{done}/{total}] {engine}, prompt {n} tokens", file=sys.stderr,
                      flush=True)  # fmt: skip
                runs.append(probed(once, llm.device) if engine.startswith("kvlm-") else once())
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append({"engine": engine, "prompt_tokens": n, **med})
    per_token = weight_bytes_per_token(llm)
    for row in rows:
        if row["engine"].startswith("kvlm-"):
            spec = llm.cache_spec(row["engine"].removeprefix("kvlm-"))
            context = row["prompt_tokens"] + config.new_tokens // 2  # the run's mean context
            if row["engine"] == "kvlm-window":  # a window keeps at most its window
                context = min(context, spec.window + spec.sinks)
            kv, own = spec.bytes_per_token * context, row["bandwidth_gb_s"] * 1e9
            row["kv_bytes_per_token"] = kv
            row["bound_tok_s"] = round(own / per_token, 1)
            row["bound_with_kv_tok_s"] = round(own / (per_token + kv), 1)
    return rows


def _run_once(runner: Callable, warm: list[int], ids: list[int], new: int, dev: Any) -> dict:
    """A warm-up run of 4 tokens, then the run, with the peak memory they reached."""
    gpu = dev.type == "cuda"
    # the peak RSS (VmHWM) starts over from the current RSS (Linux: `5` to clear_refs)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if gpu:
        torch.cuda.reset_peak_memory_stats(dev)
    runner(warm, 4)
    run = runner(ids, new)
    run["peak_rss_mib"] = proc_mib()
    if gpu:  # the GPU's own memory: weights, cache and activations live there
        run["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    return run


def per_forward_curves(llm: LLM, config: BenchConfig) -> dict[str, list[float]]:
    """Milliseconds of every forward while generating `new_tokens` from a 16-token prompt,
    without a cache (`off`: each step recomputes the sequence) and with each chosen mode."""
    ids = prompt_ids(llm, 16)
    return {mode: [round(ms, 3) for ms in _decode_ms(llm, mode, ids, config.new_tokens)]
            for mode in ["off", *config.modes]}  # fmt: skip


def _decode_ms(llm: LLM, mode: str, ids: list[int], new: int) -> list[float]:
    """Milliseconds of each decode forward of `new` greedy tokens (EOS off) after `ids`, on
    a fresh cache of `mode`."""
    llm.cache = llm.new_cache(mode)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return llm.stream(ids, params).run().metrics.per_forward_ms[1:]


def plot(result: dict[str, Any], folder: str, kv_view: dict | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, ms in result["per_forward_ms"].items():
        ax.plot(range(17, 17 + len(ms)), ms, label="no cache (off)" if mode == "off" else mode)
    ax.set(xlabel="position of the token being decoded", ylabel="ms per forward",
           title=f"{result['model']}: per-forward latency")  # fmt: skip
    paths.append(_save(fig, out / "per_forward.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    for engine in dict.fromkeys(r["engine"] for r in result["rows"]):
        pts = [(r["prompt_tokens"], r["decode_tok_s"]) for r in result["rows"]
               if r["engine"] == engine]  # fmt: skip
        ax.plot(*zip(*pts, strict=True), marker="o", label=engine)
    ax.axhline(result["decode_bound_tok_s"], linestyle="--", color="grey",
               label="bandwidth bound (kvlm weights)")  # fmt: skip
    ax.set(xscale="log", xlabel="prompt tokens (context)", ylabel="decode tokens/s",
           title=f"{result['model']}: decode speed vs context")  # fmt: skip
    paths.append(_save(fig, out / "decode_vs_context.png"))
    if result.get("memory_waste"):
        fig, ax = plt.subplots(figsize=(7, 4))
        w = result["memory_waste"]
        ax.bar([r["mode"] for r in w], [r["allocated_mib"] for r in w], label="allocated")
        ax.bar([r["mode"] for r in w], [r["needed_mib"] for r in w], label="held by tokens")
        for i, r in enumerate(w):
            ax.text(i, r["allocated_mib"], f"{r['waste']:.0%} waste", ha="center", va="bottom")
        ax.set(ylabel="KV MiB", title="KV memory for 64 mixed requests, by cache mode")
        paths.append(_save(fig, out / "memory_waste.png"))
    if result.get("streams"):
        fig, ax = plt.subplots(figsize=(7, 4))
        st = result["streams"]
        ax.plot([r["streams"] for r in st], [r["tok_s"] for r in st], marker="o",
                label="kvlm engine")  # fmt: skip
        ax.set(xlabel="concurrent streams", ylabel="aggregate tokens/s",
               title=f"{result['model']}: throughput vs streams")  # fmt: skip
        paths.append(_save(fig, out / "throughput_vs_streams.png"))
    if kv_view is not None:
        from kvlm.cache.plots import block_map_png

        title = (f"{result['model']}: the engine's KV pool at the busiest step of "
                 f"{max(r['streams'] for r in result['streams'])} streams")  # fmt: skip
        paths.append(str(block_map_png(kv_view, out / "block_map.png", title)))
    return paths


def _save(fig: Any, path: Any) -> str:
    """Write `fig` (its one plot with a legend) as `path`, and close it."""
    fig.axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def _ratios(rows: list[dict]) -> list[dict]:
    """kvlm over each peer, per prompt length: decode speed up, TTFT down is better."""
    return [
        {
            "kvlm": r["engine"],
            "peer": peer["engine"],
            "prompt_tokens": r["prompt_tokens"],
            "decode_ratio": round(r["decode_tok_s"] / peer["decode_tok_s"], 3),
            "ttft_ratio": round(r["ttft_ms"] / peer["ttft_ms"], 3),
        }
        for r in rows
        if r["engine"].startswith("kvlm-")
        for peer in rows
        if peer["prompt_tokens"] == r["prompt_tokens"] and not peer["engine"].startswith("kvlm")
    ]


def markdown(result: dict[str, Any]) -> str:
    d = result["describe"]
    lines = [
        f"model {result['model']}, threads {result['threads']}, "
        f"{result['new_tokens']} new tokens; memory bandwidth at its best moment "
        f"{result['bandwidth_gb_s']} GB/s, "
        f"weights {result['weight_bytes_per_token'] / 2**20:.0f} MiB per token -> decode bound "
        f"{result['decode_bound_tok_s']} tok/s",
        "",
        f"weights {d['weights']}, prefill {d.get('prefill_dtype', 'fp32')}, activations "
        f"{d.get('activations', 'fp32')}, KV {d['kv_dtype']}; "
        f"kernels: {d.get('kernels') or 'torch'}",
        "",
    ]
    rows = []
    for r in result["rows"]:
        cells = ["", "", "", ""]
        if r.get("bound_tok_s"):
            tok = r["decode_tok_s"]
            cells = [
                f"{r['bandwidth_gb_s']:.1f}",
                f"{tok / r['bound_tok_s']:.0%} of {r['bound_tok_s']:.0f}",
                f"{tok / r['bound_with_kv_tok_s']:.0%} of {r['bound_with_kv_tok_s']:.0f}",
                f"{tok / result['decode_bound_tok_s']:.0%}",
            ]
        rows.append(
            f"{r['engine']} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | "
            f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {' | '.join(cells)} "
            f"| {r.get('peak_rss_mib', float('nan')):.0f}"
            + (f" (GPU {r['peak_gpu_mib']:.0f})" if "peak_gpu_mib" in r else "")
        )
    head = "engine | prompt | TTFT ms | prefill tok/s | decode tok/s | GB/s then | share of bound"
    head += " | share of bound with K/V reads | share of best-moment bound | peak RSS MiB"
    lines += table(head, "l" + "r" * 9, rows)
    if result.get("loaded_rss_mib"):
        loads = ", ".join(f"{k} +{v:.0f} MiB" for k, v in result["loaded_rss_mib"].items())
        lines += ["", f"RSS added by loading each peer: {loads} (peak RSS is the process's, "
                  "all loaded engines included)"]  # fmt: skip
    for mode, cost in result.get("position_cost_ms", {}).items():
        if "ratio" in cost:
            lines += ["", f"kvlm-{mode}: forward at position 1024 {cost['1024']:.2f} ms vs "
                      f"position 16 {cost['16']:.2f} ms = {cost['ratio']:.2f}x"]  # fmt: skip
    if result.get("memory_waste"):
        head = "cache mode | KV allocated MiB | held by tokens MiB | waste"
        row = "{mode} | {allocated_mib} | {needed_mib} | {waste:.1%}"
        lines += ["", *table(head, "lrrr", [row.format_map(r) for r in result["memory_waste"]])]
    if result.get("streams"):
        rows = ["{streams} | {tok_s}".format_map(r) for r in result["streams"]]
        lines += ["", *table("streams | aggregate tok/s", "rr", rows)]
    rows = []
    for r in result["rows"]:
        if r["engine"].startswith("kvlm+"):
            plain = next((p for p in result["rows"] if p["engine"].startswith("kvlm-")
                          and p["prompt_tokens"] == r["prompt_tokens"]), None)  # fmt: skip
            x = r["decode_tok_s"] / plain["decode_tok_s"] if plain else float("nan")
            rows.append(f"{r['engine']} | {r['prompt_tokens']} | {r['decode_tok_s']:.1f} | "
                        f"{x:.2f}x | {r['acceptance']:.0%} | {r['mean_accepted']:.2f} | "
                        f"{r['tokens_per_forward']:.2f}")  # fmt: skip
    if rows:  # speculative rows
        head = "speculative | prompt | decode tok/s | x plain | acceptance | mean accepted"
        lines += ["", *table(head + " per draft | tokens per forward", "l" + "r" * 6, rows)]
    if result["ratios"]:
        head = "kvlm | peer | prompt | decode ratio | TTFT ratio"
        row = "{kvlm} | {peer} | {prompt_tokens} | {decode_ratio:.2f}x | {ttft_ratio:.2f}x"
        lines += ["", *table(head, "llrrr", [row.format_map(q) for q in result["ratios"]])]
    for peer, why in result["skipped"].items():
        lines += ["", f"skipped {peer}: {why}"]
    return "\n".join(lines) + "\n"
