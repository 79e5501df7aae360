"""The fused decode step (kvlm.model.fused) on the recurrent hybrids: Qwen3.5's gated
DeltaNets beside gated attention with partial RoPE, Granite 4.0-H's Mamba2 layers beside
NoPE attention with its multipliers (kernels/decode.c's MIX_DELTA and MIX_MAMBA2, the
states through kvlm_state_view: kvlm.cache.recurrent's StateCache and StateSlots). Each is
held to the torch model by the rules of tests/numerics.py (the exact result: the same
low-bit weights in fp64), a row's logits are the same bit for bit alone, forked or in the
engine's batch, a state kept for a rollback or a checkpoint survives the steps that move
its rows on in place, and the pool's steps keep the states, the snapshots at the block ends
their rows reach and a failed step's states as they were."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import (
    CHATML,
    POOL_PROMPTS,
    a_refused_pool_step,
    answer,
    assert_all_fused,
    assert_forked_rows_alone,
    assert_pool_fused_as_alone,
    assert_top_k_both_ways,
    conversation,
    counted_fused_runs,
    fresh_engine,
    fused_and_torch,
    fused_draft_rolled_back,
    fused_steps_on,
    needs_kernels,
    portable_build_params,
    portable_kernels,
    prompt_ids,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams
from kvlm.cache.recurrent import StateCache
from numerics import SAME_ROUNDING, assert_as_exact_as
from test_granite import GRANITE_MODELS
from test_qwen35 import QWEN35_MODELS

pytestmark = needs_kernels

# the tiny models (test_qwen35's, test_granite's) whose every projection takes low-bit
# weights: DeltaNets with 2 q/k heads serving 4 v heads, q|k|v and o biases beside the
# gate; Mamba2 layers in 2 groups, RoPE and the projections' biases, the multipliers
MODELS = {"qwen35": "qwen3_5", "qwen35-bias": "qwen3_5", "granite": "granitemoehybrid",
          "granite-rope-bias": "granitemoehybrid"}  # fmt: skip
CONTEXT = 256


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    made = {}

    def make(name: str):
        if name not in made:
            seed, overrides = {**QWEN35_MODELS, **GRANITE_MODELS}[name]
            extra = {"tokenizer": "qwen35", "chat_template": CHATML} if "qwen" in name else {}
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), MODELS[name], seed=seed,
                                         **extra, **overrides)  # fmt: skip
        return made[name]

    return make


@functools.cache
def fused_llm(folder, kv_dtype: str = "fp32", dtype: str = "fp32", **options) -> LLM:
    """int8 weights on fp32 activations and prompt products (the exact products the fused
    step and the torch step share), in `dtype` (fp64: the exact result)."""
    return LLM(model=folder, progress=False, max_context=CONTEXT, weights="int8",
               kv_dtype=kv_dtype, dtype=dtype, activations="fp32", prefill_dtype="fp32",
               **options)  # fmt: skip


def state_of(cache) -> torch.Tensor:
    """The recurrent states a one-sequence cache holds (layers, B, ...)."""
    return next(p for p in cache.parts if isinstance(p, StateCache)).rows.state


def exact_state(llm: LLM, ids: list[int]) -> torch.Tensor:
    cache = llm.new_cache("contiguous")
    llm.runner.forward(ids, cache)
    return state_of(cache)


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "q4"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_fused_step_tracks_the_torch_model(hybrid_dir, name, kv_dtype, mode):
    """24 fused steps against the torch model fed the same tokens, each over its own cache,
    both held to the exact (fp64) result: the fused logits as close to it as the torch
    step's (q4 K/V: with the int8 queries' rounding), each side's best token in the other's
    top 5; and the states the fused step left as close to the exact ones as the torch
    step's."""
    from test_fused_arch import INT8_QUERIES

    folder = hybrid_dir(name)
    llm = fused_llm(folder, kv_dtype)
    assert llm.describe()["decode_step"] == "fused"
    prompt = prompt_ids(llm, 20)
    tokens, fused, ref, fused_cache, torch_cache = fused_and_torch(llm, prompt, 24, mode)
    exact_llm = fused_llm(folder, dtype="fp64")
    ids = prompt + tokens
    exact = exact_llm.runner.logits(ids, exact_llm.new_cache("off"))[len(prompt) :]
    factor = INT8_QUERIES if kv_dtype == "q4" else SAME_ROUNDING
    assert_as_exact_as(fused, ref, exact, factor)
    assert_top_k_both_ways(fused, ref)
    want = exact_state(exact_llm, ids)
    assert_as_exact_as(state_of(fused_cache), state_of(torch_cache), want)


