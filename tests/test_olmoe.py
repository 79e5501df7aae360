"""OLMoE: a Llama block whose q and k RMSNorms each span the whole projection
(`qk_norm_extent` "projection"), and a mixture of experts in every layer whose top k keep
their softmax weights (not renormalised), against transformers' OlmoeForCausalLM on a
tiny random-weight model (4 layers of 8 experts of 64, the top 3; 4 query heads over 2 KV
heads, so the q norm spans 64 and the k norm 32), and from the GGUF files llama.cpp's own
converter writes for it (tests/converter.py). The fused C decode step norms each whole
projection too (kernels/decode.c, `qk_norm_whole`)."""

from __future__ import annotations

import pytest
import torch

import converter
from helpers import (
    FRANCE,
    GREEDY,
    POOL_PROMPTS,
    assert_greedy_agreement,
    fed,
    gguf_as_folder,
    hf_greedy,
    load_hf,
    on_pool,
    prompt_ids,
    refused,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams
from numerics import assert_as_exact_as, max_error


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("olmoe"), "olmoe", seed=50,
                           tokenizer="qwen35")  # fmt: skip


@pytest.fixture(scope="module")
def converted(folder):
    """outtype -> the GGUF llama.cpp's converter writes for the tiny model."""
    return lambda outtype="f32": converter.convert(folder, outtype, pre="qwen35")


def hf64(folder):
    """transformers' model in fp64 (its experts one at a time: its grouped product runs
    fp32 and bf16 only)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                experts_implementation="eager").eval()  # fmt: skip


def test_config_and_parameters_as_transformers_reads_them(folder, capsys):
    """The config (the experts of intermediate_size, not renormalised; q/k norms over the
    projections) and `kvlm inspect`'s parameters: every one transformers' model has, and
    those a token runs (top_k of each layer's experts)."""
    import json

    from kvlm.cli import main

    c, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder)
    x, h = c.experts, hf.config
    assert c.architecture == "olmoe" and c.qk_norm and c.qk_norm_extent == "projection"
    assert (x.count, x.top_k, x.intermediate, x.normalize, x.shared) == (
        h.num_experts, h.num_experts_per_tok, h.intermediate_size, False, 0)  # fmt: skip
    assert c.layer_ffns == ("experts",) * h.num_hidden_layers
    assert c.qk_norm_sizes == (64, 32)
    every = sum(p.numel() for p in hf.parameters())
    idle = c.num_layers * (x.count - x.top_k) * 3 * c.hidden_size * x.intermediate
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["parameters"], info["active_parameters"]) == (every, every - idle)


def test_teacher_forced_logits_match_hf(folder, monkeypatch):
    """Every position's logits over 40 tokens, the exact path: as close to transformers'
    fp64 as its own fp32 logits (tests/numerics.py), by the q/k norms' C road (each
    projection normed in place, then RoPE) and by torch's."""
    from kvlm.model.attention import Attention

    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    with torch.no_grad():
        ref = load_hf(folder)(torch.tensor([ids])).logits[0]
        exact = hf64(folder)(torch.tensor([ids])).logits[0]
    assert_as_exact_as(ours, ref, exact)
    monkeypatch.setattr(Attention, "_norm_rope_in_c", lambda *a: False)
    torch_road = llm.runner.logits(ids, llm.new_cache("off"))
    assert not torch.equal(torch_road, ours)  # the other road ran
    assert_as_exact_as(torch_road, ref, exact)


