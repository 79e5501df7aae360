"""The paged and int8 pools of a hybrid model (kvlm.cache.paged: a block table per layer
group; the windowed layers' blocks freed once they leave the window W + RING_SLACK): the
tiny Gemma 3 (layers with a window of 8 and one that sees everything, blocks of 16) on
prompts well past the window, through the engine's pool and one paged cache, against the
reference tokens; blocks really freed and all back at the end; the prefix cache's rule (a
hit needs the windowed layers' window before it), cut short when those blocks were handed
out again; a disk tier; cache files; a real `kvlm serve`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import answer, assert_generation_agrees, assert_ragged_agrees, staggered_on_pool
from kvlm import LLM, SamplingParams
from kvlm.cache import create_cache
from kvlm.cache.base import CacheFileError, blocks_for
from kvlm.cache.files import load_cache, save_cache
from kvlm.cache.kinds import RING_SLACK
from kvlm.cache.paged import FREED, PagedCache, RaggedStep, window_blocks
from kvlm.cache.saved import SavedCache
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.scheduler import SchedulerConfig
from kvlm.engine.speculative import SpeculativeConfig

LONG = "The quick brown fox jumps over the lazy dog and runs far away. " * 3
OTHER = "Once upon a time there was a tiny model that read one token at a time. " * 3
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
KEEP = 8 + RING_SLACK  # what the tiny Gemma 3's windowed layers keep behind the end


def make(folder, mode="paged", **kw) -> LLM:
    return LLM(model=folder, progress=False, max_context=256, kv=mode, **kw)


def generated(llm: LLM, prompts: list[str], params=GREEDY) -> list[list[list[int]]]:
    """Each prompt's samples' tokens: two prompts or more go through the engine's pool."""
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("gemma3")


@pytest.fixture(scope="module")
def alone(folder):
    """Each prompt's greedy tokens from the `off` oracle (fp32, every token re-fed)."""
    llm = make(folder, "off")
    return {p: generated(llm, [p])[0] for p in (LONG, OTHER, LONG[:70])}


@pytest.mark.parametrize("mode", ["paged", "int8"])
def test_the_pool_gives_the_reference_tokens(folder, alone, mode):
    """Prompts past the window, batched on the pool: each one's tokens as alone on one
    paged cache of the mode (batch invariance), and those as the `off` oracle's: equal in
    fp32, by the top-5 rule for int8 K/V (tests/helpers.assert_generation_agrees)."""
    llm = make(folder, mode)
    prompts = [LONG, OTHER, LONG[:70]]
    assert len(llm.tokenizer.encode(LONG)) > 3 * KEEP
    together = generated(llm, prompts)
    assert llm.batch_engine().pool.hybrid
    assert together == [generated(llm, [p])[0] for p in prompts]
    if mode == "paged":
        assert together == [alone[p] for p in prompts]
    else:
        assert_generation_agrees(make(folder, "off"), llm, LONG, 30)


@pytest.mark.parametrize("mode", ["paged", "int8", ("paged", "bf16"), ("paged", "fp16")])
def test_chunks_drafts_and_samples_on_the_pool(folder, mode):
    """Chunked prefill (chunks shorter and longer than the window and its slack),
    speculative decoding (drafts rolled back: never into a freed block) and n = 2 samples
    (forked tables) give the pool's plain tokens."""
    mode, dtype = mode if isinstance(mode, tuple) else (mode, None)
    plain = make(folder, mode, kv_dtype=dtype)
    want = generated(plain, [LONG, OTHER])
    for chunk in (12, 64):
        assert generated(make(folder, mode, kv_dtype=dtype, prefill_chunk=chunk),
                         [LONG, OTHER]) == want  # fmt: skip
    spec = SpeculativeConfig(num_draft=4, ngram_min=1)
    drafted = make(folder, mode, kv_dtype=dtype, speculative=spec)
    assert generated(drafted, [LONG, OTHER]) == want
    assert drafted.batch_engine().stats.spec.accepted > 0
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=24, n=2, ignore_eos=True)
    two = generated(plain, [LONG, OTHER], sampled)
    each = [generated(plain, [LONG, OTHER], replace(sampled, n=1, seed=4 + i)) for i in (0, 1)]
    assert two == [[each[0][p][0], each[1][p][0]] for p in (0, 1)]


def test_windowed_blocks_are_freed_and_all_come_back(folder):
    """While a sequence decodes, its windowed group holds at most the blocks of its last
    W + RING_SLACK positions (window_blocks), far fewer bytes than a pool keeping every
    layer whole; at the end every block of every group is back."""
    llm = make(folder)
    engine = Engine(llm, EngineConfig())
    pool = engine.pool
    whole, local = pool.groups
    ids = llm.tokenizer.encode(LONG)
    engine.add_request("a", ids, GREEDY)
    most = 0
    while engine.has_work():
        engine.step()
        seq = next(iter(engine.scheduler.running), None)
        if seq is None:
            continue
        table = seq.table.others[0]
        assert table[: local.first_live(table)] == [FREED] * local.first_live(table)
        assert local.num_used <= window_blocks(KEEP, 16, 1)
        n = seq.num_computed
        assert whole.num_used == blocks_for(n, 16)  # every block kept
        every_layer = whole.num_used * (whole.block_nbytes + local.block_nbytes)
        assert pool.used_nbytes < every_layer
        most = max(most, n)
    assert most > 3 * KEEP
    assert [g.num_used for g in pool.groups] == [0, 0]
    view = engine.kv_view()
    assert [(g["layers"], g["window"], g["used"]) for g in view["groups"]] == [
        ([2], None, 0), ([0, 1, 3], 8, 0)]  # fmt: skip