@pytest.mark.parametrize("name", ["qwen35", "granite"])
def test_forked_rows_in_one_fused_step_are_each_alone(hybrid_dir, name):
    """A prompt's cache forked into 3 rows fed different tokens: each row of the fused step
    reads its own sequence's state and rows, its logits bit for bit those of a cache fed
    its tokens alone."""
    llm = fused_llm(hybrid_dir(name))
    assert_forked_rows_alone(llm, prompt_ids(llm, 20), prompt_ids(llm, 40)[20:])


@pytest.mark.parametrize("name", ["qwen35", "granite"])
def test_kept_states_survive_the_steps_that_move_the_rows_on(hybrid_dir, name):
    """The fused step moves the conv rows on in place: a checkpoint's state (a chat's turn
    start) and a draft model's rollback depth keep rows of their own (DeltaRows.own_rows),
    so going back there and decoding again gives the first time's logits bit for bit."""
    llm = fused_llm(hybrid_dir(name))
    prompt, more = prompt_ids(llm, 20), prompt_ids(llm, 36)[20:]
    for depth in (0, 3):
        cache = llm.new_cache("contiguous")
        cache.checkpoint(len(prompt))  # kept as the prompt's step commits
        llm.runner.forward(prompt, cache)
        cache.hold_rollback(depth)
        first = torch.stack([llm.runner.forward([t], cache) for t in more])
        assert llm.runner.fused_for(cache) is not None
        if depth:
            cache.rollback(2)
            again = torch.stack([llm.runner.forward([t], cache) for t in more[-2:]])
            assert torch.equal(again, first[-2:])
        assert cache.rollback_point(len(prompt)) == len(prompt)
        cache.rollback(cache.num_tokens - len(prompt))
        assert torch.equal(torch.stack([llm.runner.forward([t], cache) for t in more]), first)


@pytest.mark.parametrize("march", portable_build_params())
@pytest.mark.parametrize("name", ["qwen35-bias", "granite-rope-bias"])
def test_the_portable_builds_run_it_alike(hybrid_dir, name, march):
    """The scalar build and the AVX2 halves run the recurrent layers' kernels as the native
    one (masked lanes there, plain loops here): the logits of 16 fused steps and the
    states they leave as close to the exact ones as the native build's, each side's."""
    from kvlm import kernels

    folder = hybrid_dir(name)
    llm = fused_llm(folder)
    prompt, steps = prompt_ids(llm, 12), prompt_ids(llm, 28)[12:]
    logits, states = [], []
    for lib in (kernels.library(), portable_kernels(march)):
        got, cache = fused_steps_on(llm, lib, prompt, steps)
        logits.append(got)
        states.append(state_of(cache))
    exact_llm = fused_llm(folder, dtype="fp64")
    ids = prompt + steps
    exact = exact_llm.runner.logits(ids, exact_llm.new_cache("off"))[len(prompt) :]
    want = exact_state(exact_llm, ids)
    for got, ref in ((logits, exact), (states, want)):
        assert_as_exact_as(got[1], got[0], ref)
        assert_as_exact_as(got[0], got[1], ref)


# --------------------------------------------------------------- the engine's pool


@functools.cache
def pool_llm(folder, **options) -> LLM:
    """The pool's: int8 weights under the defaults (int16 activations, fp16 K/V where the
    CPU has them: what `kvlm serve` of such a model runs)."""
    return LLM(model=folder, kv="paged", weights="int8", progress=False, **options)


