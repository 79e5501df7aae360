"""The cache modes on the real default model: interchangeable where they claim to be."""

from __future__ import annotations

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.cache import CacheFileError
from kvlm.cache.base import blocks_for
from kvlm.engine.generate import Generation
from kvlm.engine.verify import verify_mode
from kvlm.llm import CacheOptions

pytestmark = pytest.mark.slow

PROMPT = "Tell me a short story about a lighthouse keeper and a storm."
GREEDY_128 = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # window 256 + 4 sinks > prompt + 128 tokens: the window evicts nothing, so it is exact
    return LLM(progress=False, max_context=512, cache_options=CacheOptions(window=256, sinks=4))


def greedy(llm: LLM, ids: list[int], mode: str, params=GREEDY_128, chunk=None) -> list[int]:
    cache = llm.new_cache(mode)
    gen = Generation(llm.runner, llm.tokenizer, cache, ids, params, prefill_chunk=chunk)
    return gen.run().token_ids


@pytest.fixture(scope="module")
def oracle(llm):
    ids = llm.encode(PROMPT, chat=True)
    return ids, greedy(llm, ids, "off")


@pytest.mark.parametrize("mode", ["basic", "contiguous", "paged", "window"])
def test_exact_modes_match_off_over_128_greedy_tokens(llm, oracle, mode):
    ids, want = oracle
    assert len(want) == 128
    assert greedy(llm, ids, mode) == want


@pytest.mark.parametrize(
    ("mode", "chunk"),
    [("contiguous", 1), ("contiguous", 16), ("paged", 7), ("basic", 16), ("window", 7),
     ("int8", 16)],
)  # fmt: skip
def test_chunked_prefill_equals_one_shot(llm, mode, chunk):
    ids = llm.encode(PROMPT * 3, chat=True)
    one_shot, chunked = llm.new_cache(mode), llm.new_cache(mode)
    a = llm.runner.forward(ids, one_shot)
    for start in range(0, len(ids), chunk):
        b = llm.runner.forward(ids[start : start + chunk], chunked)
    assert chunked.num_tokens == one_shot.num_tokens == len(ids)
    # fp32 K/V of a 16-row and a whole-prompt matmul differ in their last bits; for int8
    # that can flip one rounding step, so its tolerance is a quantization step, not 1e-4.
    torch.testing.assert_close(b, a, atol=1e-3 if mode == "int8" else 1e-4, rtol=0)
    assert torch.argmax(a) == torch.argmax(b)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert greedy(llm, ids, mode, params, chunk=chunk) == greedy(llm, ids, mode, params)


def test_fan_out_shares_the_prompt_blocks(llm):
    ids = llm.encode(PROMPT, chat=True)
    cache = llm.new_cache("paged")
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True, n=4)
    out = Generation(llm.runner, llm.tokenizer, cache, ids, params).run()
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 20 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # they sampled differently
    bs = cache.spec.block_size
    full_prompt_blocks = len(ids) // bs  # never written after the fork: shared, not copied
    assert all(t[:full_prompt_blocks] == cache.tables[0][:full_prompt_blocks] for t in cache.tables)
    assert all(cache.pool.refs[b] == 4 for b in cache.tables[0][:full_prompt_blocks])
    per_row = blocks_for(len(ids) + 19, bs) - full_prompt_blocks
    assert cache.blocks_used == full_prompt_blocks + 4 * per_row  # vs 4x everything
    again = Generation(llm.runner, llm.tokenizer, llm.new_cache("paged"), ids, params).run()
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seed


@pytest.mark.parametrize("mode", ["contiguous", "paged", "off"])
def test_greedy_fan_out_repeats_the_single_answer(llm, mode):
    ids = llm.encode("What is the capital of France?", chat=True)
    one = greedy(llm, ids, mode, SamplingParams(temperature=0, max_tokens=12))
    params = SamplingParams(temperature=0, max_tokens=12, n=3)
    out = Generation(llm.runner, llm.tokenizer, llm.new_cache(mode), ids, params).run()
    assert [o.token_ids for o in out.outputs] == [one] * 3


@pytest.mark.parametrize("mode", ["contiguous", "paged", "int8", "window"])
def test_cache_file_resumes_a_conversation_exactly(llm, tmp_path, mode):
    """Two turns straight through, against turn 1, save, load into a fresh cache, turn 2:
    the same tokens, in every mode (a file restores int8 bit for bit too)."""
    params = SamplingParams(temperature=0, max_tokens=16)
    llm.kv_mode = mode
    try:
        straight = llm.chat_session(params)
        first = straight.send("Name a colour.").run()
        want = straight.send("And another one?").run()
        session = llm.chat_session(params)
        assert session.send("Name a colour.").run().token_ids == first.token_ids
        session.save(tmp_path / "conv.kv", llm.fingerprint)
        resumed = llm.chat_session(params)  # a fresh, empty cache
        resumed.load(tmp_path / "conv.kv", llm.fingerprint)
        got = resumed.send("And another one?").run()
    finally:
        llm.kv_mode = "contiguous"
    assert got.token_ids == want.token_ids
    assert got.metrics.prefill_tokens < 20  # only the new turn was computed
    assert got.metrics.prompt_tokens == want.metrics.prompt_tokens


def test_cache_file_from_another_model_is_refused(llm, tmp_path, tiny_model_dir):
    session = llm.chat_session(SamplingParams(temperature=0, max_tokens=4))
    session.send("Hi").run()
    session.save(tmp_path / "c.kv", llm.fingerprint)
    with pytest.raises(CacheFileError, match="another model"):
        session.load(tmp_path / "c.kv", "0123456789abcdef")
    text_session = llm.chat_session(SamplingParams(), use_template=False)
    with pytest.raises(CacheFileError, match="same --chat/--no-chat"):
        text_session.load(tmp_path / "c.kv", llm.fingerprint)
    other = LLM(model=tiny_model_dir("llama"), progress=False)
    assert other.fingerprint != llm.fingerprint


def test_int8_agrees_with_fp32(llm):
    ids = llm.encode(PROMPT, chat=True)
    result = verify_mode(llm, ids, "int8", 64)
    assert result.steps == 64
    assert result.agreement >= 0.99
    fp32 = verify_mode(llm, ids, "paged", 64)  # same blocks, fp32 values
    assert fp32.agreement == 1.0 and fp32.max_logit_drift < 1e-3
    head_dim = llm.config.head_dim
    assert result.kv_bytes / fp32.kv_bytes == pytest.approx((head_dim + 4) / (4 * head_dim))
