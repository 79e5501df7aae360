"""Gemma 4 (text) against transformers' Gemma4ForCausalLM on the tiny random-weight model
of conftest.TINY_MODELS "gemma4" (helpers.tiny_config): six layers, local ones (a window
of 8, heads of 16, two KV heads) and global ones (heads of 32, one KV head, K = V,
proportional RoPE over a quarter of the pairs), the last two reading the K/V of layers 2
and 3, per-layer inputs of 8, layer scalars, soft-capped logits; prompts past the window.

The cache keeps K/V for the four layers that make their own (the two that read an earlier
layer's keep nothing), each group of its own geometry; a K = V layer's one tensor (V: its
K is V times the k norm's weight, rotated at each key's position when it is read)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import fed, fresh_engine, hf64, load_hf, save_tiny_model
from kvlm import LLM
from kvlm.config import ModelConfig
from kvlm.errors import KvlmError, ModelLoadError, UnsupportedModelError
from numerics import assert_as_exact_as, max_error

PROMPT = "What is the capital of France? The capital of France is Paris, and of Spain"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("gemma4")


def exact_logits(folder, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf64(folder)(torch.tensor([ids])).logits[0]


def hf32_logits(folder, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(folder)(torch.tensor([ids])).logits[0]


def prompt_ids(llm: LLM) -> list[int]:
    ids = llm.tokenizer.encode(PROMPT * 2)[:40]
    assert len(ids) == 40  # five times the window
    return ids


def test_config_read_from_folder(folder):
    c = LLM(model=folder, kv="off", progress=False).config
    hf = json.loads((folder / "config.json").read_text())
    assert c.architecture == "gemma4" and c.layer_windows == (8, None) * 3
    layer = hf["per_layer_config"]
    assert c.layer_head_dims == tuple(layer.get(str(i), {}).get("head_dim", 16) for i in range(6))
    assert c.layer_head_dims == (16, 32) * 3 and c.layer_kv_heads == (2, 1) * 3
    assert c.layer_k_eq_v == (False, True) * 3 and c.v_norm and c.query_scale == 1.0
    assert c.kv_sources == (0, 1, 2, 3, 2, 3) and c.cache_layers == (0, 1, 2, 3)
    assert (c.per_layer_input, c.per_layer_vocab) == (8, c.vocab_size) and c.layer_scalars
    assert c.rope_scaling.rope_type == "proportional" and c.rope_scaling.proportion == 0.25
    assert (c.rope_theta, c.rope_local_theta, c.final_softcap) == (1e6, 1e4, 30.0)


def test_exact_logits_as_close_as_transformers_fp32(folder):
    """The exact path's logits of 40 tokens (past the window) through the cache modes
    that run this model, one shot and in chunks: as close to transformers' fp64 as its
    own fp32 are."""
    for mode in ("off", "contiguous", "basic", "paged"):
        llm = LLM(model=folder, kv=mode, exact=True, progress=False)
        ids = prompt_ids(llm)
        exact, ref = exact_logits(folder, ids), hf32_logits(folder, ids)
        assert_as_exact_as(fed(llm, ids, [len(ids)]), ref, exact)
        if mode != "off":  # chunks of 7 then rows one at a time (the decode road)
            assert_as_exact_as(fed(llm, ids, [7] * 4 + [1] * 12), ref, exact)


def test_the_double_wide_mlp_of_the_layers_that_read_k_v(tmp_path):
    """`use_double_wide_mlp`: the two layers that read an earlier layer's K/V have an MLP
    of twice the intermediate size; logits as exact as transformers' fp32."""
    folder = save_tiny_model(tmp_path, "gemma4", seed=12, use_double_wide_mlp=True)
    llm = LLM(model=folder, kv="contiguous", exact=True, progress=False)
    assert llm.config.layer_intermediate_sizes == (128,) * 4 + (256,) * 2
    ids = prompt_ids(llm)
    assert_as_exact_as(fed(llm, ids, [len(ids)]), hf32_logits(folder, ids),
                       exact_logits(folder, ids))  # fmt: skip


def test_each_part_of_the_block_is_applied(folder):
    """A layer's scalar, a per-layer input's gate, the queries of a layer that reads an
    earlier one's K/V, a K = V layer's V (its norm): each changed moves the logits far
    more than rounding (so the test above can fail)."""
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    exact = exact_logits(folder, ids)
    before = max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)
    for change in (
        lambda layers: layers[2].scalar.mul_(2),
        lambda layers: layers[0].per_layer.gate.weight.mul_(2),
        lambda layers: layers[4].attn.q_norm.weight.mul_(2),  # reads layer 2's K/V
        # a global layer's V (K = V), each channel scaled otherwise (a scale of all of
        # them would be normed away by the attention's output norm)
        lambda layers: layers[1].attn.v_norm.weight.copy_(torch.linspace(0.5, 1.5, 32)),
    ):
        llm = LLM(model=folder, kv="off", exact=True, progress=False)
        with torch.no_grad():
            change(llm.model.layers)
        assert max_error(llm.runner.logits(ids, llm.new_cache("off")), exact) > 100 * before


