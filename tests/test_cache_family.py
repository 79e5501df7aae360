"""The cache modes on the real default model: interchangeable where they claim to be."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_greedy, forward_in_chunks
from kvlm import LLM, SamplingParams
from kvlm.cache import CacheFileError
from kvlm.cache.base import blocks_for
from kvlm.engine.batch import Stream
from kvlm.engine.verify import verify_mode
from kvlm.llm import CacheOptions
from numerics import assert_as_exact_as, fp64_reorder_bound, max_error

pytestmark = pytest.mark.slow

PROMPT = "Tell me a short story about a lighthouse keeper and a storm."
# 32 greedy tokens after the chat prompt's 43: the 31 fed back fill positions 43-73, across
# the paged cache's block edges at 48 and 64 (a block allocated mid-decode, twice). Nothing
# else on these modes' exact road changes with the length below the window (no eviction
# under 260 tokens, no key-count edge in the torch step's decode attention).
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


OPTIONS = CacheOptions(window=256, sinks=4)


@pytest.fixture(scope="module")
def llm():
    # window 256 + 4 sinks > any prompt + answer here: the window evicts nothing, so it is exact
    return LLM(progress=False, max_context=512, cache_options=OPTIONS, exact=True)


@pytest.fixture(scope="module")
def llm64():
    """The same model in fp64: the exact result, to which fp32 paths are held."""
    return LLM(progress=False, max_context=512, cache_options=OPTIONS, dtype="fp64")


def greedy(llm: LLM, ids: list[int], mode: str, params=GREEDY_32, chunk=None) -> list[int]:
    return run(llm, llm.new_cache(mode), ids, params, chunk).token_ids


def run(llm: LLM, cache, ids, params, chunk=None):
    """One request on `cache`, through the engine's one loop (the cache as its backend)."""
    return Stream(llm.cache_engine(cache, prefill_chunk=chunk), ids, params).run()


@pytest.fixture(scope="module")
def oracle(llm):
    """The no-cache path decoding greedily, token by token: its first 16 tokens (each step
    recomputes the whole sequence: 128 of them cost ~50 s on a 2-core CPU)."""
    ids = llm.encode(PROMPT, chat=True)
    return ids, greedy(
        llm, ids, "off", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )


@pytest.mark.parametrize("mode", ["basic", "contiguous", "paged", "window"])
def test_exact_modes_match_off_over_32_greedy_tokens(llm, oracle, mode):
    """A cache mode's 32 greedy tokens are the no-cache path's: the first 16 as it decodes
    them, and every one of the 32 the no-cache forward's argmax over the same prefix (one
    forward of the whole sequence: causal, so row i sees what decoding up to i would)."""
    ids, first = oracle
    got = greedy(llm, ids, mode)
    assert len(got) == 32 and got[:16] == first
    logits = llm.runner.logits(ids + got[:-1], llm.new_cache("off"))[len(ids) - 1 :]
    assert logits.argmax(-1).tolist() == got


@pytest.fixture(scope="module")
def one_shot(llm, llm64):
    """ids -> the last logits of one paged forward over them, (fp64, fp32); each once."""
    made: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(ids) not in made:
            made[tuple(ids)] = tuple(
                forward_in_chunks(m, ids, "paged", len(ids)) for m in (llm64, llm)
            )
        return made[tuple(ids)]

    return get


