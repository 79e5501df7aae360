"""`kvlm bench --suite`: the model set, each engine alone in a fresh process."""

from __future__ import annotations

import io
import json

import pytest

from kvlm.bench import models, suite
from kvlm.cli import main

TINY = models.Shape("llama", 64, 2, 4, 2, 16, 128, 49152, True, 1e4, 256, 1e-5)


@pytest.fixture
def tiny_shape(monkeypatch):
    """A real-shape entry small enough for a test (the default tokenizer's vocabulary)."""
    for module in (models, suite):
        monkeypatch.setitem(module.SHAPES, "tiny-0.1b", TINY)


def test_suite_writes_its_files_and_measures_each_engine_in_its_own_process(tiny_shape, tmp_path):
    files = suite.suite_models(tmp_path, ["tiny-0.1b"], ["Q4_0", "Q8_0"], default=False)
    assert [f.name for f in files] == ["tiny-0.1b-Q4_0.gguf", "tiny-0.1b-Q8_0.gguf"]
    stamp = files[0].stat().st_mtime_ns
    assert suite.suite_models(tmp_path, ["tiny-0.1b"], ["Q4_0"], default=False) == files[:1]
    assert files[0].stat().st_mtime_ns == stamp  # present files are not written again

    log = io.StringIO()
    result = suite.run_suite(
        files[:1], ["kvlm", "hf"], prompt=16, new=4, rounds=2, threads=1, log=log
    )
    rows = result["rows"]
    assert [r["engine"] for r in rows] == ["kvlm", "hf"], rows
    # the rounds take turns; transformers, a reference, runs once
    assert [ln.split()[1] for ln in log.getvalue().splitlines()] == ["kvlm:", "hf:", "kvlm:"]
    assert rows[0]["rounds"] == 2 and rows[1]["rounds"] == 1
    for r in rows:
        assert r["model"] == "tiny-0.1b-Q4_0.gguf" and r["file_bytes"] == files[0].stat().st_size
        assert r["load_s"] > 0 and r["ttft_ms"] > 0 and r["decode_tok_s"] > 0
        assert r["peak_rss_mib"] > 50  # the child's own VmHWM
    kvlm = rows[0]
    assert kvlm["numerics"]["weights"] == "native"  # no flags: the fast path
    assert kvlm["bandwidth_gb_s"] > 0 and kvlm["weight_bytes_per_token"] > 0
    (t,) = result["targets"]
    assert t["share_ok"] is None and "decode_ratio" not in t  # < 1B; no llama.cpp row
    text = suite.markdown(result)
    assert "| tiny-0.1b-Q4_0.gguf | " in text and "| kvlm |" in text and "| hf |" in text


def test_rounds_merge_into_medians_and_the_largest_peak():
    def ran(ttft, decode, load, rss):
        return {"engine": "kvlm", "ttft_ms": ttft, "decode_tok_s": decode, "load_s": load,
                "peak_rss_mib": rss}  # fmt: skip

    runs = [ran(300.0, 50.0, 1.0, 900.0), {"engine": "kvlm", "error": "exit 1: killed"},
            ran(100.0, 70.0, 3.0, 950.0), ran(200.0, 60.0, 2.0, 800.0)]  # fmt: skip
    row = suite.merge_rounds(runs)
    assert (row["ttft_ms"], row["decode_tok_s"], row["load_s"]) == (200.0, 60.0, 2.0)
    assert row["peak_rss_mib"] == 950.0 and row["rounds"] == 3 and row["failed_rounds"] == 1
    assert suite.merge_rounds(runs[1:2]) == runs[1]  # no round ran: the error is the row


def test_a_failing_engine_costs_its_row_only(tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1, 2, 3]))
    row = suite.run_child("kvlm", tmp_path / "missing.gguf", str(ids), 4, 1, timeout=120)
    assert row["engine"] == "kvlm" and "model not found" in row["error"]


def test_targets_compare_kvlm_with_llama_cpp_row_by_row():
    def row(engine, **kw):
        base = {"model": "qwen3-1.7b-Q4_0.gguf", "file_bytes": 10**9, "engine": engine}
        return base | kw

    rows = [
        row(
            "kvlm",
            load_s=1.5,
            ttft_ms=400.0,
            decode_tok_s=30.0,
            peak_rss_mib=1000.0,
            bandwidth_gb_s=40.0,
            weight_bytes_per_token=10**9,
        ),
        row("llama.cpp", load_s=0.5, ttft_ms=1000.0, decode_tok_s=15.0, peak_rss_mib=1100.0),
    ]
    (t,) = suite.targets(rows)
    assert t["decode_ratio"] == 2.0 and t["decode_ok"]
    assert t["ttft_ratio"] == 0.4 and t["ttft_ok"]
    assert t["rss_ratio"] == 0.91 and t["rss_ok"]
    assert t["share_of_bound"] == 0.75 and t["share_ok"] is False  # 1.7B: >= 85% wanted
    assert t["load_s_per_gb"] == 1.5 and t["load_ok"]
    assert "4 of 5 target checks met" in suite.markdown(
        {
            "prompt_tokens": 512,
            "new_tokens": 64,
            "rounds": 2,
            "threads": 2,
            "rows": rows,
            "skipped": {},
            "targets": [t],
        }
    )


def test_suite_refuses_flags_that_do_not_apply_in_one_line(capsys, tmp_path):
    for args, message in [
        (["--exact"], "--exact does not apply"),
        (["--weights", "int8"], "--weights does not apply"),
        (["--shapes", "gpt-5"], "unknown shape 'gpt-5'"),
        (["--types", "Q2_K"], "unknown file type 'Q2_K'"),
        (["--peers", "vllm"], "--suite peers: 'vllm'"),
        (["--prompts", "8"], "--prompts >= 16"),
    ]:
        code = main(["bench", "--suite", str(tmp_path), *args])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("kvlm: error: ") and message in err, err


def test_a_conv_shape_writes_the_file_llama_cpps_converter_would(tmp_path):
    """An LFM2 shape (short convolutions beside attention): the layer pattern as
    head_count_kv per layer (0: a conv layer), the conv's taps kept F32, the final norm
    under the family's name; kvlm reads it as that pattern and runs it."""
    from kvlm import LLM, SamplingParams
    from kvlm.loading.default import default_model_path
    from kvlm.loading.gguf_file import GGUFFile

    shape = models.Shape("lfm2", 64, 4, 4, 2, 16, 128, 49152, True, 1e6, 256, 1e-5,
                         attention_layers=(1, 3))  # fmt: skip
    models.SHAPES["tiny-conv"] = shape
    try:
        path = models.write_model("tiny-conv", "Q8_0", tmp_path / "c.gguf", default_model_path())
    finally:
        del models.SHAPES["tiny-conv"]
    meta = GGUFFile(path).metadata
    assert list(meta["lfm2.attention.head_count_kv"]) == [0, 2, 0, 2]
    assert meta["lfm2.shortconv.l_cache"] == 3
    llm = LLM(str(path), threads=1)
    assert llm.config.layer_mixers == ("conv", "attention", "conv", "attention")
    out = llm.generate("a b c", SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4
