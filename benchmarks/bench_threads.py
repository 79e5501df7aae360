"""Threads under load: TTFT and decode of one request with the engine's own thread count
(kvlm.engine.threads, no --threads) against fixed counts, with 0..N other busy processes.

Each configuration runs in a fresh process (`kvlm`'s OpenMP runtime starts once per
process), the configurations taking turns round by round; a busy process is a Python loop
that never sleeps. Medians per configuration and load are printed as a Markdown table.

    python benchmarks/bench_threads.py --rounds 3 --busy 0,1 --threads auto,2,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from kvlm import LLM, SamplingParams
threads = None if sys.argv[1] == "auto" else int(sys.argv[1])
prompt_tokens, new = int(sys.argv[2]), int(sys.argv[3])
llm = LLM(progress=False, threads=threads, max_context=prompt_tokens + new + 16)
ids = (llm.tokenizer.encode("The river flows past the old mill and the town. ") * 400)
ids = ids[:prompt_tokens]
engine = llm.cache_engine()
engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
t0 = time.perf_counter(); first = None; n = 0
while engine.has_work():
    for ev in engine.step():
        n += len(ev.token_ids)
        if first is None and ev.token_ids:
            first = time.perf_counter()
end = time.perf_counter()
tuner = engine.tuner
print(json.dumps({"ttft_ms": 1000 * (first - t0), "decode_tok_s": (n - 1) / (end - first),
                  "ended_on": None if tuner is None else tuner.current,
                  "switches": None if tuner is None else tuner.switches}))
"""

BUSY = "while True: pass"


def run(threads: str, prompt: int, new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, threads, str(prompt), str(new)],
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", default="0,1", help="other busy processes, a list")
    ap.add_argument("--threads", default="auto,2,1", help="auto: the engine's own count")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", help="write every run here")
    args = ap.parse_args()
    busy_counts = [int(b) for b in args.busy.split(",")]
    configs = args.threads.split(",")
    runs: list[dict] = []
    for r in range(args.rounds):
        for busy in busy_counts:
            loops = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
            try:
                time.sleep(1)
                for t in configs:
                    got = run(t, args.prompt, args.new_tokens)
                    runs.append({"round": r, "busy": busy, "threads": t, **got})
                    print(json.dumps(runs[-1]), file=sys.stderr)
            finally:
                for p in loops:
                    p.kill()
                    p.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("| other busy processes | threads | TTFT ms (median) | decode tok/s (median) | runs |")
    print("| ---: | --- | ---: | ---: | --- |")
    for busy in busy_counts:
        for t in configs:
            rs = [x for x in runs if x["busy"] == busy and x["threads"] == t]
            ttft = statistics.median(x["ttft_ms"] for x in rs)
            dec = statistics.median(x["decode_tok_s"] for x in rs)
            each = ", ".join(f"{x['decode_tok_s']:.0f}" for x in rs)
            name = "measured (default)" if t == "auto" else f"--threads {t}"
            print(f"| {busy} | {name} | {ttft:.0f} | {dec:.1f} | {each} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