def test_memory_counts_the_layers_that_keep_k_v(folder, capsys):
    """`kvlm memory`: bytes a token for the four layers that keep K/V (none for the two
    that read an earlier layer's), each group at its own geometry: two local layers of 2
    KV heads x 16, K and V, and two global of 1 x 32, K = V: one tensor, in fp32."""
    from kvlm.cli import main

    assert main(["memory", "--model", str(folder), "--context", "64", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    want = 2 * (2 * 16) * 2 * 4 + 2 * (1 * 32) * 1 * 4  # a K = V layer's V alone
    assert record["bytes_per_token"] == want == 768
    groups = {
        g["kind"]: (g["layers"], g["keeps"], g.get("shared_by")) for g in record["layer_groups"]
    }
    # the globals keep one row (K = V), the locals K and V; layer 4 reads layer 2's, 5 3's
    assert groups == {"attention": (2, "K = V", [5]), "window": (2, "K/V", [4])}
    assert main(["memory", "--model", str(folder), "--context", "64"]) == 0
    text = capsys.readouterr().out
    assert "2 attention layers (one row a token, their K and their V)" in text
    assert "1 more layer read their K/V and keep none" in text
    # `kvlm inspect` and /v1/kv (the dashboard's table) name the same, the pool's groups
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["kv_layer_groups"]
    assert [(g["layers"], g["keeps"], g["shared_by"]) for g in shown] == [
        ([1, 3], "K = V", [5]), ([0, 2], "K/V", [4])]  # fmt: skip
    assert [g["kv_bytes_per_token"] for g in shown] == [2 * 32 * 4, 2 * 2 * 16 * 2 * 4]
    view = fresh_engine(LLM(model=folder, progress=False, max_context=64)).kv_view()["groups"]
    assert [(g["layers"], g["keeps"], g["shared_by"]) for g in view] == [
        ([1, 3], "K = V", [5]), ([0, 2], "K/V", [4])]  # fmt: skip
    # the table's rows: every mode but the window cache's (one ring of one head geometry:
    # test_the_window_cache_is_refused), int8 and q4 K/V among them
    rows = {(r["mode"], r["kv_dtype"]) for r in record["table"]}
    assert {m for m, _ in rows} == {"off", "basic", "contiguous", "paged", "int8"}
    assert ("paged", "q4") in rows and ("contiguous", "int8") in rows
    llm = LLM(model=folder, progress=False)
    assert llm.new_cache("contiguous").spec.num_layers == 4
    assert llm.config.kv_elements_per_token * 4 == want


def test_the_window_cache_is_refused(folder):
    """The window cache keeps one ring, of one head geometry, for every layer."""
    llm = LLM(model=folder, kv="off", progress=False)
    with pytest.raises(UnsupportedModelError, match="heads of their own sizes"):
        llm.new_cache("window")


@pytest.mark.parametrize(
    ("mode", "dtype"), [("int8", None), ("paged", "int8"), ("paged", "q4"), ("contiguous", "int8")]
)
def test_low_bit_k_v(folder, mode, dtype):
    """int8 and q4 K/V (K, and a quantized V, kept in a rotated basis of each group's
    own width; a K = V layer's halves in K's and V's rows each rotated back): greedy
    tokens held to the fp32 cache's by the top-5 rule (int8), and the logits' error
    under 0.3 of the logits' scale (int8: 1.0 of 7.4 in paged; with the V half left
    rotated 7.5, with the K half 7.8) or their scale (q4: 5.8)."""
    from helpers import FRANCE, assert_generation_agrees

    ref = LLM(model=folder, kv="paged", progress=False)
    kw = {} if dtype is None else {"kv_dtype": dtype}
    llm = LLM(model=folder, kv=mode, progress=False, **kw)
    ids = prompt_ids(llm)
    exact = exact_logits(folder, ids)
    error = max_error(fed(llm, ids, [len(ids)]), exact)
    assert error < (0.3 if dtype != "q4" else 1.0) * float(exact.abs().max())
    if dtype != "q4":
        assert_generation_agrees(ref, llm, FRANCE, 20)


def test_the_fused_step_says_why_not(folder):
    from kvlm.model.fused import why_not

    llm = LLM(model=folder, weights="int8", progress=False)
    assert why_not(llm.model) == "layers of their own head size or KV heads"


@pytest.mark.parametrize(
    ("key", "value", "error", "said"),
    [
        ("enable_moe_block", True, ModelLoadError, "num_experts"),  # none given
        ("per_layer_config", {"1": {"head_dim": "wide"}}, ModelLoadError, "head_dim"),
        ("per_layer_config", {"9": {"head_dim": 32}}, ModelLoadError, "per_layer_config"),
        ("layer_types", ["sliding_attention"] * 5, ModelLoadError, "layer_types"),
        ("num_kv_shared_layers", 6, ModelLoadError, "num_kv_shared_layers"),
        ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}},
         UnsupportedModelError, "RoPE type 'yarn'"),
    ],
)  # fmt: skip
def test_what_is_not_run_yet_or_bad_is_one_line(folder, tmp_path, key, value, error, said):
    from kvlm.arch import config_from_hf

    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    with pytest.raises(error, match=said) as info:
        config_from_hf(cfg, "tiny")
    assert isinstance(info.value, KvlmError) and "\n" not in str(info.value)


