"""Prompt scoring beside other requests: a scored prompt (prompt_logprobs, echo with
logprobs) prefills in chunks no bigger than any prompt's, a request that arrives meanwhile
is admitted and decodes at once (not after the scored prompt's last chunk), and through a
real `kvlm serve` a neighbour stream keeps its tokens and its pace while /health answers."""

from __future__ import annotations

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.scheduler import SchedulerConfig
from numerics import assert_as_exact_as
from test_prompt_logprobs import _teacher_forced

CHUNK = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=256)


@pytest.fixture(scope="module")
def exact(tiny_model_dir):
    return LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, dtype="fp64")


def _engine(llm: LLM) -> Engine:
    return Engine(llm, EngineConfig(num_blocks=64,
                                    scheduler=SchedulerConfig(prefill_chunk=CHUNK)))  # fmt: skip


def _alone(llm: LLM, ids: list[int], params: SamplingParams) -> list[int]:
    engine = _engine(llm)
    engine.add_request("alone", ids, params)
    tokens = []
    while engine.has_work():
        tokens += [t for e in engine.step() for t in e.token_ids]
    return tokens


def test_a_request_arriving_while_a_prompt_is_scored_decodes_beside_it(tiny, exact):
    """Every step feeds at most one chunk of prompt tokens; the neighbour, added after the
    scored prompt's first chunk, has its first token within two steps and one more at
    every step after while the scored prompt still prefills; both get their own results."""
    scored_ids = tiny.tokenizer.encode("Once upon a time there was a long prompt. " * 16)[:200]
    near_ids = tiny.tokenizer.encode("Water boils at")
    near = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = _engine(tiny)
    engine.add_request("scored", scored_ids, SamplingParams(temperature=0, max_tokens=1,
                                                            prompt_logprobs=5))  # fmt: skip
    engine.step()
    engine.add_request("near", near_ids, near)
    near_steps, tokens, entries, scored_done = [], [], None, None
    for step in range(1, 100):
        if not engine.has_work():
            break
        events = engine.step()
        fed = sum(n for _, n in engine.last_batch.prefill)
        assert fed <= CHUNK, f"step {step} fed {fed} prompt tokens, more than one chunk"
        for e in events:
            if e.request_id == "near" and e.token_ids:
                near_steps.append(step)
                tokens += e.token_ids
            if e.request_id == "scored" and e.prompt_logprobs is not None:
                entries, scored_done = e.prompt_logprobs, step
    assert scored_done is not None and near_steps, (scored_done, near_steps)
    assert near_steps[0] <= 2, f"the neighbour's first token came at step {near_steps[0]}"
    assert near_steps == list(range(near_steps[0], near_steps[0] + 6))  # a token every step
    assert near_steps[-1] < scored_done  # all while the scored prompt prefilled
    assert tokens == _alone(tiny, near_ids, near)
    got = torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float32)
    ref = _teacher_forced(tiny, scored_ids).float()
    assert_as_exact_as(got, ref, _teacher_forced(exact, scored_ids))
