"""LFM2-MoE: LFM2's short convolutions and attention with a mixture of experts after its
dense first layers, routed by sigmoid scores and a per-expert selection bias
(kvlm.model.experts, router "sigmoid"), against transformers' Lfm2MoeForCausalLM on tiny
random-weight models (8 experts of 64, the top 2, a dense layer 0, the bias randomised,
routed_scaling_factor 1.5), and from the GGUF llama.cpp's own converter writes for one
(tests/converter.py).

The router kind is tested on its own too: the kernels' router (kvlm_route, the fused
step's) against the torch road's and transformers' Lfm2MoeTopKRouter on the same rows."""

from __future__ import annotations

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
    hf64,
    load_hf,
    model_maker,
    on_pool,
    prompt_ids,
)
from kvlm import LLM, SamplingParams, kernels
from kvlm.errors import ModelLoadError, UnsupportedModelError
from numerics import assert_as_exact_as, max_error

# name -> (seed, transformers config overrides)
MODELS = {
    "lfm2moe": (50, {}),
    # llama.cpp's converter writes no routed_scaling_factor (its graph scales by nothing):
    # the file read as the folder is that of a model of scale 1
    "lfm2moe-unscaled": (51, {"routed_scaling_factor": 1.0}),
}


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return model_maker(tmp_path_factory, "lfm2_moe", MODELS, tokenizer="llama3")


def test_config_read_from_folder(moe_dir):
    folder = moe_dir("lfm2moe")
    c, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder).config
    assert c.architecture == "lfm2moe" and c.qk_norm and c.conv_layers == (0, 2)
    assert c.layer_ffns == ("mlp", "experts", "experts", "experts")
    assert c.intermediate_size == hf.intermediate_size  # no block_ff_dim adjustment
    x = c.experts
    assert (x.count, x.top_k, x.intermediate, x.normalize, x.scale) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
        hf.norm_topk_prob,
        hf.routed_scaling_factor,
    )
    assert (x.router, x.selection_bias, x.norm_eps) == ("sigmoid", True, 1e-6)


def test_teacher_forced_logits_match_hf_and_the_bias_chooses(moe_dir):
    """Every position's logits over 40 tokens, the exact path: as close to transformers'
    fp64 as its own fp32 logits (tests/numerics.py); the selection bias zeroed, or the
    scale dropped, moves them far more (both are read and applied)."""
    folder = moe_dir("lfm2moe")
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    with torch.no_grad():
        ref = load_hf(folder)(torch.tensor([ids])).logits[0]
        exact = hf64(folder)(torch.tensor([ids])).logits[0]
    assert_as_exact_as(ours, ref, exact)
    moe = llm.model.layers[1].mlp
    with torch.no_grad():
        moe.bias.zero_()
    assert max_error(llm.runner.logits(ids, llm.new_cache("off")), exact) > 100 * max_error(
        ours, exact
    )


def test_greedy_tokens_equal_hf(moe_dir):
    """32 greedy tokens: in fp64 transformers' fp64 tokens; by default (fp32) the top-5
    rule against its fp32."""
    folder = moe_dir("lfm2moe")
    assert_greedy_follows_hf(folder)


def _sigmoid_moe(router: torch.Tensor, bias: torch.Tensor, scale: float, eps: float):
    from kvlm.config import Experts as Sizes
    from kvlm.model.experts import Experts
    from kvlm.model.layers import MLP, Linear

    e, h = router.shape
    sizes = Sizes(e, 2, 1, True, router="sigmoid", norm_eps=eps, scale=scale, selection_bias=True)
    mlps = [MLP(Linear(torch.ones(2, h)), Linear(torch.ones(h, 1))) for _ in range(e)]
    return Experts(sizes, Linear(router, vocabulary=True), mlps, router, bias=bias)


