"""Granite 4.0-H: Mamba2 layers beside attention without RoPE (kvlm.model.mamba2;
ModelConfig's rope, residual_scale and logit_scale), against transformers'
GraniteMoeHybridForCausalLM on tiny random-weight models of several layer orders and
group counts; then the state in every cache mode, the pool (snapshots, prefix hits, forks,
preemption), speculative decoding, chat checkpoints and cache files: the recurrent-state
machinery test_qwen35.py holds for the gated DeltaNet, here for the second recurrent kind;
then the GGUF files llama.cpp's own converter writes for them (tests/converter.py).

The exact reference is transformers in fp64 with its fp32 casts lifted (`exact_hf`: the
layer's exp(A_log), its chunked scan and decode update, its gated norm), as test_qwen35's
for the delta rule."""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import replace

import pytest
import torch

import converter
from helpers import (
    FRANCE,
    GREEDY,
    POOL_PROMPTS,
    answer,
    assert_greedy_agreement,
    conversation,
    fed,
    fresh_engine,
    hf64,
    hf_greedy,
    hf_logits,
    load_hf,
    model_maker,
    on_pool,
    prompt_ids,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams
from kvlm.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from numerics import assert_as_exact_as, fp64_reorder_bound, max_error

M, A = "linear_attention", "full_attention"  # transformers 5's names (the Hub's: below)
# name -> (seed, transformers config overrides): the layer orders and variants (the
# helpers' config: M A M M, 8 heads of 16, 2 groups of a state of 16, kernel 4, NoPE)
GRANITE_MODELS = {
    "granite": (40, {}),
    # attention first; one group (every head reads the same B and C); a kernel of 3
    "granite-one-group": (41, {"layer_types": [A, M, M, M], "mamba_n_groups": 1,
                               "mamba_d_conv": 3}),
    # RoPE on (position_embedding_type "rope"), the multipliers at 1 but the attention's,
    # biases in the Mamba2 projections and the attention
    "granite-rope-bias": (42, {"layer_types": [M, M, A, M], "position_embedding_type": "rope",
                               "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                               "logits_scaling": 1.0, "mamba_proj_bias": True,
                               "attention_bias": True}),
}  # fmt: skip
# the MoE sizes (Tiny, Small): 8 experts of the MLP's width, the top 2, the shared MLP beside
# them; read from GGUF here (tests/test_qwen3moe.py: the folder)
GRANITE_MOE = {"granite-moe": (60, {"num_local_experts": 8, "num_experts_per_tok": 2})}


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory):
    return model_maker(tmp_path_factory, "granitemoehybrid", GRANITE_MODELS | GRANITE_MOE)


def _lifted(fn, *edits: tuple[str, str]):
    """`fn` (a module function or a method) recompiled from its own source with `edits`
    (old, new) made, its decorators dropped."""
    src = textwrap.dedent(inspect.getsource(fn))
    src = src[src.index("def ") :]
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new)
    module = inspect.getmodule(fn)
    scope: dict = {}
    exec(compile(src, module.__file__, "exec"), module.__dict__, scope)
    return scope[fn.__name__]


@pytest.fixture(scope="module", autouse=True)
def exact_hf():
    """transformers' Mamba2 layer in its inputs' dtype: A = -exp(A_log) not in fp32, the
    chunked scan and the decode update without their .float(), the gated norm in the input's
    dtype."""
    import transformers.models.granitemoehybrid.modeling_granitemoehybrid as m

    layer, norm = m.GraniteMoeHybridMambaLayer, m.GraniteMoeHybridRMSNormGated
    saved = [(m, "mamba2_chunk_scan", m.mamba2_chunk_scan),
             (m, "mamba2_selective_state_update", m.mamba2_selective_state_update),
             (layer, "forward", layer.forward), (norm, "forward", norm.forward)]  # fmt: skip
    m.mamba2_chunk_scan = _lifted(m.mamba2_chunk_scan, (".float()", ".to(dt.dtype)"))
    m.mamba2_selective_state_update = _lifted(
        m.mamba2_selective_state_update, (".float()", ".to(state.dtype)"))  # fmt: skip
    layer.forward = _lifted(layer.forward, ("self.A_log.float()", "self.A_log"))
    norm.forward = _lifted(norm.forward, ("torch.float32", "input_dtype"))
    yield
    for owner, name, fn in saved:
        setattr(owner, name, fn)


