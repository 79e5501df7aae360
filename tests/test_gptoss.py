"""gpt-oss: attention sinks, alternating windowed and whole-context layers, YaRN, biases,
and a mixture of experts routed by the top k of a biased router's logits, each expert a
clamped SwiGLU with biases: against transformers' GptOssForCausalLM (eager attention, its
experts one at a time) on a tiny random-weight model (tests/helpers.tiny_config
"gpt_oss": sinks and the experts' biases randomised), and from the GGUF files llama.cpp's
own converter writes for it (tests/converter.py), MXFP4 experts among them.

The C roads take the model: the C attention (kvlm_attend, kvlm_attend_row) with the sinks
against the explicit softmax's road, the C router ("topk_softmax" with the router's bias)
against torch's, and the fused C decode step (the sinks, the q/k/v/o biases, alternating
windowed layers on the hybrid cache, the experts' biases and the clamped SwiGLU) against
the torch step, alone and on the engine's pool (batched, forked, drafted)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import converter
from helpers import (
    FRANCE,
    assert_greedy_agreement,
    fed,
    gguf_as_folder,
    hf_greedy,
    prompt_ids,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams, kernels
from numerics import U32, assert_as_exact_as, attention_bound, max_error, product_bound

SEED = 50
ALPHA, LIMIT = 1.702, 7.0  # the clamped SwiGLU's, as the config's defaults


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("gptoss"), "gpt_oss", seed=SEED,
                           tokenizer="qwen35")  # fmt: skip


@pytest.fixture(scope="module")
def q8_0(folder):
    """The GGUF llama.cpp's converter writes for the tiny model at --outtype q8_0."""
    return converter.convert(folder, "q8_0", pre="qwen35")


def hf(folder, dtype=torch.float32):
    """transformers' model: eager attention (its sinks' road), experts one at a time (its
    grouped product takes no fp64)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager").eval()  # fmt: skip


def hf_logits(folder, ids, dtype=torch.float32):
    with torch.no_grad():
        return hf(folder, dtype)(torch.tensor([ids])).logits[0]


def test_config_read_from_folder(folder):
    c = LLM(model=folder, kv="off", progress=False).config
    cfg = json.loads((folder / "config.json").read_text())
    assert c.architecture == "gpt-oss" and c.attn_sinks
    assert c.layer_windows == (8, None, 8, None)
    assert c.layer_ffns == ("experts",) * 4
    x = c.experts
    assert (x.count, x.top_k, x.intermediate, x.router, x.activation) == (
        8, 2, 64, "topk_softmax", "clamped_swiglu")  # fmt: skip
    assert (x.swiglu_alpha, x.swiglu_limit) == (cfg["swiglu_alpha"], cfg["swiglu_limit"])
    s = c.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.truncate) == (
        "yarn", 4.0, 64, False)  # fmt: skip


def test_teacher_forced_logits_match_hf(folder):
    """40 positions (past the window of 8), the exact path: as close to transformers' fp64
    as its own fp32 logits; the fused step refuses the model, saying why."""
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    assert_as_exact_as(ours, hf_logits(folder, ids), hf_logits(folder, ids, torch.float64))


def test_the_sinks_router_bias_and_experts_are_applied(folder):
    """Each part moved (the sinks zeroed, a router bias zeroed, an expert's down bias
    zeroed) moves the logits far more than rounding, so the test above can fail."""
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    exact = hf_logits(folder, ids, torch.float64)

    def error() -> float:
        return max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)

    before = error()
    layer = llm.model.layers[1]
    with torch.no_grad():
        for part in (layer.attn.sinks, layer.mlp.router.bias):
            saved = part.clone()
            part.zero_()
            assert error() > 1000 * before
            part.copy_(saved)
        chosen, _ = layer.mlp.route(llm.model.embed(torch.tensor(ids)))
        layer.mlp.experts[int(chosen[0, 0])].down.bias.zero_()
        assert error() > 1000 * before


def test_the_c_roads_take_the_model_and_refuse_what_they_cannot_run(folder):
    """The fused step (config and block) and the kernels' router take the model; what the
    step still cannot run (here: some experts with biases and some without, fp64) it
    refuses, saying what, and the model then decodes on the torch step."""
    from kvlm.model.fused import config_why_not, why_not

    llm = LLM(model=folder, weights="int8", progress=False)
    assert config_why_not(llm.config) is None and why_not(llm.model) is None
    assert llm.describe()["decode_step"] == "fused"
    moe = llm.model.layers[0].mlp
    assert moe.kernel_refusal() is None
    saved, moe.experts[3].down.bias = moe.experts[3].down.bias, None
    try:
        assert why_not(llm.model) == "biases on some experts and not on others"
    finally:
        moe.experts[3].down.bias = saved
    fp64 = LLM(model=folder, dtype="fp64", progress=False)
    assert why_not(fp64.model) == "needs fp32 activations on the CPU"
    assert fp64.describe()["decode_step"] != "fused"


def test_greedy_tokens_equal_hf(folder):
    """24 greedy tokens past the window: in fp64 transformers' fp64 tokens; by default
    (fp32) the top-5 rule against its fp32."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    fp64 = LLM(model=folder, kv="contiguous", dtype="fp64", progress=False)
    ids = fp64.tokenizer.encode(FRANCE)
    out = fp64.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    assert out.token_ids == hf_greedy(hf(folder, torch.float64), ids, 24)[0]
    llm = LLM(model=folder, progress=False)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(hf(folder), ids, 24)
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


