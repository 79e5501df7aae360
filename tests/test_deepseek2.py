"""DeepSeek-V2: latent attention (kvlm.model.mla) and its experts, against transformers'
DeepseekV2ForCausalLM on tiny random-weight models (conftest.TINY_MODELS "deepseek2": three
layers, a latent of 32 and a rotated key part of 8, heads of nope 16 + rope 8 and values of
16; a dense first layer, then 8 experts, the top 2, beside a shared expert; and the same
without a compressed query, q_lora_rank null).

The cache keeps a token's latent and key part alone (40 values a layer); a decode row
attends over them with kv_b absorbed into its query and output, a prompt's rows over K/V
made from them: both are held to transformers' fp64 as closely as its own fp32 is."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import converter
from helpers import (
    FRANCE,
    GREEDY,
    POOL_PROMPTS,
    assert_greedy_follows_hf,
    fed,
    gguf_as_folder,
    hf64,
    hf_logits,
    load_hf,
    on_pool,
    prompt_ids,
    refused,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams
from kvlm.arch import config_from_hf
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.model.fused import why_not
from kvlm.model.mla import LatentAttention
from numerics import assert_as_exact_as, max_error

MODELS = {
    "deepseek2": (90, {}),
    "deepseek2-q": (91, {"q_lora_rank": None}),  # one q_proj, no compressed query
    # a latent of 24 + a key part of 8: halves of 16, a power of two, so a quantized
    # cache stores both halves through Hadamard's R (kvlm.cache.storage)
    "deepseek2-pow2": (92, {"kv_lora_rank": 24}),
}


@pytest.fixture(scope="session")
def ds_dir(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            seed, overrides = MODELS[name]
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), "deepseek2", seed=seed,
                                         **overrides)  # fmt: skip
        return made[name]

    return make


def exact_logits(folder, ids):
    with torch.no_grad():
        return hf64(folder)(torch.tensor([ids])).logits[0]


def decode_logits(llm, ids, cut):
    """Logits of ids[cut:] fed a token at a time after the prompt ids[:cut], in one cache."""
    return fed(llm, ids, [cut] + [1] * (len(ids) - cut))


@pytest.mark.parametrize("name", list(MODELS))
def test_config_read_from_folder(ds_dir, name):
    folder = ds_dir(name)
    c, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder).config
    x = c.latent
    assert c.architecture == "deepseek2" and c.layer_mixers == ("latent",) * 3
    assert (x.kv_rank, x.q_rank, x.nope_dim, x.rope_dim, x.v_dim) == (
        hf.kv_lora_rank, hf.q_lora_rank or 0, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
        hf.v_head_dim,
    )  # fmt: skip
    assert c.head_dim == hf.qk_rope_head_dim == c.rotary_dim  # RoPE's dimensions
    assert c.layer_ffns == ("mlp", "experts", "experts")
    e = c.experts
    assert (e.count, e.top_k, e.normalize, e.scale, e.shared) == (8, 2, False, 2.0, 64)


@pytest.mark.parametrize("name", list(MODELS))
def test_teacher_forced_logits_match_hf(ds_dir, name):
    """Every position's logits over 40 tokens, the exact path: as close to transformers'
    fp64 as its own fp32 logits (tests/numerics.py)."""
    folder = ds_dir(name)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    ref = hf_logits(load_hf(folder), ids)
    assert_as_exact_as(ours, ref, exact_logits(folder, ids))


def test_greedy_tokens_equal_hf(ds_dir):
    """32 greedy tokens: in fp64 transformers' fp64 tokens; by default the top-5 rule."""
    assert_greedy_follows_hf(ds_dir("deepseek2"))


