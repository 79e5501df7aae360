"""GLM-4.7-Flash (transformers' Glm4MoeLiteForCausalLM, model_type `glm4_moe_lite`) and
DeepSeek-V3 (DeepseekV3ForCausalLM), read by the DeepSeek-V2 family (kvlm.arch.deepseek2):
its latent attention with DeepSeek-V3's router (noaux_tc), each expert's sigmoid, the top
k by sigmoid + the selection bias (e_score_correction_bias) among the experts of the
best groups, renormalised, times routed_scaling_factor (kvlm.model.experts).

Tiny random-weight models (helpers.tiny_config): deepseek2's three latent layers, the
first FFN dense, then 8 experts of 32 (the top 2) beside a shared expert, the bias
randomised: "glm" in one group, as GLM-4.7-Flash (the kernels' router runs it);
"glm-groups" among the 2 best of 4 groups of 2 (group-limited: the torch road's);
"deepseek3" DeepSeek-V3's config, 4 groups too. Against transformers, and from the GGUF
llama.cpp's own converter writes for them (tests/converter.py: its `deepseek2` files)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch

import converter
from helpers import (
    FRANCE,
    assert_greedy_follows_hf,
    fed,
    hf_logits,
    load_hf,
    on_pool,
    prompt_ids,
    refused,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams, kernels
from kvlm.arch import config_from_gguf, config_from_hf
from kvlm.errors import UnsupportedModelError
from kvlm.model.experts import GROUPS_REFUSED, Experts
from kvlm.model.fused import why_not
from numerics import assert_as_exact_as, max_error

# name -> (transformers' model_type, seed, config overrides)
MODELS = {
    "glm": ("glm4_moe_lite", 93, {}),
    "glm-groups": ("glm4_moe_lite", 94, {"n_group": 4, "topk_group": 2}),
    "deepseek3": ("deepseek_v3", 95, {}),
}
# each model's (groups, groups used)
GROUPS = {"glm": (1, 1), "glm-groups": (4, 2), "deepseek3": (4, 2)}


@pytest.fixture(scope="session")
def glm_dir(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            arch, seed, overrides = MODELS[name]
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), arch, seed=seed,
                                         tokenizer="glm", **overrides)  # fmt: skip
        return made[name]

    return make


@functools.cache
def exact_logits(folder, ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' fp64 teacher-forced logits (the exact result both are held to)."""
    return hf_logits(folder, list(ids), torch.float64)


def expert_layers(llm) -> list[Experts]:
    return [b.mlp for b in llm.model.layers if isinstance(b.mlp, Experts)]


@pytest.mark.parametrize("name", list(MODELS))
def test_config_read_from_folder(glm_dir, name):
    """The latent sizes, the dense first layer (GLM's mlp_layer_types, V3's
    first_k_dense_replace) and the router: sigmoid with the selection bias, renormalised
    (transformers' 1e-20 in the sum), scaled, the groups the config names."""
    from transformers import AutoConfig

    folder = glm_dir(name)
    hf = AutoConfig.from_pretrained(folder)
    c = config_from_hf(json.loads((folder / "config.json").read_text()), "m")
    x, e = c.latent, c.experts
    assert c.architecture == "deepseek2" and c.layer_mixers == ("latent",) * 3
    assert (x.kv_rank, x.q_rank, x.nope_dim, x.rope_dim, x.v_dim) == (
        hf.kv_lora_rank, hf.q_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
        hf.v_head_dim,
    )  # fmt: skip
    assert c.head_dim == hf.qk_rope_head_dim == c.rotary_dim
    assert c.layer_ffns == ("mlp", "experts", "experts")
    assert (e.count, e.top_k, e.intermediate, e.shared) == (8, 2, 32, 32)
    assert (e.router, e.selection_bias, e.normalize, e.norm_eps) == ("sigmoid", True, True, 1e-20)
    assert e.scale == hf.routed_scaling_factor
    assert (e.groups, e.groups_used, e.group_score) == (*GROUPS[name], "top2")
    assert e.group_limited == (name != "glm")


