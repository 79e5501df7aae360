"""The serving engine: continuous batching gives every request the tokens it would get
alone; prefix reuse, preemption, chunked prefill, fan-out and abort keep that true."""

from __future__ import annotations

import gc

import pytest

from helpers import break_sampler, fail_schedule_at, low_bit_llm
from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.scheduler import SchedulerConfig
from kvlm.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a kingdom by the sea, there lived",
    "def fibonacci(n):",
    "List three colours:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1492, Columbus sailed",
    "My favourite food is",
]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Submit all, step to the end; {request id: {sample index: token ids}}."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    out: dict[str, dict[int, list[int]]] = {rid: {} for rid in requests}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].setdefault(ev.index, []).extend(ev.token_ids)
    assert engine.pool.num_used == 0  # every block back
    return out


@pytest.fixture(scope="module")
def real():
    # Its own LLM: the engine repacks the weights (oneDNN), which other tests should not see.
    return LLM(progress=False, max_context=1024)


def test_batched_requests_match_the_single_stream_engine(tiny):
    reference = {p: tiny.generate(p, GREEDY)[0].token_ids for p in PROMPTS}
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    reqs = {p: (tiny.tokenizer.encode(p), GREEDY) for p in PROMPTS}
    out = run(engine, reqs)
    assert {p: out[p][0] for p in PROMPTS} == reference