def test_the_sigmoid_router_on_both_roads_and_as_transformers(monkeypatch):
    """The router kind "sigmoid": the kernels' router (kvlm_route, the fused step's) and
    the torch road's pick the same experts, the bias choosing and never weighing; equal
    selection scores go to the lower expert on both; the weights agree to the last bits
    (each road's exp its own: glibc's and torch's differ in the last place) and are
    transformers' Lfm2MoeTopKRouter's on the same rows."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    if kernels.library() is None:
        pytest.skip("no C kernels")
    g = torch.Generator().manual_seed(7)
    # dot products exact in fp32 in any order: the roads' logits the same bits
    router = torch.randint(-8, 9, (8, 16), generator=g).float() / 8
    router[5] = router[2]  # experts 2 and 5 score alike: with equal biases, a tie
    bias = (torch.randint(-4, 5, (8,), generator=g).float() / 16).contiguous()
    bias[5] = bias[2]
    x = torch.randint(-2, 3, (64, 16), generator=g).float() / 4
    moe = _sigmoid_moe(router, bias, 1.5, 1e-6)
    chosen, weights = moe.route(x)  # the kernels' (fp32, the CPU)
    with monkeypatch.context() as m:
        m.setattr(kernels, "library", lambda: None)
        t_chosen, t_weights = moe.route(x)
    assert torch.equal(chosen, t_chosen)
    torch.testing.assert_close(weights, t_weights, rtol=3e-7, atol=0)
    scores = torch.sigmoid(x @ router.T) + bias
    two, five = (chosen == 2).any(1), (chosen == 5).any(1)
    one = two ^ five  # room for one of the tied pair: always the lower
    assert one.any() and not five[one].any()
    assert (chosen[two & five] == torch.tensor([2, 5])).all()  # both: the lower first
    # transformers' router on the rows without a tie among the top 3 (its topk's order
    # among equal scores is its own)
    top3 = scores.topk(3).values
    plain = (top3[:, 0] != top3[:, 1]) & (top3[:, 1] != top3[:, 2])
    cfg = Lfm2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                        routed_scaling_factor=1.5, norm_topk_prob=True)  # fmt: skip
    hf = Lfm2MoeTopKRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(router)
        _, hf_weights, hf_chosen = hf(x[plain], bias)
    assert torch.equal(chosen[plain], hf_chosen)
    torch.testing.assert_close(weights[plain], hf_weights, rtol=3e-7, atol=0)
    # the bias chooses alone: without it, other experts, the same kind of weights
    unbiased = _sigmoid_moe(router, torch.zeros(8), 1.5, 1e-6).route(x)[0]
    assert not torch.equal(unbiased, chosen)


def test_the_kernels_refuse_a_router_kind_they_do_not_know():
    """kvlm_route: a kind past ROUTER_TOPK_SOFTMAX, a scale of 0, a selection bias or a
    router bias shorter than the experts are refused (-2) before anything is read."""
    import ctypes

    from kvlm.model.experts import ROUTER_CODES

    lib = kernels.library()
    if lib is None:
        pytest.skip("no C kernels")
    x, r, b = torch.ones(1, 4), torch.ones(3, 4), torch.zeros(3)
    out = (torch.empty(1, 2, dtype=torch.int64), torch.empty(1, 2), torch.empty(1, 3))

    def call(kind=ROUTER_CODES["sigmoid"], bn=3, scale=1.0, rbn=3):
        c, w, lg = out
        return lib.kvlm_route(x.data_ptr(), 4, 1, 4, r.data_ptr(), 12, 3, 2, 1, kind,
                              ctypes.c_void_p(b.data_ptr()), bn, 0.0, scale, c.data_ptr(), 2,
                              w.data_ptr(), 2, lg.data_ptr(), 3, b.data_ptr(), rbn)  # fmt: skip

    assert call() == 0
    assert max(ROUTER_CODES.values()) == 2
    assert call(kind=3) == call(bn=2) == call(scale=0.0) == call(rbn=2) == -2


ROW_MODES = ["basic", "contiguous", "paged", "int8", "window"]


@pytest.mark.parametrize("mode", ROW_MODES)
def test_every_mode_chunked_equals_one_shot(moe_dir, mode):
    """Chunks of 7, then a token at a time, give the one-shot prefill's logits through the
    same mode bit for bit; the exact modes also the `off` oracle's (int8 and the ring as
    exact as transformers' fp32: their decode rows attend in another order)."""
    folder = moe_dir("lfm2moe")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    if mode in ("window", "int8"):
        with torch.no_grad():
            exact = hf64(folder)(torch.tensor([ids])).logits[0]
        assert_as_exact_as(chunked, one_shot, exact)
    else:
        assert torch.equal(chunked, one_shot)
    if mode in ("basic", "contiguous", "paged"):
        off = LLM(model=folder, kv="off", exact=True, progress=False)
        assert torch.equal(one_shot, off.runner.logits(ids, off.new_cache("off")))


