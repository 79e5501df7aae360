"""The `kvlm` command line: the --json contract and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import write_gguf_from_hf
from kvlm.cli import main
from numerics import U32, fp64_reorder_bound

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
        [sys.executable, "-m", "kvlm.cli", "generate", "What is the capital of Japan?",
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
    assert "Tokyo" in record["text"]
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
        (["--max-context", "0"], "max_context must be between 1 and"),
        (["--rope-scale", "2"], "a RoPE scale needs the RoPE scaling linear or yarn"),
        (["--top-p", "0"], "top_p"),
        (
            ["--weights", "int3"],
            "unknown weight format 'int3'; valid: auto, f32, bf16, int8, int4, native",
        ),
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


@pytest.mark.parametrize("kv", ["paged", "int8", "window"])
def test_generate_json_on_the_new_modes(capsys, tiny_gguf, kv):
    code, out, _ = run_cli(
        capsys, "generate", "hello", "--model", str(tiny_gguf), "--json", "--kv", kv,
        "--max-new-tokens", "6", "--ignore-eos", "--no-chat", "--window", "4", "--sinks", "1",
        "--block-size", "4", "--prefill-chunk", "2",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    assert record["kv_mode"] == kv and record["completion_tokens"] == 6
    assert record["kv_dtype"] == ("int8" if kv == "int8" else "fp32")
    assert len(record["metrics"]["per_forward_ms"]) >= 6


def test_generate_n_samples(capsys, tiny_gguf):
    code, out, _ = run_cli(
        capsys, "generate", "hello", "--model", str(tiny_gguf), "--json", "-n", "3",
        "--temperature", "1.0", "--seed", "3", "--max-new-tokens", "5", "--ignore-eos",
        "--kv", "paged",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    assert len(record["samples"]) == 3
    assert record["token_ids"] == record["samples"][0]["token_ids"]


def test_save_and_load_cache_resume_a_conversation(capsys, tiny_gguf, tmp_path):
    conv = tmp_path / "conv.kv"
    base = ["--model", str(tiny_gguf), "--json", "--max-new-tokens", "4", "--ignore-eos"]
    code, out, _ = run_cli(capsys, "generate", "hello there", *base, "--save-cache", str(conv))
    assert code == 0 and conv.is_file()
    code, out, _ = run_cli(capsys, "generate", "and then", *base, "--load-cache", str(conv))
    assert code == 0
    record = json.loads(out)
    assert record["metrics"]["prefill_tokens"] < record["prompt_tokens"]  # prefix reused
    code, _, err = run_cli(capsys, "generate", "x", "--model", str(tiny_gguf), "--load-cache",
                           str(tmp_path / "missing.kv"))  # fmt: skip
    assert code == 2 and "cache file not found" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "generate", "x", "--model", str(tiny_gguf), "-n", "2",
                           "--save-cache", str(conv))  # fmt: skip
    assert code == 2 and "use -n 1" in err


def test_memory_command(capsys, tiny_gguf):
    code, out, _ = run_cli(
        capsys, "memory", "--model", str(tiny_gguf), "--context", "128", "--batch", "4",
        "--kv", "paged", "--kv-dtype", "bf16", "--budget", "1MiB", "--json",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    assert record["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert record["total_bytes"] == 4 * 128 * record["bytes_per_token"]
    assert record["sequences_in_budget"] == 2**20 // (128 * record["bytes_per_token"])
    code, out, _ = run_cli(capsys, "memory", "--model", str(tiny_gguf), "--context", "64")
    assert code == 0 and "| window | int8 |" in out
    code, _, err = run_cli(capsys, "memory", "--model", str(tiny_gguf), "--context", "100000")
    assert code == 2 and "--context must be between 1 and 256" in err
    code, _, err = run_cli(capsys, "memory", "--model", str(tiny_gguf), "--budget", "lots")
    assert code == 2 and "cannot read the size" in err


@pytest.mark.parametrize("kv", ["contiguous", "int8", "window"])
def test_verify_command(capsys, tiny_gguf, kv):
    code, out, _ = run_cli(
        capsys, "verify", "hello world", "--model", str(tiny_gguf), "--kv", kv, "--json",
        "--max-new-tokens", "12", "--window", "4", "--sinks", "1",
    )  # fmt: skip
    assert code == 0
    record = json.loads(out)
    assert record["steps"] == 12 and record["mode"] == kv
    # an exact mode differs from the oracle by rounding only: in fp64 (kvlm verify --dtype
    # fp64) by 2^-29 of what fp32 rounding gives, whose floor is a logit's last bit
    code, out, _ = run_cli(
        capsys, "verify", "hello world", "--model", str(tiny_gguf), "--kv", "contiguous",
        "--json", "--max-new-tokens", "12",
    )  # fmt: skip
    rounding = max(json.loads(out)["max_logit_drift"], 16 * U32)
    if kv == "contiguous":
        code, out, _ = run_cli(
            capsys, "verify", "hello world", "--model", str(tiny_gguf), "--kv", kv, "--json",
            "--max-new-tokens", "12", "--dtype", "fp64",
        )  # fmt: skip
        exact = json.loads(out)
        assert exact["agreement"] == 1.0 and exact["worst_rank"] == 0
        assert exact["max_logit_drift"] <= fp64_reorder_bound(rounding)
    if kv == "window":  # a 1 + 4 window on a longer sequence changes the model's output
        assert record["max_logit_drift"] > 1000 * rounding
    code, out, _ = run_cli(capsys, "verify", "--model", str(tiny_gguf), "--kv", kv,
                           "--max-new-tokens", "4")  # fmt: skip
    assert code == 0 and "greedy agreement" in out


def test_verify_against_the_reference_counts_first_tokens_answers_and_ranks(tiny_gguf):
    """compare() on the reference's own answers: all agree; then one answer's last token
    swapped for the reference's second choice there: that answer differs, its first token
    does not, one token of all is off the argmax, at rank 1."""
    from kvlm import LLM
    from kvlm.bench.prompts import KINDS, fidelity_prompts
    from kvlm.engine.verify import compare, greedy_answers

    texts = fidelity_prompts()
    assert len(texts) == 216 == 24 * len(KINDS) and len(set(texts)) == 216
    ref = LLM(str(tiny_gguf), exact=True, progress=False)
    prompts = [ref.encode(t) for t in texts[::54]]  # one of four kinds
    expected = greedy_answers(ref, prompts, 6)
    same = compare(ref, prompts, expected, expected, 6)
    assert (same.first_token, same.whole_answer, same.forced_agreement) == (1.0, 1.0, 1.0)
    assert same.worst_rank == 0 and same.differing == []
    changed = [list(a) for a in expected]
    ids, answer = prompts[1], changed[1]
    assert len(answer) == 6  # a random model writes no end-of-sequence this soon
    step = ref.runner.logits(ids + answer[:5], ref.new_cache("off"))[-1]
    answer[5] = int(step.topk(2).indices[1])  # the last: no later step sees another prefix
    other = compare(ref, prompts, expected, changed, 6)
    assert other.first_token == 1.0 and other.whole_answer == 3 / 4 and other.differing == [1]
    assert other.forced_agreement == 1 - 1 / sum(map(len, changed)) and other.worst_rank == 1


def test_verify_against_exact_from_the_command_line(capsys, tiny_gguf, tmp_path):
    flags = ("--exact", "--prompts", "4", "--max-new-tokens", "4", "--json")
    code, out, _ = run_cli(capsys, "verify", "--against", "exact", "--model", str(tiny_gguf),
                           *flags)  # fmt: skip
    record = json.loads(out)
    assert code == 0 and record["prompts"] == 4 and record["max_tokens"] == 4
    assert record["whole_answer"] == 1.0 and record["worst_rank"] == 0  # the same numerics
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 plus 2?\n\nName a colour.\n")
    code, out, _ = run_cli(capsys, "verify", "--against", "exact", "--model", str(tiny_gguf),
                           "--prompts-file", str(prompts), "--max-new-tokens", "3")  # fmt: skip
    assert code == 0 and "2 prompts" in out and "whole answer" in out
    for bad, says in (
        (["--prompts", "0"], "--prompts must be between 1 and 216"),
        (["--prompts-file", str(tmp_path / "none.txt")], "--prompts-file:"),
    ):
        code, _, err = run_cli(capsys, "verify", "--against", "exact", "--model",
                               str(tiny_gguf), *bad)  # fmt: skip
        assert code == 2 and says in err


def test_bench_compares_modes_and_peers_in_one_run(capsys, tiny_gguf, tmp_path):
    out_file = tmp_path / "bench.json"
    code, out, err = run_cli(
        capsys, "bench", "--model", str(tiny_gguf), "--kv", "contiguous,paged",
        "--prompts", "8,24", "--new-tokens", "4", "--json", str(out_file),
        "--peers", "hf,hf-static", "--plots", str(tmp_path / "plots"),
    )  # fmt: skip
    assert code == 0, err
    assert "[1/8]" in err and "[8/8]" in err  # progress: 2 prompts x (2 modes + 2 peers)
    result = json.loads(out_file.read_text())
    engines = {(r["engine"], r["prompt_tokens"]) for r in result["rows"]}
    assert engines == {
        (e, n) for e in ("kvlm-contiguous", "kvlm-paged", "hf", "hf-static") for n in (8, 24)
    }
    for r in result["rows"]:
        assert r["ttft_ms"] > 0 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert len(result["ratios"]) == 8  # 2 modes x 2 peers x 2 prompts
    assert result["bandwidth_gb_s"] > 0 and result["decode_bound_tok_s"] > 0
    for r in result["rows"]:  # kvlm rows: the bound at the bandwidth probed around them,
        if r["engine"].startswith("kvlm-"):  # and with the mean context's K/V read per step
            assert r["bandwidth_gb_s"] > 0
            per_token = result["weight_bytes_per_token"]
            assert r["bound_tok_s"] == pytest.approx(r["bandwidth_gb_s"] * 1e9 / per_token, 1e-3)
            assert 0 < r["bound_with_kv_tok_s"] < r["bound_tok_s"]
            assert r["kv_bytes_per_token"] > 0
        else:
            assert "bound_with_kv_tok_s" not in r and "bandwidth_gb_s" not in r
    assert "| kvlm-paged | hf-static | 24 |" in out
    curves = result["per_forward_ms"]
    assert set(curves) == {"off", "contiguous", "paged"} and len(curves["off"]) == 3
    for name in ("per_forward.png", "decode_vs_context.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_runs_llama_cpp_when_it_is_installed(capsys, tmp_path):
    pytest.importorskip("llama_cpp")  # the optional `bench` extra; not in CI
    out_file = tmp_path / "bench.json"
    args = ["--prompts", "8", "--new-tokens", "4", "--peers", "llama.cpp", "--json", str(out_file)]
    code, _, err = run_cli(capsys, "bench", *args)  # the default model's GGUF
    assert code == 0, err
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["engine"] for r in rows] == ["kvlm-contiguous", "llama.cpp"]
    assert rows[1]["decode_tok_s"] > 0


def test_bench_reports_a_peer_that_cannot_load_and_goes_on(capsys, tiny_gguf, tmp_path):
    pytest.importorskip("llama_cpp")
    out_file = tmp_path / "bench.json"
    args = ["--prompts", "8", "--new-tokens", "4", "--peers", "llama.cpp", "--json", str(out_file)]
    code, out, err = run_cli(capsys, "bench", "--model", str(tiny_gguf), *args)
    assert code == 0, err
    result = json.loads(out_file.read_text())
    assert [r["engine"] for r in result["rows"]] == ["kvlm-contiguous"]
    assert result["skipped"]["llama.cpp"].startswith("failed to load")
    assert "skipped llama.cpp: failed to load" in out


def test_bench_refuses_bad_arguments_in_one_line(capsys, tiny_gguf):
    for args, message in [
        (["--prompts", "8,x"], "--prompts takes comma-separated token counts"),
        (["--peers", "vllm"], "unknown peer 'vllm'"),
        (["--kv", "contiguous,nope", "--prompts", "8"], "unknown cache mode 'nope'"),
    ]:
        code, _, err = run_cli(capsys, "bench", "--model", str(tiny_gguf), *args)
        assert code == 2 and err.startswith("kvlm: error: ") and message in err, err


def test_generate_speculative_gives_the_plain_text(capsys, tiny_gguf):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    common = ("generate", prompt, "--model", str(tiny_gguf), "--json", "--max-new-tokens",
              "60", "--ignore-eos", "--no-chat")  # fmt: skip
    code, out, _ = run_cli(capsys, *common)
    assert code == 0
    plain = json.loads(out)["text"]
    code, out, _ = run_cli(capsys, *common, "--speculative", "ngram", "--num-draft", "4")
    assert code == 0
    record = json.loads(out)  # the documented --json, and what the drafts did
    assert record["text"] == plain and record["completion_tokens"] == 60
    assert len(record["token_ids"]) == 60 and record["metrics"]["ttft_ms"] > 0
    spec = record["speculative"]
    assert spec["drafted"] > 0 and 0 <= spec["acceptance"] <= 1 and spec["method"] == "ngram"
    code, _, err = run_cli(capsys, *common, "--speculative", "ngram", "--num-draft", "0")
    assert code != 0 and "num_draft" in err and "Traceback" not in err
    code, out, _ = run_cli(capsys, *common, "--kv", "window")  # every cache speculates alike
    code2, out2, _ = run_cli(capsys, *common, "--speculative", "ngram", "--kv", "window")
    assert code == code2 == 0 and json.loads(out2)["text"] == json.loads(out)["text"]
    code, _, err = run_cli(capsys, *common, "--speculative", "ngram", "--kv", "off")
    assert code != 0 and "no speculative decoding with kv 'off'" in err


def test_bench_reports_speculative_rows(capsys, tiny_gguf, tmp_path):
    out_file = tmp_path / "bench.json"
    code, out, err = run_cli(
        capsys, "bench", "--model", str(tiny_gguf), "--prompts", "24", "--new-tokens", "24",
        "--peers", "none", "--streams", "none", "--json", str(out_file),
        "--speculative", "ngram", "--num-draft", "4",
    )  # fmt: skip
    assert code == 0, err
    rows = {r["engine"]: r for r in json.loads(out_file.read_text())["rows"]}
    assert set(rows) == {"kvlm-contiguous", "kvlm+ngram"}
    spec = rows["kvlm+ngram"]
    assert spec["decode_tok_s"] > 0 and 0 <= spec["acceptance"] <= 1
    assert spec["tokens_per_forward"] >= 1 or spec["acceptance"] == 0
    assert "| kvlm+ngram | 24 |" in out and "tokens per forward" in out


def test_the_command_reference_is_the_parsers():
    """docs/CLI.md is generated from build_parser() (kvlm.cli.reference): a flag added,
    renamed or re-described without regenerating it fails here."""
    from pathlib import Path

    from kvlm.cli import reference

    written = (Path(__file__).resolve().parent.parent / "docs" / "CLI.md").read_text()
    assert written == reference(), "docs/CLI.md is stale: regenerate it (its header says how)"