@pytest.mark.parametrize(
    ("mode", "chunk"),
    [("contiguous", 1), ("contiguous", 16), ("paged", 7), ("basic", 16), ("window", 7),
     ("int8", 7)],
)  # fmt: skip
def test_chunked_prefill_equals_one_shot(llm, llm64, one_shot, mode, chunk):
    """The same positions, masks and slots whatever the chunking. In fp64 a chunked prefill
    is one-shot's result up to fp64 rounding (an int8 cache included: its codes come from
    values equal to ~1e-16, so they round alike). In fp32 the summation order differs
    between a 16-row and a 200-row product, and an int8 code whose value sits on a rounding
    boundary may take the other side: that is why int8 is held to exactness in fp64 and to
    the greedy top-k rule in fp32, and fp32 caches to their own rounding error. Chunks of 7
    and 16 cross several blocks and int8 groups of the 2x prompt; one-token chunks feed the
    1x prompt's first 20 tokens (across the block edge at 16): each is a forward of its
    own, and an fp32 prompt chunk is a call of PROMPT_BLOCK rows however short (~0.3 s a
    token). Then 13 greedy tokens: the first decode step already reads every chunk's slots,
    and the 12 fed back take the 2x prompt's 56 tokens to position 68, across the block
    edge at 64."""
    ids = llm.encode(PROMPT * (1 if chunk == 1 else 2), chat=True)
    ids = ids[:20] if chunk == 1 else ids
    exact, one_shot_32 = one_shot(ids)  # fp64 and fp32 one-shot, paged
    err32 = max_error(one_shot_32, exact)
    # paged's fp64 one-shot is the one `one_shot` made
    a64 = exact if mode == "paged" else forward_in_chunks(llm64, ids, mode, len(ids))
    b64 = forward_in_chunks(llm64, ids, mode, chunk)
    assert max_error(b64, a64) <= fp64_reorder_bound(err32)
    if mode != "int8":
        assert_as_exact_as(forward_in_chunks(llm, ids, mode, chunk), one_shot_32, exact)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=5)
    assert_same_greedy(llm, ids, mode, params, chunk)


def test_fan_out_shares_the_prompt_blocks(llm):
    ids = llm.encode(PROMPT, chat=True)
    cache = llm.new_cache("paged")
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True, n=4)
    out = run(llm, cache, ids, params)
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 20 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # they sampled differently
    bs = cache.spec.block_size
    full_prompt_blocks = len(ids) // bs  # never written after the fork: shared, not copied
    assert all(t[:full_prompt_blocks] == cache.tables[0][:full_prompt_blocks] for t in cache.tables)
    assert all(cache.pool.refs[b] == 4 for b in cache.tables[0][:full_prompt_blocks])
    per_row = blocks_for(len(ids) + 19, bs) - full_prompt_blocks
    assert cache.blocks_used == full_prompt_blocks + 4 * per_row  # vs 4x everything
    again = run(llm, llm.new_cache("paged"), ids, params)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seed


@pytest.mark.parametrize("mode", ["contiguous", "paged", "off"])
def test_greedy_fan_out_repeats_the_single_answer(llm, mode):
    ids = llm.encode("What is the capital of France?", chat=True)
    one = greedy(llm, ids, mode, SamplingParams(temperature=0, max_tokens=12))
    params = SamplingParams(temperature=0, max_tokens=12, n=3)
    out = run(llm, llm.new_cache(mode), ids, params)
    assert [o.token_ids for o in out.outputs] == [one] * 3


@pytest.mark.parametrize("mode", ["contiguous", "paged", "int8", "window"])
def test_cache_file_resumes_a_conversation_exactly(llm, tmp_path, mode):
    """Two turns straight through, against turn 1, save, load into a fresh cache, turn 2:
    the same tokens, in every mode (a file restores int8 bit for bit too). 8 tokens a turn:
    turn 2's first step already reads every restored slot."""
    params = SamplingParams(temperature=0, max_tokens=8)
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


def test_int8_agrees_with_fp32(llm, llm64, one_shot):
    """int8 K/V hold greedy decoding to the top-5 rule against the oracle at every step;
    the same blocks with fp32 values are the oracle up to rounding: in fp64, to fp64's."""
    ids = llm.encode(PROMPT, chat=True)
    result = verify_mode(llm, ids, "int8", 32)
    assert result.steps == 32
    assert result.worst_rank < 5
    exact_one_shot, one_shot_32 = one_shot(ids)
    err32 = max_error(one_shot_32, exact_one_shot)
    exact = verify_mode(llm64, ids, "paged", 32)  # same blocks, fp64 values
    assert exact.agreement == 1.0 and exact.max_logit_drift <= fp64_reorder_bound(err32)
    # as many tokens (43 + 31) in an fp32 paged cache: which tokens does not change its bytes
    fp32 = llm.new_cache("paged")
    llm.runner.forward((ids * 2)[: exact.prompt_tokens + exact.steps - 1], fp32)
    assert fp32.num_tokens == result.prompt_tokens + result.steps - 1
    assert fp32.nbytes == exact.kv_bytes // 2
    head_dim = llm.config.head_dim
    assert result.kv_bytes * 4 * head_dim == fp32.nbytes * (head_dim + 4)  # 0.266x
