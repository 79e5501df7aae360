"""Prompt logprobs (vLLM's prompt_logprobs; echo with logprobs on /v1/completions): every
prompt token's log-probability under the model, computed in the prefill itself (chunked
or not, no second pass), equal to the teacher-forced forward's; a request asking for them
computes its whole prompt (no prefix-cache hit), and the others keep the cache."""

from __future__ import annotations

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.scheduler import SchedulerConfig
from numerics import SAME_ROUNDING, assert_as_exact_as


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    firsts: dict[str, list] = {}
    for _ in range(1000):
        if not engine.has_work():
            break
        for event in engine.step():
            if event.prompt_logprobs is not None and event.index == 0:
                firsts[event.request_id] = (event.prompt_logprobs, event.cached_tokens)
    return firsts


def _teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    logits = llm.runner.logits(ids, llm.new_cache("off"))
    return torch.log_softmax(logits.double(), -1)[:-1].gather(
        -1, torch.tensor(ids[1:])[:, None])[:, 0]  # fmt: skip


@pytest.mark.parametrize("chunk", [256, 7])
def test_prompt_logprobs_are_the_teacher_forced_forwards(tiny, exact, chunk):
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then " * 3)
    engine = Engine(tiny, EngineConfig(num_blocks=64,
                                       scheduler=SchedulerConfig(prefill_chunk=chunk)))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    entries, cached = run(engine, {"a": ids}, params)["a"]
    assert len(entries) == len(ids) and entries[0] is None and cached == 0
    got = torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float32)
    assert [e.token_id for e in entries[1:]] == ids[1:]
    ref = _teacher_forced(tiny, ids).float()
    assert_as_exact_as(got, ref, _teacher_forced(exact, ids))
    for e in entries[1:]:  # rank 1 + how many are likelier; the top 3 include it when rank <= 3
        assert len(e.top) == 3 and e.rank >= 1
        assert (e.rank <= 3) == (e.token_id in e.top)
        assert max(e.top.values()) >= e.logprob


def test_a_scored_prompt_skips_the_prefix_cache_and_others_keep_it(tiny):
    ids = tiny.tokenizer.encode("Once upon a time there was a cache. " * 6)
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    plain = SamplingParams(temperature=0, max_tokens=1)
    run(engine, {"warm": ids}, plain)  # fills the prefix cache
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    first = run(engine, {"s1": ids}, scored)["s1"]
    second = run(engine, {"s2": ids}, scored)["s2"]
    assert first[1] == second[1] == 0  # nothing reused: every row's logits computed
    assert [e and e.logprob for e in first[0]] == [e and e.logprob for e in second[0]]
    engine.add_request("p", ids, plain)
    cached = [e.cached_tokens for _ in range(50) if engine.has_work() for e in engine.step()]
    assert max(cached) > 0  # a plain request still hits


def test_n_samples_each_carry_the_prompts_logprobs(tiny):
    ids = tiny.tokenizer.encode("Water boils at")
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    engine.add_request("r", ids, SamplingParams(temperature=0.8, seed=1, max_tokens=2, n=3,
                                                prompt_logprobs=1))  # fmt: skip
    seen = {}
    while engine.has_work():
        for event in engine.step():
            if event.prompt_logprobs is not None:
                seen[event.index] = [e and e.logprob for e in event.prompt_logprobs]
    assert sorted(seen) == [0, 1, 2] and seen[0] == seen[1] == seen[2]


def test_ranks_and_alternatives_are_the_reference_forwards(tiny, exact):
    """Each scored position's rank and top 5 (token ids and log-probabilities) against the
    no-cache forward's whole distribution in fp64, to within fp32's own rounding on this
    CPU (SAME_ROUNDING times the fp32 reference's largest error): a token clearly ahead of
    the target counts in its rank, one clearly behind does not; the top 5 hold every token
    clearly in the top 5 and none clearly out, most likely first."""
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then " * 3)
    engine = Engine(tiny, EngineConfig(num_blocks=64,
                                       scheduler=SchedulerConfig(prefill_chunk=7)))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    entries = run(engine, {"a": ids}, params)["a"][0]

    def logprobs(llm: LLM) -> torch.Tensor:
        return torch.log_softmax(llm.runner.logits(ids, llm.new_cache("off")).double(), -1)

    ex = logprobs(exact)[:-1]  # (T - 1, V): row i predicts ids[i + 1]
    tol = SAME_ROUNDING * float((logprobs(tiny)[:-1] - ex).abs().max())
    for i, e in enumerate(entries[1:]):
        row, target = ex[i], ids[i + 1]
        chosen = float(row[target])
        assert abs(e.logprob - chosen) <= tol
        assert 1 + int((row > chosen + tol).sum()) <= e.rank <= 1 + int((row > chosen - tol).sum())
        kth = float(row.topk(5).values[-1])
        assert set((row > kth + tol).nonzero()[:, 0].tolist()) <= set(e.top)
        assert all(float(row[t]) >= kth - tol and abs(v - float(row[t])) <= tol
                   for t, v in e.top.items())  # fmt: skip
        assert list(e.top.values()) == sorted(e.top.values(), reverse=True)


def test_llm_generate_hands_out_the_prompts_logprobs(tiny):
    """LLM.generate carries prompt_logprobs in its RequestOutput: one prompt (the LLM's own
    cache) and the same prompt batched beside another (the pool) score it alike, bit for
    bit, and as a bare engine's step events do."""
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    ref = run(Engine(tiny, EngineConfig(num_blocks=64)), {"a": ids}, params)["a"][0]
    alone = tiny.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    both = tiny.generate(prompt_token_ids=[ids, ids[:5]], sampling_params=params)

    def seen(entries):
        return [e and (e.token_id, e.logprob, e.rank, e.top) for e in entries]

    assert len(ref) == len(ids) and ref[0] is None
    assert seen(alone.prompt_logprobs) == seen(both[0].prompt_logprobs) == seen(ref)
    assert len(both[1].prompt_logprobs) == 5
    assert alone.to_dict()["prompt_logprobs"][1]["token_id"] == ids[1]
