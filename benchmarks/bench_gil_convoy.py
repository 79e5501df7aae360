"""An engine step beside a busy Python thread, at a given GIL switch interval.

Each torch op of a step releases the GIL and takes it back; while another thread of the
process runs Python (in `kvlm serve`: the HTTP loop making a scored prompt's logprobs into
JSON, tokenizing a prompt), taking it back waits up to `sys.getswitchinterval()`. This
steps an engine of 13 sampled decode rows on the default model, with or without a thread
that builds dicts in a loop, and prints the median and the longest step.

    python benchmarks/bench_gil_convoy.py --interval 0.005 --busy
    python benchmarks/bench_gil_convoy.py --interval 0.0005 --busy

The engine's own loop (AsyncEngine) sets kvlm.engine.async_engine.SWITCH_INTERVAL_S; this
script steps the engine by hand, so the interval is the one given here.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.005, help="seconds (Python: 0.005)")
    ap.add_argument("--busy", action="store_true", help="a thread running Python beside it")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    from kvlm import LLM, SamplingParams
    from kvlm.engine.engine import Engine, EngineConfig

    sys.setswitchinterval(args.interval)
    llm = LLM(progress=False)
    engine = Engine(llm, EngineConfig())
    params = SamplingParams(max_tokens=args.steps + 10, temperature=0.7, top_p=0.9, logprobs=2,
                            ignore_eos=True)  # fmt: skip
    for i in range(13):
        engine.add_request(f"d{i}", llm.tokenizer.encode(f"Tell me about the number {i}."), params)
    stop = threading.Event()

    def burn() -> None:  # what building a scored prompt's JSON-ready logprobs looks like
        while not stop.is_set():
            [{str(j): {"logprob": -1.0 * j, "rank": j} for j in range(20)} for _ in range(200)]

    if args.busy:
        threading.Thread(target=burn, daemon=True).start()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    stop.set()
    times = sorted(times[5:])  # the first steps admit the prompts
    median, longest = times[len(times) // 2] * 1000, times[-1] * 1000
    print(f"switch interval {args.interval * 1000:.1f} ms, busy thread {args.busy}: median "
          f"step {median:.0f} ms, longest {longest:.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
