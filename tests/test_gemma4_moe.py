"""Gemma 4's experts beside the MLP (`enable_moe_block`, the 26B-A4B's layers) against
transformers' Gemma4ForCausalLM on the tiny random-weight model of conftest.TINY_MODELS
"gemma4-moe": four layers, local (a window of 8) and global (K = V), the last two reading
layers 0 and 1's K/V, per-layer inputs; in every layer a dense MLP and 8 experts of 32
beside it (the top 2), the router reading the residual stream through its own norm
and scaling each chosen expert's weight by the expert's own scale
(kvlm.model.transformer.ExpertsBeside, kvlm.model.experts). helpers._bump_norm_and_biases
makes the router's input scale, the experts' scales and the norms around the experts
random (transformers: ones), the scale sharpening the router as helpers.sharpen_routers
does others'."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from helpers import (
    FRANCE,
    GREEDY,
    POOL_PROMPTS,
    assert_greedy_follows_hf,
    fed,
    hf_logits,
    load_hf,
    on_pool,
)
from kvlm import LLM
from kvlm.errors import ModelLoadError
from numerics import assert_as_exact_as, max_error

PROMPT = "What is the capital of France? The capital of France is Paris, and of Spain"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("gemma4-moe")


def prompt_ids(llm: LLM) -> list[int]:
    ids = llm.tokenizer.encode(PROMPT * 2)[:40]
    assert len(ids) == 40  # five times the window
    return ids


def test_config_and_inspect_count_every_and_the_active_parameters(folder, capsys):
    """The experts beside every layer's MLP, as transformers' config says; `kvlm inspect`:
    transformers' parameters, and those a token runs (its top 2 of the 8 experts)."""
    from kvlm.cli import main

    hf = load_hf(folder)
    c = LLM(model=folder, kv="off", progress=False).config
    x = c.experts
    assert (x.count, x.top_k, x.intermediate) == (8, 2, 32) and c.layer_ffns == ("experts",) * 4
    assert x.normalize and x.router_norm and x.expert_scale and x.beside_mlp
    assert x.router == "softmax" and (x.scale, x.norm_eps, x.shared) == (1.0, 0.0, 0)
    assert c.kv_sources == (0, 1, 0, 1) and c.layer_k_eq_v == (False, True) * 2
    every = sum(p.numel() for p in hf.parameters()) + 4  # and each layer's scalar (a buffer)
    idle = 4 * (8 - 2) * 3 * c.hidden_size * 32
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["parameters"], info["active_parameters"]) == (every, every - idle)


def test_exact_logits_as_close_as_transformers_fp32(folder):
    """The exact path's logits of 40 tokens through off, contiguous and paged, one shot
    and (contiguous, paged) in chunks of 7 then single rows: as close to transformers'
    fp64 as its own fp32 are."""
    modes = ("off", "contiguous", "paged")
    llms = {mode: LLM(model=folder, kv=mode, exact=True, progress=False) for mode in modes}
    ids = prompt_ids(llms["off"])
    exact, ref = hf_logits(folder, ids, torch.float64), hf_logits(load_hf(folder), ids)
    for mode, llm in llms.items():
        assert_as_exact_as(fed(llm, ids, [len(ids)]), ref, exact)
        if mode != "off":
            assert_as_exact_as(fed(llm, ids, [7] * 4 + [1] * 12), ref, exact)


def test_greedy_tokens_follow_transformers(folder):
    """32 greedy tokens: in fp64 transformers' fp64 tokens; by default (fp32) the top-5
    rule against its fp32."""
    assert_greedy_follows_hf(folder)


def test_each_part_of_the_experts_is_applied(folder):
    """The experts' scales, the router's input norm, the experts' input and output
    norms, the dense MLP's output norm, an expert's down projection: each changed moves
    the logits far more than rounding (so the tests above can fail)."""
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    exact = hf_logits(folder, ids, torch.float64)
    before = max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)
    spread = torch.linspace(0.5, 1.5, 64)  # each channel scaled otherwise
    for change in (
        lambda b: b.experts.expert_scale.fill_(1.0),
        lambda b: b.experts.router_norm.weight.mul_(spread),
        lambda b: b.in_norm.weight.mul_(spread),
        lambda b: b.out_norm.weight.mul_(2),
        lambda b: b.dense_out_norm.weight.mul_(2),
        lambda b: [e.down.weight.zero_() for e in b.experts.experts],
    ):
        llm = LLM(model=folder, kv="off", exact=True, progress=False)
        with torch.no_grad():
            change(llm.model.layers[2].beside)
        assert max_error(llm.runner.logits(ids, llm.new_cache("off")), exact) > 100 * before


def test_the_device_road_follows_transformers(folder, monkeypatch):
    """The experts stacked and multiplied as on a GPU (experts.ROAD "gather" over dense
    weights, on the CPU: tests/test_experts_device.py): the exact path's logits as close
    to transformers' fp64 as its fp32, and no read on the host (a CUDA graph holds it)."""
    from kvlm.model import experts, graphs, layers

    monkeypatch.setattr(layers, "_pick_kernel", lambda weight, bf16: "torch")
    monkeypatch.setattr(experts, "ROAD", "gather")
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    assert graphs.why_not(llm.model) is None
    ids = prompt_ids(llm)
    with torch.no_grad():
        ref = load_hf(folder)(torch.tensor([ids])).logits[0]
    assert_as_exact_as(llm.runner.logits(ids, llm.new_cache("off")), ref,
                       hf_logits(folder, ids, torch.float64))  # fmt: skip


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_batched_and_chunked_equal_alone(folder, mode):
    """The default path: prompts batched = each alone, a prefill in chunks of 5 = one
    shot; on the engine's pool (paged) batched in chunks of 5 too."""
    from test_composition import make, tokens

    llm = make(folder, mode, None)
    prompts = [FRANCE, "Once upon a time", "def add(a, b):"]
    alone = [tokens(llm, p) for p in prompts]
    assert [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, GREEDY)] == alone
    assert tokens(make(folder, mode, None, prefill_chunk=5)) == tokens(llm)
    if mode == "paged":
        want = [tokens(llm, p) for p in POOL_PROMPTS]
        assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want


def test_the_fused_step_refuses_the_experts_beside_the_mlp(folder):
    """The fused C step has one FFN a layer and a router with no input norm or expert
    scales: refused by name where nothing else of Gemma 4's is; the torch step runs."""
    from kvlm.model import fused

    llm = LLM(model=folder, weights="int8", progress=False)
    assert llm.describe()["decode_step"].startswith("torch step")
    c = llm.config
    plain = replace(c, layer_head_dims=(), layer_kv_heads=(), layer_k_eq_v=(), v_norm=False,
                    kv_sources=(), per_layer_input=0, per_layer_vocab=0,
                    layer_scalars=False)  # fmt: skip
    assert fused.config_why_not(plain) == fused.BESIDE
    assert fused.config_why_not(replace(plain, experts=None, layer_ffns=())) is None


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [("num_experts", None, "num_experts"), ("top_k_experts", 9, "top_k_experts"),
     ("moe_intermediate_size", 0, "moe_intermediate_size")],
)  # fmt: skip
def test_bad_expert_keys_are_one_line(folder, key, value, said):
    from kvlm.arch import config_from_hf

    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    with pytest.raises(ModelLoadError, match=said):
        config_from_hf(cfg, "tiny")