@pytest.mark.parametrize("mode", ["basic", "contiguous", "paged", "int8", "window"])
def test_every_mode_chunked_equals_one_shot(folder, mode):
    """Chunks of 7, then a token at a time, give the one-shot prefill's logits through the
    same mode as exactly; on the pool's modes bit for bit (the sinks in kvlm_attend: a
    row's bits depend on its query and the keys it sees alone, every key where a one-shot
    prompt has it), and there the `off` oracle's one shot too. A ring (basic and
    contiguous keep each window's layers in one, window every layer) hands the kernels a
    window layer's keys at other offsets of their blocks of keys: as exact, not bit for
    bit."""
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    exact = hf_logits(folder, ids, torch.float64)
    assert_as_exact_as(chunked, one_shot, exact)
    off = LLM(model=folder, kv="off", exact=True, progress=False)
    oracle = off.runner.logits(ids, off.new_cache("off"))
    if mode in ("paged", "int8"):
        assert torch.equal(chunked, one_shot)
    if mode == "paged":
        assert torch.equal(one_shot, oracle)
    elif mode in ("basic", "contiguous"):
        assert_as_exact_as(one_shot, oracle, exact)


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_batched_forked_and_speculative_equal_alone(folder, mode):
    """Prompts batched = each alone; n = 2 greedy samples = the one; prompt lookup's
    drafts = plain."""
    from kvlm.engine.speculative import SpeculativeConfig

    llm = LLM(model=folder, kv=mode, progress=False)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [FRANCE, "One two three, one two three, one two"]
    alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], SamplingParams(n=2, max_tokens=20, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2
    spec = LLM(model=folder, kv=mode, speculative=SpeculativeConfig("ngram", ngram_min=1),
               progress=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == alone


# ---------------------------------------------------------------- llama.cpp's converter


def test_gguf_from_llama_cpps_converter_reads_as_the_folder(folder):
    """The converter's f32 file (gate|up split and de-interleaved, `attn_sinks`, the
    router's and the experts' biases): the folder's config and logits bit for bit."""
    path = converter.convert(folder, "f32", pre="qwen35")
    from_gguf, from_hf = gguf_as_folder(path, folder)
    ids = prompt_ids(from_hf)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    assert torch.equal(ours, from_hf.runner.logits(ids, from_hf.new_cache("off")))


def _mxfp4_folder(folder, out):
    """The tiny model as the Hub keeps gpt-oss: its experts' gate_up and down as MXFP4
    blocks and scales (random codes, exponents near 1), `quantization_config` mxfp4."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, t in load_file(folder / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = t.shape  # HF's (E, in, out): blocks of 32 along `in`
            shape = (e, rows, cols // 32)
            tensors[name + "_blocks"] = torch.randint(0, 256, (*shape, 16), generator=g,
                                                      dtype=torch.uint8)  # fmt: skip
            tensors[name + "_scales"] = torch.randint(124, 129, shape, generator=g,
                                                      dtype=torch.uint8)  # fmt: skip
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_mxfp4_experts_dequantize_as_gguf_py_does(folder, tmp_path, capsys):
    """The converter's file of an MXFP4 checkpoint keeps the experts MXFP4
    (`ffn_*_exps`): kvlm's values are gguf-py's `dequantize` bit for bit, and the model
    loads them as they are (--weights native, the CPU's default for a low-bit file: each
    expert's gate|up and down an "mxfp4" weight at the file's 4.25 bits a weight, its
    values gguf-py's rows of the stack) and generates from them; `kvlm memory` counts them
    at their bytes in the file, `kvlm inspect` names the type."""
    import gguf

    from kvlm.cli import main
    from kvlm.loading.gguf import GGUFWeights
    from kvlm.model.quant import QuantWeight

    path = converter.convert(_mxfp4_folder(folder, tmp_path / "mxfp4"), "f32", pre="qwen35")
    weights = GGUFWeights(path)
    stacks = [n for n in weights.names() if weights.stored_as(n)[1] == "MXFP4"]
    assert len(stacks) == 3 * 4  # gate, up and down of every layer
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            name = weights.family.from_gguf_name(t.name, 4)
            got = weights.get(name).numpy()
            assert np.array_equal(got.reshape(want.shape).view(np.uint32), want.view(np.uint32))
    llm = LLM(model=path, progress=False)
    dense = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    held = 0
    for i, layer in enumerate(llm.model.layers):
        for e, mlp in enumerate(layer.mlp.experts):
            for linear, parts in ((mlp.gate_up, ("gate", "up")), (mlp.down, ("down",))):
                q = linear.quant
                assert isinstance(q, QuantWeight) and q.kind == "mxfp4"
                assert q.nbytes == -(-q.out_features // 16) * 16 * q.in_features * 17 // 32
                held += q.out_features * q.in_features * 17 // 32
                want = np.concatenate([dense[f"blk.{i}.ffn_{p}_exps.weight"][e] for p in parts])
                assert np.array_equal(q.dense().numpy().view(np.uint32), want.view(np.uint32))
    assert held == sum(weights.stored_bytes(n) for n in stacks)
    out = llm.generate(FRANCE, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    assert main(["memory", "--model", str(path), "--context", "64", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    others = sum(np.prod(weights.shape(n)) * 4 for n in weights.names() if n not in stacks)
    assert record["weight_bytes"] == held + others  # the experts at 17 bytes a 32 weights
    assert main(["inspect", "--model", str(path), "--json"]) == 0
    assert "MXFP4" in json.loads(capsys.readouterr().out)["weight_types"]


def test_the_pool_batches_and_chunks_as_alone(folder):
    """Through the engine's pool (ragged steps: attend_ragged reaches the sinks): the
    prompts batched and in chunks of 5, each prompt's tokens alone."""
    from helpers import GREEDY, POOL_PROMPTS, on_pool

    llm = LLM(model=folder, kv="paged", progress=False)
    want = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    assert on_pool(llm, POOL_PROMPTS, GREEDY)[0] == want
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want


def test_a_benchmark_shape_writes_sinks_biases_and_mxfp4_experts(tmp_path, monkeypatch):
    """kvlm.bench.models' random-weight file of a gpt-oss shape (a small one here: the real
    ones are "gpt-oss-20b" and its 4-layer slice) as the Hub's files come, MXFP4_MOE: the
    experts MXFP4, the rest Q8_0, a sink a query head, the biases of the attention, the
    router and the experts, YaRN's keys, the MLP's norm under llama.cpp's name for it;
    kvlm reads each and generates."""
    import gguf

    from kvlm.bench import models
    from kvlm.loading.default import default_model_path

    shape = models.Shape("gpt-oss", 64, 2, 4, 2, 16, 64, 49152, False, 150000.0, 4096, 1e-5,
                         window=8, experts=8, experts_used=2, expert_inter=64, biases=True,
                         yarn=(32.0, 256))  # fmt: skip
    monkeypatch.setitem(models.SHAPES, "tiny-gptoss", shape)
    path = models.write_model("tiny-gptoss", "MXFP4_MOE", tmp_path / "g.gguf", default_model_path())
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["blk.1.ffn_down_exps.weight"] == "MXFP4" and kinds["output.weight"] == "Q8_0"
    for name in ("attn_sinks.weight", "attn_output.bias", "ffn_gate_inp.bias",
                 "ffn_up_exps.bias", "post_attention_norm.weight"):  # fmt: skip
        assert f"blk.0.{name}" in kinds
    llm = LLM(str(path), threads=1, progress=False)
    c = llm.config
    assert c.attn_sinks and c.layer_windows == (8, None) and c.experts.count == 8
    assert (
        c.rope_scaling.rope_type == "yarn"
        and c.rope_scaling.original_max_position_embeddings == 256
    )
    attn, moe = llm.model.layers[0].attn, llm.model.layers[0].mlp
    assert attn.sinks is not None and attn.o_proj.bias is not None and moe.router.bias is not None
    out = llm.generate("a b c", SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------ the C roads


def _c_kernels(build: str):
    from helpers import portable_kernels

    lib = kernels.library() if build == "native" else portable_kernels(build)
    if lib is None:
        pytest.skip("no C kernels")
    return lib


@pytest.mark.parametrize("build", ["native", "x86-64"])
@pytest.mark.parametrize("D", [16, 64, 128])
def test_the_c_attention_takes_the_sinks(build, D, monkeypatch):
    """kvlm_attend (a prompt's rows: causal from the top left, and a window's mask after a
    prefix) and kvlm_attend_row (a decode row over a mask) with a sink a query head: the
    explicit softmax's road within the attention bound (one key more: the sink's column);
    a row that sees no key is zeros; without the sinks the output moves far past it."""
    from kvlm.model.attention import _attend_kernel, attend, attend_explicit

    lib = _c_kernels(build)
    monkeypatch.setattr(kernels, "library", lambda: lib)
    g = torch.Generator().manual_seed(D)
    H, Hkv, S = 4, 2, 70
    k, v = (torch.randn(1, Hkv, S, D, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g) * 3
    seen = torch.ones(S, S, dtype=torch.bool).tril()
    window = seen & ~seen.tril(-9)  # the query at p sees p - 8 .. p
    cases = [(S, None, True, False), (23, window[-23:], False, False),
             (1, torch.rand(1, S, generator=g) < 0.5, False, True)]  # fmt: skip
    for T, mask, causal, decode in cases:
        q = torch.randn(1, H, T, D, generator=g)
        got = _attend_kernel(q, k, v, mask, causal, decode=decode, sinks=sinks)
        assert got is not None, (T, causal, decode)
        want = attend_explicit(q, k, v, mask, causal, None, sinks)
        bound = attention_bound(q, k, v, n_keys=S + 1)
        assert max_error(got, want) <= bound, (T, causal, decode)
        assert max_error(got, attend_explicit(q, k, v, mask, causal)) > 10 * bound
        # `attend` takes the kernels for a sink layer on the CPU now, not the explicit road
        assert torch.equal(attend(q, k, v, mask, causal, sinks=sinks, prompt=not decode), got)
    blind = torch.zeros(1, S, dtype=torch.bool)
    q = torch.randn(1, H, 1, D, generator=g)
    for decode in (True, False):
        out = _attend_kernel(q, k, v, blind, False, decode=decode, sinks=sinks)
        assert torch.equal(out, torch.zeros_like(out))


def _topk_moe(router: torch.Tensor, bias: torch.Tensor, top_k: int = 2):
    """A mixture routed by "topk_softmax" over `router` (E, hidden) with the router's own
    `bias` (E,) (its experts unread: the router alone is tested)."""
    from kvlm.config import Experts as Sizes
    from kvlm.model.experts import Experts
    from kvlm.model.layers import MLP, Linear

    e, h = router.shape
    sizes = Sizes(e, top_k, 1, False, router="topk_softmax", activation="clamped_swiglu",
                  swiglu_alpha=ALPHA, swiglu_limit=LIMIT)  # fmt: skip
    mlps = [MLP(Linear(torch.ones(2, h)), Linear(torch.ones(h, 1)), "clamped_swiglu",
                (ALPHA, LIMIT)) for _ in range(e)]  # fmt: skip
    return Experts(sizes, Linear(router, bias, vocabulary=True), mlps, router)


def test_the_kernels_router_takes_topk_softmax_and_its_bias(folder, monkeypatch):
    """The router "topk_softmax" with the router's own bias: the kernels' (kvlm_route, the
    fused step's, which the torch road calls on the CPU) picks the torch road's experts
    with the torch road's weights. Logits exact in fp32 in any order (weights, bias and
    rows in eighths): the same experts, the weights within each side's exp, sum and
    division (each weight within (K + 3) u of exact relatively, twice that apart), ties
    to the lower expert on both; on the tiny model's own router and random rows, each
    weight within the product bound's move of the softmax, the experts the same where the
    logits' k-th and next are further apart than twice the bound."""
    if kernels.library() is None:
        pytest.skip("no C kernels")

    def both(moe, x):
        got = moe.route(x)
        with monkeypatch.context() as m:
            m.setattr(kernels, "library", lambda: None)
            return got, moe.route(x)

    g = torch.Generator().manual_seed(SEED)
    count, hidden, k = 8, 32, 2
    router = torch.randint(-8, 9, (count, hidden), generator=g) / 8
    router[5] = router[2]  # experts 2 and 5 alike: with equal biases, a tie
    bias = torch.randint(-8, 9, (count,), generator=g) / 8
    bias[5] = bias[2]
    moe = _topk_moe(router, bias, k)
    assert moe.kernel_refusal() is None
    x = torch.randint(-4, 5, (64, hidden), generator=g) / 8
    (chosen, w), (t_chosen, t_w) = both(moe, x)
    assert torch.equal(chosen, t_chosen)
    assert ((w - t_w).abs() <= 2 * (k + 3) * U32 * t_w).all()
    two, five = (chosen == 2).any(1), (chosen == 5).any(1)
    one = two ^ five  # room for one of the tied pair: always the lower
    assert one.any() and not five[one].any()
    assert (chosen[two & five] == torch.tensor([2, 5])).all()  # both: the lower first
    # the bias moves the choice: without it other experts win
    assert not torch.equal(_topk_moe(router, torch.zeros(count), k).route(x)[0], chosen)
    # the tiny model's router (random fp32 weights and bias) on random rows
    real = LLM(model=folder, kv="off", progress=False).model.layers[1].mlp
    w0, b0 = real.router_weight, real.router_bias()
    x = torch.randn(64, w0.shape[1], generator=g)
    k = real.config.top_k
    (chosen, w), (t_chosen, t_w) = both(real, x)
    logits = (x.double() @ w0.double().T + b0.double()).sort(dim=1, descending=True).values
    d = float(product_bound(x, w0).max()) + 4 * U32 * float(logits.abs().max())
    clear = (logits[:, k - 1] - logits[:, k]) > 2 * d
    assert clear.sum() > 48 and torch.equal(chosen[clear], t_chosen[clear])
    assert ((w[clear] - t_w[clear]).abs() <= math.expm1(4 * d) + 2 * (k + 3) * U32).all()


def test_the_fused_step_runs_the_model(q8_0, folder):
    """The converter's Q8_0 file decodes on the fused C step (the sinks, the q/k/v/o
    biases, every other layer windowed over the hybrid cache's rings, the biased router,
    the experts' biases and clamped SwiGLU): 32 greedy steps, contiguous and paged, its
    logits as exact as the torch step's (fp32 products on both; the same file's model in
    fp64 the exact one) and the top-5 rule both ways under the defaults."""
    from helpers import assert_top_k_both_ways, fused_and_torch, low_bit_llm

    exact = LLM(model=q8_0, kv="off", dtype="fp64", progress=False)
    for mode in ("contiguous", "paged"):
        llm = low_bit_llm(model=q8_0, kv=mode)
        assert llm.runner.fused_reason is None and llm.describe()["decode_step"] == "fused"
        prompt = prompt_ids(llm, 16)
        tokens, fused, ref, cache, _ = fused_and_torch(llm, prompt, 32, mode)
        if mode == "contiguous":  # the windowed layers' ring beside the whole ones'
            assert type(cache).__name__ == "HybridCache"
        ids = prompt + tokens
        want = exact.runner.logits(ids, exact.new_cache("off"))[len(prompt) : len(ids)]
        assert_as_exact_as(fused, ref, want)
        default = LLM(model=q8_0, kv=mode, progress=False)
        _, fused, ref, _, _ = fused_and_torch(default, prompt, 32, mode)
        assert_top_k_both_ways(fused, ref)


def test_the_fused_step_reads_the_sinks_biases_and_activation(q8_0):
    """Each part the step reads moves its logits far past the rounding it agrees to the
    torch step within: the sinks, the router's bias, the experts' down biases and the
    clamped SwiGLU's limit, each changed in the step's own structs alone."""
    from helpers import low_bit_llm

    llm = low_bit_llm(model=q8_0, kv="contiguous")
    prompt = prompt_ids(llm, 16)
    cache = llm.new_cache("contiguous")
    token = int(llm.runner.forward(prompt, cache).argmax())
    fused = llm.runner.fused_for(cache)
    before = llm.runner.forward([token], cache)
    cache.rollback(1)
    again = llm.runner.forward([token], cache)
    assert torch.equal(before, again)
    layer = fused.spec.layers[1]
    for field, off in (("sinks", None), ("router_bias", None), ("exp_down_bias", None),
                       ("swiglu_limit", 0.5)):  # fmt: skip
        saved = getattr(layer, field)
        setattr(layer, field, off)
        try:
            cache.rollback(1)
            moved = llm.runner.forward([token], cache)
        finally:
            setattr(layer, field, saved)
        assert max_error(moved, before) > 1000 * max(max_error(again, before), 1e-6), field


def test_the_pools_fused_step_batches_forks_and_drafts_as_alone(q8_0, monkeypatch):
    """On the engine's pool every decode row through the fused step (its calls counted:
    it ran, no fallback): batched, n = 2, drafts (prompt lookup's, the file's int8 self's)
    = each prompt alone, bit for bit; a draft's rows rolled back leave each kept row's
    logits those of the row alone."""
    from helpers import assert_pool_fused_as_alone, fused_draft_rolled_back

    llm = LLM(model=q8_0, kv="paged", progress=False)
    assert_pool_fused_as_alone(llm, monkeypatch, "int8")
    alone = LLM(model=q8_0, kv="contiguous", progress=False)
    ids = prompt_ids(alone, 20)
    fused_draft_rolled_back(alone, ids, ids[3:7], 2, monkeypatch)


def test_the_hubs_mxfp4_checkpoint_loads_as_the_converters_file(folder, tmp_path):
    """A folder as the Hub keeps gpt-oss (its experts MXFP4 `_blocks` and `_scales`) reads
    natively: its experts the converter's GGUF blocks bit for bit (gate|up de-interleaved
    as the float stack's fold does it), packed as MXFP4, the logits the GGUF file's; their
    values (`get`) gguf-py's decoding of those blocks."""
    from kvlm.loading.gguf import GGUFWeights
    from kvlm.loading.hf import SafetensorsWeights
    from kvlm.model.quant import QuantWeight

    hub = _mxfp4_folder(folder, tmp_path / "hub")
    path = converter.convert(hub, "f32", pre="qwen35")
    mine, theirs = SafetensorsWeights(hub), GGUFWeights(path)
    e = "model.layers.1.mlp.experts"
    assert mine.stored_as(f"{e}.gate_up_proj.weight")[1] == "MXFP4"
    gate_up = torch.cat([theirs.get(f"{e}.gate_proj.weight"), theirs.get(f"{e}.up_proj.weight")], 1)
    for got, want in (
        (mine.get(f"{e}.gate_up_proj.weight"), gate_up),
        (mine.get(f"{e}.down_proj.weight"), theirs.get(f"{e}.down_proj.weight")),
    ):
        assert torch.equal(got.view(torch.int32), want.float().view(torch.int32))  # fmt: skip
    a, b = (LLM(model=m, kv="off", progress=False) for m in (hub, path))
    experts = a.model.layers[0].mlp.experts[0]
    assert isinstance(experts.gate_up.quant, QuantWeight) and experts.gate_up.quant.kind == "mxfp4"
    # the experts at their 17 bytes a group of 32, as the converter's file holds them
    assert mine.stored_bytes(f"{e}.down_proj.weight") == theirs.stored_bytes(
        f"{e}.down_proj.weight"
    )
    ids = prompt_ids(a)
    assert torch.equal(
        a.runner.logits(ids, a.new_cache("off")), b.runner.logits(ids, b.new_cache("off"))
    )


def test_an_mxfp4_stacks_blocks_and_scales_read_from_different_shards(folder, tmp_path):
    """A sharded checkpoint may keep a stack's blocks and its scales in different files:
    read as from one."""
    from safetensors.torch import load_file, save_file

    from kvlm.loading.hf import SafetensorsWeights

    hub = _mxfp4_folder(folder, tmp_path / "hub")
    split = tmp_path / "split"
    split.mkdir()
    for f in hub.iterdir():
        if f.suffix != ".safetensors":
            (split / f.name).write_bytes(f.read_bytes())
    tensors = load_file(hub / "model.safetensors")
    scales = {n: t for n, t in tensors.items() if n.endswith("_scales")}
    rest = {n: t for n, t in tensors.items() if n not in scales}
    save_file(rest, split / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(scales, split / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    one, two = SafetensorsWeights(hub), SafetensorsWeights(split)
    for part in ("gate_up_proj", "down_proj"):
        name = f"model.layers.2.mlp.experts.{part}.weight"
        assert torch.equal(two.get(name).view(torch.int32), one.get(name).view(torch.int32))
        assert np.array_equal(
            two.get_quant(name, packed=False).raw, one.get_quant(name, packed=False).raw
        )
