"""LFM2: gated short convolutions beside attention (kvlm.model.conv), against transformers'
Lfm2ForCausalLM on tiny random-weight models of several conv/attention layer orders, and
from the GGUF file llama.cpp's own converter writes for them (tests/converter.py).

Every one-sequence cache mode keeps the conv rows as a layer group of its own
(kvlm.cache.conv), the engine's pool a slot of them a sequence and each sealed block's end
rows for prefix hits (kvlm.cache.conv.ConvSlots); the fused C decode step (kvlm.model.fused,
kernels/conv.c) reads and moves them on in place in the contiguous, paged and int8 modes
and the pool's slots (each sequence's ring), held to the torch model by tests/numerics.py's
rules as test_fused_arch holds the other families (docs/NOTES-lfm2.md: what is left)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import converter
from helpers import (
    FRANCE,
    GREEDY,
    LFM2_TEMPLATE,
    POOL_PROMPTS,
    a_refused_pool_step,
    alone_on_cache,
    answer,
    assert_all_fused,
    assert_forked_rows_alone,
    assert_greedy_agreement,
    assert_pool_fused_as_alone,
    assert_ragged_agrees,
    assert_top_k_both_ways,
    conversation,
    conversation_on_a_tier,
    counted_fused_runs,
    fed,
    fresh_engine,
    fused_and_torch,
    fused_draft_rolled_back,
    fused_steps_on,
    gguf_as_folder,
    hf_greedy,
    hf_logits,
    load_hf,
    model_maker,
    on_pool,
    portable_build_params,
    portable_kernels,
    prompt_ids,
    staggered_on_pool,
)
from kvlm import LLM, SamplingParams
from kvlm.errors import InvalidRequestError
from numerics import SAME_ROUNDING, assert_as_exact_as, fp64_reorder_bound, max_error

PROMPT = FRANCE
C, A = "conv", "full_attention"
# name -> (seed, transformers config overrides): the layer orders and conv variants
LFM2_MODELS = {
    "lfm2": (20, {}),  # conv, attention, conv, attention
    "lfm2-attention-first": (21, {"layer_types": [A, C, C, A]}),
    "lfm2-convs-last": (22, {"layer_types": [A, C, C, C]}),
    # biases in the conv layers' products and kernel, a kernel of 4
    "lfm2-bias-k4": (23, {"layer_types": [C, C, A, C], "conv_bias": True, "conv_L_cache": 4}),
    "lfm2-k4": (24, {"conv_L_cache": 4}),
}


@pytest.fixture(scope="session")
def lfm2_dir(tmp_path_factory):
    """name in LFM2_MODELS -> its folder: weights, config, an LFM2-like tokenizer
    (Llama 3's split, a BOS on every text) and LFM2.5's chat template."""
    return model_maker(tmp_path_factory, "lfm2", LFM2_MODELS, chat_template=LFM2_TEMPLATE,
                       tokenizer="llama3")  # fmt: skip


@pytest.mark.parametrize("name", list(LFM2_MODELS))
def test_config_read_from_folder(lfm2_dir, name):
    folder = lfm2_dir(name)
    config, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder)
    types = hf.config.layer_types
    assert config.layer_mixers == tuple("conv" if t == C else "attention" for t in types)
    assert config.conv_kernel == hf.config.conv_L_cache
    assert config.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 96
    assert config.rms_norm_eps == hf.config.norm_eps
    assert config.num_kv_heads == hf.config.num_key_value_heads
    assert config.tie_word_embeddings and config.qk_norm


@pytest.mark.parametrize("name", list(LFM2_MODELS))
def test_teacher_forced_logits_match_hf(lfm2_dir, name):
    """Every position's logits over 40 tokens, the exact path (fp32 reference numerics):
    as close to the exact result (transformers in fp64) as transformers' own fp32 logits
    (tests/numerics.py)."""
    folder = lfm2_dir(name)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours, ref = llm.runner.logits(ids, llm.new_cache("off")), hf_logits(load_hf(folder), ids)
    assert_as_exact_as(ours, ref, hf_logits(folder, ids, torch.float64))


@pytest.mark.parametrize("name", ["lfm2", "lfm2-bias-k4"])
def test_greedy_tokens_equal_hf(lfm2_dir, name):
    """32 greedy tokens through LLM.generate (kv off): in fp64 the same tokens as
    transformers in fp64; in fp32 by default numerics, the top-5 rule against its fp32."""
    from transformers import AutoModelForCausalLM

    folder = lfm2_dir(name)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    ids = fp64.tokenizer.encode(PROMPT)
    hf64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf64, ids, 32)[0]
    llm = LLM(model=folder, kv="off", progress=False)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, 32)
    tops = [list(lp.top) for lp in out.logprobs]
    assert_greedy_agreement(out.token_ids, tops, ref_ids, ref_logits)


def test_the_convolution_is_applied(lfm2_dir):
    """The conv layers matter: a kernel zeroed moves the logits by far more than rounding
    (so the tests above can fail)."""
    folder = lfm2_dir("lfm2")
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    exact = hf_logits(folder, ids, torch.float64)
    before = max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)
    llm.model.layers[0].conv.kernel.data[1:] = 0  # position t reads only its own row
    after = max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)
    assert after > 1000 * before


def carried(llm: LLM, ids: list[int], chunks: list[int], mode: str = "contiguous"):
    """Teacher-forced logits of `ids` fed in `chunks` through a one-sequence cache of
    `mode` with no conv group and the conv rows carried beside it by hand
    (`Transformer.forward(conv=)`), each chunk committed to both."""
    from dataclasses import replace

    from kvlm.cache import create_cache

    spec = replace(llm.cache_spec(mode), layer_kinds=())
    cache, rows = create_cache(mode, spec), llm.model.new_conv_rows(slack=8)
    out, at = [], 0
    with torch.inference_mode():
        for n in chunks:
            step, conv = cache.begin(n), rows.begin(n)
            tokens = torch.tensor([ids[at : at + n]])
            out.append(llm.model(tokens, step.positions, step, last_only=False, conv=conv)[0])
            cache.commit(step)
            rows.commit(conv)
            at += n
    return torch.cat(out), cache, rows


@pytest.mark.parametrize("mode", ["contiguous", "basic"])
def test_rows_carried_across_chunks_and_decode_equal_one_shot(lfm2_dir, mode):
    """Chunks of 7 across the kernel's edge, then a token at a time: every position's
    logits as close to the exact ones as the one-shot forward's (the conv rows of the
    tokens before a step are what a step from position 0 computes)."""
    folder = lfm2_dir("lfm2-bias-k4")
    chunks = [7] * 4 + [1] * 12
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot = llm.runner.logits(ids, llm.new_cache("off"))
    exact = hf_logits(folder, ids, torch.float64)
    assert_as_exact_as(carried(llm, ids, chunks, mode)[0], one_shot, exact)
    # in fp64, within the reordering bound of two fp64 evaluations (tests/numerics.py)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    one_shot64 = fp64.runner.logits(ids, fp64.new_cache("off"))
    far = max_error(carried(fp64, ids, chunks, mode)[0], one_shot64)
    assert far <= fp64_reorder_bound(max_error(one_shot, exact))


def test_conv_rows_roll_back_fork_and_restore(lfm2_dir):
    """ConvRows as a cache's rows: a rollback within the slack and the same tokens fed
    again give the same logits; one past it is refused; a snapshot restores; a fork
    decodes each row as the one it came from."""
    from kvlm.errors import CacheOverflowError

    llm = LLM(model=lfm2_dir("lfm2"), kv="off", exact=True, progress=False)
    ids = prompt_ids(llm, 24)
    first, cache, rows = carried(llm, ids, [16, 8])
    cache.rollback(5), rows.rollback(5)
    with torch.inference_mode():
        step, conv = cache.begin(5), rows.begin(5)
        again = llm.model(torch.tensor([ids[19:]]), step.positions, step, last_only=False,
                          conv=conv)[0]  # fmt: skip
    cache.commit(step), rows.commit(conv)
    assert torch.equal(again, first[19:])
    saved = rows.snapshot()
    rows.rollback(8)  # the 8 rows of slack: kernel - 1 rows before position 16 still held
    with pytest.raises(CacheOverflowError, match="rollback"):
        rows.rollback(1)
    rows.restore(saved)
    assert rows.length == 24
    cache.fork(2), rows.fork(2)
    with torch.inference_mode():
        step, conv = cache.begin(1), rows.begin(1)
        two = llm.model(torch.tensor([[5], [5]]), step.positions, step, conv=conv)
    assert torch.equal(two[0], two[1])
    with pytest.raises(ValueError, match="conv rows"):  # rows and cache out of step
        llm.model(torch.tensor([[5], [5]]), step.positions + 1, step, conv=conv)


ROW_MODES = ["basic", "contiguous", "paged", "int8", "window"]


@pytest.mark.parametrize("mode", ROW_MODES)
def test_every_mode_keeps_the_rows_chunked_equals_one_shot(lfm2_dir, mode):
    """Every one-sequence mode keeps the conv layers' rows as a layer group of its cache
    (kvlm.cache.conv): chunks of 7 across the kernel's edge, then a token at a time, give
    the one-shot prefill's logits through the same mode bit for bit (window: as exact);
    the exact modes also the `off` oracle's; a conv layer takes no K/V (the K/V bytes per
    token are the attention layers')."""
    folder = lfm2_dir("lfm2-bias-k4")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    if mode == "window":  # keys kept before RoPE, turned at each step: as exact, not equal
        assert_as_exact_as(chunked, one_shot, hf_logits(folder, ids, torch.float64))
    else:
        assert torch.equal(chunked, one_shot)
    if mode in ("basic", "contiguous", "paged"):
        off = LLM(model=folder, kv="off", exact=True, progress=False)
        assert torch.equal(one_shot, off.runner.logits(ids, off.new_cache("off")))
    spec, attention = llm.cache_spec(), 1  # C C A C
    per_layer = spec.num_kv_heads * spec.head_dim * 2 * spec.dtype.itemsize
    assert spec.bytes_per_token == attention * per_layer or mode == "int8"


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_generate_batched_forked_and_speculative_equal_alone(lfm2_dir, mode):
    """Prompts batched = each alone; n = 2 greedy samples (a fork of the prompt's cache,
    rows and all) = the one greedy sample; speculative (prompt lookup: drafts checked as
    rows of one step, the rejected rolled back; a draft model, the file's int8 self) =
    plain decoding."""
    from kvlm.engine.speculative import SpeculativeConfig

    folder = lfm2_dir("lfm2")
    llm = LLM(model=folder, kv=mode, progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [PROMPT, "One two three, one two three, one two"]
    alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], SamplingParams(n=2, max_tokens=24, temperature=0.0))
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        spec = LLM(model=folder, kv=mode, speculative=how, progress=False)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == alone