@pytest.mark.parametrize("name", ["qwen35-bias", "granite-rope-bias"])
def test_the_pools_fused_step_batches_forks_and_drafts_as_alone(hybrid_dir, name, monkeypatch):
    """The fused step on the engine's pool reads each sequence's slot and writes its state
    back (StateSlots.view, written): the prompts batched, n = 2 (forked slots), prompt
    lookup's drafts and a draft model's (a draft's rows one run of its sequence, the state
    after each kept, the rejected rolled back to it: StateSlots.drafted) give every
    prompt's tokens alone, every decode row through the fused step."""
    assert_pool_fused_as_alone(pool_llm(hybrid_dir(name)), monkeypatch, "int4")


@pytest.mark.parametrize("name", ["qwen35", "granite"])
def test_a_prefix_hit_on_a_snapshot_the_fused_step_took(hybrid_dir, name, monkeypatch):
    """A decode row that reaches a block end leaves the state's snapshot there
    (StateSlots.written): a prompt that is a first answer's tokens and more hits at the
    last block its answer filled and answers as a fresh pool does; a chat's second turn
    likewise."""
    llm = pool_llm(hybrid_dir(name), activations="fp32", prefill_dtype="fp32")
    first = llm.tokenizer.encode(POOL_PROMPTS[0])[:10]
    calls = counted_fused_runs(monkeypatch)
    engine = fresh_engine(llm)
    answer_ids, _ = answer(engine, first, SamplingParams(max_tokens=30, temperature=0.0,
                                                         ignore_eos=True))  # fmt: skip
    assert_all_fused(calls, engine)
    second = first + answer_ids + llm.tokenizer.encode(" And Spain?")[1:]
    want, cold = answer(fresh_engine(llm), second)
    got, cached = answer(engine, second)
    assert cold == 0 and cached == 32 and got == want
    first_turn, second_turn = conversation(llm)
    want = answer(fresh_engine(llm), second_turn)[0]
    engine = fresh_engine(llm)
    answer(engine, first_turn)
    got, cached = answer(engine, second_turn)
    assert got == want and cached >= 16


def test_a_failed_fused_step_leaves_the_states_as_they_were(hybrid_dir):
    """A fused step on the pool that the C step refuses (a row's block table that does not
    cover its position) raises with every slot's state, rows and end as they were; the
    same step with good tables then moves them on."""
    llm = pool_llm(hybrid_dir("qwen35"))
    engine, step, starts, _ = a_refused_pool_step(llm)
    slots = next(g for g in engine.pool.groups if type(g).__name__ == "StateSlots")
    before = (slots.state.clone(), slots.conv.clone(), list(slots.end), slots.win.clone())
    with pytest.raises(ValueError, match="fused decode step refused"):
        step(good=False)
    assert torch.equal(slots.state, before[0]) and torch.equal(slots.conv, before[1])
    assert slots.end == before[2] and torch.equal(slots.win, before[3])
    step(good=True)  # (the state moves at a chunk's end: the carried rows, each row)
    assert not torch.equal(slots.win, before[3]) and not torch.equal(slots.conv, before[1])
    assert sorted(slots.end)[-2:] == sorted(s + 1 for s in starts)


@pytest.mark.parametrize("reject", [0, 2, 5])
@pytest.mark.parametrize("name", ["qwen35", "granite"])
def test_a_draft_in_the_fused_step_keeps_each_rows_state(hybrid_dir, name, reject, monkeypatch):
    """The last token and a draft of 5 as 6 rows of one fused step (one run of the
    sequence: the state after each row but the last kept, kvlm_state_view.snaps), `reject`
    of them rolled back: each kept row's logits are those of the fused step fed its token
    alone, and the state, the conv rows and the next token's logits bit for bit those of a
    cache fed the kept tokens one at a time."""
    llm = fused_llm(hybrid_dir(name))
    ids, draft = prompt_ids(llm, 30), prompt_ids(llm, 40)[30:35]
    a, b = fused_draft_rolled_back(llm, ids, draft, reject, monkeypatch)
    parts = [next(p for p in c.parts if isinstance(p, StateCache)).rows for c in (a, b)]
    assert parts[0].length == parts[1].length == len(ids) + 5 - reject
    assert torch.equal(parts[0].state, parts[1].state)
    assert torch.equal(parts[0].conv.rows, parts[1].conv.rows)
    assert torch.equal(llm.runner.forward([7], a), llm.runner.forward([7], b))