@pytest.mark.parametrize("name", list(MODELS))
def test_teacher_forced_logits_match_hf(glm_dir, name):
    """Every position's logits over 40 tokens, the exact path: as close to transformers'
    fp64 as its own fp32 logits (tests/numerics.py); the selection bias zeroed, or the
    groups not limiting, moves them far more (both are read and applied)."""
    folder = glm_dir(name)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    ref, exact = hf_logits(load_hf(folder), ids), exact_logits(folder, tuple(ids))
    assert_as_exact_as(ours, ref, exact)
    moes = expert_layers(llm)
    if name == "glm":
        for moe in moes:
            moe.bias.zero_()
    else:
        for moe in moes:
            moe.config = replace(moe.config, groups_used=moe.config.groups)
    off = llm.runner.logits(ids, llm.new_cache("off"))
    assert max_error(off, exact) > 100 * max_error(ours, exact)


@pytest.mark.parametrize("name", ["glm", "glm-groups"])
def test_greedy_tokens_equal_hf(glm_dir, name):
    """32 greedy tokens: in fp64 transformers' fp64 tokens; by default (fp32: the kernels'
    router for "glm", the torch road's group-limited one for "glm-groups") the top-5
    rule against its fp32."""
    assert_greedy_follows_hf(glm_dir(name))


def _moe(router: torch.Tensor, bias: torch.Tensor, **sizes) -> Experts:
    """kvlm's mixture over `router` (E, H) and the selection bias, experts of one unit."""
    from kvlm.config import Experts as Sizes
    from kvlm.model.layers import MLP, Linear

    e, h = router.shape
    config = Sizes(e, router="sigmoid", selection_bias=True, normalize=True, norm_eps=1e-20,
                   intermediate=1, **sizes)  # fmt: skip
    mlps = [MLP(Linear(torch.ones(2, h)), Linear(torch.ones(h, 1))) for _ in range(e)]
    return Experts(config, Linear(router, vocabulary=True), mlps, router, bias=bias)


def _hf_router(router: torch.Tensor, bias: torch.Tensor, **cfg):
    from transformers import Glm4MoeLiteConfig
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter

    e, h = router.shape
    hf = Glm4MoeLiteTopkRouter(Glm4MoeLiteConfig(hidden_size=h, n_routed_experts=e, **cfg))
    with torch.no_grad():
        hf.weight.copy_(router)
        hf.e_score_correction_bias.copy_(bias)
    return hf


def test_the_group_limited_router_is_transformers():
    """16 experts in 4 groups of 4, the top 3 among the 2 best groups: the same experts as
    transformers' Glm4MoeLiteTopkRouter on every row, equal scores too (two groups and
    two experts alike: its torch.topk's calls, so ties fall where they fall in its
    router), the weights to the last bits; the kernels' router refuses it by name (the
    torch road routes), and unlimited routing chooses other experts."""
    g = torch.Generator().manual_seed(11)
    # dot products exact in fp32 in any order: both sides' scores the same bits
    router = torch.randint(-8, 9, (16, 16), generator=g).float() / 8
    bias = torch.randint(-4, 5, (16,), generator=g).float() / 32
    router[8:12], bias[8:12] = router[4:8], bias[4:8]  # groups 1 and 2 score alike
    router[14], bias[14] = router[13], bias[13]  # experts 13 and 14 too
    x = torch.randint(-2, 3, (256, 16), generator=g).float() / 4
    sizes = dict(top_k=3, scale=1.8, groups=4, groups_used=2)
    moe = _moe(router, bias, **sizes)
    assert moe.kernel_refusal() == GROUPS_REFUSED
    chosen, weights = moe.route(x)
    hf = _hf_router(router, bias, num_experts_per_tok=3, routed_scaling_factor=1.8, n_group=4,
                    topk_group=2)  # fmt: skip
    with torch.no_grad():
        _, hf_weights, hf_chosen = hf(x)
    ours, theirs = chosen.sort(dim=1), hf_chosen.sort(dim=1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(weights.gather(1, ours.indices),
                               hf_weights.gather(1, theirs.indices), rtol=3e-7, atol=0)  # fmt: skip
    scores = torch.sigmoid(x @ router.T) + bias
    groups = scores.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1)
    tied = groups[:, 1] == groups[:, 2]
    assert tied.all() and (chosen >= 4).any() and ((chosen == 13) | (chosen == 14)).any()
    unlimited = _moe(router, bias, top_k=3, scale=1.8).route(x)[0]
    assert not torch.equal(unlimited.sort(dim=1).values, ours.values)