def test_absorbed_decode_is_as_exact_as_materialised(ds_dir):
    """Decode rows with kv_b absorbed (scores over the latent rows) against the same rows
    with K/V materialised from the latent, both after a prompt of 24 in one cache: the
    absorbed logits as close to transformers' fp64 as the materialised ones (whose
    teacher-forced logits are held to transformers' own fp32 above), and the two roads
    are taken (the absorbed and materialised logits are not the same bits)."""
    folder = ds_dir("deepseek2")
    llm = LLM(model=folder, kv="contiguous", exact=True, progress=False)
    ids = prompt_ids(llm)
    mixers = [b.attn for b in llm.model.layers]
    assert all(isinstance(m, LatentAttention) and m.absorb for m in mixers)
    absorbed = decode_logits(llm, ids, 24)
    for m in mixers:
        m.absorb = False
    try:
        materialised = decode_logits(llm, ids, 24)
    finally:
        for m in mixers:
            m.absorb = True
    exact = exact_logits(folder, ids)
    assert_as_exact_as(absorbed[24:], materialised[24:], exact[24:])
    assert not torch.equal(absorbed[24:], materialised[24:])


def test_the_latent_rows_are_what_the_cache_keeps(ds_dir, capsys):
    """The cache keeps kv_lora_rank + qk_rope_head_dim values a token and layer: one KV
    head of half that, in every cache's spec, in `kvlm memory`'s bytes and in the rows a
    prompt leaves in a contiguous cache."""
    from kvlm.cli import main

    folder = ds_dir("deepseek2")
    llm = LLM(model=folder, kv="contiguous", progress=False)
    spec = llm.new_cache("paged").spec
    assert (spec.num_kv_heads, spec.head_dim) == (1, (32 + 8) // 2)
    assert spec.bytes_per_token == 3 * (32 + 8) * 4
    assert llm.config.kv_elements_per_token == 3 * (32 + 8)
    assert main(["memory", "--model", str(folder), "--context", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["bytes_per_token"] == 3 * (32 + 8) * 4
    bf16 = [r for r in plan["table"] if (r["mode"], r["kv_dtype"]) == ("contiguous", "bf16")]
    assert bf16[0]["bytes_per_token"] == 3 * (32 + 8) * 2


@pytest.mark.parametrize("name", list(MODELS))
def test_inspect_counts_every_and_the_active_parameters(ds_dir, name, capsys):
    """`kvlm inspect`: the parameters transformers' model has (latent attention's
    products and norms, the shared expert), and those one token runs (top_k of the
    routed experts)."""
    from kvlm.cli import main

    folder = ds_dir(name)
    hf, c = load_hf(folder), LLM(model=folder, kv="off", progress=False).config
    every = sum(p.numel() for p in hf.parameters())
    x = c.experts
    idle = len(c.expert_layers) * (x.count - x.top_k) * 3 * c.hidden_size * x.intermediate
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["parameters"], info["active_parameters"]) == (every, every - idle)


ROW_MODES = ["basic", "contiguous", "paged", "int8"]


@pytest.mark.parametrize("mode", ROW_MODES)
def test_every_mode_chunked_equals_one_shot(ds_dir, mode):
    """Chunks of 7, then a token at a time (absorbed rows), against the one-shot prefill
    through the same mode: as exact (transformers' fp64 the reference); the exact modes'
    one-shot logits are the `off` oracle's bit for bit."""
    folder = ds_dir("deepseek2")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    assert_as_exact_as(chunked, one_shot, exact_logits(folder, ids))
    if mode != "int8":
        off = LLM(model=folder, kv="off", exact=True, progress=False)
        assert torch.equal(one_shot, off.runner.logits(ids, off.new_cache("off")))


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_generate_batched_forked_and_speculative_equal_alone(ds_dir, mode):
    """Prompts batched = each alone; n = 2 greedy samples = the one; speculative (prompt
    lookup: drafts verified as several rows, materialised) = plain."""
    from kvlm.engine.speculative import SpeculativeConfig

    folder = ds_dir("deepseek2")
    llm = LLM(model=folder, kv=mode, progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [FRANCE, "One two three, one two three, one two"]
    alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], SamplingParams(n=2, max_tokens=24, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2
    spec = LLM(model=folder, kv=mode, speculative=SpeculativeConfig("ngram", ngram_min=1),
               progress=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == alone


def test_the_pool_batches_chunks_and_hits_as_alone(ds_dir):
    """Through the engine's pool: the prompts batched, in chunks of 5, and n = 2, each
    prompt's tokens alone."""
    llm = LLM(model=ds_dir("deepseek2"), kv="paged", progress=False)
    want = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    assert on_pool(llm, POOL_PROMPTS, GREEDY)[0] == want
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    two = SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)
    got = on_pool(llm, POOL_PROMPTS[:1], two)[0]
    alone = llm.generate(POOL_PROMPTS[0], two)[0]
    assert got == [[s.token_ids for s in alone.outputs]]


def test_what_it_cannot_run_is_refused_in_one_line(ds_dir):
    """The window cache (keys turned where they sit) and the fused C step (no kernel for
    latent attention: the torch step decodes) refuse by name."""
    folder = ds_dir("deepseek2")
    with pytest.raises(UnsupportedModelError, match=r"latent attention .* window cache"):
        LLM(model=folder, kv="window", progress=False)
    llm = LLM(model=folder, progress=False)
    with pytest.raises(UnsupportedModelError, match=r"latent attention .* window cache"):
        llm.new_cache("window")
    int8 = LLM(model=folder, weights="int8", progress=False)
    assert "latent layer" in why_not(int8.model)


def test_hostile_config_keys_are_refused(ds_dir):
    """Each latent size and the expert keys, given a wrong type or range, is one
    ModelLoadError naming it; a router kvlm does not have is refused by name."""
    good = json.loads((ds_dir("deepseek2") / "config.json").read_text())
    for key, bad in (("kv_lora_rank", "32"), ("qk_rope_head_dim", 0), ("v_head_dim", -1),
                     ("q_lora_rank", 1.5), ("n_routed_experts", None),
                     ("first_k_dense_replace", 9)):  # fmt: skip
        refused(config_from_hf, good, {**good, key: bad}, key)
    refused(config_from_hf, good, {**good, "qk_rope_head_dim": 7}, "rope_dim=7")
    refused(config_from_hf, good, {**good, "topk_method": "noaux_tc"}, "noaux_tc")


def test_group_limited_greedy_matches_hf(tmp_path):
    """topk_method "group_limited_greedy" (DeepSeek-V2's 236B model's): the softmax's top
    2 among the experts of the best of 4 groups, a group scored by its best expert
    (Experts.group_score "max"; were 2 of the 4 groups chosen, the top 2 would be every
    expert's top 2: their groups are the best by their best): the exact path as close to
    transformers' fp64 as its own fp32, and routing every expert moves the logits far
    more."""
    groups = {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}
    folder = save_tiny_model(tmp_path / "glg", "deepseek2", seed=96, **groups)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    x = llm.config.experts
    assert (x.router, x.groups, x.groups_used, x.group_score) == ("softmax", 4, 1, "max")
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    ref = hf_logits(load_hf(folder), ids)
    exact = exact_logits(folder, ids)
    assert_as_exact_as(ours, ref, exact)
    for block in llm.model.layers[1:]:
        block.mlp.config = replace(block.mlp.config, groups_used=4)
    every = llm.runner.logits(ids, llm.new_cache("off"))
    assert max_error(every, exact) > 100 * max_error(ours, exact)


def test_yarn_scales_the_scores_by_mscale(ds_dir):
    """Under YaRN with mscale_all_dim, the scores' scale is (nope + rope) ** -0.5 times
    mscale ** 2, as transformers' yarn_apply_mscale; and the logits still follow it."""
    import math

    good = json.loads((ds_dir("deepseek2") / "config.json").read_text())
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}  # fmt: skip
    c = config_from_hf({**good, "rope_parameters": yarn}, "m")
    m = 0.1 * 0.707 * math.log(4.0) + 1.0
    assert c.query_scale == pytest.approx(24**-0.5 * m * m, rel=1e-12)
    assert config_from_hf(good, "m").query_scale is None


def test_a_yarn_model_matches_hf(tmp_path):
    """A tiny model with DeepSeek's YaRN (cos/sin by mscale / mscale_all_dim, scores by
    mscale_all_dim squared): the exact path as close to transformers' fp64 as its fp32."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 0.8, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
    folder = save_tiny_model(tmp_path / "yarn", "deepseek2", seed=92, rope_parameters=yarn)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    assert llm.config.query_scale is not None
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    ref = hf_logits(load_hf(folder), ids)
    exact = exact_logits(folder, ids)
    assert_as_exact_as(ours, ref, exact)


@pytest.fixture(scope="module")
def converted(ds_dir):
    """(name, outtype) -> (the folder, the GGUF llama.cpp's converter writes for it)."""
    return lambda name, outtype="f32": (
        ds_dir(name), converter.convert(ds_dir(name), outtype, pre="gpt2"),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_from_llama_cpps_converter_reads_as_the_folder(converted, name):
    """The file users get (kv_b split per head, `attn_k_b` transposed and `attn_v_b`; the
    MQA view's key_length; the experts stacked; RoPE's pairs as transformers' rows): the
    folder's config and its logits bit for bit, and its tokenizer's ids."""
    folder, path = converted(name)
    from_gguf, from_hf = gguf_as_folder(path, folder)
    ids = prompt_ids(from_hf)
    assert from_gguf.tokenizer.encode(FRANCE) == from_hf.tokenizer.encode(FRANCE)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    assert torch.equal(ours, from_hf.runner.logits(ids, from_hf.new_cache("off")))


def test_a_q8_0_gguf_generates_as_the_folder(converted):
    """--outtype q8_0, its blocks multiplied as stored (the default path): 16 greedy
    tokens, each of the folder's in the file's top 5 until they part, as the low-bit
    paths are held (helpers.assert_greedy_agreement)."""
    from helpers import assert_greedy_agreement

    folder, path = converted("deepseek2", "q8_0")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = LLM(model=path, progress=False).generate(FRANCE, params)[0].outputs[0]
    ref = LLM(model=folder, progress=False, kv="off", exact=True)
    ids = ref.tokenizer.encode(FRANCE)
    ref_out = ref.generate(FRANCE, params)[0].outputs[0]
    logits = ref.runner.logits(ids + ref_out.token_ids, ref.new_cache("off"))[len(ids) - 1 :]
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs],
                            ref_out.token_ids, logits)  # fmt: skip


@pytest.mark.parametrize("key,value,says", [
    ("deepseek2.attention.key_length_mla", 8, "key_length_mla 8 is not more than"),
    ("deepseek2.attention.kv_lora_rank", 31, r"kv_a_layernorm|attn_kv_a"),
    ("deepseek2.expert_gating_func", 3, "expert_gating_func 3"),
    ("deepseek2.leading_dense_block_count", 9, "leading_dense_block_count"),
])  # fmt: skip
def test_a_faulty_gguf_is_one_clear_line(converted, tmp_path, key, value, says):
    """A converted file with a latent size, the router or the dense layers' count edited:
    one ModelLoadError / UnsupportedModelError line naming it."""
    from gguf_hostile import read, set_key, write

    _, path = converted("deepseek2")
    spec = read(path)
    if key not in spec.meta:  # a key the converter leaves out for its default: as an int
        from gguf import GGUFValueType

        spec.set(key, value, GGUFValueType.UINT32, None)
    else:
        set_key(key, value)(spec)
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=says):
        LLM(model=write(spec, tmp_path / "m.gguf"), progress=False)


def test_a_quantized_latent_stored_rotated_reads_back(ds_dir):
    """An int8 cache of a latent whose halves are a power of two keeps both halves through
    R (K's rotation and V's, "+vrot"): the mixer turns both back, so its teacher-forced
    logits follow the fp32 cache's by the top-5 rule (a half left turned would not)."""
    from helpers import assert_top_k_both_ways

    folder = ds_dir("deepseek2-pow2")
    q = LLM(model=folder, kv="contiguous", kv_dtype="int8", progress=False)
    assert q.cache_spec("contiguous").kv_format == "int8+vrot"
    f = LLM(model=folder, kv="contiguous", kv_dtype="fp32", progress=False)
    ids = prompt_ids(q)
    cut = len(ids) - 12
    assert_top_k_both_ways(decode_logits(q, ids, cut), decode_logits(f, ids, cut))
