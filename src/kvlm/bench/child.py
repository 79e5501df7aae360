"""One engine on one model file, alone in a fresh process: `kvlm bench --suite` runs this
file (by path, so a llama.cpp or transformers run does not import kvlm or torch unless it
needs them) once per engine and model, and reads one JSON line from its stdout.

    python child.py ENGINE MODEL IDS_JSON NEW_TOKENS THREADS

ENGINE: kvlm (its defaults: no flags), llama.cpp (llama-cpp-python) or hf (transformers
loading the GGUF). It loads the model (timed), warms up on 16 tokens, then runs the
prompt once (greedy, EOS off) and prints TTFT and decode tokens/s, the load time and the
process's peak RSS (VmHWM: everything the engine holds, its libraries included).

The measurements here are also `kvlm bench`'s (kvlm.bench), one engine among others in
its own process.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any


class _Clock:
    """A transformers streamer that timestamps every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True  # the first put is the prompt

    def end(self) -> None:
        pass


def weight_bytes_per_token(llm: Any) -> int:
    """Bytes of projection weights a decode step of one sequence reads: every Linear
    once, but a mixture of experts' experts, of which a token reads top_k of count (one
    embedding row is negligible)."""
    from kvlm.model.experts import Experts
    from kvlm.model.layers import Linear

    def linears(module: Any) -> list[Linear]:
        return [m for m in module.modules() if isinstance(m, Linear)]

    moes = [m for m in llm.model.modules() if isinstance(m, Experts)]
    routed = {id(lin) for moe in moes for lin in linears(moe.experts)}
    total = sum(m.nbytes for m in linears(llm.model) if id(m) not in routed)
    for moe in moes:
        every = sum(lin.nbytes for lin in linears(moe.experts))
        total += every * moe.config.top_k // moe.config.count
    return total


def proc_mib(key: str = "VmHWM") -> float:
    """A /proc/self/status field in MiB (Linux; the peak RSS by default), else nan."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _timed(times: list[float], start: float, prompt: int) -> dict[str, float]:
    ttft = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"ttft_ms": ttft * 1000, "prefill_tok_s": prompt / ttft, "decode_tok_s": decode}


def metrics_row(m: Any) -> dict[str, float]:
    """TTFT, prefill and decode speed of kvlm's RequestMetrics, as the other engines' runs
    give them."""
    return {
        "ttft_ms": m.ttft_ms,
        "prefill_tok_s": m.prefill_tokens_per_s,
        "decode_tok_s": m.decode_tokens_per_s,
    }


def run_kvlm(llm: Any, mode: str, ids: list[int], new: int) -> dict[str, float]:
    """`new` greedy tokens after `ids` on a fresh cache of `mode`."""
    from kvlm import SamplingParams

    llm.cache = llm.new_cache(mode)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    return metrics_row(llm.stream(ids, params).run().metrics)


def _kvlm(model: str, ids: list[int], new: int, threads: int) -> tuple[float, Any, dict]:
    import torch

    torch.set_num_threads(threads)
    from kvlm import LLM

    start = time.perf_counter()
    llm = LLM(model, progress=False, max_context=len(ids) + new + 16, threads=threads)
    load = time.perf_counter() - start
    d = llm.describe()
    extra = {
        "weight_bytes_per_token": weight_bytes_per_token(llm),
        "numerics": {k: d.get(k) for k in ("weights", "activations", "prefill_dtype", "kv_dtype")},
    }
    return load, lambda prompt, n: run_kvlm(llm, "contiguous", prompt, n), extra


def new_llamacpp(path: str, n_ctx: int, threads: int, gpu_layers: int = 0) -> Any:
    """A llama_cpp.Llama on the GGUF file `path`, its threads kvlm's."""
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                 n_batch=512, n_gpu_layers=gpu_layers, verbose=False)  # fmt: skip


def _llamacpp(model: str, ids: list[int], new: int, threads: int) -> tuple[float, Any, dict]:
    import llama_cpp

    start = time.perf_counter()
    llm = new_llamacpp(model, len(ids) + new + 16, threads)
    load = time.perf_counter() - start
    extra = {"version": llama_cpp.__version__}
    return load, lambda prompt, n: run_llamacpp(llm, prompt, n), extra


def run_llamacpp(model: Any, ids: list[int], new: int) -> dict[str, float]:
    """`new` greedy tokens after `ids` on a llama_cpp.Llama, timed token by token."""
    model.reset()  # no reuse of the previous run's tokens
    times = []
    start = time.perf_counter()
    for _ in model.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) >= new:
            break
    return _timed(times, start, len(ids))


def run_hf(model: Any, ids: list[int], new: int, static: bool = False) -> dict[str, float]:
    """`new` greedy tokens after `ids` on a transformers model (its DynamicCache, or its
    static cache), timed token by token."""
    import torch

    clock = _Clock()
    extra = {"cache_implementation": "static"} if static else {}
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(torch.tensor([ids], device=model.device), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                       streamer=clock, **extra)  # fmt: skip
    return _timed(clock.times, start, len(ids))


def _hf(model: str, ids: list[int], new: int, threads: int) -> tuple[float, Any, dict]:
    from pathlib import Path

    import torch

    torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(model)
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()  # fmt: skip
    load = time.perf_counter() - start
    extra = {"version": transformers.__version__, "dtype": "fp32"}
    return load, lambda prompt, n: run_hf(hf, prompt, n), extra


ENGINES = {"kvlm": _kvlm, "llama.cpp": _llamacpp, "hf": _hf}


def main(argv: list[str]) -> int:
    engine, model, ids_file, new, threads = argv
    with open(ids_file) as f:
        ids = json.load(f)
    load, run, extra = ENGINES[engine](model, ids, int(new), int(threads))
    run(ids[:16], 4)  # warm-up: first-call allocations, kernel choice
    result = run(ids, int(new)) | {"engine": engine, "load_s": load, "peak_rss_mib": proc_mib()}
    print(json.dumps(result | extra), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