@pytest.mark.parametrize("mode", ["paged", "int8"])
def test_one_paged_cache_keeps_the_window_and_rolls_back(folder, mode):
    """One paged cache (LLM.stream's): 190 tokens in, its windowed layers hold at most
    what planned_nbytes plans; a rollback within RING_SLACK gives what a fresh cache
    gives, a longer one is refused (the caller starts over)."""
    llm = make(folder, mode)
    cache = llm.new_cache(mode)
    assert isinstance(cache, PagedCache) and cache.layout == "groups"
    ids = list(range(10, 200))
    llm.runner.forward(ids, cache)
    whole = create_cache(mode, replace(cache.spec, layer_kinds=()))
    llm.runner.forward(ids, whole)  # every layer kept (the model's windows still masked)
    assert cache.nbytes <= PagedCache.planned_nbytes(cache.spec, 190, 1) < 0.6 * whole.nbytes
    assert cache.can_roll_back(RING_SLACK) and not cache.can_roll_back(RING_SLACK + 8)
    cache.rollback(20)
    fresh = llm.new_cache(mode)
    llm.runner.forward(ids[:-20], fresh)
    assert llm.runner.forward([5, 6], cache).equal(llm.runner.forward([5, 6], fresh))


def test_prefix_hits_need_the_window_and_are_cut_short_without_it(folder):
    """A second request sharing a long prefix takes its blocks: the global layer's up to
    the hit and the windowed layers' window before it. With one seat (a windowed group of
    one sequence's blocks) a request between them takes those windowed blocks: the hit is
    cut short (counted), and the tokens are still the fresh engine's. (One seat and
    prompt chunks of 16: a windowed group of 6 blocks, window_blocks + the reserve.)"""
    llm = make(folder)
    ids = llm.tokenizer.encode(LONG)
    a, b = [*ids[:110], 5, 6, 7], [*ids[:110], 9, 10]
    other = llm.tokenizer.encode(OTHER)

    want_b = answer(Engine(llm, EngineConfig()), b, GREEDY)[0]
    roomy = Engine(llm, EngineConfig())
    answer(roomy, a, GREEDY)
    got, cached = answer(roomy, b, GREEDY)
    assert got == want_b and cached == 96
    st = roomy.manager.stats
    assert (st.window_lookups, st.window_cut) == (1, 0)
    sched = SchedulerConfig(max_num_seqs=1, prefill_chunk=16)
    tight = Engine(llm, EngineConfig(num_blocks=64, scheduler=sched))
    assert tight.pool.groups[1].num_blocks == window_blocks(KEEP, 16, 16) + 1 == 6
    answer(tight, a, GREEDY)
    answer(tight, other, GREEDY)  # takes the windowed blocks a left behind
    got, cached = answer(tight, b, GREEDY)
    st = tight.manager.stats
    assert got == want_b and cached < 96
    assert (st.window_lookups, st.window_cut) == (1, 1) and st.window_cut_tokens == 96 - cached
    assert tight.snapshot()["prefix_window_cut"] == 1


