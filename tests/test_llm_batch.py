"""LLM.generate with many prompts: batched through the engine, each prompt's result the
same bits as when it is generated alone, in prompt order."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import break_sampler, fail_schedule_at
from kvlm import LLM, SamplingParams
from kvlm.errors import CacheOverflowError, InvalidRequestError

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a kingdom by the sea, there lived",
    "def fibonacci(n):",
    "List three colours:",
    "The quick brown fox jumps over the lazy dog and runs into the forest where",
    "Water",
]


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampling, n > 1, stop strings, different max_tokens."""
    return [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, n=3),
        SamplingParams(temperature=0, max_tokens=20, n=2, logprobs=0),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5, max_tokens=25),
        SamplingParams(temperature=0, max_tokens=40, stop=["e"], ignore_eos=True),
    ]


def penalized_params() -> list[SamplingParams]:
    """mixed_params() with a penalty, logit_bias, min_p or a JSON guide on each."""
    from kvlm.engine.guided import Guide

    extra = [{"frequency_penalty": 1.0}, {"presence_penalty": 1.5, "min_p": 0.05},
             {"repetition_penalty": 1.3}, {"logit_bias": {28: 4.0}},
             {"guide": Guide("json_schema", {"type": "object", "properties": {
                 "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False})},
             {"min_p": 0.2}]  # fmt: skip
    return [replace(p, **e) for p, e in zip(mixed_params(), extra, strict=True)]


def assert_batched_as_alone(llm: LLM, params: list[SamplingParams], prompts=PROMPTS) -> list:
    """The prompts generated together give each its tokens (and all it reports) alone;
    returns the outputs generated together."""
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, q)[0] for p, q in zip(prompts, params, strict=True)]
    assert [result(o) for o in together] == [result(o) for o in alone]
    return together


def result(out) -> list:
    """Everything a RequestOutput reports but timings: ids, text, reasons, logprobs."""
    return [
        (o.index, o.token_ids, o.text, o.finish_reason,
         None if o.logprobs is None else [lp.to_dict() for lp in o.logprobs])
        for o in out.outputs
    ]  # fmt: skip


def test_a_batch_gives_every_prompt_its_tokens_alone(tiny):
    params = mixed_params()
    alone = [tiny.generate(p, q)[0] for p, q in zip(PROMPTS, params, strict=True)]
    engine = tiny.batch_engine()
    steps = engine.stats.steps
    together = tiny.generate(PROMPTS, params)
    assert [o.prompt for o in together] == PROMPTS
    assert [result(o) for o in together] == [result(o) for o in alone]  # bit for bit
    assert [o.prompt_token_ids for o in together] == [o.prompt_token_ids for o in alone]
    fan = together[2].outputs
    assert len(fan) == 3 and len({tuple(o.token_ids) for o in fan}) > 1
    # the engine ran them: batched decode steps of many rows, fewer steps than tokens
    assert engine.stats.steps > steps and engine.stats.max_decode_rows >= 6
    assert engine.stats.requests_finished >= len(PROMPTS) and engine.pool.num_used == 0
    m = together[1].metrics
    assert m.prompt_tokens == len(together[1].prompt_token_ids) == m.prefill_tokens
    assert m.ttft_ms > 0 and m.total_ms >= m.ttft_ms and m.per_forward_ms
    assert tiny.batch_engine() is engine  # made once, reused


def test_one_sampling_params_for_all_and_prompt_token_ids(tiny):
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=16, ignore_eos=True)
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    alone = [tiny.generate(prompt_token_ids=[i], sampling_params=params)[0] for i in ids]
    together = tiny.generate(prompt_token_ids=ids, sampling_params=params)
    assert [result(o) for o in together] == [result(o) for o in alone]
    assert [o.prompt for o in together] == [None] * len(PROMPTS)
    assert [o.prompt_token_ids for o in together] == ids
    by_text = tiny.generate(PROMPTS, params)
    assert [result(o) for o in by_text] == [result(o) for o in alone]


def test_many_more_prompts_than_the_engine_holds(tiny):
    """The queue is fed as it drains; every prompt comes back in its place."""
    prompts = [f"{p} {i}" for i in range(7) for p in PROMPTS[:4]]  # 28 > 16 seats
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = tiny.generate(prompts, params)
    assert [o.prompt for o in together] == prompts
    assert [o.token_ids for o in together] == [tiny.generate(p, params)[0].token_ids
                                               for p in prompts]  # fmt: skip


def test_a_list_of_params_must_match_the_prompts(tiny):
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        tiny.generate(PROMPTS[:3], [SamplingParams(), SamplingParams()])
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        tiny.generate(PROMPTS[:2], [SamplingParams(), {"max_tokens": 3}])


def test_prompts_of_the_wrong_type_are_one_clear_error(tiny):
    """A user's token ids passed as prompts, a flat list of ids, a float or bool id: an
    InvalidRequestError naming what was meant (they were a TypeError from deep in the
    tokenizer, or a list() of an int); ids that are ints in other clothes still run."""
    cases = [
        ({"prompts": [[1, 2]]}, "prompts are a string or a list of strings"),
        ({"prompts": [b"hi"]}, "prompts are a string or a list of strings"),
        ({"prompts": 5}, "not int 5"),
        ({"prompt_token_ids": [5, 6]}, "a list of lists of ints, not int 5"),
        ({"prompt_token_ids": "ab"}, "a list of lists of ints, not str"),
        ({"prompt_token_ids": [[1.5]]}, "1.5 is a float"),
        ({"prompt_token_ids": [[True, 3]]}, "True is a bool"),
    ]
    for kw, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            tiny.generate(**kw)
    ids = tiny.tokenizer.encode(PROMPTS[0])
    greedy = SamplingParams(temperature=0, max_tokens=5)
    want = tiny.generate(prompt_token_ids=[ids], sampling_params=greedy)[0].outputs[0].token_ids
    for same in (tuple(ids), torch.tensor(ids), np.array(ids)):
        out = tiny.generate(prompt_token_ids=[same], sampling_params=greedy)[0].outputs[0]
        assert out.token_ids == want


def test_bad_prompts_are_refused_before_any_work(tiny):
    """The same errors as alone, raised before any prompt runs."""
    engine = tiny.batch_engine()
    steps, added = engine.stats.steps, engine.stats.requests_added
    good = tiny.tokenizer.encode(PROMPTS[0])
    cases = [
        ([good, []], InvalidRequestError, "empty"),
        ([good, [10**6]], InvalidRequestError, "vocabulary"),
        ([good, [5] * 300], CacheOverflowError, "300 tokens but the cache holds at most 256"),
    ]
    for batch, error, message in cases:
        with pytest.raises(error, match=message):
            tiny.generate(prompt_token_ids=batch)
        with pytest.raises(error, match=message):
            tiny.generate(prompt_token_ids=batch[1:])  # alone: the same error
    assert engine.stats.steps == steps and engine.stats.requests_added == added
    assert not engine.has_work()


def test_what_the_engine_cannot_take_runs_alone(tiny):
    """A prompt of the whole context (the engine wants room for a token) and n beyond the
    engine's seats run on the LLM's own cache, in their place among the others."""
    full = [5] * 256
    wide = SamplingParams(temperature=0.9, seed=2, max_tokens=4, n=17)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = [tiny.tokenizer.encode(PROMPTS[0]), full, tiny.tokenizer.encode(PROMPTS[1])]
    params = [greedy, greedy, wide]
    together = tiny.generate(prompt_token_ids=ids, sampling_params=params)
    alone = [tiny.generate(prompt_token_ids=[i], sampling_params=p)[0]
             for i, p in zip(ids, params, strict=True)]  # fmt: skip
    assert [result(o) for o in together] == [result(o) for o in alone]
    assert len(together[1].token_ids) == 1 and together[1].finish_reason == "length"
    assert len(together[2].outputs) == 17


def test_a_failing_request_ends_alone_with_error(tiny, monkeypatch, caplog):

    good = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [tiny.generate(p, good)[0] for p in PROMPTS[:3]]
    break_sampler(monkeypatch)
    bad = SamplingParams(max_tokens=8, top_k=13, n=2)
    out = tiny.generate([*PROMPTS[:3], "poison"], [good, good, good, bad])
    assert [result(o) for o in out[:3]] == [result(o) for o in alone]
    assert [o.finish_reason for o in out[3].outputs] == ["error", "error"]
    assert "failed" in caplog.text and tiny.batch_engine().pool.num_used == 0


def test_an_engine_failure_leaves_the_engine_empty(tiny, monkeypatch):
    engine = tiny.batch_engine()
    real = engine.scheduler.schedule
    fail_schedule_at(engine, monkeypatch, call=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="simulated"):
        tiny.generate(PROMPTS, params)
    assert not engine.has_work() and not engine.requests and engine.pool.num_used == 0
    monkeypatch.setattr(engine.scheduler, "schedule", real)
    out = tiny.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in out] == [tiny.generate(p, params)[0].token_ids
                                          for p in PROMPTS[:2]]  # fmt: skip