@pytest.mark.parametrize("name", list(GRANITE_MODELS))
def test_config_read_from_folder(granite_dir, name):
    folder = granite_dir(name)
    config, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder).config
    mixers = {"linear_attention": "mamba2", "full_attention": "attention"}
    assert config.architecture == "granitehybrid"
    assert config.layer_mixers == tuple(mixers[t] for t in hf.layer_types)
    m = config.mamba2
    assert (m.heads, m.head_dim, m.state_size, m.groups, m.conv_kernel) == (
        hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups,
        hf.mamba_d_conv)  # fmt: skip
    assert config.rope == (hf.position_embedding_type == "rope")
    assert config.query_scale == hf.attention_multiplier
    assert config.intermediate_size == hf.shared_intermediate_size
    ones = {None: 1.0}
    assert ones.get(config.embed_scale, config.embed_scale) == hf.embedding_multiplier
    assert ones.get(config.residual_scale, config.residual_scale) == hf.residual_multiplier
    assert ones.get(config.logit_scale, config.logit_scale) == hf.logits_scaling


def test_the_hubs_layer_type_names_read_alike(granite_dir, tmp_path):
    """The Hub's config.json files name the layers "mamba" and "attention" (transformers 5
    reads them as its own names): the same config either way."""
    folder = granite_dir("granite")
    hub = hub_folder(folder, tmp_path / "hub")
    ours = LLM(model=hub, kv="off", progress=False).config
    assert ours == replace(LLM(model=folder, kv="off", progress=False).config, name=hub.name)


@pytest.mark.parametrize("name", list(GRANITE_MODELS))
def test_teacher_forced_logits_match_hf(granite_dir, name):
    """Every position's logits over 40 tokens, the exact path: as close to the exact
    result as transformers' own fp32 logits (tests/numerics.py)."""
    folder = granite_dir(name)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours, ref = llm.runner.logits(ids, llm.new_cache("off")), hf_logits(load_hf(folder), ids)
    assert_as_exact_as(ours, ref, hf_logits(folder, ids, torch.float64))


@pytest.mark.parametrize("name", ["granite", "granite-rope-bias"])
def test_greedy_tokens_equal_hf(granite_dir, name):
    """16 greedy tokens through LLM.generate (kv off): in fp64 the same tokens as
    transformers in fp64 (its decode path: the Mamba2 update a token at a time); in fp32
    by default numerics, the top-5 rule against its fp32."""
    from transformers import AutoModelForCausalLM

    folder, n = granite_dir(name), 16
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    ids = fp64.tokenizer.encode(FRANCE)
    hf64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf64, ids, n)[0]
    llm = LLM(model=folder, kv="off", progress=False)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, n)
    tops = [list(lp.top) for lp in out.logprobs]
    assert_greedy_agreement(out.token_ids, tops, ref_ids, ref_logits)


def test_the_mamba_layer_and_the_multipliers_are_applied(granite_dir):
    """Each part matters: the convolution reduced to its last tap, D zeroed, the residual
    or logit multiplier dropped, or RoPE turned on where the model has none, moves the
    logits by far more than rounding (so the tests above can fail)."""
    folder = granite_dir("granite")
    ids = prompt_ids(LLM(model=folder, kv="off", progress=False))
    exact = hf_logits(folder, ids, torch.float64)

    def error(**changes) -> float:
        llm = LLM(model=folder, kv="off", exact=True, progress=False)
        if changes:
            llm = LLM(model=folder, kv="off", exact=True, progress=False)
            llm.model.config = replace(llm.config, **changes)
            for layer in llm.model.layers:
                layer.residual_scale = llm.model.config.residual_scale
            if "rope" in changes:
                from kvlm.model.layers import RotaryEmbedding

                llm.model.rope = RotaryEmbedding(llm.model.config)
        return max_error(llm.runner.logits(ids, llm.new_cache("off")), exact), llm

    before, llm = error()
    mixer = llm.model.layers[0].recurrent
    kernel = mixer.kernel.data.clone()
    mixer.kernel.data[:-1] = 0
    assert max_error(llm.runner.logits(ids, llm.new_cache("off")), exact) > 1000 * before
    mixer.kernel.data, mixer.d.data[:] = kernel, 0
    assert max_error(llm.runner.logits(ids, llm.new_cache("off")), exact) > 1000 * before
    for change in ({"residual_scale": None}, {"logit_scale": None}, {"rope": True}):
        assert error(**change)[0] > 1000 * before, change