def test_cache_rows_roll_back_within_the_slack_fork_and_draft(lfm2_dir):
    """A cache's conv rows: a rollback within RING_SLACK and the same tokens fed again
    give the same logits; one past it is refused (can_roll_back False, the caller starts
    over); a draft's rows (begin(n, draft=True)) give each token's decode logits."""
    from kvlm.cache.kinds import RING_SLACK
    from kvlm.engine.runner import DraftBatch

    llm = LLM(model=lfm2_dir("lfm2-k4"), kv="contiguous", exact=True, progress=False)
    ids = prompt_ids(llm, 60)
    cache = llm.new_cache()
    first = fed(llm, ids, [40, 20], cache)
    cache.rollback(RING_SLACK)
    assert not cache.can_roll_back(1)
    with pytest.raises(InvalidRequestError, match="rollback"):
        cache.rollback(1)
    assert torch.equal(fed(llm, ids[60 - RING_SLACK :], [RING_SLACK], cache), first[-RING_SLACK:])
    plain = llm.new_cache()
    fed(llm, ids[:50], [50], plain)
    steps = [llm.runner.forward([t], plain) for t in ids[50:55]]
    draft = llm.new_cache()
    fed(llm, ids[:50], [50], draft)
    rows = llm.runner.run(DraftBatch(ids[50:55], draft))
    assert torch.equal(rows, torch.stack(steps))