def test_one_group_runs_on_the_kernels_router_as_on_torchs(monkeypatch):
    """GLM-4.7-Flash's one group (groups_used = groups) limits nothing: the kernels'
    router (kvlm_route) takes it, choosing as the torch road and transformers do."""
    if kernels.library() is None:
        pytest.skip("no C kernels")
    g = torch.Generator().manual_seed(12)
    router = torch.randint(-8, 9, (8, 16), generator=g).float() / 8
    bias = torch.randint(-4, 5, (8,), generator=g).float() / 32
    x = torch.randint(-2, 3, (64, 16), generator=g).float() / 4
    moe = _moe(router, bias, top_k=2, scale=1.8)
    assert moe.kernel_refusal() is None
    chosen, weights = moe.route(x)
    with monkeypatch.context() as m:
        m.setattr(kernels, "library", lambda: None)
        t_chosen, t_weights = moe.route(x)
    assert torch.equal(chosen, t_chosen)
    torch.testing.assert_close(weights, t_weights, rtol=3e-7, atol=0)
    hf = _hf_router(router, bias, num_experts_per_tok=2, routed_scaling_factor=1.8)
    with torch.no_grad():
        _, _, hf_chosen = hf(x)
    # the rows without a tie at the second place (kvlm's router gives equal scores to the
    # lower expert, on both roads; transformers' topk as it falls)
    top3 = (torch.sigmoid(x @ router.T) + bias).topk(3).values
    plain = top3[:, 1] != top3[:, 2]
    assert plain.sum() > 32
    assert torch.equal(chosen[plain].sort(dim=1).values, hf_chosen[plain].sort(dim=1).values)


def test_the_fused_step_and_the_kernels_router_refuse_in_one_line(glm_dir):
    """The group-limited model's layers refuse the kernels' router by name (the torch road
    routes), and the fused step refuses the latent layer (no kernel for one yet)."""
    llm = LLM(model=glm_dir("glm-groups"), weights="int8", progress=False)
    assert all(m.kernel_refusal() == GROUPS_REFUSED for m in expert_layers(llm))
    assert "latent layer" in why_not(llm.model)


CACHE_MODES = ["contiguous", "paged"]


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_chunked_equals_one_shot(glm_dir, mode):
    """Chunks of 7, then a token at a time (absorbed decode rows, routed alone), against
    the one-shot prefill through the same cache: as exact (transformers' fp64 the
    reference)."""
    folder = glm_dir("glm-groups")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    assert_as_exact_as(chunked, one_shot, exact_logits(folder, tuple(ids)))


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_batched_equals_alone(glm_dir, mode):
    """Prompts batched = each alone (group-limited routing a row at a time, whatever
    rows share its batch); through the engine's pool in chunks of 5 too."""
    llm = LLM(model=glm_dir("glm-groups"), kv=mode, progress=False)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [FRANCE, "One two three, one two three, one two"]
    alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    if mode == "paged":
        got = on_pool(llm, prompts, greedy, scheduler={"prefill_chunk": 5})[0]
        assert got == [[a] for a in alone]