@pytest.mark.slow
def test_batch_invariance_on_the_default_model(real):
    """A request's greedy tokens are the same alone or batched with 7 others."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = Engine(real)
    reqs = {p: (real.tokenizer.encode(p), params) for p in PROMPTS}
    alone = {p: run(engine, {p: reqs[p]})[p][0] for p in PROMPTS}
    together = run(engine, reqs)
    assert {p: together[p][0] for p in PROMPTS} == alone


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_the_fused_batch_answers_as_generate_does(kv_dtype):
    """Low-bit weights: the decode batch is one fused C step over the paged pool. Each
    request's greedy tokens are the same alone, batched with 7 others, and through
    LLM.generate (the single-sequence fused step over a contiguous cache)."""
    llm = low_bit_llm(max_context=1024, kv_dtype=kv_dtype)
    if llm.runner.fused_reason is not None:
        pytest.skip(llm.runner.fused_reason)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(llm)
    decoder, calls = llm.runner._decoder(engine.spec.max_tokens), []
    fused_run = decoder.run

    def counted(store, tokens, *args):
        calls.append(len(tokens))
        return fused_run(store, tokens, *args)

    decoder.run = counted
    reqs = {p: (llm.tokenizer.encode(p), params) for p in PROMPTS}
    together = run(engine, reqs)
    assert max(calls) == len(PROMPTS)  # the decode rows went through the fused step at once
    alone = {p: run(engine, {p: reqs[p]})[p][0] for p in PROMPTS}
    assert {p: together[p][0] for p in PROMPTS} == alone
    assert alone == {p: llm.generate(p, params)[0].token_ids for p in PROMPTS}


@pytest.mark.slow
def test_a_shared_system_prompt_is_not_recomputed(real):
    system = "You are a helpful assistant who answers briefly. " * 20
    first = real.tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    )
    second = real.tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a city."}]
    )
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    engine = Engine(real)
    run(engine, {"1": (first, GREEDY)})
    computed = engine.stats.prefill_tokens
    engine.add_request("2", second, GREEDY)
    engine.step()
    hit = engine.manager.stats.hits
    assert hit == (shared // 16) * 16 and hit >= 128
    assert engine.stats.prefill_tokens - computed == len(second) - hit
    while engine.has_work():
        engine.step()
    cold = Engine(real, EngineConfig(prefix_caching=False))
    assert run(cold, {"2": (second, GREEDY)}) == run(engine, {"2": (second, GREEDY)})


def test_preemption_recomputes_and_changes_no_token(tiny):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reqs = {p: (tiny.tokenizer.encode(p), params) for p in PROMPTS[:4]}
    roomy = run(Engine(tiny, EngineConfig(num_blocks=64)), reqs)
    # 17 blocks of 16: one full context (256 tokens) and the reserve, far from 4 x 75.
    tight = Engine(tiny, EngineConfig(num_blocks=17))
    assert run(tight, reqs) == roomy
    assert tight.scheduler.preemptions > 0


def test_one_sequence_at_a_time_gets_a_pool_that_holds_it(tiny):
    """--max-num-seqs 1 with the pool at its default size: one full context and the
    reserve (the cap of max_num_seqs full contexts had left out the reserve, and the
    engine refused to start); a request then answers as on a roomy pool."""
    engine = Engine(tiny, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1)))
    bs = engine.pool.block_size
    assert engine.pool.num_blocks == -(-tiny.max_context // bs) + 1
    reqs = {PROMPTS[0]: (tiny.tokenizer.encode(PROMPTS[0]), GREEDY)}
    assert run(engine, reqs) == run(Engine(tiny, EngineConfig(num_blocks=64)), reqs)


def test_chunked_prefill_changes_no_token(tiny):
    long_prompt = " ".join(PROMPTS)
    ids = tiny.tokenizer.encode(long_prompt)
    assert len(ids) > 100
    whole = run(Engine(tiny, EngineConfig(num_blocks=64)), {"a": (ids, GREEDY)})
    cfg = EngineConfig(num_blocks=64, scheduler=SchedulerConfig(prefill_chunk=7))
    assert run(Engine(tiny, cfg), {"a": (ids, GREEDY)}) == whole


def test_fan_out_shares_the_prompt_and_greedy_samples_agree(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[1])
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
    engine.add_request("a", ids, params)
    engine.step()  # prefill, fork, three first tokens
    assert len(engine.scheduler.running) == 3
    prompt_blocks = -(-len(ids) // 16)
    assert engine.pool.num_used == prompt_blocks  # shared, not copied
    while engine.has_work():
        engine.step()
    out = run(engine, {"b": (ids, params)})["b"]
    assert out[0] == out[1] == out[2] == tiny.generate(PROMPTS[1], GREEDY)[0].token_ids[:8]


def test_seeded_samples_do_not_depend_on_the_batch(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5, n=2)
    ids = tiny.tokenizer.encode(PROMPTS[0])
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    alone = run(engine, {"a": (ids, params)})["a"]
    others = {p: (tiny.tokenizer.encode(p), GREEDY) for p in PROMPTS[1:]}
    batched = run(engine, {"a": (ids, params), **others})["a"]
    assert alone == batched and alone[0] != alone[1]


def test_abort_frees_blocks_at_once(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    engine.add_request("a", tiny.tokenizer.encode(PROMPTS[1]), GREEDY)
    engine.add_request("b", tiny.tokenizer.encode(PROMPTS[2]), GREEDY)
    engine.step()
    assert engine.pool.num_used > 0
    events = engine.abort("a") + engine.abort("b")
    assert [e.finish_reason for e in events] == ["abort", "abort"]
    assert engine.pool.num_used == 0 and not engine.has_work()
    assert engine.abort("a") == []  # twice is harmless


def test_context_limit_ends_a_sequence_with_length(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    engine.add_request("a", ids, params)
    events = []
    while engine.has_work():
        events += engine.step()
    assert events[-1].finish_reason == "length"
    # every one of the 256 slots holds a computed token; the last sampled one is never fed:
    # 257 in all, as a single stream on the LLM's own cache of 256 ends
    assert len(ids) + sum(len(e.token_ids) for e in events) == 257
    alone = tiny.generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0]
    assert [t for e in events for t in e.token_ids] == alone.token_ids
    assert alone.finish_reason == "length"


def test_bad_requests_are_refused_before_anything_is_held(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.add_request("a", [5] * 256, GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("a", [10**6], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], GREEDY)
    assert not engine.has_work() and not engine.requests
    with pytest.raises(InvalidRequestError, match="cannot hold one sequence"):
        Engine(tiny, EngineConfig(num_blocks=4))


def test_a_failing_step_ends_its_requests_and_the_engine_goes_on(tiny, monkeypatch):
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    engine.add_request("a", tiny.tokenizer.encode(PROMPTS[0]), GREEDY)
    real_forward = engine.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "run", broken)
    events = engine.step()
    assert [e.finish_reason for e in events] == ["error"]
    assert engine.pool.num_used == 0 and engine.stats.errors == 1
    monkeypatch.setattr(engine.runner, "run", real_forward)
    out = run(engine, {"b": (tiny.tokenizer.encode(PROMPTS[0]), GREEDY)})
    assert out["b"][0] == tiny.generate(PROMPTS[0], GREEDY)[0].token_ids


def _poison(engine: Engine, monkeypatch, bad_first_token: int) -> None:
    """Make the forward raise for any batch that holds a row whose prompt starts with
    `bad_first_token` (a stand-in for a request that breaks a kernel)."""
    real_forward = engine.runner.run
    first = {}

    def forward(batch):
        for seq in engine.scheduler.running:
            first[tuple(seq.table.blocks)] = seq.token_ids[0]
        if any(first.get(tuple(t)) == bad_first_token for t in batch.tables):
            raise RuntimeError("simulated kernel failure")
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "run", forward)


def test_a_failing_request_ends_alone_and_the_others_keep_their_tokens(tiny, monkeypatch):
    """The decode batch raises while a bad request is in it: the batch is run again row by
    row, the bad request ends with 'error', every other request gets its own tokens."""
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    reqs = {p: (tiny.tokenizer.encode(p), GREEDY) for p in PROMPTS[:4]}
    alone = {p: run(engine, {p: reqs[p]})[p][0] for p in reqs}
    bad_ids = [7, *tiny.tokenizer.encode("poison")]
    assert bad_ids[0] not in {ids[0] for ids, _ in reqs.values()}
    _poison(engine, monkeypatch, bad_first_token=bad_ids[0])
    for rid, (ids, params) in reqs.items():
        engine.add_request(rid, ids, params)
    engine.add_request("bad", bad_ids, SamplingParams(max_tokens=24, n=3, seed=1))
    out, finishes = {rid: [] for rid in reqs}, {}
    while engine.has_work():
        for ev in engine.step():
            if ev.request_id in out:
                out[ev.request_id] += ev.token_ids
            if ev.finish_reason is not None:
                finishes.setdefault(ev.request_id, []).append((ev.index, ev.finish_reason))
    assert out == alone
    # n = 3 and the prompt never finished: still three finishes, one per sample
    assert sorted(finishes["bad"]) == [(0, "error"), (1, "error"), (2, "error")]
    assert engine.stats.errors == 1 and engine.pool.num_used == 0


def test_a_sampler_that_raises_ends_its_request_only(tiny, monkeypatch):
    engine = Engine(tiny, EngineConfig(num_blocks=64))

    break_sampler(monkeypatch)
    ids = tiny.tokenizer.encode(PROMPTS[0])
    engine.add_request("good", ids, GREEDY)
    engine.add_request("bad", ids, SamplingParams(max_tokens=8, top_k=13, n=2))
    out, finishes = [], {}
    while engine.has_work():
        for ev in engine.step():
            out += ev.token_ids if ev.request_id == "good" else []
            if ev.finish_reason:
                finishes.setdefault(ev.request_id, set()).add((ev.index, ev.finish_reason))
    assert out == tiny.generate(PROMPTS[0], GREEDY)[0].token_ids
    assert finishes == {"good": {(0, "length")}, "bad": {(0, "error"), (1, "error")}}


def test_n_is_counted_at_admission(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4)))
    ids = tiny.tokenizer.encode(PROMPTS[0])
    with pytest.raises(InvalidRequestError, match="max-num-seqs") as e:
        engine.add_request("a", ids, SamplingParams(n=5))
    assert e.value.param == "n"
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, n=3)
    for i in range(3):
        engine.add_request(f"r{i}", ids, params)
    widest = 0
    while engine.has_work():
        engine.step()
        widest = max(widest, len(engine.scheduler.running))
    assert widest == 3  # one request of 3 rows at a time: 9 rows asked for, 4 seats


def test_the_engine_loop_survives_any_exception(tiny, monkeypatch):
    """A scheduler bug (not a request's own failure) ends the requests held; the loop goes
    on and serves the next request."""
    import asyncio

    from kvlm.engine.async_engine import AsyncEngine

    engine = Engine(tiny, EngineConfig(num_blocks=64))
    aeng = AsyncEngine(engine)
    aeng.start()
    fail_schedule_at(engine, monkeypatch, call=2)
    ids = tiny.tokenizer.encode(PROMPTS[0])

    async def one() -> list[tuple[int, str | None]]:
        events = await aeng.generate(ids, SamplingParams(max_tokens=6, temperature=0, n=2))
        return [(ev.index, ev.finish_reason) async for ev in events if ev.finish_reason]

    try:
        first = asyncio.run(asyncio.wait_for(one(), 60))
        second = asyncio.run(asyncio.wait_for(one(), 60))
    finally:
        aeng.stop()
    assert sorted(first) == [(0, "error"), (1, "error")]
    assert sorted(second) == [(0, "length"), (1, "length")]
    assert aeng.alive is False and engine.pool.num_used == 0


def test_an_int8_pool_serves_batches_as_it_serves_one(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, kv_dtype="int8")
    engine = Engine(llm, EngineConfig(num_blocks=64))
    assert engine.pool.store.quantized
    reqs = {p: (llm.tokenizer.encode(p), GREEDY) for p in PROMPTS[:4]}
    alone = {p: run(engine, {p: reqs[p]})[p] for p in reqs}
    assert run(engine, reqs) == alone
    fp32 = run(Engine(LLM(model=tiny_model_dir("llama"), progress=False, max_context=256),
                      EngineConfig(num_blocks=64)), reqs)  # fmt: skip
    agree = [a[0][:8] == fp32[p][0][:8] for p, a in alone.items()]
    assert sum(agree) >= 3  # int8 K/V: the first tokens agree with fp32 on this model


def test_a_step_longer_than_any_before_says_what_it_held(tiny, monkeypatch, caplog):
    """A step that froze every stream longer than any before it is logged with its
    contents (prompt chunks, scored tokens, decode rows), once per new longest step."""
    import kvlm.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SLOW_STEP_S", 0.0)
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    assert engine_module.GC_TIME._callback in gc.callbacks  # watched from an engine's start
    from kvlm.engine.guided import Guide

    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    guided = SamplingParams(temperature=0, max_tokens=2, guide=Guide("regex", "[a-z]+"))
    ids = tiny.tokenizer.encode("The quick brown fox")
    with caplog.at_level("INFO", logger="kvlm.engine"):
        run(engine, {"a": (ids, scored), "b": (ids, GREEDY), "c": (ids, guided)})
    lines = [r.getMessage() for r in caplog.records if "longest engine step" in r.getMessage()]
    assert lines, "the first step is the longest so far"
    # the guided request counts while its prompt is fed, not only once it decodes
    assert f"3 prompt chunks of {3 * len(ids)} tokens ({len(ids)} scored)" in lines[0]
    assert lines[0].endswith("; 1 guided sequences")
    assert len(lines) < engine.stats.steps  # only new longest steps


def test_a_running_engine_loop_takes_the_gil_back_within_half_a_millisecond(tiny):
    """Beside an HTTP thread running Python, each torch op of a step waited for the GIL up
    to Python's switch interval (5 ms): the loop lowers it for its process."""
    import sys
    import time

    from kvlm.engine.async_engine import SWITCH_INTERVAL_S, AsyncEngine

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    aeng = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64)))
    try:
        aeng.start()
        deadline = time.time() + 30
        while sys.getswitchinterval() > SWITCH_INTERVAL_S and time.time() < deadline:
            time.sleep(0.01)
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S <= 0.001
    finally:
        aeng.stop()
        sys.setswitchinterval(before)


