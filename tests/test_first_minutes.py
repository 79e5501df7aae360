"""A newcomer's first minutes (issue [19]): the real `kvlm` command in a subprocess, as a
user runs it, and the README's own words. (The kernels' first-build line:
tests/test_kernel_build.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from kvlm.cli import CHAT_HELP

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def kvlm(*args: str, stdin: str | None = None, env: dict | None = None):
    """`kvlm ARGS` in its own process: (exit status, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvlm.cli", *map(str, args)], input=stdin, capture_output=True,
        text=True, timeout=300, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def test_kvlm_version():
    code, out, err = kvlm("--version")
    assert code == 0, err
    assert out.strip() == f"kvlm {version('kvlm')}"


# --- kvlm chat's own commands never reach the model --------------------------------------

TURN = re.compile(r"^\[\d+ tokens, ", re.MULTILINE)  # the summary line after each reply


def chat(tiny_model_dir, stdin: str) -> tuple[str, str]:
    code, out, err = kvlm(
        "chat", "--model", tiny_model_dir("llama"), "--no-chat", "--max-new-tokens", "2",
        "--temperature", "0", "--threads", "1", stdin=stdin,
    )  # fmt: skip
    assert code == 0, err
    return out, err


def test_chat_commands_answer_and_are_not_sent(tiny_model_dir):
    out, err = chat(tiny_model_dir, "/help\n/reset\n/nonsense\nhello\n/exit\nnever read\n")
    assert out.count(CHAT_HELP) == 2  # /help, and the unknown command's answer
    assert "unknown command /nonsense" in out
    assert "conversation cleared" in out
    assert len(TURN.findall(err)) == 1  # only "hello" was a turn: /exit left before the rest


@pytest.mark.parametrize("word", ["exit", "quit", "/quit"])
def test_chat_leaves_on_exit_words(tiny_model_dir, word):
    _, err = chat(tiny_model_dir, f"{word}\nhello\n")
    assert TURN.findall(err) == []


# --- kvlm memory counts the K/V dtype kvlm generate allocates -----------------------------


@pytest.mark.slow
def test_memory_counts_what_generate_allocates():
    """The default model (a Q4_1 GGUF): generate stores fp16 K/V where the kernels run;
    memory, asked nothing about dtypes, reports the same storage and bytes."""
    code, out, err = kvlm("generate", "Hi", "--json", "--max-new-tokens", "2", "--threads", "2",
                          "--max-context", "4096")  # fmt: skip
    assert code == 0, err
    generated = json.loads(out)
    code, out, err = kvlm("memory", "--json", "--context", "4096")
    assert code == 0, err
    planned = json.loads(out)
    assert planned["kv_dtype"] == generated["kv_dtype"]
    assert planned["bytes_per_sequence"] == generated["kv_bytes"]


# --- without matplotlib, a picture's command still gives its text ------------------------


@pytest.fixture
def no_matplotlib(tmp_path) -> dict:
    """An environment whose Python finds no matplotlib (a package that is not one)."""
    fake = tmp_path / "hide" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}


def test_inspect_plot_without_matplotlib_keeps_the_report(tmp_path, tiny_model_dir, no_matplotlib):
    conv = tmp_path / "conv.kv"
    code, _, err = kvlm("generate", "hello", "--model", tiny_model_dir("llama"), "--no-chat",
                        "--max-new-tokens", "3", "--json", "--save-cache", conv)  # fmt: skip
    assert code == 0, err
    code, out, err = kvlm("inspect", "--cache", conv, "--plot", tmp_path / "c.png",
                          env=no_matplotlib)  # fmt: skip
    assert "mode: contiguous" in out and "stored_bytes:" in out  # the text report
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kvlm: no picture written to {tmp_path / 'c.png'}: pictures need matplotlib: "
        "pip install matplotlib, then run this command again"
    )
    assert not (tmp_path / "c.png").exists()


def test_memory_plot_without_matplotlib_keeps_the_report(tmp_path, tiny_model_dir, no_matplotlib):
    code, out, err = kvlm("memory", "--model", tiny_model_dir("llama"), "--context", "64",
                          "--plot", tmp_path / "m.png", env=no_matplotlib)  # fmt: skip
    assert "bytes per token" in out and code == 2
    assert "pictures need matplotlib: pip install matplotlib" in err


# --- the README's words ------------------------------------------------------------------


def test_readme_says_how_to_get_the_cpu_only_torch():
    text = README.read_text("utf-8")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text("utf-8"))
    assert pinned and f"torch=={pinned[1]} --index-url" in text  # the pin the README names


def readme_client_snippet() -> str:
    """The Python block under README's <!-- client-snippet --> marker."""
    text = README.read_text("utf-8")
    found = re.search(r"<!-- client-snippet -->\n```python\n(.*?)```", text, re.DOTALL)
    assert found, "README lost its client snippet"
    return found[1]


def test_readme_client_snippet_prints_the_answer(tiny_model_dir):
    """The snippet as written (its port aside) against a real kvlm serve: it prints the
    reply. The server greedy: a random tiny model's sampled reply may rightly be an
    end-of-text at once or blanks, which print nothing to see (one CI run in many drew
    that, 2026-11-29); its greedy reply is one, and shows."""
    from serving import kvlm_serve

    snippet = readme_client_snippet()
    assert "pip install openai" in README.read_text("utf-8").split(snippet)[0][-300:]
    folder = tiny_model_dir("llama")
    with kvlm_serve("--model", str(folder), "--threads", "1", "--temperature", "0") as (port, _):
        code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stdout  # it printed the reply (greedy: always this one)