def test_a_small_pool_runs_fewer_at_once_and_preempts_none(tiny_model_dir):
    """17 blocks of 16: one full context. Requests wait for room for all their tokens
    rather than being admitted and then preempted (recomputed)."""
    from kvlm.llm import CacheOptions

    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256,
              cache_options=CacheOptions(num_blocks=17))  # fmt: skip
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=90, ignore_eos=True, n=2)
    together = llm.generate(PROMPTS[:4], params)
    engine = llm.batch_engine()
    assert engine.pool.num_blocks == 17 and engine.scheduler.preemptions == 0
    assert engine.stats.max_decode_rows == 2  # one request of two samples at a time
    alone = [llm.generate(p, params)[0] for p in PROMPTS[:4]]
    assert [result(o) for o in together] == [result(o) for o in alone]


@pytest.mark.parametrize("show", [True, False, None])
def test_the_progress_bar_goes_to_stderr_when_asked(tiny, capsys, show):
    params = SamplingParams(temperature=0, max_tokens=3)
    for prompts in (PROMPTS[:3], PROMPTS[0]):  # batched, and alone
        tiny.generate(prompts, params, use_tqdm=show)
        out, err = capsys.readouterr()
        assert out == ""
        if show:  # None: the LLM's `progress`, False here
            assert "Processed prompts" in err and "100%" in err
        else:
            assert err == ""