@pytest.mark.parametrize("mode", ["paged", "window"])
def test_a_saved_conversation_continues_with_the_same_tokens(lfm2_dir, tmp_path, mode):
    """A chat saved after a turn and loaded into a fresh session continues as the one
    that never stopped (the file's `groups` layout holds the conv group's rows; --kv
    window's group 0 a sinks + ring, its slot positions checked as a window file's; the
    chat is longer than its 2 sinks + 12, so the ring has wrapped when it is saved)."""
    from kvlm.llm import CacheOptions

    llm = LLM(model=lfm2_dir("lfm2"), kv=mode, progress=False,
              cache_options=CacheOptions(window=12, sinks=2))  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0.0)
    one = llm.chat_session(params)
    "".join(one.send("Hello there"))
    one.save(tmp_path / "chat.kvc", llm.fingerprint)
    went_on = "".join(one.send("And then?"))
    two = llm.chat_session(params)
    two.load(tmp_path / "chat.kvc", llm.fingerprint)
    assert one.cache.num_tokens > 14  # wrapped past the window's 2 + 12
    assert "".join(two.send("And then?")) == went_on
    assert two.history == one.history
    # the rows' file checks: how far back the rows go, their shape
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvlm.cache.base import CacheFileError

    with safe_open(tmp_path / "chat.kvc", "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    conv = next(k[: -len("held")] for k in tensors if k.endswith("held"))
    short = tensors[conv + "rows"][:, :, 1:].contiguous()
    bad_files = [({conv + "held": torch.tensor([1])}, meta, "held 1 is not"),
                 ({conv + "rows": short}, meta, "rows have shape")]  # fmt: skip
    extra = json.loads(meta["layout_extra"])
    if mode == "window":  # group 0's ring: a position twice; the window's keys dropped
        pos = tensors["g0_slot_pos"].clone()
        pos[1] = pos[0]
        plain = json.dumps({k: v for k, v in extra.items() if k not in ("sinks", "window")})
        bad_files += [({"g0_slot_pos": pos}, meta, "slot_pos"),
                      ({}, {**meta, "layout_extra": plain}, "ring")]  # fmt: skip
    else:  # a ring claimed by a cache whose group 0 keeps every position
        ringed = json.dumps({**extra, "sinks": 0, "window": 8})
        bad_files.append(({}, {**meta, "layout_extra": ringed}, "ring"))
    for bad, bad_meta, says in bad_files:
        save_file({**tensors, **bad}, tmp_path / "bad.kvc", bad_meta)
        with pytest.raises(CacheFileError, match=says):
            llm.chat_session(params).load(tmp_path / "bad.kvc", llm.fingerprint)


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_memory_counts_the_rows_per_sequence(lfm2_dir, mode, capsys):
    """`kvlm memory`'s plan: the conv layers' rows a sequence whatever its length (kernel
    - 1 + RING_SLACK rows of the hidden size in fp32), the attention layers' K/V per
    token, and what `kvlm serve`'s pool keeps more a block for prefix hits (the kernel - 1
    rows at its end); a made cache holds what is planned for it."""
    from kvlm.cache import memory
    from kvlm.cache.kinds import RING_SLACK
    from kvlm.cli import main

    llm = LLM(model=lfm2_dir("lfm2-k4"), kv=mode, progress=False)
    c, spec = llm.config, llm.cache_spec()
    rows = len(c.conv_layers) * (c.conv_kernel - 1 + RING_SLACK) * c.hidden_size * 4
    for context, batch in ((64, 1), (128, 3)):
        conv = [g for g in memory.layer_groups(mode, spec, context, batch) if g["kind"] == "conv"]
        end = len(c.conv_layers) * (c.conv_kernel - 1) * c.hidden_size * 4  # a block's
        assert conv == [{"kind": "conv", "layers": len(c.conv_layers), "window": None,
                         "tokens": 0, "bytes": batch * rows, "block_end_bytes": end}]  # fmt: skip
    cache = llm.new_cache()
    assert cache.parts[-1].nbytes == rows
    assert main(["memory", "--model", str(llm.loaded.path), "--kv", mode, "--context", "64"]) == 0
    assert f"kvlm serve's pool keeps {end / 2**10:,.1f} KiB more a block for prefix hits" in (
        capsys.readouterr().out)  # fmt: skip


def test_the_fused_step_takes_it(lfm2_dir):
    """The fused step decodes the modes whose caches it reads (their conv part's rows a
    ConvView), the others the torch step, saying why."""
    from dataclasses import replace

    from kvlm.cache import create_cache
    from kvlm.errors import UnsupportedModelError
    from kvlm.model import fused
    from kvlm.model.transformer import NO_CONV_ROWS

    llm = LLM(model=lfm2_dir("lfm2"), kv="contiguous", weights="int8", progress=False)
    assert fused.why_not(llm.model) is None
    assert llm.describe()["decode_step"] == "fused"
    for mode in ("contiguous", "paged", "int8"):
        assert llm.runner.decode_step(llm.new_cache(mode)) == "fused", mode
    for mode in ("basic", "window"):
        assert llm.runner.decode_step(llm.new_cache(mode)).startswith("torch step: the fused")
    # a cache made for another spec, with no conv group: the model says why
    cache = create_cache("contiguous", replace(llm.cache_spec(), layer_kinds=()))
    llm.runner.forward([3, 4], cache)  # from position 0: the rows are zeros
    with pytest.raises(UnsupportedModelError, match="cache spec"):
        llm.runner.forward([5], cache)
    assert "LLM.new_cache" in NO_CONV_ROWS


# ------------------------------------------------------------------- the engine's pool


@pytest.fixture(scope="module")
def pooled(lfm2_dir):
    """The tiny LFM2 (C A C A) on --kv paged, and each POOL_PROMPTS' greedy tokens alone
    on its one-sequence cache (a HybridCache: the paged part and the conv rows)."""
    llm = LLM(model=lfm2_dir("lfm2"), kv="paged", progress=False)
    alone = {p: [llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS}
    return llm, alone


def test_the_pool_batches_chunks_forks_and_drafts_as_alone(pooled):
    """Through the engine's pool (a slot of conv rows a sequence, kvlm.cache.conv): the
    prompts batched, in chunks of 5 (across the kernel's edge and the blocks'), n = 2
    greedy samples (the slot forked by copy) and drafts, prompt lookup's and a draft
    model's (the file's int8 self; a draft's rows one sequence to the convolution, the
    rejected rolled back in the ring) each give every prompt's tokens alone; every slot
    is back at the end."""
    from kvlm.engine.speculative import SpeculativeConfig

    llm, alone = pooled
    want = [alone[p] for p in POOL_PROMPTS]
    got, engine = on_pool(llm, POOL_PROMPTS, GREEDY)
    assert got == want
    conv = engine.pool.conv
    assert conv is not None and conv.num_used == 0 and conv.num_blocks == 16
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    two, engine = on_pool(llm, POOL_PROMPTS, SamplingParams(n=2, max_tokens=20, temperature=0.0,
                                                            ignore_eos=True))  # fmt: skip
    assert two == [w * 2 for w in want] and engine.pool.conv.num_used == 0
    for spec in (SpeculativeConfig("ngram", num_draft=4, ngram_min=1),
                 SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        drafted, engine = on_pool(llm, POOL_PROMPTS, GREEDY, speculative=spec)
        st = engine.stats.spec
        assert drafted == want and st.drafted > st.accepted  # some were rolled back
    assert st.accepted > 0  # the draft model's: rows of a draft checked as one sequence
    assert [o.outputs[0].token_ids for o in llm.generate(POOL_PROMPTS, GREEDY)] == [
        w[0] for w in want]  # LLM.generate's own pool  # fmt: skip


def test_a_preempted_sequence_gets_its_rows_back(pooled):
    """A pool too small for every sequence's growth: the newest are preempted (their
    slots freed) and recomputed; each prompt still gets its tokens alone."""
    llm = LLM(model=pooled[0].loaded.path, kv="paged", max_context=96, progress=False)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [[llm.generate(p, long)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    for prefix_caching in (False, True):  # recomputed whole, or from its sealed blocks
        got, engine = on_pool(llm, POOL_PROMPTS, long, num_blocks=8,
                              prefix_caching=prefix_caching)  # fmt: skip
        assert got == want
        assert engine.scheduler.preemptions > 0 and engine.pool.conv.num_used == 0


def test_one_ragged_forward_per_step_follows_a_forward_per_chunk(pooled):
    """The GPU's road switched on here (one ragged forward a step: prompt chunks and
    decode rows together, each sequence's conv rows by its slot, kvlm.cache.conv.SlotStep):
    greedy tokens held to the top-5 rule against the forward-per-chunk road."""
    llm, _ = pooled
    prompts = [llm.tokenizer.encode(p) for p in POOL_PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)

    def run(one_forward: bool) -> dict[str, list]:
        out, engine = staggered_on_pool(llm, prompts, params, 8, one_forward)
        assert engine.pool.conv.num_used == 0
        return out

    ragged, split = run(True), run(False)
    assert_ragged_agrees(ragged, split, 12)


def test_a_prefix_hit_mid_conversation_restores_the_rows(pooled):
    """The second turn of a chat finds the first's blocks: the hit's last block's end
    rows (kept when it was sealed) restore the sequence's slot, and the answer is a
    fresh pool's; without those rows the hit goes back to the last block that has them."""
    llm, _ = pooled
    first, second = conversation(llm)
    want, cold = answer(fresh_engine(llm), second)
    assert cold == 0
    engine = fresh_engine(llm)
    answer(engine, first)
    got, cached = answer(engine, second)
    hit = (len(first) // 16) * 16  # the first turn's full blocks (its reply's last block
    assert got == want and cached >= hit > 0  # may be the prompt's too)
    assert engine.manager.stats.hits == cached and engine.manager.stats.window_cut == 0
    conv = engine.pool.conv
    assert conv.blocks_with_rows >= len(second) // 16 and conv.num_used == 0
    # the rows of the blocks after the first one forgotten: the hit is that one block
    blocks, _ = engine.manager.match(second)
    for block in blocks[1:]:
        conv.ends_of[block] = 0
    got, cached = answer(engine, second)
    assert got == want and cached == 16 and engine.manager.stats.window_cut == 1


def test_a_disk_tier_restores_the_rows(pooled, tmp_path, monkeypatch):
    """A disk tier holds each block's end rows under the conv group's own records: a
    restarted engine hits the first turn's prefix from the tier, rows and all, with a
    fresh pool's tokens; with those records gone the hit is none."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the tier key's home
    llm, _ = pooled
    first, second, want, tier, writer = conversation_on_a_tier(llm, tmp_path / "tier")
    sealed = (len(first) + GREEDY.max_tokens - 1) // 16  # full blocks of computed tokens
    assert writer.tiers.stats["disk"].writes == 2 * sealed  # each one's K/V and end rows
    reader = fresh_engine(llm, kv_tiers=tier)
    got, cached = answer(reader, second)
    reader.close()
    assert got == want and cached >= (len(first) // 16) * 16 > 0
    rows_ns = reader.tiers.groups[0][0][:32]
    for f in (tmp_path / "tier").rglob("*"):
        if f.is_file() and rows_ns in f.name:
            f.unlink()
    third = fresh_engine(llm, kv_tiers=tier)
    got, cached = answer(third, second)
    third.close()
    assert got == want and cached == 0 and third.manager.stats.window_cut == 1


def test_conv_slots_roll_back_within_the_slack_only(pooled):
    """A slot's ring keeps RING_SLACK rows past the kernel's: a step after a rollback
    within them reads its rows, one past them is refused (the sequence would be
    recomputed), and a step past what the slot holds too."""
    from kvlm.cache.kinds import RING_SLACK
    from kvlm.errors import CacheOverflowError

    llm, _ = pooled
    conv = fresh_engine(llm).pool.conv
    slot = conv.allocate()
    table = list(range(8))
    with torch.inference_mode():
        step = conv.step([(slot, 0, 60, table)])
        for layer in range(2):
            step.taps(layer, torch.ones(1, 60, 64))
        step.commit()
    conv.step([(slot, 60 - RING_SLACK, 1, table)])  # within the slack
    with pytest.raises(CacheOverflowError, match="slack"):
        conv.step([(slot, 59 - RING_SLACK, 1, table)])
    with pytest.raises(CacheOverflowError, match="slack"):
        conv.step([(slot, 61, 1, table)])


def test_the_pools_memory_counts_slots_and_end_rows(pooled):
    """The pool's plan (windowed_plan, memory_blocks): a slot of rows for each of
    max_num_seqs sequences beside the K/V, and with the prefix cache each block's end
    rows; the pool made holds what was planned. The pacing's work has no attention in
    the conv layers."""
    from kvlm.engine.engine import EngineConfig, block_bytes, memory_blocks, pool_spec
    from kvlm.engine.pacing import Work

    llm, _ = pooled
    c, spec = llm.config, pool_spec(llm)
    rows = len(c.conv_layers) * (c.conv_kernel - 1) * c.hidden_size * 4
    kv = 16 * spec.bytes_per_token
    assert block_bytes(EngineConfig(), spec) == kv + rows
    assert block_bytes(EngineConfig(prefix_caching=False), spec) == kv
    blocks = memory_blocks(EngineConfig(kv_memory=1 << 21), spec, 256)
    engine = fresh_engine(llm, kv_memory=1 << 21)
    slots = 16 * (c.conv_kernel - 1 + 32) * c.hidden_size * 4 * len(c.conv_layers)
    assert engine.pool.num_blocks == blocks == ((1 << 21) - slots) // (kv + rows)
    zero_row = len(c.conv_layers) * c.hidden_size * 4  # the rows before position 0
    assert engine.pool.total_nbytes == blocks * (kv + rows) + slots + zero_row
    view = engine.kv_view()["groups"][1]
    assert (view["kind"], view["num_blocks"], view["block_bytes"], view["block_rows_bytes"]) == (
        "conv", 16, slots // 16, rows)  # fmt: skip
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    dense = 2 * h * (2 * q + 2 * kv) + 2 * h * (4 * h + 3) + 4 * 3 * h * c.intermediate_size
    assert Work(c).attend == 2 * 2 * q / dense  # C A C A: two layers attend


def test_the_pool_view_counts_each_sequences_rows(pooled):
    """/v1/kv's view of the pool (Engine.kv_view) while two sequences decode: each holds a
    slot of conv rows (its bytes the group's block_bytes), the conv group counts them."""
    llm, _ = pooled
    engine = fresh_engine(llm)
    for i, p in enumerate(POOL_PROMPTS[:2]):
        engine.add_request(str(i), llm.tokenizer.encode(p), GREEDY)
    engine.step()
    engine.step()
    view = engine.kv_view()
    conv = view["groups"][1]
    rows = [s["conv_rows"] for s in view["sequences"]]
    assert len(rows) == 2 and {r["slot"] for r in rows} == {0, 1}
    assert all(r["bytes"] == conv["block_bytes"] > 0 for r in rows)
    assert (conv["kind"], conv["used"], conv["used_bytes"]) == ("conv", 2, 2 * conv["block_bytes"])
    assert "windowed_blocks" not in view["sequences"][0]


def test_kvlm_serve_answers_concurrent_chats(lfm2_dir):
    """A real `kvlm serve` of the tiny LFM2 in int8 weights (its pool: a slot of conv rows
    a sequence, decoded by the fused step): two chat requests at once, batched (fewer
    steps than tokens), each answered as the LLM answers it alone; every decode row
    through the fused step (/metrics' fused rows, /v1/kv's decode_step); /v1/kv and
    /metrics show the conv group."""
    from serving import QUESTIONS, chats_alone, chats_at_once, get, kvlm_serve, wait_idle

    llm = pool_fused_llm(lfm2_dir("lfm2"), "int8")
    want = chats_alone(llm, QUESTIONS, 48)
    key = "sekret"
    with kvlm_serve("--model", str(llm.loaded.path), "--threads", "1", "--api-key", key,
                    "--max-context", "256", "--weights", "int8") as (port, _):  # fmt: skip
        got = chats_at_once(port, key, QUESTIONS, 48)
        m = wait_idle(port, key)
        status, text = get(port, "/v1/kv", {"Authorization": f"Bearer {key}"})
    assert got == want
    assert m["kvlm_engine_steps_total"] < m["kvlm_generation_tokens_total"]  # rows together
    # every token after each answer's first (the prefill's) a row of the fused step
    decoded = m["kvlm_generation_tokens_total"] - len(QUESTIONS)
    assert m["kvlm_engine_fused_rows_total"] == decoded > 0
    assert m['kvlm_kv_group_blocks_total{group="1",window="none",layers="2"}'] == 16  # slots
    assert m['kvlm_kv_group_blocks_used{group="1",window="none",layers="2"}'] == 0
    assert status == 200
    view = json.loads(text)
    groups = view["groups"]
    assert [(g["kind"], g["layers"]) for g in groups] == [("attention", [1, 3]), ("conv", [0, 2])]
    assert groups[1]["blocks_with_rows"] > 0  # the answers' blocks' end rows, for hits
    assert view["decode_step"] == "fused"


# ----------------------------------------------------- the engine's pool through the fused step

# the pool's fused tests: low-bit weights under the defaults (int16 activations, fp16 K/V
# where the CPU has them: what `kvlm serve` of such a model runs)
POOL_FUSED = {"lfm2": "int8", "lfm2-bias-k4": "int4"}


@functools.cache
def pool_fused_llm(folder, weights: str, exact_products: bool = False, **options) -> LLM:
    """`exact_products`: fp32 activations and prompt products, so that a sequence's rows
    recomputed as a prompt (a preemption's, a prefix's) are the bits its decode rows made."""
    if exact_products:
        options |= {"activations": "fp32", "prefill_dtype": "fp32"}
    return LLM(model=folder, kv="paged", weights=weights, progress=False, **options)


@pytest.mark.parametrize("name", list(POOL_FUSED))
def test_the_pools_fused_step_batches_forks_and_drafts_as_alone(lfm2_dir, name, monkeypatch):
    """The fused step on the engine's pool reads and writes each sequence's conv slot (a
    ring a slot, kvlm_conv_view's CONV_SLOTS): the prompts batched, n = 2 (a forked slot),
    prompt lookup's drafts and a draft model's (a draft's rows one sequence to the
    convolution, the rejected rolled back in the ring) each give every prompt's tokens
    alone, every decode row through the fused step."""
    llm = pool_fused_llm(lfm2_dir(name), POOL_FUSED[name])
    other = {"int8": "int4", "int4": "int8"}[POOL_FUSED[name]]  # a draft model that errs

    def no_slot_held(engine) -> None:
        assert engine.pool.conv.num_used == 0

    assert_pool_fused_as_alone(llm, monkeypatch, other, no_slot_held)


def test_the_pools_fused_step_after_preemptions(lfm2_dir, monkeypatch):
    """A pool too small for every sequence's growth, decoding through the fused step: the
    preempted sequences' slots freed and recomputed (whole, or from their sealed blocks'
    end rows that the fused step's decode rows wrote), each prompt's tokens alone."""
    llm = pool_fused_llm(lfm2_dir("lfm2"), "int8", True, max_context=96)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = alone_on_cache(llm, POOL_PROMPTS, long)
    calls = counted_fused_runs(monkeypatch)
    for prefix_caching in (False, True):
        calls.clear()
        got, engine = on_pool(llm, POOL_PROMPTS, long, num_blocks=8,
                              prefix_caching=prefix_caching)  # fmt: skip
        assert got == want
        assert engine.scheduler.preemptions > 0 and engine.pool.conv.num_used == 0
        assert_all_fused(calls, engine)


def test_a_prefix_hit_on_blocks_the_fused_step_sealed(lfm2_dir, monkeypatch):
    """Blocks sealed by the fused step's decode rows keep their end rows (copied from the
    slot's ring after the step, ConvSlots.written): a prompt that is a first answer's
    tokens and more hits those blocks, restores the slot from the last one's rows, and
    answers as a fresh pool does; a chat's second turn likewise."""
    llm = pool_fused_llm(lfm2_dir("lfm2"), "int8", True)
    first = llm.tokenizer.encode(PROMPT)[:10]
    calls = counted_fused_runs(monkeypatch)
    engine = fresh_engine(llm)
    answer_ids, _ = answer(engine, first, SamplingParams(max_tokens=30, temperature=0.0,
                                                         ignore_eos=True))  # fmt: skip
    assert_all_fused(calls, engine)
    # 10 + 29 tokens computed: blocks 0 and 1 sealed, each at a decode row
    assert engine.pool.conv.blocks_with_rows == 2
    second = first + answer_ids + llm.tokenizer.encode(" And Spain?")[1:]
    want, cold = answer(fresh_engine(llm), second)
    got, cached = answer(engine, second)
    assert cold == 0 and cached == 32 and got == want
    assert engine.manager.stats.window_cut == 0
    first_turn, second_turn = conversation(llm)
    want = answer(fresh_engine(llm), second_turn)[0]
    engine = fresh_engine(llm)
    answer(engine, first_turn)
    got, cached = answer(engine, second_turn)
    assert got == want and cached >= (len(first_turn) // 16) * 16 > 0


def test_a_failed_fused_step_leaves_the_slots_as_they_were(lfm2_dir):
    """A fused step on the pool that the C step refuses (a row's block table that does not
    cover its position) raises, and every slot's rings, end rows and ends are as they
    were, the other row's too; the same step with good tables then moves the rows on."""
    llm = pool_fused_llm(lfm2_dir("lfm2"), "int8")
    engine, step, starts, others = a_refused_pool_step(llm)
    conv = engine.pool.conv
    before = (conv.rows.clone(), conv.ends.clone(), list(conv.end), list(conv.first))
    with pytest.raises(ValueError, match="fused decode step refused"):
        step(good=False)
    assert torch.equal(conv.rows, before[0]) and torch.equal(conv.ends, before[1])
    assert (conv.end, conv.first) == (before[2], before[3])
    step(good=True)
    assert not torch.equal(conv.rows, before[0])
    assert [conv.end[t[0]] for t in others[0]] == [s + 1 for s in starts]


# ---------------------------------------------------------------------- the fused C step

FUSED_CONTEXT = 256
KV_DTYPES = ["fp32", "int8", "q4"]
# each tiny model's low-bit weights in the fused tests: both kinds over the layer orders
FUSED_WEIGHTS = {"lfm2": "int8", "lfm2-attention-first": "int4", "lfm2-convs-last": "int8",
                 "lfm2-bias-k4": "int4", "lfm2-k4": "int8"}  # fmt: skip


@functools.cache
def fused_llm(folder, weights: str, kv_dtype: str = "fp32", dtype: str = "fp32") -> LLM:
    """Low-bit weights on fp32 activations and prompt products (the exact products the
    fused step and the torch step share), in `dtype` (fp64: the exact result)."""
    return LLM(model=folder, progress=False, max_context=FUSED_CONTEXT, weights=weights,
               kv_dtype=kv_dtype, dtype=dtype, activations="fp32",
               prefill_dtype="fp32")  # fmt: skip


def exact_rows(llm: LLM, ids: list[int], n: int) -> torch.Tensor:
    """The conv layers' last n input rows after `ids`, (conv layers, 1, n, H), computed by
    `llm` (fp64: exact) with rows of its own dtype carried beside a cache."""
    return carried(llm, ids, [len(ids)])[2].rows[:, :, -n:]


def held_rows(cache, n: int) -> torch.Tensor:
    """The last n rows a cache's conv part holds before its length."""
    return cache.parts[-1].rows.at_length()[:, :, -n:]


def factor_for(kv_dtype: str) -> float:
    """The fused step also rounds each query head to int8 over an int8 or q4 cache
    (test_fused_arch.INT8_QUERIES)."""
    from test_fused_arch import INT8_QUERIES

    return INT8_QUERIES if kv_dtype in ("int8", "q4") else SAME_ROUNDING


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("name", list(LFM2_MODELS))
def test_the_fused_step_tracks_the_torch_model(lfm2_dir, name, kv_dtype, mode):
    """40 fused steps against the torch model fed the same tokens, each over its own cache,
    both held to the exact (fp64) result: the fused logits as close to it as the torch
    path's (int8 and q4 K/V: with the int8 queries' rounding), each side's best token in
    the other's top 5; and the conv rows the fused step moved on in place (the last
    kernel - 1 + 8, past where a misplaced row would sit) as close to the exact ones as
    the torch step's."""
    folder, weights = lfm2_dir(name), FUSED_WEIGHTS[name]
    llm = fused_llm(folder, weights, kv_dtype)
    prompt = prompt_ids(llm, 20)
    tokens, fused, ref, fused_cache, torch_cache = fused_and_torch(llm, prompt, 40, mode)
    exact_llm = fused_llm(folder, weights, dtype="fp64")
    ids = prompt + tokens
    exact = exact_llm.runner.logits(ids, exact_llm.new_cache("off"))[len(prompt) :]
    assert_as_exact_as(fused, ref, exact, factor_for(kv_dtype))
    assert_top_k_both_ways(fused, ref)
    n = llm.config.conv_kernel - 1 + 8
    want = exact_rows(exact_llm, ids, n)
    assert_as_exact_as(held_rows(fused_cache, n), held_rows(torch_cache, n), want)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_generate_decodes_through_the_fused_step(lfm2_dir, mode, kv_dtype, monkeypatch):
    """LLM.generate decodes every token after the prefill's through the fused step (one
    call of one row each), its greedy tokens the torch step's (equal up to a first
    divergence, where each side's token is in the other's top 5)."""

    llm = fused_llm(lfm2_dir("lfm2-bias-k4"), "int4", kv_dtype)
    n, prompt = 48, prompt_ids(llm, 8)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    calls = counted_fused_runs(monkeypatch)
    fused = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert calls == [1] * (n - 1)
    reason, llm.runner.fused_reason = llm.runner.fused_reason, "off for the comparison"
    try:
        ref = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        ref_logits = llm.runner.logits(prompt + ref.token_ids[:-1], llm.new_cache(mode))
    finally:
        llm.runner.fused_reason = reason
    assert len(calls) == n - 1  # the torch runs did not call it
    assert_greedy_agreement(fused.token_ids, [list(lp.top) for lp in fused.logprobs],
                            ref.token_ids, ref_logits[len(prompt) - 1 :])  # fmt: skip


def test_the_conv_products_take_their_own_activation_setting(lfm2_dir):
    """--activations int8 rounds every product's input, the conv layers' in_proj and
    out_proj too (their own bits of the fused step's masks): the two steps differ by
    summation order only, with those two on int8 or on fp32 while the rest stay on int8;
    and turning them to fp32 moves the logits far more than that."""
    llm = LLM(model=lfm2_dir("lfm2"), progress=False, max_context=FUSED_CONTEXT,
              weights="int8", activations="int8", prefill_dtype="fp32")  # fmt: skip
    prompt = prompt_ids(llm, 12)
    _, every, every_ref, *_ = fused_and_torch(llm, prompt, 6)
    convs = [b.conv for b in llm.model.layers if b.conv is not None]
    assert all(c.in_proj.act_int8 and c.out_proj.act_int8 for c in convs)
    for conv in convs:
        conv.in_proj.act_int8 = conv.out_proj.act_int8 = False
    _, mixed, mixed_ref, *_ = fused_and_torch(llm, prompt, 6)
    order = max(max_error(every, every_ref), max_error(mixed, mixed_ref))
    assert max_error(mixed, mixed_ref) <= 4 * max_error(every, every_ref)
    assert max_error(mixed[0], every[0]) > 4 * order  # step 0: the same prefix
    assert_top_k_both_ways(mixed, mixed_ref)


def test_fused_steps_after_a_chunked_prompt_equal_those_after_one_shot(lfm2_dir):
    """A prompt fed in chunks of 7 across the kernel's edge leaves the rows a one-shot
    prompt leaves, bit for bit, so the fused steps after either give the same logits and
    move the rows on alike."""
    llm = fused_llm(lfm2_dir("lfm2-bias-k4"), "int4")
    ids, steps = prompt_ids(llm, 28), prompt_ids(llm, 40)[28:]
    caches = [llm.new_cache("contiguous") for _ in range(2)]
    fed(llm, ids, [7] * 4, caches[0])
    fed(llm, ids, [28], caches[1])
    assert llm.runner.fused_for(caches[0]) is not None
    logits = [torch.stack([llm.runner.forward([t], c) for t in steps]) for c in caches]
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(held_rows(caches[0], 35), held_rows(caches[1], 35))


def test_fused_and_torch_steps_take_turns_on_one_cache(lfm2_dir):
    """Each step reads the rows the other left (the fused step's in place, the torch
    step's ConvRows.commit), so steps taking turns are as exact as the torch step alone."""
    folder = lfm2_dir("lfm2")
    llm = fused_llm(folder, "int8")
    prompt = prompt_ids(llm, 12)
    tokens, _, ref, _, _ = fused_and_torch(llm, prompt, 24)
    cache, runner, turns = llm.new_cache("contiguous"), llm.runner, []
    runner.forward(prompt, cache)
    for i, t in enumerate(tokens):
        runner.fused_reason = None if i % 3 else "off: the torch step's turn"
        try:
            turns.append(runner.forward([t], cache))
        finally:
            runner.fused_reason = None
    exact_llm = fused_llm(folder, "int8", dtype="fp64")
    exact = exact_llm.runner.logits(prompt + tokens, exact_llm.new_cache("off"))[len(prompt) :]
    assert_as_exact_as(torch.stack(turns), ref, exact)


@pytest.mark.parametrize("reject", [0, 1, 3, 5])
def test_a_draft_through_the_fused_step_rolls_back(lfm2_dir, reject, monkeypatch):
    """The last token and a draft of 5 checked as 6 rows of one fused step (one sequence
    to the convolution: each row reads the rows of those before it), `reject` of them
    rolled back: each kept row's logits are those of the fused step fed its token alone,
    the rows held then bit for bit those of a cache fed the kept tokens one at a time, and
    so are the next tokens' logits."""
    llm = fused_llm(lfm2_dir("lfm2-k4"), "int8", "int8")
    ids, draft = prompt_ids(llm, 30), prompt_ids(llm, 40)[30:35]
    a, b = fused_draft_rolled_back(llm, ids, draft, reject, monkeypatch)
    keep = a.parts[-1].rows.keep - reject  # a's rows below the rollback: zeros, not held
    assert torch.equal(held_rows(a, keep), held_rows(b, keep))
    for t in ids[:4]:
        assert torch.equal(llm.runner.forward([t], a), llm.runner.forward([t], b))


def test_ngram_drafts_through_the_fused_step_keep_the_plain_tokens(lfm2_dir, monkeypatch):
    """Prompt lookup's drafts checked as rows of one fused step, the rejected rolled back
    (the conv rows within their slack): the plain greedy tokens, which the fused step
    decodes too."""
    from tqdm import tqdm

    from kvlm.engine.batch import run_batch
    from kvlm.engine.speculative import SpeculativeConfig

    folder = lfm2_dir("lfm2")
    options = {"model": folder, "progress": False, "weights": "int8", "kv": "contiguous"}
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = [PROMPT, "One two three, one two three, one two"]
    calls = counted_fused_runs(monkeypatch)
    # one prompt a call: its own cache (more go to the engine's pool: the tests above)
    llm = LLM(**options)
    plain = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert set(calls) == {1}
    # drafts on the LLM's own cache (LLM.generate sends them to the pool)
    spec = LLM(**options, speculative=SpeculativeConfig("ngram", ngram_min=1))
    one, bar = spec.cache_engine(), tqdm(disable=True)
    runs = [run_batch(one, [(p, spec.tokenizer.encode(p))], [greedy], bar)[0] for p in prompts]
    assert [r.outputs[0].token_ids for r in runs] == plain
    assert max(calls) > 1  # drafts went through it


def test_forked_rows_in_one_fused_step_are_each_alone(lfm2_dir):
    """A prompt's cache forked into 3 rows fed different tokens: each row of the fused
    step reads and moves on its own sequence's rows, its logits bit for bit those of a
    cache fed its tokens alone."""

    llm = fused_llm(lfm2_dir("lfm2-convs-last"), "int8")
    assert_forked_rows_alone(llm, prompt_ids(llm, 20), prompt_ids(llm, 40)[20:])


@pytest.mark.parametrize("march", portable_build_params())
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_the_portable_builds_run_it_alike(lfm2_dir, march, kv_dtype):
    """The scalar build and the AVX2 halves: the conv layers' arithmetic is the same
    operations in the same order on every build, the rest as the other families'
    (test_fused_arch): the logits of 24 fused steps as close to the exact ones as the
    native build's, and each side's conv rows as close as the other's."""
    from kvlm import kernels

    folder = lfm2_dir("lfm2-bias-k4")
    llm = fused_llm(folder, "int4", kv_dtype)
    prompt, steps = prompt_ids(llm, 12), prompt_ids(llm, 36)[12:]
    logits, rows = [], []
    for lib in (kernels.library(), portable_kernels(march)):
        got, cache = fused_steps_on(llm, lib, prompt, steps)
        logits.append(got)
        rows.append(held_rows(cache, 10))
    exact_llm = fused_llm(folder, "int4", dtype="fp64")
    ids = prompt + steps
    exact = exact_llm.runner.logits(ids, exact_llm.new_cache("off"))[len(prompt) :]
    want = exact_rows(exact_llm, ids, 10)
    factor = factor_for(kv_dtype)
    for got, ref in ((logits, exact), (rows, want)):
        assert_as_exact_as(got[1], got[0], ref, factor)
        assert_as_exact_as(got[0], got[1], ref, factor)


# ------------------------------------------------------------------- llama.cpp's converter


@pytest.fixture(scope="module")
def converted(lfm2_dir):
    """name -> (the HF folder, the f32 GGUF llama.cpp's convert_hf_to_gguf.py writes)."""
    return lambda name: (lfm2_dir(name), converter.convert(lfm2_dir(name), pre="lfm2"))


@pytest.mark.parametrize("name", ["lfm2", "lfm2-attention-first", "lfm2-k4"])
def test_gguf_from_llama_cpps_converter_reads_as_the_folder(converted, name):
    """The file users get: the same config (but the epsilon, stored in fp32) and logits as
    close to the exact ones as the folder's through kvlm. (Not of a model with conv
    biases: the converter squeezes the kernel's bias as it does the kernel, and fails.)"""
    folder, path = converted(name)
    from_gguf, from_hf = gguf_as_folder(path, folder)
    ids = prompt_ids(from_hf)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    ref = from_hf.runner.logits(ids, from_hf.new_cache("off"))
    assert_as_exact_as(ours, ref, hf_logits(folder, ids, torch.float64))


def test_gguf_vocabulary_and_template_read_as_transformers(converted):
    """The vocabulary's pre-tokenizer "lfm2" is Llama 3's: the file's ids are transformers' for the
    folder (a BOS before each text), and its chat template renders as transformers'."""
    from transformers import AutoTokenizer

    folder, path = converted("lfm2")
    ours = LLM(model=path, kv="off", progress=False).tokenizer
    ref = AutoTokenizer.from_pretrained(folder)
    for text in ["The quick brown fox.", "  runs   of\n\n spaces\t", "12345 3.14159 café", "I'll"]:
        assert ours.encode(text) == ref.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, add_generation_prompt=True) == want
    assert want.startswith("<s><|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_a_q8_0_gguf_takes_the_fused_step(converted, mode):
    """--weights native on llama.cpp's Q8_0 file: every projection, the conv layers' in the
    file's blocks, goes to the fused step, its logits over 40 steps as close to the exact
    ones as the torch step's."""
    folder, _ = converted("lfm2")
    path = converter.convert(folder, outtype="q8_0", pre="lfm2")
    llm = fused_llm(path, "native")
    assert llm.runner.fused_reason is None, llm.runner.fused_reason
    conv = llm.model.layers[0].conv  # the file's Q8_0 blocks: kvlm's q8
    assert conv.in_proj.quant.kind == conv.out_proj.quant.kind == "q8"
    prompt = prompt_ids(llm, 16)
    tokens, fused, ref, _, _ = fused_and_torch(llm, prompt, 40, mode)
    exact_llm = fused_llm(path, "native", dtype="fp64")
    exact = exact_llm.runner.logits(prompt + tokens, exact_llm.new_cache("off"))[len(prompt) :]
    assert_as_exact_as(fused, ref, exact)
    assert_top_k_both_ways(fused, ref)


def test_a_quantized_gguf_follows_hf(converted):
    """--outtype q8_0 (llama.cpp's Q8_0 products; the conv kernels, 3 wide, stay as they
    were): greedy tokens by the top-5 rule against transformers' fp32."""
    folder, _ = converted("lfm2")
    path = converter.convert(folder, outtype="q8_0", pre="lfm2")
    llm = LLM(model=path, kv="off", progress=False)
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, 16)
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


# ---------------------------------------------------------------------------- config keys


def hf_cfg(**changes) -> dict:
    cfg = {"model_type": "lfm2", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "layer_types": [C, A, C, A], "block_multiple_of": 32}  # fmt: skip
    return {k: v for k, v in {**cfg, **changes}.items() if v is not None}


def gguf_meta(**changes) -> dict:
    meta = {"general.architecture": "lfm2", "lfm2.embedding_length": 64,
            "lfm2.attention.head_count": 4, "lfm2.attention.head_count_kv": [0, 2, 0, 2],
            "lfm2.feed_forward_length": 96, "lfm2.block_count": 4, "lfm2.vocab_size": 64,
            "lfm2.shortconv.l_cache": 3}  # fmt: skip
    return {k: v for k, v in {**meta, **changes}.items() if v is not None}


def test_the_mlp_width_is_derived_as_transformers_and_llama_cpp_do():
    """LFM2-350M's and 1.2B's block_ff_dim (6656, 12288) give the widths llama.cpp names
    those models by (4608, 8192); without the multiplier transformers does not round."""
    from kvlm.arch import config_from_hf

    real = {"block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0}
    for ff, want in ((6656, 4608), (12288, 8192)):
        assert config_from_hf(hf_cfg(block_ff_dim=ff, **real)).intermediate_size == want
    unrounded = {**hf_cfg(), "block_ffn_dim_multiplier": None}
    assert config_from_hf(unrounded).intermediate_size == 85
    assert config_from_hf(hf_cfg(block_auto_adjust_ff_dim=False)).intermediate_size == 128
    old = hf_cfg(layer_types=None, full_attn_idxs=[1, 3])  # the Hub's first configs
    assert config_from_hf(old).layer_mixers == ("conv", "attention", "conv", "attention")


def test_hostile_config_keys_are_refused():
    from kvlm.arch import config_from_gguf, config_from_hf
    from kvlm.errors import ModelLoadError, UnsupportedModelError

    bad_hf = [
        ({"layer_types": "conv"}, ModelLoadError, "layer_types is a string"),
        ({"layer_types": [C, A]}, ModelLoadError, "names 2 layers; num_hidden_layers is 4"),
        ({"layer_types": [C, A, "mamba", A]}, UnsupportedModelError, "layer types .'mamba'."),
        ({"layer_types": None, "full_attn_idxs": [1, 9]}, ModelLoadError, "full_attn_idxs"),
        ({"conv_L_cache": 1}, ModelLoadError, "conv_L_cache is 1; expected an integer at least 2"),
        ({"norm_eps": -1.0}, ModelLoadError, "norm_eps is -1.0"),
        ({"block_multiple_of": 0}, ModelLoadError, "block_multiple_of is 0"),
    ]
    for changes, error, said in bad_hf:
        with pytest.raises(error, match=said):
            config_from_hf(hf_cfg(**changes))
    bad_gguf = [
        ({"lfm2.attention.head_count_kv": [0, 2, 0]}, ModelLoadError, "names 3 layers"),
        ({"lfm2.attention.head_count_kv": [0, 2, 0, 1]}, UnsupportedModelError, r"\[1, 2\]"),
        ({"lfm2.attention.head_count_kv": [0, -2, 0, 2]}, ModelLoadError, "an entry of lfm2"),
        ({"lfm2.shortconv.l_cache": None}, UnsupportedModelError, "lacks lfm2.shortconv.l_cache"),
        ({"lfm2.shortconv.l_cache": 1000}, ModelLoadError, "l_cache is 1000"),
        ({"lfm2.attention.sliding_window": 8}, UnsupportedModelError, "windowed attention"),
    ]
    for changes, error, said in bad_gguf:
        with pytest.raises(error, match=said):
            config_from_gguf(gguf_meta(**changes))
    c = config_from_gguf(gguf_meta())
    assert (c.layer_mixers, c.num_kv_heads, c.conv_kernel) == (("conv", "attention") * 2, 2, 3)
