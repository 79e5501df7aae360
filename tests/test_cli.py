"""The `kvlm` command line: the --json contract and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import write_gguf_from_hf
from kvlm.cli import main

CONTRACT = {
    "model",
    "kv_mode",
    "prompt_tokens",
    "completion_tokens",
    "token_ids",
    "text",
    "metrics",
    "kv_bytes",
}
METRICS = {"ttft_ms", "decode_tokens_per_s", "per_forward_ms"}


@pytest.mark.slow
def test_generate_json_contract_through_the_installed_entry_point():
    """The real `kvlm` script on the default model, as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvlm.cli", "generate", "What is the capital of France?",
         "--json", "--max-new-tokens", "12", "--kv", "contiguous", "--threads", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert record.keys() >= CONTRACT
    assert record["metrics"].keys() >= METRICS
    assert record["kv_mode"] == "contiguous"
    assert record["completion_tokens"] == len(record["token_ids"]) <= 12
    assert len(record["metrics"]["per_forward_ms"]) == record["completion_tokens"]
    assert "Paris" in record["text"]
    assert record["kv_bytes"] > 0
    assert record["prompt_tokens"] > 20  # the chat template was applied


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    return write_gguf_from_hf(tiny_model_dir("llama"), tmp_path_factory.mktemp("g") / "t.gguf")


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kv", ["off", "basic", "contiguous"])
def test_generate_json_on_every_mode(capsys, tiny_gguf, kv):
    code, out, _ = run_cli(
        capsys, "generate", "hello", "--model", str(tiny_gguf), "--json", "--kv", kv,
        "--max-new-tokens", "5", "--ignore-eos", "--logprobs", "3", "--no-chat",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    assert record.keys() >= CONTRACT and record["metrics"].keys() >= METRICS
    assert record["kv_mode"] == kv and record["completion_tokens"] == 5
    assert record["chat_template"] is False
    assert len(record["logprobs"]) == 5 and len(record["logprobs"][0]["top"]) == 3
    assert (record["kv_bytes"] == 0) == (kv == "off")


def test_generate_streams_text_and_reads_stdin(capsys, monkeypatch, tiny_gguf):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello from stdin"))
    code, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_gguf), "--max-new-tokens", "4", "--ignore-eos"
    )
    assert code == 0
    assert out.endswith("\n") and len(out) > 1
    assert "tokens" in err and "TTFT" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv", "nope"], "unknown cache mode 'nope'; valid modes: off, basic, contiguous"),
        (["--max-new-tokens", "0"], "max_tokens must be >= 1"),
        (["--temperature", "-1"], "temperature must be"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--max-context", "999999"], "max_context must be between 1 and"),
        (["--top-p", "0"], "top_p"),
    ],
)
def test_user_mistakes_end_in_one_line(capsys, tiny_gguf, args, message):
    code, out, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_gguf), *args)
    assert code == 2
    assert out == ""
    assert err.startswith("kvlm: error: ") and err.count("\n") == 1, err
    assert message in err
    assert "Traceback" not in err


def test_bad_model_files_end_in_one_line(capsys, tmp_path, tiny_gguf):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:1000])
    for path, message in [
        (tmp_path / "missing.gguf", "model not found"),
        (broken, "truncated or corrupt"),
    ]:
        code, _, err = run_cli(capsys, "generate", "hi", "--model", str(path))
        assert code == 2 and message in err and err.count("\n") == 1


def test_prompt_over_the_context_is_refused(capsys, tiny_gguf):
    code, out, err = run_cli(
        capsys, "generate", "word " * 100, "--model", str(tiny_gguf), "--max-context", "16"
    )
    assert code == 2 and out == ""
    assert "cache holds at most 16" in err


def test_inspect(capsys, tiny_gguf):
    code, out, _ = run_cli(capsys, "inspect", "--model", str(tiny_gguf), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["architecture"] == "llama" and info["num_layers"] == 2
    assert info["kv_bytes_per_token"]["fp32"] == 2 * 2 * 2 * 16 * 4
    assert info["format"] == "gguf" and info["chat_template"] is True


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(capsys, tiny_gguf):
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_gguf), "--device", "cuda")
    assert code == 2 and "no CUDA GPU is available" in err


def test_help_names_every_cache_mode_and_skips_torch():
    from kvlm.cache import CACHE_MODES
    from kvlm.cli import KV_HELP

    assert all(mode in KV_HELP for mode in CACHE_MODES)
    code = "import sys, kvlm.cli; kvlm.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