@pytest.mark.parametrize(
    "kv, options",
    [("window", {"window": 16, "sinks": 2}), ("basic", {}), ("off", {})],
)
def test_window_basic_and_off_caches_run_prompts_one_after_another(tiny_model_dir, kv, options):
    from kvlm.llm import CacheOptions

    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, kv=kv,
              cache_options=CacheOptions(**options))  # fmt: skip
    assert_batched_as_alone(llm, mixed_params()[:4], PROMPTS[:4])
    assert llm._engine is None  # no pool: these caches keep state the engine cannot


@pytest.mark.parametrize("kv, kv_dtype", [("paged", None), ("int8", None), ("contiguous", "bf16")])
def test_other_batchable_caches_batch_exactly(tiny_model_dir, kv, kv_dtype):
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, kv=kv,
              kv_dtype=kv_dtype)  # fmt: skip
    assert_batched_as_alone(llm, mixed_params())
    engine = llm.batch_engine()
    assert engine.pool.store.values.dtype == llm.cache_spec().dtype  # int8 for --kv int8
    assert engine.stats.max_decode_rows > 1


def test_a_model_window_and_chunked_prefill_batch_exactly(tiny_model_dir):
    """Mistral's attention window and the LLM's prefill_chunk: the engine feeds each prompt
    in the chunks a single stream uses."""
    llm = LLM(model=tiny_model_dir("mistral-window"), progress=False, max_context=256,
              prefill_chunk=5)  # fmt: skip
    assert_batched_as_alone(llm, mixed_params())
    # penalties, logit_bias, min_p and a JSON guide on the fused step's logits, per row
    assert_batched_as_alone(llm, penalized_params())


@pytest.mark.slow
def test_the_default_model_batches_exactly(default_llm):
    """fp32 weights (oneDNN packed, padded one-row products, attention row by row)."""
    assert_batched_as_alone(default_llm, mixed_params())
    assert default_llm.batch_engine().stats.max_decode_rows >= 6


@pytest.mark.slow
def test_the_fused_step_batches_exactly_on_the_default_model():
    """The default (fast-path) numerics: low-bit weights, bf16 prompt products and int8
    activations where the CPU has them; decode rows through the fused C step, alone and
    batched."""
    llm = LLM(progress=False, max_context=512, kv_dtype="int8")
    if llm.runner.fused_reason is not None:
        pytest.skip(llm.runner.fused_reason)
    assert_batched_as_alone(llm, mixed_params())
    # penalties, logit_bias, min_p and a JSON guide on the fused step's logits, per row
    assert_batched_as_alone(llm, penalized_params())
