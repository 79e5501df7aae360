"""Coding agents, unchanged, against a real `kvlm serve` of the default model on 127.0.0.1.

Claude Code (the npm package, version CLAUDE_CODE_VERSION, installed by npm into
KVLM_AGENTS_DIR, default ~/.cache/kvlm-agents, on first use) is configured only as its
docs say for a gateway: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN, ANTHROPIC_MODEL, and
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC (no update check, telemetry or error reports:
there is no internet here) and CLAUDE_CODE_MAX_OUTPUT_TOKENS (its cap on a reply), in a
HOME of its own. Its default prompt is ~12.8k tokens
(12 tools) on the default model's tokenizer, past its trained 8,192: the run restricts
its built-in tools with its own `--tools` flag (Bash, Read, Edit: ~4.1k tokens), and
the server's context is 5,120, and requests that set no sampling are greedy with a
repeat penalty (SAMPLING).

The keep-alive checks share the server: a prompt whose prefill takes seconds on the
default model, `--stream-ping 0.5`, and on each streaming route a keep-alive (Anthropic's
`ping` event, an SSE comment on OpenAI's) comes before the first token.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from serving import kvlm_serve, metrics, wait_idle

KEY = "agents-key"
CLAUDE_CODE_VERSION = "2.1.332"
# Claude Code's prompt with --tools Bash,Read,Edit is ~4.1k tokens; a context of 5,120
# leaves ~1,000 for the reply (a reply that fills it ends in seconds)
CONTEXT = 5120
PROMPT = "Reply with one word: hello"


# Claude Code sends no temperature, so the server's defaults for requests that set none
# decide (kvlm serve --temperature, --repeat-penalty). The API's default (temperature 1)
# makes the 135M model write on past any cap (BENCHMARKS 21.3). Greedy with the repeat
# penalty 1.1 answers in one turn on an AMX Xeon (exit 0, "completed") and writes on past
# the cap on a Zen 3 (greedy tokens follow the CPU's kernels): `_ended` takes either.
SAMPLING = ("--temperature", "0", "--repeat-penalty", "1.1")


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--max-context", str(CONTEXT), "--threads", "2", "--api-key", KEY,
                    "--stream-ping", "0.5", *SAMPLING) as (port, _):  # fmt: skip
        yield port


def _model(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return json.loads(conn.getresponse().read())["data"][0]["id"]


# ------------------------------------------------------------------------ keep-alive


def _long_prompt(seed: str) -> str:
    """~1,200 tokens, different per route (no prefix shared: each prefill is cold)."""
    return " ".join(f"{seed} item {i} is numbered {i * 7 % 1000}." for i in range(150))


_TEXT = re.compile(r'"(text|content|delta)": "[^"]')  # a delta with text in it


def _stream_head(port: int, path: str, body: dict) -> list[str]:
    """The stream's lines up to and including its first data line that carries text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    lines = []
    for _ in range(10_000):  # bounded: a stream ends long before
        line = resp.readline().decode()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("data: ") and _TEXT.search(line):
            break
    conn.close()
    return lines


@pytest.mark.parametrize("route", ["messages", "chat", "responses"])
def test_a_long_prefill_keeps_the_stream_alive(server, route):
    model = _model(server)
    text = _long_prompt(route)
    body, path = {
        "messages": ({"model": model, "max_tokens": 4, "stream": True,
                      "messages": [{"role": "user", "content": text}]}, "/v1/messages"),
        "chat": ({"model": model, "max_tokens": 4, "stream": True,
                  "messages": [{"role": "user", "content": text}]}, "/v1/chat/completions"),
        "responses": ({"model": model, "max_output_tokens": 4, "stream": True, "input": text,
                       "store": False}, "/v1/responses"),
    }[route]  # fmt: skip
    lines = _stream_head(server, path, body)
    ping = "event: ping" if route == "messages" else ": keep-alive"
    assert ping in lines, lines[:20]
    if route == "messages":  # after message_start, as Anthropic's API sends it
        assert lines.index("event: message_start") < lines.index(ping)
    wait_idle(server, KEY)