def test_what_the_router_cannot_be_is_refused_in_one_line(glm_dir):
    """Groups that do not divide the experts, more groups used than there are, groups of
    one expert (a group's score is its two best), fewer experts in the chosen groups
    than a token takes, a bad mlp_layer_types, rope rows kvlm does not fold (not
    interleaved, or a partial rotary factor): one line each, naming it."""
    good = json.loads((glm_dir("glm") / "config.json").read_text())
    rope = {**good["rope_parameters"], "partial_rotary_factor": 0.5}
    for bad, said in (
        ({"n_group": 3}, "8 experts do not divide into 3 groups"),
        ({"n_group": 2, "topk_group": 3}, "expert groups used is 3"),
        ({"n_group": 8}, "groups of 1 expert"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "3 experts a token from 1"),
        ({"n_group": "4"}, "n_group"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"rope_parameters": rope}, "partial_rotary_factor 0.5"),
    ):  # fmt: skip
        refused(config_from_hf, good, {**good, **bad}, said)
    # without mlp_layer_types: the first first_k_dense_replace layers dense (default 1)
    bare = {k: v for k, v in good.items() if k not in ("mlp_layer_types", "first_k_dense_replace")}
    assert config_from_hf(bare, "m").layer_ffns == ("mlp", "experts", "experts")
    two = config_from_hf({**bare, "first_k_dense_replace": 2}, "m")
    assert two.layer_ffns == ("mlp", "mlp", "experts")


@pytest.fixture(scope="module")
def converted(glm_dir):
    """name -> (the folder, the f32 GGUF llama.cpp's converter writes for it)."""
    return lambda name: (glm_dir(name), converter.convert(glm_dir(name), "f32", pre="gpt2"))


@pytest.mark.parametrize("name", ["glm", "glm-groups"])
def test_gguf_from_llama_cpps_converter_reads_as_the_folder(converted, name):
    """The file users get (`deepseek2`: kv_b split per head, the experts stacked, the
    selection bias `exp_probs_b`, the sigmoid gating, the groups' counts): the folder's
    config (routed_scaling_factor as the file keeps it, in fp32) and, the folder's model
    given that scale, its logits bit for bit; its tokenizer's ids."""
    folder, path = converted(name)
    from_gguf = LLM(model=path, kv="off", exact=True, progress=False)
    from_hf = LLM(model=folder, kv="off", exact=True, progress=False)
    a, b = from_gguf.config, from_hf.config
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-7)
    assert a.experts.scale == pytest.approx(b.experts.scale, rel=1e-7)
    as_stored = dict(name="", rms_norm_eps=0.1, experts=replace(b.experts, scale=a.experts.scale))
    assert replace(a, **as_stored) == replace(b, **as_stored)
    assert from_gguf.tokenizer.encode(FRANCE) == from_hf.tokenizer.encode(FRANCE)
    for moe in expert_layers(from_hf):
        moe.config = replace(moe.config, scale=a.experts.scale)
    ids = prompt_ids(from_hf)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    assert torch.equal(ours, from_hf.runner.logits(ids, from_hf.new_cache("off")))


def test_a_file_without_a_gating_key_reads_as_llama_cpp_reads_it(converted):
    """GLM-4.7-Flash's config names no scoring function, so its converted file has no
    `expert_gating_func` (the tiny config names one, as DeepSeek-V3's does): llama.cpp's
    loader then takes the sigmoid for a model of its shape (47 or 48 blocks, a vocabulary
    of 154880) and the softmax for any other; kvlm reads the metadata alike, and a
    gating it does not have is refused by name."""
    from gguf_hostile import read

    _, path = converted("glm")
    meta = {k: v[0] for k, v in read(path).meta.items()}
    assert meta.pop("deepseek2.expert_gating_func") == 2
    assert config_from_gguf(meta, "m").experts.router == "softmax"
    for blocks in (47, 48):
        flash = {**meta, "deepseek2.block_count": blocks, "deepseek2.vocab_size": 154880}
        x = config_from_gguf(flash, "m").experts
        assert (x.router, x.selection_bias) == ("sigmoid", True)
    with pytest.raises(UnsupportedModelError, match="expert_gating_func 3"):
        config_from_gguf({**meta, "deepseek2.expert_gating_func": 3}, "m")