STATE_MODES = ["basic", "contiguous", "paged", "int8", "window"]


def cut(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


@pytest.mark.parametrize("mode", STATE_MODES)
def test_every_mode_keeps_the_state_chunked_equals_one_shot(granite_dir, mode):
    """Every one-sequence mode keeps the Mamba2 layers' state as its cache's state group:
    chunks of 1, 3 and 5 (below and above the kernel of 4) give the one-shot prefill's
    logits bit for bit but where K/V rows are read another way (int8 rows, the window's
    ring: as exactly as the one shot); in fp64 within the reordering bound."""
    folder = granite_dir("granite")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    fp64 = LLM(model=folder, kv=mode, dtype="fp64", progress=False)
    ids = prompt_ids(llm)
    exact = hf_logits(folder, ids, torch.float64)
    one_shot, one_shot64 = fed(llm, ids, [len(ids)]), fed(fp64, ids, [len(ids)])
    off = LLM(model=folder, kv="off", exact=True, progress=False)
    off_shot = off.runner.logits(ids, off.new_cache("off"))
    for size in (1, 3, 5):
        chunked = fed(llm, ids, cut(len(ids), size))
        if mode in ("int8", "window"):
            assert_as_exact_as(chunked, one_shot, exact)
        else:  # bit for bit (kernels/mamba2.c: each value one way wherever it falls)
            assert torch.equal(chunked, one_shot), (size, max_error(chunked, one_shot))
        far = max_error(fed(fp64, ids, cut(len(ids), size)), one_shot64)
        assert far <= fp64_reorder_bound(max_error(off_shot, exact)) or mode == "int8", size
    if mode in ("basic", "contiguous", "paged"):
        assert torch.equal(one_shot, off_shot)


@pytest.mark.parametrize("mode", STATE_MODES)
def test_generate_in_every_mode_and_forks_equal_kv_off(granite_dir, mode):
    """Greedy tokens in every mode = kv off's (int8: its own alone); n = 2 greedy samples
    (a fork of the state) = the one; two prompts batched = each alone."""
    folder = granite_dir("granite-one-group")
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [FRANCE, "One two three, one two three, one two"]
    llm = LLM(model=folder, kv=mode, progress=False)
    # int8 K/V rows are not kv off's: there, each prompt alone on the same cache mode
    off = llm if mode == "int8" else LLM(model=folder, kv="off", progress=False)
    alone = [off.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], replace(greedy, n=2))
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2