@pytest.mark.parametrize("name", ["qwen35", "granite"])
def test_a_prefix_hit_on_a_snapshot_a_draft_row_took(hybrid_dir, name, monkeypatch):
    """A draft's rows on the pool's fused step reach block ends: the snapshot there is the
    state after that draft row (the view's snaps; one after a rejected row forgotten by the
    trim). A draft model of the same weights (every draft accepted) and one of int4 weights
    (some rejected): a prompt that is the first answer's tokens and more hits at the block
    end a draft row took (32) and answers as a fresh pool does."""
    from kvlm.cache.recurrent import StateSlots
    from kvlm.engine.speculative import SpeculativeConfig

    llm = pool_llm(hybrid_dir(name), activations="fp32", prefill_dtype="fp32")
    first = llm.tokenizer.encode(POOL_PROMPTS[0])[:10]
    inside: list[int] = []  # block ends a draft row reached, its snapshot taken
    written = StateSlots.written

    def spied(self, pieces):
        written(self, pieces)
        for d in self.drafted.values():
            n = d.conv.shape[1] - self.conv.shape[2]
            inside.extend(e for e, _ in d.snaps if e < d.start + n)

    monkeypatch.setattr(StateSlots, "written", spied)
    calls = counted_fused_runs(monkeypatch)
    drafted_hit = []  # whether the hit's block end was a draft row's, each run
    for weights in ("int8", "int4"):
        inside.clear()
        spec = SpeculativeConfig("draft", draft_weights=weights, num_draft=4)
        engine = fresh_engine(llm, speculative=spec)
        answer_ids, _ = answer(engine, first, SamplingParams(max_tokens=30, temperature=0.0,
                                                             ignore_eos=True))  # fmt: skip
        assert max(calls) > 1 and inside
        drafted_hit.append(32 in inside)
        second = first + answer_ids + llm.tokenizer.encode(" And Spain?")[1:]
        want, _ = answer(fresh_engine(llm), second)
        got, cached = answer(engine, second)
        assert cached == 32 and got == want
    assert any(drafted_hit)  # (where a draft's rows fall follows the tokens: both, here)


def test_a_prefix_hit_at_a_block_end_inside_the_rules_chunk(hybrid_dir):
    """With blocks of 8 a block end can fall inside the delta rule's chunk of 16: the
    snapshot there keeps the chunk's carried rows too (StateSlots.snap_carries; a block
    size of 16 needs none), so a prompt that continues a first prompt of 30 tokens hits at
    24 (the first's last block end) and scores as a fresh pool does, bit for bit."""
    from kvlm.llm import CacheOptions

    llm = pool_llm(hybrid_dir("qwen35"), activations="fp32", prefill_dtype="fp32",
                   cache_options=CacheOptions(block_size=8))  # fmt: skip
    ids = prompt_ids(llm, 42)
    engine = fresh_engine(llm)
    state = next(g for g in engine.pool.groups if type(g).__name__ == "StateSlots")
    assert state.snap_carries and state.snap_win.shape[1] > 0
    answer(engine, ids[:30], SamplingParams(max_tokens=1, temperature=0.0))
    assert state.snap_win.abs().sum() > 0  # the block end's carried rows were kept
    scored = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(engine) -> tuple[list, int]:
        engine.add_request("r", ids, scored)
        out, cached = [], 0
        while engine.has_work():
            for ev in engine.step():
                out += [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in ev.logprobs]
                cached = ev.cached_tokens
        return out, cached

    want, cold = run(fresh_engine(llm))
    got, cached = run(engine)
    assert cold == 0 and cached == 24 and got == want  # the logprobs too, bit for bit
