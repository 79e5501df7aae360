"""One engine on one model file, alone in a fresh process: `kvlm bench --suite` runs this
file (by path, so a llama.cpp or transformers run does not import kvlm or torch unless it
needs them) once per engine and model, and reads one JSON line from its stdout.

    python child.py ENGINE MODEL IDS_JSON NEW_TOKENS ROUNDS THREADS

ENGINE: kvlm (its defaults: no flags), llama.cpp (llama-cpp-python) or hf (transformers
loading the GGUF). It loads the model (timed), warms up on 16 tokens, then runs the
prompt `ROUNDS` times (greedy, EOS off) and prints the medians of TTFT and decode
tokens/s, the load time and the process's peak RSS (VmHWM: everything the engine holds,
its libraries included).
"""

from __future__ import annotations

import json
import statistics
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
    """Bytes of projection weights a decode step reads (every Linear once; one embedding
    row is negligible)."""
    from kvlm.model.layers import Linear

    return sum(m.nbytes for m in llm.model.modules() if isinstance(m, Linear))


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _timed(times: list[float], start: float, prompt: int) -> dict[str, float]:
    ttft = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"ttft_ms": ttft * 1000, "prefill_tok_s": prompt / ttft, "decode_tok_s": decode}


def _kvlm(model: str, ids: list[int], new: int, threads: int) -> tuple[float, object, dict]:
    import torch

    torch.set_num_threads(threads)
    from kvlm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, progress=False, max_context=len(ids) + new + 16)
    load = time.perf_counter() - start

    def run(prompt: list[int], n: int) -> dict[str, float]:
        llm.cache = llm.new_cache("contiguous")
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        m = llm.stream(prompt, params).run().metrics
        return {
            "ttft_ms": m.ttft_ms,
            "prefill_tok_s": m.prefill_tokens_per_s,
            "decode_tok_s": m.decode_tokens_per_s,
        }

    d = llm.describe()
    extra = {
        "weight_bytes_per_token": weight_bytes_per_token(llm),
        "numerics": {k: d.get(k) for k in ("weights", "activations", "prefill_dtype", "kv_dtype")},
    }
    return load, run, extra


def _llamacpp(model: str, ids: list[int], new: int, threads: int) -> tuple[float, object, dict]:
    import llama_cpp

    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(ids) + new + 16, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, n_gpu_layers=0,
                          verbose=False)  # fmt: skip
    load = time.perf_counter() - start

    def run(prompt: list[int], n: int) -> dict[str, float]:
        return run_llamacpp(llm, prompt, n)

    return load, run, {"version": llama_cpp.__version__}


def run_llamacpp(model: object, ids: list[int], new: int) -> dict[str, float]:
    """`new` greedy tokens after `ids` on a llama_cpp.Llama, timed token by token (also
    kvlm bench's llama.cpp peer)."""
    model.reset()  # no reuse of the previous run's tokens
    times = []
    start = time.perf_counter()
    for _ in model.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) >= new:
            break
    return _timed(times, start, len(ids))


def _hf(model: str, ids: list[int], new: int, threads: int) -> tuple[float, object, dict]:
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

    def run(prompt: list[int], n: int) -> dict[str, float]:
        clock = _Clock()  # timestamps every generated token
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=0,
                        streamer=clock)  # fmt: skip
        return _timed(clock.times, start, len(prompt))

    return load, run, {"version": transformers.__version__, "dtype": "fp32"}


ENGINES = {"kvlm": _kvlm, "llama.cpp": _llamacpp, "hf": _hf}


def main(argv: list[str]) -> int:
    engine, model, ids_file, new, rounds, threads = argv
    with open(ids_file) as f:
        ids = json.load(f)
    new, rounds, threads = int(new), int(rounds), int(threads)
    load, run, extra = ENGINES[engine](model, ids, new, threads)
    run(ids[:16], 4)  # warm-up: first-call allocations, kernel choice
    runs = [run(ids, new) for _ in range(rounds)]
    result = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result |= {"engine": engine, "load_s": load, "peak_rss_mib": _peak_rss_mib(), **extra}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
