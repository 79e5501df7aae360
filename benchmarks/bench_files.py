"""`kvlm bench --suite`'s runs over model files named one by one (a suite of shapes whose
file types differ, in one run): each engine alone in a fresh process, the engines taking
turns, the suite's table and targets.

    python benchmarks/bench_files.py F1.gguf F2.gguf ... [--rounds 3] [--threads 2]
        [--peers llama.cpp] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlm.bench.suite import markdown, run_suite


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--peers", default="llama.cpp", help="comma-separated: llama.cpp, hf")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    engines = ["kvlm", *(e for e in args.peers.split(",") if e and e != "none")]
    result = run_suite(args.files, engines, rounds=args.rounds, threads=args.threads)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
