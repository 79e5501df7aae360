"""OpenAI's Codex CLI (`@openai/codex`, pinned below) unchanged against a real `kvlm serve`
of the default model on 127.0.0.1, configured as Codex's docs say for a local provider:
a config.toml in a temporary CODEX_HOME with a `model_providers` entry (`base_url`,
`wire_api = "responses"`, `env_key`), its update check, analytics and feedback off (no
network here), and its sub-agent tools off (they would not fit the default model's
context: CONFIG).

Each request it sends carries what kvlm once refused: `client_metadata` and a hosted
`web_search` tool (and, with its sub-agents on, a `namespace` of functions);
tests/test_responses_api.py holds a test of each with the openai SDK. Its prompt is
long and stable (~6.5k tokens of instructions and tools), so a second run prefills only
what differs: Codex's own `--json` events say how many input tokens the server read
from its cache.

Codex comes from npm: the test installs the pinned version into a cache folder once
(`KVLM_CODEX`, a codex binary of that version, skips the install); it is skipped where
node or npm is missing or the install fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from serving import kvlm_serve

CODEX_VERSION = "0.171.0"
KEY = "codex-key"
MODEL = "smollm2"
# Codex's sub-agent tools are a namespace of five functions: 2,677 of the 9,186 tokens the
# default model's tokenizer makes of Codex's first request, past the 8,192 it was trained
# on (and kvlm serves). With them off (`[agents] enabled = false`) the prompt is ~6.5k.
CONFIG = """\
model = "{model}"
model_provider = "kvlm"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[agents]
enabled = false

[model_providers.kvlm]
name = "kvlm"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "KVLM_API_KEY"
"""


@pytest.fixture(scope="module")
def codex() -> str:
    """The pinned Codex CLI's binary: KVLM_CODEX, else npm's install into a cache folder."""
    given = os.environ.get("KVLM_CODEX")
    if given:
        return given
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(f"node and npm are needed to install @openai/codex@{CODEX_VERSION}")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "kvlm-tests" / f"codex-{CODEX_VERSION}"
    binary = folder / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        folder.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                ["npm", "install", "--prefix", str(folder), "--no-audit", "--no-fund",
                 f"@openai/codex@{CODEX_VERSION}"],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install @openai/codex@{CODEX_VERSION} ran past 600 s")
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"npm install @openai/codex@{CODEX_VERSION} failed: {done.stderr[-800:]}")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.split() == ["codex-cli", CODEX_VERSION], version
    return str(binary)


@pytest.fixture(scope="module")
def server():
    with kvlm_serve("--max-context", "8192", "--threads", "2", "--api-key", KEY,
                    "--served-model-name", MODEL) as (port, _):  # fmt: skip
        yield port


# The answer's shape (Codex's --output-schema: text.format json_schema, through kvlm's
# grammar), so that it ends: Codex sets no max_output_tokens and no temperature, and the
# default model sampled at 1.0 ran on to the context's end in 1 of 12 tries of this prompt
# (Codex then fails the turn: "Incomplete response returned")
SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 40}},
          "required": ["greeting"], "additionalProperties": False}  # fmt: skip


def codex_exec(codex: str, home: Path, work: Path, prompt: str) -> list[dict]:
    """`codex exec --json PROMPT` in `work`, its answer in SCHEMA: its exit code checked,
    its events."""
    env = {**os.environ, "CODEX_HOME": str(home), "KVLM_API_KEY": KEY, "NO_COLOR": "1"}
    run = subprocess.run(
        [codex, "exec", "--json", "--skip-git-repo-check", "--ephemeral", "--output-schema",
         str(home / "schema.json"), prompt],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [e for e in events if e["type"] in ("error", "turn.failed")]
    assert run.returncode == 0, failed or run.stderr[-3000:]
    return events


def test_codex_exec_answers_and_its_second_run_reads_the_prompt_from_the_cache(
    codex, server, tmp_path
):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(CONFIG.format(model=MODEL, port=server))
    (home / "schema.json").write_text(json.dumps(SCHEMA))
    prompt = "Say hello in one short sentence."
    runs = [codex_exec(codex, home, work, prompt) for _ in range(2)]
    for events in runs:
        kinds = [e["type"] for e in events]
        assert "turn.failed" not in kinds and kinds[-1] == "turn.completed", events
        said = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message"]  # fmt: skip
        assert said, events
        jsonschema.validate(json.loads(said[-1]), SCHEMA)
    first, second = (events[-1]["usage"] for events in runs)
    assert first["input_tokens"] > 4096, first  # Codex's own instructions and tools
    # the second run's prompt is the first's (its instructions, tools, the same message):
    # all of it but the block its last tokens share
    assert second["cached_input_tokens"] >= second["input_tokens"] - 32, second