def test_a_disk_tier_restores_each_group(folder, tmp_path, monkeypatch):
    """A disk tier holds each layer group's blocks under its own records: a restarted
    engine gets the prefix back (the windowed layers' window from the tier too) with the
    same tokens; with the windowed group's records gone the hit is none."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the tier key's home
    llm = make(folder)
    ids = llm.tokenizer.encode(LONG)[:120]
    tier = f"disk:{tmp_path / 'tier'}"

    def run(engine):
        engine.add_request("x", ids, GREEDY)
        out, cached = [], 0
        while engine.has_work():
            for ev in engine.step():
                out += ev.token_ids
                cached = ev.cached_tokens
        engine.close()
        return out, cached

    first = Engine(llm, EngineConfig(kv_tiers=(tier,)))
    want, cached = run(first)
    assert cached == 0 and first.tiers.stats["disk"].writes > 2 * (119 // 16)
    second = Engine(llm, EngineConfig(kv_tiers=(tier,)))
    assert run(second) == (want, 112)
    assert second.manager.stats.window_cut == 0
    local_ns = second.tiers.groups[0][0][:32]
    for f in (tmp_path / "tier").rglob("*"):
        if f.is_file() and local_ns in f.name:
            f.unlink()
    third = Engine(llm, EngineConfig(kv_tiers=(tier,)))
    got, cached = run(third)
    assert got == want and cached == 0 and third.manager.stats.window_cut == 1


def test_a_hybrid_paged_file_reads_back_and_a_whole_one_is_refused(folder, tmp_path):
    """A paged cache's file of a hybrid model holds the groups layout (the whole layers'
    rows, the windowed ones' last W + RING_SLACK positions): it resumes into a paged or a
    contiguous cache with the tokens of the cache that wrote it; a file of a cache that
    kept every layer whole is refused with one line."""
    llm = make(folder)
    ids = llm.tokenizer.encode(LONG)
    cache = llm.new_cache("paged")
    llm.runner.forward(ids, cache)
    save_cache(cache, tmp_path / "c.kv", llm.fingerprint)
    groups = SavedCache.read(tmp_path / "c.kv").summary()["layer_groups"]
    assert [(g["kind"], len(g["layers"])) for g in groups] == [("attention", 1), ("window", 3)]
    want = llm.runner.forward([5, 6, 7], cache)
    for mode in ("paged", "contiguous"):
        other = llm.new_cache(mode)
        load_cache(other, tmp_path / "c.kv", llm.fingerprint)
        assert other.num_tokens == len(ids)
        got = llm.runner.forward([5, 6, 7], other)
        assert got.equal(want) if mode == "paged" else (got - want).abs().max() < 1e-4
    whole = PagedCache(replace(cache.spec, layer_kinds=()))
    llm.runner.forward(ids, whole)
    save_cache(whole, tmp_path / "w.kv", llm.fingerprint)
    with pytest.raises(CacheFileError, match="a dense cache cannot be restored into --kv paged"):
        load_cache(llm.new_cache("paged"), tmp_path / "w.kv", llm.fingerprint)


def test_kvlm_serve_shows_the_groups_and_the_window_counters(folder):
    """A real `kvlm serve` of the hybrid model on its pool: /metrics has each layer
    group's blocks and bytes and the hybrid prefix counters, /v1/kv the groups."""
    from serving import get, kvlm_serve, openai_client, wait_idle

    key = "sekret"
    with kvlm_serve("--model", str(folder), "--threads", "1", "--api-key", key,
                    "--max-context", "256") as (port, _):  # fmt: skip
        client = openai_client(port, key)
        model = client.models.list().data[0].id
        for suffix in (" alpha", " beta"):
            client.completions.create(model=model, prompt=LONG + suffix, max_tokens=8,
                                      temperature=0)  # fmt: skip
        m = wait_idle(port, key)
        status, text = get(port, "/v1/kv", {"Authorization": f"Bearer {key}"})
    assert m["kvlm_prefix_cache_window_lookups_total"] == 1
    assert m["kvlm_prefix_cache_window_cut_total"] == 0
    assert m['kvlm_kv_group_blocks_used{group="1",window="8",layers="3"}'] == 0
    assert m['kvlm_kv_group_blocks_total{group="0",window="none",layers="1"}'] > 0
    assert m["kvlm_prefix_cache_hits_total"] > 0
    assert status == 200
    view = json.loads(text)
    assert [(g["kind"], g["layers"], g["window"]) for g in view["groups"]] == [
        ("attention", [2], None), ("window", [0, 1, 3], 8)]  # fmt: skip
    assert view["prefix_cache"]["window_lookups"] == 1


def test_kvlm_inspect_names_the_layer_groups(folder, capsys):
    from kvlm.cli import main

    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    row = 2 * 2 * 32 * 4  # a layer's K and V a token: 2 KV heads x 32, fp32
    assert info["kv_layer_groups"] == [
        {"kind": "attention", "window": None, "layers": [2], "keeps": "K/V",
         "kv_bytes_per_token": row},
        {"kind": "window", "window": 8, "layers": [0, 1, 3], "keeps": "K/V",
         "kv_bytes_per_token": 3 * row},
    ]  # fmt: skip


def test_one_ragged_forward_per_step_on_the_hybrid_pool(folder, monkeypatch):
    """The GPU's road (one ragged forward per step, kvlm.cache.paged.RaggedStep: each
    layer group's blocks through its own tables) switched on here: requests arriving
    while others decode, prompts in chunks of 16 past the window, greedy tokens held to the
    top-5 rule against a forward per chunk; every block of every group back at the end."""
    llm = make(folder)
    prompts = [llm.tokenizer.encode(p) for p in (LONG, OTHER, LONG[:80])]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)

    def run(one_forward: bool) -> dict[str, list]:
        out, engine = staggered_on_pool(llm, prompts, params, 16, one_forward)
        assert [g.num_used for g in engine.pool.groups] == [0, 0]
        return out

    made = []
    real = RaggedStep.__init__

    def spy(self, *args, **kwargs):
        made.append(len(args[-1]) if len(args) > 6 else 0)  # the windowed groups' tables
        real(self, *args, **kwargs)

    monkeypatch.setattr(RaggedStep, "__init__", spy)
    ragged = run(True)
    assert made and set(made) == {1}  # mixed steps, each through the windowed group's tables
    assert_ragged_agrees(ragged, run(False), 12)
