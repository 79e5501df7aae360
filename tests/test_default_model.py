"""The real embedded model (SmolLM2-135M, Q4_1 GGUF) against transformers, and the cache
modes against each other."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_greedy_agreement, hf_forced
from kvlm import SamplingParams
from kvlm.engine.batch import Stream
from kvlm.errors import CacheOverflowError

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache does in a language model.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)


def run(llm, ids, params=GREEDY, kv="contiguous"):
    llm.cache = llm.new_cache(kv)
    return llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]


@pytest.fixture(scope="module")
def greedy_answer(default_llm):
    """prompt -> kvlm's GREEDY answer on a contiguous cache (run's default), each once: the
    transformers test's and the bf16 test's fp32 side."""
    made = {}

    def get(prompt: str):
        if prompt not in made:
            made[prompt] = run(default_llm, default_llm.encode(prompt, chat=True))
        return made[prompt]

    return get


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_32_greedy_tokens_match_transformers(default_llm, hf_default, greedy_answer, prompt):
    """kvlm's 32 greedy tokens against transformers' by the top-5 rule; transformers'
    argmax and logits at each step from one forward over them (hf_forced: what its own
    greedy decoding gives up to the first step where the two part, all the rule reads)."""
    ids = default_llm.encode(prompt, chat=True)
    out = greedy_answer(prompt)
    ref_ids, ref_logits = hf_forced(hf_default, ids, out.token_ids)
    assert_greedy_agreement(
        out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids, ref_logits
    )


def test_first_answer_is_right(default_llm):
    ids = default_llm.encode(CHAT_PROMPTS[0], chat=True)
    out = run(default_llm, ids, SamplingParams(temperature=0, max_tokens=32))
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"  # ended on <|im_end|>, which the text does not show
    assert out.token_ids[-1] in default_llm.tokenizer.eos_token_ids


# basic and contiguous against the no-cache path (its greedy decoding and one forward's
# argmax), on this model's exact fp32 road: test_cache_family.py's
# test_exact_modes_match_off_over_32_greedy_tokens[basic] and [contiguous] (with paged and
# window), which this file's copy of the check repeated on another prompt.


@pytest.mark.parametrize("kv", ["contiguous", "basic"])
def test_rollback_then_regenerate_is_identical(default_llm, kv):
    """Rolled back by 1, 5 and 20 tokens in turn, the cache regenerates what it held. Each
    regeneration leaves it holding prompt + first[:-1] again, the state the next rollback
    starts from, so one 32-token answer serves the three (a cell each once)."""
    ids = default_llm.encode(CHAT_PROMPTS[2], chat=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first = run(default_llm, ids, params, kv).token_ids
    cache = default_llm.cache  # holds prompt + first[:-1]
    for back in (1, 5, 20):
        assert cache.num_tokens == len(ids) + 31, back
        cache.rollback(back)
        resume = ids + first[: 32 - back]  # the cache holds all but the last of these
        engine = default_llm.cache_engine(cache, reuse=True)  # starts from what it holds
        again = Stream(
            engine, resume, SamplingParams(temperature=0, max_tokens=back, ignore_eos=True)
        ).run()
        assert again.token_ids == first[32 - back :], back
        assert again.metrics.prefill_tokens == 1, back  # the one token past the kept prefix


def test_prompt_longer_than_the_cache_is_refused_and_nothing_is_written(default_llm):
    default_llm.cache = default_llm.new_cache("contiguous")
    run(default_llm, default_llm.encode("hello", chat=True), kv="contiguous")
    cache = default_llm.cache
    before = cache.store.values.clone()
    too_long = default_llm.encode("word " * (default_llm.max_context + 10))
    with pytest.raises(CacheOverflowError, match=f"at most {default_llm.max_context}"):
        default_llm.stream(too_long, GREEDY).run()
    assert torch.equal(cache.store.values, before)
    ok = default_llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=4)
    )
    assert len(ok[0].token_ids) == 4  # and the engine carries on


def test_generation_stops_when_the_context_is_full(default_llm):
    """max_tokens past the cache's end: the request ends with 'length', no error."""
    from kvlm import LLM

    small = LLM(max_context=40, progress=False)
    ids = small.encode("Tell me a long story.", chat=True)
    out = small.stream(ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)).run()
    assert out.finish_reason == "length"
    assert len(ids) + len(out.token_ids) == 41  # 40 in the cache + the last sampled token


def test_bf16_cache_agrees_with_fp32(default_llm, greedy_answer):
    from kvlm.cache import CacheSpec, create_cache

    ids = default_llm.encode(CHAT_PROMPTS[0], chat=True)
    fp32 = greedy_answer(CHAT_PROMPTS[0])
    spec = CacheSpec.for_model(default_llm.config, 256, dtype=torch.bfloat16)
    default_llm.cache = create_cache("contiguous", spec)
    bf16 = default_llm.stream(ids, GREEDY).run()
    tops = [list(lp.top) for lp in fp32.logprobs]
    ref_logits = torch.full((32, default_llm.config.vocab_size), -1e9)
    for i, lp in enumerate(bf16.logprobs):
        for tok, val in lp.top.items():
            ref_logits[i, tok] = val
    assert_greedy_agreement(fp32.token_ids, tops, bf16.token_ids, ref_logits)
    assert default_llm.cache.nbytes == spec.bytes_per_token * 256


def test_metrics_are_recorded(default_llm):
    out = run(default_llm, default_llm.encode("Hi", chat=True))
    m = out.metrics
    assert len(m.per_forward_ms) == len(out.token_ids) == 32
    assert m.ttft_ms > 0 and m.decode_tokens_per_s > 0 and m.total_ms >= m.ttft_ms
    assert m.prefill_tokens == m.prompt_tokens == len(out.prompt_token_ids)


def test_chat_session_reuses_its_cache(default_llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    session = default_llm.chat_session(params)
    first = session.send("What is the capital of France?").run()
    second_turn = session.send("And of Germany?")
    second = second_turn.run()
    m = second.metrics
    assert m.prompt_tokens - m.prefill_tokens >= len(first.prompt_token_ids)  # turn 1 reused
    assert m.prefill_tokens < 20
    # The same conversation from scratch gives the same reply.
    history = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And of Germany?"},
    ]
    fresh = default_llm.chat(history, params)
    assert second.token_ids == fresh.token_ids
    assert second.prompt_token_ids == fresh.prompt_token_ids


def test_chat_session_survives_other_requests(default_llm):
    """A generate() between two turns must not leak into the session's cache."""
    params = SamplingParams(temperature=0, max_tokens=12)
    session = default_llm.chat_session(params)
    first = session.send("What is the capital of France?").run()
    default_llm.generate(["Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"], params)
    second = session.send("And of Germany?").run()
    history = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And of Germany?"},
    ]
    assert second.token_ids == default_llm.chat(history, params).token_ids