def test_generate_batched_forked_and_speculative_equal_alone(moe_dir):
    """Prompts batched = each alone; n = 2 greedy samples = the one; speculative (prompt
    lookup; a draft model, the file's int8 self) = plain; the engine's pool batched, in
    chunks and as prefix hits = alone."""
    from kvlm.engine.speculative import SpeculativeConfig

    folder = moe_dir("lfm2moe")
    llm = LLM(model=folder, kv="paged", progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [FRANCE, "One two three, one two three, one two"]
    alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], SamplingParams(n=2, max_tokens=24, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        spec = LLM(model=folder, kv="paged", speculative=how, progress=False)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == alone
    want = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    again, engine = on_pool(llm, POOL_PROMPTS * 2, GREEDY, scheduler={"max_num_seqs": 3})
    assert again == want * 2 and engine.manager.stats.hits > 0


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_the_fused_step_runs_the_sigmoid_router(moe_dir, mode):
    """int8 weights: the fused C step takes the model (conv and attention layers, the
    dense layer, the experts behind the sigmoid router and its bias), its logits over 24
    greedy steps following the torch model's by the top-5 rule both ways."""
    from helpers import assert_top_k_both_ways, fused_and_torch

    llm = LLM(model=moe_dir("lfm2moe"), kv=mode, weights="int8", progress=False)
    assert llm.runner.fused_reason is None and llm.describe()["decode_step"] == "fused"
    _, fused, ref, _, _ = fused_and_torch(llm, prompt_ids(llm, 16), 24, mode)
    assert_top_k_both_ways(fused, ref)
    assert max_error(fused, ref) < 0.5 * max_error(ref, torch.zeros_like(ref))


def test_the_pools_fused_step_batches_forks_and_drafts_as_alone(moe_dir, monkeypatch):
    from helpers import assert_pool_fused_as_alone

    llm = LLM(model=moe_dir("lfm2moe"), kv="paged", weights="int8", progress=False)
    assert_pool_fused_as_alone(llm, monkeypatch, "int8")


# ---------------------------------------------------------------- llama.cpp's converter


def test_gguf_from_llama_cpps_converter_reads_as_the_folder(moe_dir):
    """The file users get (the experts stacked, `exp_probs_b` the bias, the dense layers
    `leading_dense_block_count`, `expert_gating_func` sigmoid): the folder's config but
    the renormalisation's epsilon (llama.cpp's graph adds none), its logits within that
    epsilon's reach, and its greedy tokens."""
    folder = moe_dir("lfm2moe-unscaled")
    path = converter.convert(folder, "f32", pre="lfm2")
    from_gguf = LLM(model=path, kv="off", exact=True, progress=False)
    from_hf = LLM(model=folder, kv="off", exact=True, progress=False)
    a, b = from_gguf.config, from_hf.config
    assert a.experts == replace(b.experts, norm_eps=0.0)
    same = dict(name="", rms_norm_eps=0.1)
    assert replace(a, experts=b.experts, **same) == replace(b, **same)
    ids = prompt_ids(from_hf)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    theirs = from_hf.runner.logits(ids, from_hf.new_cache("off"))
    assert max_error(ours, theirs) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert (from_gguf.generate(FRANCE, params)[0].outputs[0].token_ids
            == from_hf.generate(FRANCE, params)[0].outputs[0].token_ids)  # fmt: skip


# ---------------------------------------------------------------- hostile keys


def hf_cfg(**changes) -> dict:
    cfg = {"model_type": "lfm2_moe", "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "num_dense_layers": 1,
           "layer_types": ["conv", "full_attention"]}  # fmt: skip
    return {k: v for k, v in {**cfg, **changes}.items() if v is not None}


def gguf_meta(**changes) -> dict:
    meta = {"general.architecture": "lfm2moe", "lfm2moe.embedding_length": 64,
            "lfm2moe.attention.head_count": 4, "lfm2moe.attention.head_count_kv": [0, 2],
            "lfm2moe.feed_forward_length": 128, "lfm2moe.block_count": 2,
            "lfm2moe.vocab_size": 64, "lfm2moe.expert_count": 8,
            "lfm2moe.expert_used_count": 2, "lfm2moe.expert_feed_forward_length": 64,
            "lfm2moe.leading_dense_block_count": 1, "lfm2moe.expert_gating_func": 2,
            "lfm2moe.shortconv.l_cache": 3}  # fmt: skip
    return {k: v for k, v in {**meta, **changes}.items() if v is not None}


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_dense_layers": 3}, "num_dense_layers"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
        ({"use_expert_bias": "yes"}, "use_expert_bias"),
        ({"moe_intermediate_size": -1}, "moe_intermediate_size"),
    ],
)
def test_hostile_config_keys_are_refused(changes, said):
    from kvlm.arch import config_from_hf

    assert config_from_hf(hf_cfg(), "m").layer_ffns == ("mlp", "experts")
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=said):
        config_from_hf(hf_cfg(**changes), "m")


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"lfm2moe.expert_gating_func": 1}, "expert_gating_func"),
        ({"lfm2moe.leading_dense_block_count": 5}, "leading_dense_block_count"),
        ({"lfm2moe.expert_count": None}, "expert_count"),
        ({"lfm2moe.expert_used_count": 9}, "expert_used_count"),
    ],
)
def test_hostile_gguf_keys_are_refused(changes, said):
    from kvlm.arch import config_from_gguf

    assert config_from_gguf(gguf_meta(), "m.gguf").experts.router == "sigmoid"
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=said):
        config_from_gguf(gguf_meta(**changes), "m.gguf")
