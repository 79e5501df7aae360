"""lm-evaluation-harness against `kvlm serve`: a small multiple-choice task shipped in
tests/lm_eval_task (YAML + JSONL, no download) scored through `local-completions` (echo
with logprobs: the prompt's own logprobs, from kvlm's prefill) and through lm-eval's own
`hf` backend (transformers) on the same model folder. Each choice's loglikelihood agrees
within 1e-3 and the accuracy is the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from serving import get, kvlm_serve

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "lm_eval_task"


def _evaluate(model: str, model_args: str, monkeypatch) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASK_DIR)  # the YAML names its JSONL relative to here
    return simple_evaluate(
        model=model, model_args=model_args, tasks=["kvlm_mc"], batch_size=1, device="cpu",
        task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True,
    )  # fmt: skip


def _loglikelihoods(results: dict) -> list[list[float]]:
    samples = sorted(results["samples"]["kvlm_mc"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def test_lm_eval_scores_kvlm_as_it_scores_transformers(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tiny_model_dir("llama")
    args = ("--model", str(folder), "--max-context", "256", "--threads", "2")
    with kvlm_serve(*args) as (port, _):
        name = json.loads(get(port, "/v1/models")[1])["data"][0]["id"]
        served = _evaluate(
            "local-completions",
            f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={folder},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
            "max_retries=1",
            monkeypatch,
        )
    reference = _evaluate("hf", f"pretrained={folder},dtype=float32", monkeypatch)
    ours, theirs = _loglikelihoods(served), _loglikelihoods(reference)
    assert len(ours) == 8 and [len(c) for c in ours] == [len(c) for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3, (a, b)
    acc = served["results"]["kvlm_mc"]["acc,none"]
    assert acc == reference["results"]["kvlm_mc"]["acc,none"]
    assert os.path.exists(TASK_DIR / "kvlm_mc.jsonl")