def test_greedy_tokens_equal_hf(folder):
    """32 greedy tokens: in fp64 transformers' fp64 tokens; by default the top-5 rule
    against its fp32."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    fp64 = LLM(model=folder, kv="off", dtype="fp64", progress=False)
    ids = fp64.tokenizer.encode(FRANCE)
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf64(folder), ids, 32)[0]
    out = LLM(model=folder, progress=False).generate(prompt_token_ids=[ids],
                                                     sampling_params=params)[0]  # fmt: skip
    ref_ids, ref_logits = hf_greedy(load_hf(folder), ids, 32)
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


@pytest.mark.parametrize("mode", ["basic", "contiguous", "paged", "int8", "window"])
def test_every_mode_chunked_equals_one_shot(folder, mode):
    """Chunks of 7, then a token at a time, give the one-shot prefill's logits through the
    same mode bit for bit (int8 and window: as exact, as a dense model's there); the exact
    modes also the `off` oracle's."""
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    if mode in ("window", "int8"):
        with torch.no_grad():
            exact = hf64(folder)(torch.tensor([ids])).logits[0]
        assert_as_exact_as(chunked, one_shot, exact)
    else:
        assert torch.equal(chunked, one_shot)
        off = LLM(model=folder, kv="off", exact=True, progress=False)
        assert torch.equal(one_shot, off.runner.logits(ids, off.new_cache("off")))


def test_batched_forked_speculative_and_the_pool_equal_alone(folder):
    """Prompts batched = each alone; n = 2 greedy samples = the one; prompt lookup's
    drafts = plain; on the engine's pool batched, in chunks of 5 and as prefix hits too."""
    from kvlm.engine.speculative import SpeculativeConfig

    llm = LLM(model=folder, kv="paged", progress=False)
    want = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    assert [[o.outputs[0].token_ids] for o in llm.generate(POOL_PROMPTS, GREEDY)] == want
    two = SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert [s.token_ids for s in llm.generate(POOL_PROMPTS[0], two)[0].outputs] == want[0] * 2
    spec = LLM(model=folder, kv="paged", speculative=SpeculativeConfig("ngram", ngram_min=1),
               progress=False)  # fmt: skip
    assert [[o.outputs[0].token_ids] for o in spec.generate(POOL_PROMPTS, GREEDY)] == want
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    again, engine = on_pool(llm, POOL_PROMPTS * 2, GREEDY, scheduler={"max_num_seqs": 3})
    assert again == want * 2 and engine.manager.stats.hits > 0


# ---------------------------------------------------------------- llama.cpp's converter


def test_gguf_from_llama_cpps_converter_reads_as_the_folder(folder, converted):
    """The file users get (experts stacked, the q/k norms' weights of 64 and 32, the
    experts' width as feed_forward_length): the folder's config, its logits bit for bit,
    and its greedy tokens."""
    from_gguf, from_hf = gguf_as_folder(converted("f32"), folder)
    ids = prompt_ids(from_hf)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    assert torch.equal(ours, from_hf.runner.logits(ids, from_hf.new_cache("off")))
    prompt = from_hf.tokenizer.encode(FRANCE)
    assert from_gguf.tokenizer.encode(FRANCE) == prompt
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [m.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
            for m in (from_gguf, from_hf)]  # fmt: skip
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_the_fused_step_norms_each_projection(converted, mode):
    """The converter's Q8_0 file: the fused C step takes the model, and its logits over 40
    greedy steps follow the torch step's by the top-5 rule both ways; the step's norms
    per head instead (the weights' first head_dim) move them far."""
    from helpers import assert_top_k_both_ways, fused_and_torch

    llm = LLM(model=converted("q8_0"), kv=mode, progress=False)
    assert llm.runner.fused_reason is None and llm.describe()["decode_step"] == "fused"
    prompt = prompt_ids(llm, 16)
    _, fused, ref, _, _ = fused_and_torch(llm, prompt, 40, mode)
    assert_top_k_both_ways(fused, ref)
    close = max_error(fused, ref)
    assert close < 0.05 * max_error(ref, torch.zeros_like(ref))
    cache = llm.new_cache(mode)
    token = int(llm.runner.forward(prompt, cache).argmax())
    spec = llm.runner.fused_for(cache).spec
    spec.qk_norm_whole = 0
    try:
        per_head = llm.runner.forward([token], cache)
    finally:
        spec.qk_norm_whole = 1
    assert max_error(per_head, ref[0]) > 10 * close


def test_the_pools_fused_step_batches_forks_and_drafts_as_alone(converted, monkeypatch):
    """On the engine's pool every decode row through the fused step: batched, n = 2,
    drafts (prompt lookup's, the file's int4 self's: its int8 self agrees with every
    draft) = each prompt alone, bit for bit."""
    from helpers import assert_pool_fused_as_alone

    llm = LLM(model=converted("q8_0"), kv="paged", progress=False)
    assert_pool_fused_as_alone(llm, monkeypatch, "int4")


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """The address ranges this process maps `path` at (/proc/self/maps)."""
    import os

    want, out = os.path.realpath(path), []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == want:
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                out.append((lo, hi))
    return out


def test_q8_0_experts_are_read_where_they_lie_in_the_map(converted, monkeypatch):
    """A Q8_0 file larger than the memory available at load (IN_PLACE_SHARE 0 here) has
    its expert stacks multiplied in the file's map (quant.ROWS_KIND: every expert's gate
    and up parts and down inside the mapped file, nothing copied); one that fits packs
    them (q8, the faster products); the two compute the same bits: a prompt's logits, and
    8 greedy steps on the fused step and on the torch step."""
    import sys

    from helpers import fused_and_torch
    from kvlm.model import quant

    path = converted("q8_0")
    transformer = sys.modules["kvlm.model.transformer"]
    packed_now = LLM(model=path, progress=False)  # a file that fits: packed, the faster road
    assert {e.down.quant.kind for e in packed_now.model.layers[0].mlp.experts} == {"q8"}
    with monkeypatch.context() as m:  # as where the file passes the memory available
        m.setattr(transformer, "IN_PLACE_SHARE", 0.0)
        llm = LLM(model=path, progress=False)
    ranges = _mapped_ranges(path)
    assert ranges
    for block in llm.model.layers:
        for e in block.mlp.experts:
            for part in (*e.gate_up.quant.parts(), e.down.quant):
                lo, hi = part.data.data_ptr(), part.data.data_ptr() + part.data.numel()
                assert part.kind == quant.ROWS_KIND
                assert any(a <= lo and hi <= b for a, b in ranges)
    before = packed_now
    ids = prompt_ids(llm, 16)
    assert torch.equal(llm.runner.logits(ids, llm.new_cache("contiguous")),
                       before.runner.logits(ids, before.new_cache("contiguous")))  # fmt: skip
    now, then = fused_and_torch(llm, ids, 8), fused_and_torch(before, ids, 8)
    assert now[0] == then[0]
    assert torch.equal(now[1], then[1]) and torch.equal(now[2], then[2])


def test_memory_says_what_a_token_reads(converted, capsys):
    """`kvlm memory` on the Q8_0 file: every expert held, a token's top k read."""
    import json

    from kvlm.cli import main

    assert main(["memory", "--model", str(converted("q8_0")), "--context", "64", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["weight_bytes"] > 2 * record["weight_bytes_read_per_token"] > 0


def test_a_benchmark_shape_writes_the_projections_norms(tmp_path, monkeypatch):
    """kvlm.bench.models' random-weight file of an OLMoE shape (a small one here: the
    real one is "olmoe-1b-7b"): q/k norm weights of the projections' widths, the experts'
    width as feed_forward_length; kvlm loads it and decodes on the fused step."""
    from kvlm.bench import models
    from kvlm.loading.default import default_model_path

    shape = models.Shape("olmoe", 64, 2, 4, 2, 16, 64, 49152, False, 1e4, 256, 1e-5,
                         experts=8, experts_used=2, expert_inter=64)  # fmt: skip
    monkeypatch.setitem(models.SHAPES, "tiny-olmoe", shape)
    path = models.write_model("tiny-olmoe", "Q8_0", tmp_path / "o.gguf", default_model_path())
    llm = LLM(str(path), threads=1, progress=False)
    attn = llm.model.layers[0].attn
    assert (attn.q_norm.weight.numel(), attn.k_norm.weight.numel()) == (64, 32)
    assert llm.describe()["decode_step"] == "fused"
    out = llm.generate("a b c", SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------- hostile config keys


def hf_cfg(**changes) -> dict:
    cfg = {"model_type": "olmoe", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_experts": 8, "num_experts_per_tok": 3}  # fmt: skip
    return {k: v for k, v in {**cfg, **changes}.items() if v is not None}


def gguf_meta(**changes) -> dict:
    meta = {"general.architecture": "olmoe", "olmoe.embedding_length": 64,
            "olmoe.attention.head_count": 4, "olmoe.feed_forward_length": 64,
            "olmoe.block_count": 2, "olmoe.vocab_size": 64, "olmoe.expert_count": 8,
            "olmoe.expert_used_count": 3}  # fmt: skip
    return {k: v for k, v in {**meta, **changes}.items() if v is not None}


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts": None}, "num_experts"),
        ({"intermediate_size": -1}, "intermediate_size"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"clip_qkv": 8.0}, "clip_qkv"),
        ({"clip_qkv": "x"}, "clip_qkv"),
    ],
)
def test_hostile_config_keys_are_refused(changes, said):
    from kvlm.arch import config_from_hf

    assert refused(config_from_hf, hf_cfg(), hf_cfg(**changes), said).experts.count == 8


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"olmoe.expert_count": 0}, "expert_count"),
        ({"olmoe.expert_used_count": 9}, "expert_used_count"),
        ({"olmoe.expert_count": None}, "expert_count"),
        ({"olmoe.feed_forward_length": 0}, "feed_forward_length"),
    ],
)
def test_hostile_gguf_keys_are_refused(changes, said):
    from kvlm.arch import config_from_gguf

    config = refused(config_from_gguf, gguf_meta(), gguf_meta(**changes), said)
    assert config.experts.normalize is False