def test_a_conversation_cache_is_reused_only_under_its_salt(tiny):
    """An engine over one cache with `reuse` (a conversation's) starts a request from the
    K/V the cache holds only if it carries the cache_salt they were computed under."""
    engine = tiny.cache_engine(tiny.new_cache("contiguous"), reuse=True)
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(rid: str, salt: str | None) -> int:
        engine.add_request(rid, ids, params, cache_salt=salt)
        seen = 0
        while engine.has_work():
            seen = max([seen, *(ev.cached_tokens for ev in engine.step())])
        return seen

    assert cached("a", "tenant-a") == 0
    assert cached("b", "tenant-a") == len(ids) - 1  # all but the fed last token
    assert cached("c", "tenant-b") == 0  # another tenant's K/V are not served
    assert cached("d", None) == 0
    assert cached("e", None) == len(ids) - 1


def test_events_dropped_before_they_start_let_their_request_go(tiny):
    """A route that drops a request's events without ever reading them (a stream whose
    response was cancelled before its body began; the keep-alive's first read cancelled
    before it ran) never runs the events' own cleanup: the request must still be let go,
    no longer held and aborted, its blocks freed (the schema fuzzer found one held)."""
    import asyncio
    import time

    from kvlm.engine.async_engine import AsyncEngine

    aeng = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64)))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def drop_one() -> None:
        events = await aeng.generate(tiny.tokenizer.encode("A river runs"), params)
        assert aeng.metrics()["requests_held"] == 1
        del events  # never started

    try:
        aeng.start()
        asyncio.run(drop_one())
        assert aeng.metrics()["requests_held"] == 0
        deadline = time.time() + 30
        while aeng.engine.requests and time.time() < deadline:  # the abort lands
            time.sleep(0.01)
        assert not aeng.engine.requests
    finally:
        aeng.stop()