def test_a_multimodal_folder_runs_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration (`text_config`, weights under
    `model.language_model.`): kvlm runs the language model, as transformers' forward over
    text alone does."""
    import shutil

    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from helpers import tiny_config

    text = tiny_config("gemma4", 320)
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(13)
    hf = Gemma4ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    donor = save_tiny_model(tmp_path / "donor", "llama")  # tokenizer files
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(donor / f, tmp_path / f)
    llm = LLM(model=tmp_path, kv="off", exact=True, progress=False)
    assert isinstance(llm.config, ModelConfig) and llm.config.kv_sources == (0, 1, 2, 3, 2, 3)
    ids = [0, *range(10, 50)]
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
        exact = hf.double()(input_ids=torch.tensor([ids])).logits[0]
    assert_as_exact_as(ours, ref, exact)


def test_one_ragged_forward_a_step_follows_a_forward_per_chunk(folder, monkeypatch):
    """The engine's steps as one ragged forward (RaggedStep, the GPU's road: each
    sequence's keys packed, a K = V layer's keys made at each sequence's own positions):
    greedy tokens held to the forward-per-chunk road's by the top-5 rule, requests
    arriving while others decode, prompts in chunks of 4."""
    from helpers import assert_greedy_agreement
    from kvlm import SamplingParams
    from kvlm.cache.paged import RaggedStep
    from kvlm.engine.engine import Engine, EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig

    made = []
    real = RaggedStep.__init__

    def spy(self, *args, **kwargs):
        made.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(RaggedStep, "__init__", spy)
    llm = LLM(model=folder, kv="paged", progress=False)
    prompts = [llm.tokenizer.encode(p) for p in (PROMPT, "Once upon a time there was",
                                                 "Red, green and blue")]  # fmt: skip

    def run(one_forward: bool) -> dict[str, list]:
        engine = Engine(llm, EngineConfig(num_blocks=64,
                                          scheduler=SchedulerConfig(prefill_chunk=4)))  # fmt: skip
        engine.runner.one_forward = one_forward
        out: dict[str, list] = {}
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
            for step in range(200):
                if step < len(prompts):
                    engine.add_request(str(step), prompts[step], params)
                if not engine.has_work():
                    break
                for ev in engine.step():
                    out.setdefault(ev.request_id, []).extend(ev.logprobs)
        finally:
            engine.runner.one_forward = False
        return out

    ragged = run(True)
    assert made, "no ragged step"
    split = run(False)
    for rid, lps in split.items():
        logits = torch.full((len(lps), llm.config.vocab_size), -torch.inf)
        for i, lp in enumerate(lps):
            for t, v in lp.top.items():
                logits[i, t] = v
        ours = ragged[rid]
        assert len(ours) == len(lps) == 12
        assert_greedy_agreement([lp.token_id for lp in ours], [list(lp.top) for lp in ours],
                                [lp.token_id for lp in lps], logits)  # fmt: skip


@pytest.mark.parametrize("weights", ["int8", "bf16"])
def test_low_bit_weights_run_on_the_torch_step(folder, weights):
    """Low-bit or bf16 projections (the per-layer inputs' too) on the torch step (the fused
    one refuses the model): 20 greedy tokens held to the fp32 model's by the top-5 rule."""
    from helpers import FRANCE, assert_generation_agrees

    ref = LLM(model=folder, progress=False)
    llm = LLM(model=folder, weights=weights, progress=False)
    assert llm.describe()["decode_step"].startswith("torch step")
    assert_generation_agrees(ref, llm, FRANCE, 20)


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_chunks_longer_than_the_window_equal_one_shot(folder, mode):
    """Prefill chunks of 12 and 20 past the window of 8 (a ring stages a chunk's own K/V,
    which the layers reading a local layer's K/V read there too) give the one-shot
    tokens."""
    from test_composition import make, tokens

    prompt = "The quick brown fox jumps over the lazy dog and runs far away" * 2
    want = tokens(make(folder, mode, None), prompt)
    for chunk in (12, 20):
        assert tokens(make(folder, mode, None, prefill_chunk=chunk), prompt) == want