def test_a_rows_bits_are_the_same_on_one_thread_or_two(granite_dir):
    """kvlm_mamba2 splits its (sequence, head) pairs and its norm's (row, group) pairs
    between threads: one thread or two, the same bits; and it refuses a shape out of range
    (-2, nothing written)."""
    from kvlm import kernels

    llm = LLM(model=granite_dir("granite"), kv="contiguous", progress=False, threads=2)
    ids, runs, before = prompt_ids(llm), [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = llm.new_cache()
            prompt = fed(llm, ids, [len(ids)], cache)
            decode = torch.stack([llm.runner.forward([7 + i], cache) for i in range(6)])
            runs.append((prompt, decode))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    lib = kernels.library()
    buf = torch.zeros(4096)
    cu = torch.tensor([0, 1], dtype=torch.int64)
    p, n = buf.data_ptr(), buf.numel()
    args = [p, n, p, n, p, n, p, p, p, 8, p, 128, 1e-6, None, p, n, p, n, cu.data_ptr(), 2,
            None, 0, None, 0, 1, 8, 16, 16, 2]  # fmt: skip
    assert lib.kvlm_mamba2(*args) == 0
    for i, bad in ((26, 513), (28, 3), (1, 10), (9, 7)):  # hd, groups, conv's floats, hn
        assert lib.kvlm_mamba2(*args[:i], bad, *args[i + 1 :]) == -2, i


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_a_chat_turn_resumes_from_the_state_where_its_reply_began(granite_dir, mode):
    """A chat session's next turn rolls back to the state kept where the last turn's
    generation prompt began and prefills only the rest; its replies are a kv-off
    session's; back past what is kept is refused."""
    folder = granite_dir("granite")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm, off = (LLM(model=folder, kv=mode, progress=False),
                LLM(model=folder, kv="off", progress=False))  # fmt: skip
    one, ref = llm.chat_session(params), off.chat_session(params)
    turns = []
    for text in ("Hello there", "And then?", "Go on."):
        stream = one.send(text)
        assert "".join(stream) == "".join(ref.send(text))
        prompt = llm.tokenizer.encode_chat(one.messages)
        began = len(llm.tokenizer.encode_chat(one.messages, add_generation_prompt=False))
        turns.append((len(prompt), began, stream.output.metrics.prefill_tokens))
    (n1, b1, p1), (n2, b2, p2), (n3, b3, p3) = turns
    assert p1 == n1 and p2 == n2 - b1 and p3 == n3 - b2, turns
    cache = one.cache
    assert not cache.can_roll_back(1) and cache.rollback_point(cache.num_tokens - 1) == b3
    with pytest.raises(InvalidRequestError, match="cannot forget"):
        cache.rollback(1)


def test_a_saved_conversation_continues_from_its_checkpoint(granite_dir, tmp_path):
    """A chat saved after two turns and loaded into a fresh session continues as the one
    that never stopped, prefilling as little (the file holds the state, its rows and the
    turns' checkpoints)."""
    llm = LLM(model=granite_dir("granite"), kv="paged", progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = llm.chat_session(params)
    for text in ("Hello there", "And then?"):
        "".join(one.send(text))
    path = tmp_path / "chat.kvc"
    one.save(path, llm.fingerprint)
    went_on = one.send("Go on.")
    text = "".join(went_on)
    two = llm.chat_session(params)
    two.load(path, llm.fingerprint)
    again = two.send("Go on.")
    assert "".join(again) == text and two.history == one.history
    assert again.output.metrics.prefill_tokens == went_on.output.metrics.prefill_tokens
    assert 0 < again.output.metrics.prefill_tokens < len(again.tokens) - 8


def test_speculative_decoding_on_one_cache_equals_plain(granite_dir):
    """Prompt lookup and a draft model (the file's int8 self) on one cache give plain
    greedy decoding's tokens: the state after each draft row kept, the rejected rows'
    rolled back to the accepted one's."""
    from kvlm.engine.speculative import SpeculativeConfig

    folder = granite_dir("granite")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(model=folder, kv="contiguous", progress=False)
    prompts = [llm.tokenizer.encode(p) for p in (FRANCE, "One two three, one two three, one two")]
    want = [answer(llm.cache_engine(), ids, greedy)[0] for ids in prompts]
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        spec = LLM(model=folder, kv="contiguous", speculative=how, progress=False)
        engine = spec.cache_engine()
        assert [answer(engine, ids, greedy)[0] for ids in prompts] == want, how.method
        st = engine.stats.spec
        assert st.drafted > 0 and (how.method == "ngram" or 0 < st.accepted < st.drafted), st


# ------------------------------------------------------------------- the engine's pool


@pytest.fixture(scope="module")
def pooled(granite_dir):
    llm = LLM(model=granite_dir("granite"), kv="paged", progress=False)
    alone = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    return llm, alone


def test_the_pool_batches_chunks_forks_and_preempts_as_alone(pooled):
    """Through the pool (a slot of Mamba2 state a sequence): batched, in chunks of 5, n = 2
    (the slot forked), preempted on a pool too small, and again as prefix hits: each
    prompt's tokens alone; every slot back at the end."""
    from kvlm.cache.recurrent import StateSlots

    llm, want = pooled
    got, engine = on_pool(llm, POOL_PROMPTS, GREEDY)
    state = engine.pool.groups[1]
    assert got == want and isinstance(state, StateSlots) and state.num_used == 0
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    two, engine = on_pool(llm, POOL_PROMPTS, SamplingParams(n=2, max_tokens=20, temperature=0.0,
                                                            ignore_eos=True))  # fmt: skip
    assert two == [w * 2 for w in want] and engine.pool.groups[1].num_used == 0
    small = LLM(model=llm.loaded.path, kv="paged", max_context=96, progress=False)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want_long = [[small.generate(p, long)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    got, engine = on_pool(small, POOL_PROMPTS, long, num_blocks=8)
    assert got == want_long and engine.scheduler.preemptions > 0
    again, engine = on_pool(llm, POOL_PROMPTS * 2, GREEDY, scheduler={"max_num_seqs": 3})
    assert again == want * 2 and engine.manager.stats.hits > 0


def test_a_prefix_hit_mid_conversation_restores_the_state(pooled):
    """A chat's second turn hits the first's blocks through the state's snapshot at the
    hit's last block end: the answer is a fresh pool's bit for bit; the snapshot forgotten,
    the hit is an earlier end or none, recomputed to the same tokens."""
    llm, _ = pooled
    first, second = conversation(llm)
    want, cold = answer(fresh_engine(llm), second)
    engine = fresh_engine(llm)
    answer(engine, first)
    got, cached = answer(engine, second)
    assert cold == 0 and got == want and cached >= (len(first) // 16) * 16 > 0
    state = engine.pool.groups[1]
    for block in engine.manager.match(second)[0]:
        state.forget(block)
    got, cached = answer(engine, second)
    assert got == want and cached == 0


def test_speculative_decoding_on_the_pool_equals_plain(pooled):
    """Through the pool: prompt lookup and the file's int8 self as draft model give every
    prompt's tokens alone, batched, drafts accepted and rejected (the state after each
    draft row kept until the sequence's next step, a rejected row's trim back to the
    accepted one's); every slot and draft state back at the end."""
    from kvlm.engine.speculative import SpeculativeConfig

    llm, want = pooled
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        got, engine = on_pool(llm, POOL_PROMPTS, GREEDY, speculative=how)
        st, state = engine.stats.spec, engine.pool.groups[1]
        assert got == want and st.drafted > 0, how.method
        assert how.method == "ngram" or 0 < st.accepted < st.drafted, st
        assert state.num_used == 0 and not state.drafted


def test_a_disk_tier_restores_the_state_snapshots(pooled, tmp_path, monkeypatch):
    """A disk tier holds the Mamba2 state's snapshots under the state group's own records
    (MAC'd as the K/V's): a restarted engine hits the first turn's prefix from the tier,
    state and all, with a fresh pool's tokens; records changed in one byte are refused
    (no state: no hit, the same tokens)."""
    from helpers import conversation_on_a_tier

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the tier key's home
    llm, _ = pooled
    first, second, want, tier, _ = conversation_on_a_tier(llm, tmp_path / "tier")
    reader = fresh_engine(llm, kv_tiers=tier)
    got, cached = answer(reader, second)
    reader.close()
    assert got == want and cached >= (len(first) // 16) * 16 > 0
    state_ns = reader.tiers.groups[0][0][:32]
    records = [f for f in (tmp_path / "tier").rglob("*") if f.is_file() and state_ns in f.name]
    assert records
    for f in records:
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    bent = fresh_engine(llm, kv_tiers=tier)
    got, cached = answer(bent, second)
    bent.close()
    assert got == want and cached == 0 and bent.tiers.stats["disk"].refused >= 1


def test_memory_counts_the_state_per_sequence(granite_dir, capsys):
    """`kvlm memory`: the Mamba2 layers' state a sequence whatever its length (heads x
    head_dim x state_size and kernel - 1 rows of x|B|C, fp32), the attention layer's K/V
    per token; a made cache holds what is planned."""
    from kvlm.cache import memory
    from kvlm.cli import main

    llm = LLM(model=granite_dir("granite"), kv="paged", progress=False)
    m, layers = llm.config.mamba2, len(llm.config.mamba2_layers)
    state = layers * (m.heads * m.head_dim * m.state_size
                      + (m.conv_kernel - 1) * m.conv_width) * 4  # fmt: skip
    groups = memory.layer_groups("paged", llm.cache_spec(), 64, 2)
    assert [g for g in groups if g["kind"] == "state"] == [
        {
            "kind": "state",
            "layers": layers,
            "window": None,
            "tokens": 0,
            "bytes": 2 * state,
            "snapshot_bytes": state,
        }
    ]
    assert llm.new_cache().parts[-1].nbytes == state
    assert main(["memory", "--model", str(llm.loaded.path), "--kv", "paged", "--context",
                 "64"]) == 0  # fmt: skip
    assert (
        f"{layers} recurrent layers, their state {state / 2**10:,.1f} KiB"
        in capsys.readouterr().out
    )


def test_hostile_config_keys_are_refused(tmp_path):
    """Sizes and kinds kvlm does not run are one clear error each, before any tensor."""
    base = save_tiny_model(tmp_path / "base", "granitemoehybrid", seed=43)
    cfg = json.loads((base / "config.json").read_text())
    cases = [
        # the MoE sizes read (tests/test_qwen3moe.py), but a dense file's are not theirs
        ({"num_local_experts": 4}, ModelLoadError, "num_experts_per_tok is 0"),
        ({"num_local_experts": 4, "num_experts_per_tok": 5}, ModelLoadError, "num_experts_per_tok"),
        (
            {"num_local_experts": 4, "num_experts_per_tok": 2},
            ModelLoadError,
            "no tensor .*block_sparse_moe",
        ),
        ({"time_step_limit": [0.0, 8.0]}, UnsupportedModelError, "time_step_limit"),
        ({"position_embedding_type": "alibi"}, UnsupportedModelError, "position_embedding"),
        ({"mamba_d_head": 12}, ModelLoadError, "mamba_d_head"),
        ({"mamba_n_groups": 3}, ModelLoadError, "mamba_n_groups"),
        ({"layer_types": ["mamba", "cross"] * 2}, UnsupportedModelError, "layer types"),
        ({"layer_types": ["mamba"] * 3}, ModelLoadError, "layer_types names 3"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
    ]
    for change, error, says in cases:
        folder = tmp_path / "bad"
        folder.mkdir(exist_ok=True)
        for f in base.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(error, match=says):
            LLM(model=folder, kv="off", progress=False)


# ------------------------------------------------------------------- GGUF files


def hub_folder(folder, dest):
    """`folder` as the Hub holds such a model: config.json's layer_types named "mamba" and
    "attention" (llama.cpp's converter finds the attention layers by that name alone)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    hub = {M: "mamba", A: "attention"}
    cfg["layer_types"] = [hub[t] for t in cfg["layer_types"]]
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def converted(granite_dir, tmp_path_factory):
    """Each model converted by llama.cpp's own convert_hf_to_gguf.py (f32 and Q8_0), from
    its folder as the Hub holds it."""
    out = {}

    def make(name: str, outtype: str = "f32"):
        if (name, outtype) not in out:
            folder = hub_folder(granite_dir(name), tmp_path_factory.mktemp(f"hub-{name}"))
            out[name, outtype] = converter.convert(folder, outtype)
        return out[name, outtype]

    return make


@pytest.mark.parametrize("name", ["granite", "granite-one-group", "granite-moe"])
def test_gguf_from_llama_cpps_converter_reads_as_the_folder(granite_dir, converted, name):
    """The converter's f32 file (its q/k rows permuted, A_log as -exp(A_log), D and the
    norm reshaped, gate|up split, the MLP's width as the shared expert's) reads to the
    folder's config and, on the exact path, the folder's logits within rounding (A_log
    taken back to a value of the same exp) and HF's greedy tokens. (The converter writes
    every granitehybrid file without RoPE whatever position_embedding_type says, and
    llama.cpp runs it so: kvlm reads the file's `rope.scaling.finetuned` as llama.cpp
    does; the Granite 4.0-H models are all NoPE.)"""
    folder, path = granite_dir(name), converted(name)
    gguf = LLM(model=path, kv="off", exact=True, progress=False)
    hf = LLM(model=folder, kv="off", exact=True, progress=False)
    same = ("layer_mixers", "mamba2", "rope", "query_scale", "embed_scale", "residual_scale",
            "logit_scale", "intermediate_size", "num_kv_heads", "experts",
            "layer_ffns")  # fmt: skip
    for field in same:
        assert getattr(gguf.config, field) == getattr(hf.config, field), field
    ids = prompt_ids(hf)
    exact = hf_logits(folder, ids, torch.float64)
    assert_as_exact_as(gguf.runner.logits(ids, gguf.new_cache("off")),
                       hf.runner.logits(ids, hf.new_cache("off")), exact)  # fmt: skip
    fp64 = LLM(model=path, kv="off", dtype="fp64", progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf64(folder), ids, 12)[0]


def test_a_q8_0_gguf_runs_native_on_the_pool(converted):
    """The converter's Q8_0 file with --weights native: served through the pool, greedy
    tokens batched = alone."""
    llm = LLM(model=converted("granite", "q8_0"), kv="paged", weights="native", progress=False)
    alone = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    assert on_pool(llm, POOL_PROMPTS, GREEDY)[0] == alone