# ------------------------------------------------------------------------ Claude Code


def _claude_binary_path() -> Path:
    folder = Path(os.environ.get("KVLM_AGENTS_DIR", Path.home() / ".cache" / "kvlm-agents"))
    return folder / "node_modules" / ".bin" / "claude"


def _claude() -> Path:
    """The `claude` binary of CLAUDE_CODE_VERSION, npm-installed once into the agents'
    folder; skips where node or npm is missing or the install fails (no registry)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Claude Code needs node and npm (neither is installed here)")
    binary = _claude_binary_path()
    folder = binary.parent.parent.parent
    package = folder / "node_modules" / "@anthropic-ai" / "claude-code" / "package.json"
    installed = package.is_file() and json.loads(package.read_text())["version"]
    if installed != CLAUDE_CODE_VERSION:
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
             f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"npm could not install Claude Code: {done.stderr[-500:]}")
    return binary


def _run_claude(
    binary: Path, port: int, model: str, home: Path, prompt: str, cap: int = 128
) -> dict:
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_AUTH_TOKEN": KEY, "ANTHROPIC_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(cap),
    }  # fmt: skip
    done = subprocess.run(
        [str(binary), "-p", prompt, "--tools", "Bash,Read,Edit", "--output-format", "json"],
        cwd=home, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.stdout.strip(), done.stderr[-2000:]
    result = json.loads(done.stdout)
    result["returncode"] = done.returncode
    return result


def _said(run: dict) -> tuple:
    return (run["returncode"], run.get("num_turns"), run.get("terminal_reason"),
            run.get("api_error"), run["usage"].get("output_tokens"),
            str(run.get("result"))[:160])  # fmt: skip


def _ended(run: dict, cap: int = 128) -> bool:
    """Claude Code ended the run on kvlm's replies, one of the two ways the model lets it:
    its answer (exit 0), or, where the model writes on past CLAUDE_CODE_MAX_OUTPUT_TOKENS
    (128, so that such a run ends in seconds), its own ending after it asked the model to
    resume: every reply stopped at exactly the cap with stop_reason max_tokens (which is
    what it resumes on), and the resumed turns read the prompt from the cache."""
    if run["returncode"] == 0:
        return bool(run["result"])
    usage = run["usage"]
    return (run.get("api_error") == "max_output_tokens" and run["num_turns"] > 1
            and usage["output_tokens"] == cap * run["num_turns"]
            and usage["cache_read_input_tokens"] > 3000)  # fmt: skip


def test_claude_code_runs_unchanged_and_its_prompt_is_cached(server, tmp_path):
    binary = _claude()
    model = _model(server)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=60, env={"PATH": os.environ["PATH"],
                                              "HOME": str(tmp_path)})  # fmt: skip
    assert CLAUDE_CODE_VERSION in version.stdout
    # An error of kvlm's (a 4xx for something Claude Code sends) is api_error_status: never
    # allowed but for "prompt is too long" after a turn of its tools' results grew the
    # prompt (the first request is Claude Code's own, whole).
    run = _run_claude(binary, server, model, tmp_path, PROMPT)
    grew = run.get("terminal_reason") == "prompt_too_long" and run.get("num_turns", 0) > 1
    assert run.get("api_error_status") is None or grew, run
    assert _ended(run), _said(run)
    before = metrics(server, KEY)["kvlm_prefix_cache_hits_total"]
    second = _run_claude(binary, server, model, tmp_path, PROMPT)
    grew = second.get("terminal_reason") == "prompt_too_long" and second.get("num_turns", 0) > 1
    assert second.get("api_error_status") is None or grew, second
    assert _ended(second), _said(second)
    # its long prompt (system, tools) came from the prefix cache, and usage said so
    assert second["usage"]["cache_read_input_tokens"] > 3000, second["usage"]
    assert metrics(server, KEY)["kvlm_prefix_cache_hits_total"] - before > 3000
    wait_idle(server, KEY)
