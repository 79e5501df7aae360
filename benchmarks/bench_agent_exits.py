"""How often Claude Code's one-shot run against `kvlm serve` exits 0, by the server's
sampling flags (tests/test_agents.py's run; BENCHMARKS 21.3). Needs node, npm and Claude
Code installed as the test installs it (run tests/test_agents.py once).

    python benchmarks/bench_agent_exits.py --runs 10 --cap 128 -- --temperature 0.8 \\
        --top-k 40 --top-p 0.95 --min-p 0.05 --repeat-penalty 1.1
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from serving import kvlm_serve
from test_agents import KEY, PROMPT, _claude_binary_path, _run_claude


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--cap", type=int, default=128, help="CLAUDE_CODE_MAX_OUTPUT_TOKENS")
    ap.add_argument("--context", type=int, default=5120)
    ap.add_argument("flags", nargs="*", help="kvlm serve's flags (after --)")
    args = ap.parse_args()
    binary = _claude_binary_path()
    with kvlm_serve("--max-context", str(args.context), "--threads", "2", "--api-key", KEY,
                    *args.flags) as (port, _):  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        exits = 0
        for _ in range(args.runs):
            home = Path(tempfile.mkdtemp(prefix="claude-run-"))
            r = _run_claude(binary, port, model, home, PROMPT, cap=args.cap)
            exits += r["returncode"] == 0
            usage = r.get("usage") or {}
            print(r["returncode"], r.get("num_turns"), usage.get("output_tokens"),
                  repr(str(r.get("result"))[:80]), flush=True)  # fmt: skip
        print(f"flags {args.flags} cap {args.cap}: {exits} of {args.runs} runs exited 0")


if __name__ == "__main__":
    main()
