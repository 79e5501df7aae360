"""Qwen3-MoE: a mixture of experts for the FFN (kvlm.model.experts), against transformers'
Qwen3MoeForCausalLM on tiny random-weight models (8 experts of 64, the top 2; with and
without dense layers beside them), and from the GGUF files llama.cpp's own converter
writes for them (tests/converter.py: the experts stacked into one tensor a layer).

The router's products stay fp32 and its ties go to the lower expert, and a routed row
runs its experts under the numerics of the rows the block was given, so a row routes and
computes the same alone, batched, chunked or drafted: the contracts below hold on the
default path bit for bit, as for the dense families. The fused C decode step runs the
experts too (kernels/experts.c: its own router sums, so held to the torch model by the
top-5 rule, and to itself alone = batched bit for bit)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import converter
from gguf_hostile import cut_rows, set_key
from helpers import (
    FRANCE,
    GREEDY,
    POOL_PROMPTS,
    assert_generation_agrees,
    assert_greedy_agreement,
    assert_greedy_follows_hf,
    fed,
    gguf_as_folder,
    hf64,
    hf_greedy,
    load_hf,
    model_maker,
    on_pool,
    prompt_ids,
    refused,
    save_tiny_model,
)
from kvlm import LLM, SamplingParams
from kvlm.engine.runner import ModelRunner
from kvlm.errors import InvalidRequestError
from kvlm.model import graphs
from numerics import assert_as_exact_as, max_error, nudged

# name -> (seed, transformers config overrides)
MODELS = {
    "qwen3moe": (40, {}),  # experts in all four layers
    # a dense MLP in layers 0 and 2 (mlp_only_layers, and every 2nd layer sparse)
    "qwen3moe-dense": (41, {"mlp_only_layers": [0], "decoder_sparse_step": 2}),
}


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return model_maker(tmp_path_factory, "qwen3_moe", MODELS, tokenizer="qwen35")


def exact_logits(folder, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf64(folder)(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_config_read_from_folder(moe_dir, name):
    folder = moe_dir(name)
    c, hf = LLM(model=folder, kv="off", progress=False).config, load_hf(folder).config
    assert c.architecture == "qwen3moe" and c.qk_norm
    x = c.experts
    assert (x.count, x.top_k, x.intermediate, x.normalize) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
        hf.norm_topk_prob,
    )
    sparse = [i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0
              for i in range(hf.num_hidden_layers)]  # fmt: skip
    assert c.layer_ffns == tuple("experts" if s else "mlp" for s in sparse)
    assert ("mlp" in c.layer_ffns) == (name == "qwen3moe-dense")


@pytest.mark.parametrize("name", list(MODELS))
def test_inspect_counts_every_and_the_active_parameters(moe_dir, name, capsys):
    """`kvlm inspect`: the parameters transformers' model has, and those one token runs
    (top_k of the experts of each expert layer: the dense layers whole); the benchmark's
    bytes a decode step reads count the experts a token reads alone."""
    import json

    from kvlm.bench.child import weight_bytes_per_token
    from kvlm.cli import main
    from kvlm.model.layers import Linear

    folder = moe_dir(name)
    hf, llm = load_hf(folder), LLM(model=folder, weights="int8", progress=False)
    c, x = llm.config, llm.config.experts
    every = sum(p.numel() for p in hf.parameters())
    idle = len(c.expert_layers) * (x.count - x.top_k) * 3 * c.hidden_size * x.intermediate
    assert main(["inspect", "--model", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["parameters"], info["active_parameters"]) == (every, every - idle)
    expert = llm.model.layers[c.expert_layers[0]].mlp.experts[0]
    one = expert.gate_up.nbytes + expert.down.nbytes  # every expert's bytes alike
    linears = sum(m.nbytes for m in llm.model.modules() if isinstance(m, Linear))
    idle_bytes = len(c.expert_layers) * (x.count - x.top_k) * one
    assert weight_bytes_per_token(llm) == linears - idle_bytes


def test_memory_says_what_a_token_reads(converted, capsys):
    """`kvlm memory` on the converter's Q8_0 file: the weights held (every expert) and
    what one token's step reads of them (its top k of the experts, a row of the untied
    embedding table), the latter the benchmark's own count of the loaded projections'
    bytes but for the file's small float vectors (norms)."""
    import json

    from kvlm.bench.child import weight_bytes_per_token
    from kvlm.cli import main

    _, path = converted("qwen3moe", "q8_0")
    assert main(["memory", "--model", str(path), "--context", "64", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    read, held = record["weight_bytes_read_per_token"], record["weight_bytes"]
    bench = weight_bytes_per_token(LLM(model=path, progress=False))
    assert held > 2 * read and abs(read - bench) < 0.02 * bench
    assert main(["memory", "--model", str(path), "--context", "64"]) == 0
    assert "of which a token reads" in capsys.readouterr().out


def test_memory_leaves_host_experts_out_of_the_device(converted, capsys):
    """`kvlm memory --cpu-experts`: the routed experts of those layers in host memory at
    their bytes in the file (Q8_0 blocks), out of the device's weights and budget."""
    import json

    from kvlm.cli import main

    _, path = converted("qwen3moe", "q8_0")
    plans = {}
    for n in ("0", "2", "all"):
        args = ["memory", "--model", str(path), "--dtype", "bf16", "--cpu-experts", n]
        assert main([*args, "--context", "64", "--budget", "1GiB", "--json"]) == 0
        plans[n] = json.loads(capsys.readouterr().out)
    host = plans["all"]["host_expert_bytes"]
    assert "host_expert_bytes" not in plans["0"] and plans["2"]["host_expert_bytes"] == host / 2
    on_device = [plans[n]["weight_bytes"] for n in ("0", "2", "all")]
    assert on_device[0] > on_device[1] > on_device[2] and host < on_device[0] - on_device[2]


@pytest.mark.parametrize("name", list(MODELS))
def test_teacher_forced_logits_match_hf(moe_dir, name):
    """Every position's logits over 40 tokens, the exact path: as close to transformers'
    fp64 as its own fp32 logits (tests/numerics.py)."""
    folder = moe_dir(name)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    with torch.no_grad():
        ref = load_hf(folder)(torch.tensor([ids])).logits[0]
    assert_as_exact_as(ours, ref, exact_logits(folder, ids))


def test_greedy_tokens_equal_hf(moe_dir):
    """32 greedy tokens: in fp64 transformers' fp64 tokens; by default (fp32) the top-5
    rule against its fp32."""
    folder = moe_dir("qwen3moe")
    assert_greedy_follows_hf(folder)


def test_the_router_and_the_experts_are_applied(moe_dir):
    """An expert's down projection zeroed, or the router's rows of two experts swapped,
    move the logits far more than rounding (so the tests above can fail)."""
    folder = moe_dir("qwen3moe")
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    ids = prompt_ids(llm)
    exact = exact_logits(folder, ids)
    before = max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)
    moe = llm.model.layers[1].mlp
    chosen, _ = moe.route(llm.model.embed(torch.tensor(ids)))  # some rows' picks, any
    e = int(chosen[0, 0])
    with torch.no_grad():
        moe.experts[e].down.weight.zero_()
    zeroed = max_error(llm.runner.logits(ids, llm.new_cache("off")), exact)
    assert zeroed > 1000 * before


def test_ties_go_to_the_lower_expert_and_weights_renormalise():
    """The router's top k by a stable sort: equal scores pick the lower index, whatever
    the row's neighbours; the weights are the softmax's over every expert, divided by
    their sum with `normalize` (transformers' norm_topk_prob)."""
    from kvlm.config import Experts as Sizes
    from kvlm.model.experts import Experts
    from kvlm.model.layers import MLP, Linear

    def moe(normalize: bool) -> Experts:
        router = torch.tensor([[1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
        mlps = [MLP(Linear(torch.ones(2, 2)), Linear(torch.ones(2, 1))) for _ in range(4)]
        return Experts(Sizes(4, 2, 1, normalize), Linear(router, vocabulary=True), mlps, router)

    x = torch.tensor([[1.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    chosen, weights = moe(False).route(x)
    assert chosen.tolist() == [[1, 2], [3, 0], [1, 2]]  # experts 1 and 2 tie: 1 first
    p = torch.softmax(torch.tensor([1.0, 2.0, 2.0, 0.0]), 0)
    assert torch.allclose(weights[0], p[[1, 2]])
    _, normed = moe(True).route(x)
    assert torch.allclose(normed.sum(-1), torch.ones(3)) and torch.equal(normed[0], normed[2])
    alone = moe(False).route(x[2:])[0]
    assert torch.equal(alone, chosen[2:])


ROW_MODES = ["basic", "contiguous", "paged", "int8", "window"]


@pytest.mark.parametrize("mode", ROW_MODES)
def test_every_mode_chunked_equals_one_shot(moe_dir, mode):
    """Chunks of 7, then a token at a time, give the one-shot prefill's logits through the
    same mode bit for bit (a chunk's rows route as they do in the whole prompt; the
    default path's on a low-bit file: test_a_q8_0_gguf_runs_each_expert_from_its_blocks);
    the exact modes also the `off` oracle's."""
    folder = moe_dir("qwen3moe-dense")
    llm = LLM(model=folder, kv=mode, exact=True, progress=False)
    ids = prompt_ids(llm)
    one_shot, chunked = fed(llm, ids, [len(ids)]), fed(llm, ids, [7] * 4 + [1] * 12)
    if mode in ("window", "int8"):  # a ring's keys turned at each step; int8 decode rows
        # attend on the row kernel, in another order (a dense model's alike): as exact
        assert_as_exact_as(chunked, one_shot, exact_logits(folder, ids))
    else:
        assert torch.equal(chunked, one_shot)
    if mode in ("basic", "contiguous", "paged"):
        off = LLM(model=folder, kv="off", exact=True, progress=False)
        assert torch.equal(one_shot, off.runner.logits(ids, off.new_cache("off")))


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_generate_batched_forked_and_speculative_equal_alone(moe_dir, mode):
    """Prompts batched = each alone (a decode row routes as it does alone); n = 2 greedy
    samples = the one; speculative (prompt lookup; a draft model, the file's int8 self,
    routing on its own) = plain."""
    from kvlm.engine.speculative import SpeculativeConfig

    folder = moe_dir("qwen3moe")
    llm = LLM(model=folder, kv=mode, progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [FRANCE, "One two three, one two three, one two"]
    alone = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
    two = llm.generate(prompts[0], SamplingParams(n=2, max_tokens=24, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
    assert [s.token_ids for s in two[0].outputs] == [alone[0]] * 2
    for how in (SpeculativeConfig("ngram", ngram_min=1),
                SpeculativeConfig("draft", draft_weights="int8")):  # fmt: skip
        spec = LLM(model=folder, kv=mode, speculative=how, progress=False)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == alone


def test_the_pool_batches_chunks_and_hits_as_alone(moe_dir):
    """Through the engine's pool: the prompts batched, in chunks of 5, n = 2, and again
    as prefix hits, each prompt's tokens alone."""
    llm = LLM(model=moe_dir("qwen3moe"), kv="paged", progress=False)
    want = [[llm.generate(p, GREEDY)[0].outputs[0].token_ids] for p in POOL_PROMPTS]
    assert on_pool(llm, POOL_PROMPTS, GREEDY)[0] == want
    assert on_pool(llm, POOL_PROMPTS, GREEDY, scheduler={"prefill_chunk": 5})[0] == want
    two = SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert on_pool(llm, POOL_PROMPTS, two)[0] == [w * 2 for w in want]
    again, engine = on_pool(llm, POOL_PROMPTS * 2, GREEDY, scheduler={"max_num_seqs": 3})
    assert again == want * 2 and engine.manager.stats.hits > 0


# ---------------------------------------------------------------- llama.cpp's converter


@pytest.fixture(scope="module")
def converted(moe_dir):
    """(name, outtype) -> (the folder, the GGUF llama.cpp's converter writes)."""
    return lambda name, outtype="f32": (
        moe_dir(name),
        converter.convert(moe_dir(name), outtype, pre="qwen35"),
    )


def test_gguf_from_llama_cpps_converter_reads_as_the_folder(converted):
    """The file users get (the experts stacked, `ffn_*_exps`): the folder's config and
    its logits bit for bit (the same fp32 values, the same products)."""
    folder, path = converted("qwen3moe")
    from_gguf, from_hf = gguf_as_folder(path, folder)
    assert from_gguf.config.experts == from_hf.config.experts
    ids = prompt_ids(from_hf)
    ours = from_gguf.runner.logits(ids, from_gguf.new_cache("off"))
    assert torch.equal(ours, from_hf.runner.logits(ids, from_hf.new_cache("off")))


def test_a_q8_0_gguf_runs_each_expert_from_its_blocks(converted):
    """--outtype q8_0: each expert's products from the file's Q8_0 blocks (its rows of the
    stacked tensor), with fp32 products and K/V as exact as the dequantized weights'
    fp32 run;
    by default, greedy tokens by the top-5 rule against transformers' fp32; chunked =
    one shot on the default path."""
    folder, path = converted("qwen3moe", "q8_0")
    llm = LLM(model=path, progress=False, prefill_dtype="fp32", activations="fp32",
              kv_dtype="fp32")  # fmt: skip
    moe = llm.model.layers[0].mlp
    assert {m.gate_up.quant.kind for m in moe.experts} == {"q8"}
    ids = prompt_ids(llm)
    dequantized = LLM(model=path, kv="off", exact=True, progress=False)
    ref = dequantized.runner.logits(ids, dequantized.new_cache("off"))
    exact64 = LLM(model=path, kv="off", dtype="fp64", progress=False)
    assert_as_exact_as(fed(llm, ids, [len(ids)]), ref, exact64.runner.logits(
        ids, exact64.new_cache("off")))  # fmt: skip
    default = LLM(model=path, progress=False)
    assert torch.equal(fed(default, ids, [9, 1, 30]), fed(default, ids, [len(ids)]))
    prompt = default.tokenizer.encode(FRANCE)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = default.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    ref_ids, ref_logits = hf_greedy(load_hf(folder), prompt, 16)
    assert_greedy_agreement(out.token_ids, [list(lp.top) for lp in out.logprobs], ref_ids,
                            ref_logits)  # fmt: skip


def test_kvlm_serve_answers_concurrent_chats_from_the_converted_file(converted):
    """A real `kvlm serve` of the converter's Q8_0 file (its pool, decode rows on the
    fused step): two chats at once, batched (fewer steps than tokens), each answered as
    the LLM answers it alone; the second asking again is a prefix hit with the same
    answer."""
    from serving import QUESTIONS, chats_alone, chats_at_once, kvlm_serve, wait_idle

    _, path = converted("qwen3moe", "q8_0")
    llm = LLM(model=path, kv="paged", progress=False)
    want = chats_alone(llm, QUESTIONS, 24)
    key = "sekret"
    with kvlm_serve("--model", str(path), "--threads", "1", "--api-key", key,
                    "--max-context", "256") as (port, _):  # fmt: skip
        assert chats_at_once(port, key, QUESTIONS, 24) == want
        m = wait_idle(port, key)
        assert m["kvlm_engine_steps_total"] < m["kvlm_generation_tokens_total"]
        decoded = m["kvlm_generation_tokens_total"] - len(QUESTIONS)
        assert m["kvlm_engine_fused_rows_total"] == decoded > 0
        assert chats_at_once(port, key, QUESTIONS, 24) == want
        assert wait_idle(port, key)["kvlm_prefix_cache_hits_total"] > 0


# ------------------------------------------------------------------ the fused decode step


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_the_fused_step_runs_the_experts(converted, mode):
    """The converter's Q8_0 file: the fused C step takes the model (its experts from the
    file's blocks, the router's fp32 weights), and its logits over 40 greedy steps follow
    the torch model's by the top-5 rule both ways (its router's sums are its own); an
    expert zeroed in the step's weights moves them (the step reads the experts)."""
    from helpers import assert_top_k_both_ways, fused_and_torch

    _, path = converted("qwen3moe", "q8_0")
    llm = LLM(model=path, kv=mode, progress=False)
    assert llm.runner.fused_reason is None and llm.describe()["decode_step"] == "fused"
    prompt = prompt_ids(llm, 16)
    _, fused, ref, _, _ = fused_and_torch(llm, prompt, 40, mode)
    assert_top_k_both_ways(fused, ref)
    assert max_error(fused, ref) < 0.5 * max_error(ref, torch.zeros_like(ref))


def test_the_pools_fused_step_batches_forks_and_drafts_as_alone(converted, monkeypatch):
    """On the engine's pool every decode row through the fused step: the prompts batched,
    n = 2, prompt lookup's drafts and a draft model's (the file's int8 self) give each
    prompt's tokens alone, bit for bit (a row routes and sums the same in any batch)."""
    from helpers import assert_pool_fused_as_alone

    _, path = converted("qwen3moe", "q8_0")
    llm = LLM(model=path, kv="paged", progress=False)
    assert_pool_fused_as_alone(llm, monkeypatch, "int8")


def test_the_step_refuses_experts_it_cannot_read(converted):
    """A mixture the step cannot run is refused by the kernels before anything is read:
    top_k past the experts, an expert's product of another shape, no router."""
    import ctypes

    from kvlm.model.fused import FusedDecoder

    _, path = converted("qwen3moe", "q8_0")
    llm = LLM(model=path, progress=False)
    dec = FusedDecoder(llm.model, 64)
    lib, spec = dec.lib, dec.spec
    assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) > 0
    layer = dec._layers[1]
    for field, bad in (("top_k", 9), ("top_k", 0), ("n_experts", 0), ("n_experts", 1 << 20),
                       ("expert_inter", 63), ("router", None), ("normalize", 2)):  # fmt: skip
        good = getattr(layer, field)
        setattr(layer, field, bad)
        assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) == -2, field
        setattr(layer, field, good)
    assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) > 0


# ------------------------------------------------- experts in host memory (--cpu-experts)


def test_experts_in_host_memory_follow_the_cpu_road(moe_dir, monkeypatch):
    """--cpu-experts 2 on a bf16 model (the hop a GPU takes, here from bf16 to the host's
    fp32 experts and back): the first two layers' experts fp32 on the CPU, the others' and
    the routers in bf16; greedy tokens by the top-5 rule against the fp32 CPU road. A
    model with experts off the device road (in host memory, or the CPU's packed weights)
    replays no CUDA graphs (graphs.EXPERTS: the routing reads the chosen experts on the
    host)."""
    folder = moe_dir("qwen3moe")
    llm = LLM(model=folder, dtype="bf16", cpu_experts=2, progress=False)
    moes = [block.mlp for block in llm.model.layers]
    assert [m.host for m in moes] == [True, True, False, False]
    dtypes = [m.experts[0].gate_up.weight.dtype for m in moes]
    assert dtypes == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert moes[0].router_weight.dtype == torch.float32  # the router as on every road
    assert_generation_agrees(LLM(model=folder, progress=False), llm, FRANCE, 16)
    monkeypatch.setattr(graphs, "enabled", lambda device: True)  # as on a GPU
    runner = ModelRunner(llm.model)
    assert runner.graphs is None and runner.graphs_reason == graphs.EXPERTS


def test_cpu_experts_is_checked_before_the_load(moe_dir, tiny_model_dir):
    """--cpu-experts: a count >= 0 or "all" (past the count: every layer), on a model with
    experts, and not on the CPU in fp32 (every expert is in host memory there already)."""
    folder = moe_dir("qwen3moe")
    for bad, says in [(-1, ">= 0"), ("some", "count of layers or 'all'")]:
        with pytest.raises(InvalidRequestError, match=says):
            LLM(model=folder, dtype="bf16", cpu_experts=bad, progress=False)
    with pytest.raises(InvalidRequestError, match="already there"):
        LLM(model=folder, cpu_experts=1, progress=False)
    with pytest.raises(InvalidRequestError, match="no mixture-of-experts"):
        LLM(model=tiny_model_dir("llama"), dtype="bf16", cpu_experts=1, progress=False)
    assert LLM(model=folder, dtype="bf16", cpu_experts=9, progress=False).cpu_experts == 4


def test_host_experts_of_a_q8_0_gguf_are_its_blocks(converted):
    """A Q8_0 file with --cpu-experts all on a bf16 model: every host expert multiplies
    the file's own Q8_0 blocks on the CPU kernels (as the CPU road loads them), and the
    tokens follow the file's default CPU road by the top-5 rule."""
    _, path = converted("qwen3moe", "q8_0")
    llm = LLM(model=path, dtype="bf16", cpu_experts="all", progress=False)
    for block in llm.model.layers:
        assert block.mlp.host
        assert {(m.gate_up.quant.kind, m.down.quant.kind) for m in block.mlp.experts} == {
            ("q8", "q8")
        }
    assert_generation_agrees(LLM(model=path, progress=False), llm, FRANCE, 16)


def _drop(tensor):
    return lambda spec: spec.tensors.pop(tensor)


# a converted file's faults -> what the one line names
MOE_GGUF_FINDINGS = {
    "experts-12": (set_key("qwen3moe.expert_count", 12), r"the config's sizes give \(12, "),
    "used-9": (set_key("qwen3moe.expert_used_count", 9), r"expert_used_count"),
    "expert-width-32": (set_key("qwen3moe.expert_feed_forward_length", 32),
                        r"blk\.0\.ffn_(gate|up|down)_exps"),
    "six-up-experts": (cut_rows("blk.1.ffn_up_exps.weight", 6), r"blk\.1\.ffn_up_exps"),
    "no-router": (_drop("blk.2.ffn_gate_inp.weight"), r"no tensor blk\.2\.ffn_gate_inp"),
    "no-down-experts": (_drop("blk.3.ffn_down_exps.weight"), r"no tensor blk\.3\.ffn_down_exps"),
}  # fmt: skip


@pytest.mark.parametrize("finding", [None, *MOE_GGUF_FINDINGS])
def test_a_faulty_moe_gguf_is_one_clear_line(converted, child, tmp_path, finding):
    """The converted file written back from its Spec loads and generates in the child;
    each fault of its experts (a count the tensors do not have, more used than there are,
    a width or a stack of another size, a router or a stack missing) is one
    ModelLoadError / UnsupportedModelError line naming the file and the fault, nothing
    read past a tensor's end."""
    from gguf_hostile import read, write

    _, path = converted("qwen3moe")
    spec = read(path)
    if finding is None:
        got = child.run(write(spec, tmp_path / "m.gguf"))
        assert got.outcome == "ran", got
        return
    edit, says = MOE_GGUF_FINDINGS[finding]
    edit(spec)
    child.run(write(spec, tmp_path / "m.gguf")).refused_in_one_line("m.gguf", says)


# ------------------------------------------------------- Qwen3.5's mixture-of-experts sizes


@pytest.fixture(scope="module")
def q35moe(tmp_path_factory):
    """A tiny Qwen3.5-MoE (DeltaNet, attention, DeltaNet, attention; every FFN 8 experts
    of 64, the top 2, and a shared expert of 96 behind its gate): the folder, and
    llama.cpp's converter's f32 and Q8_0 files of it."""
    folder = save_tiny_model(tmp_path_factory.mktemp("q35moe"), "qwen3_5_moe", seed=50,
                             tokenizer="qwen35")  # fmt: skip
    files = {t: converter.convert(folder, t, pre="qwen35", options=("--no-mtp",))
             for t in ("f32", "q8_0")}  # fmt: skip
    return folder, files


def test_qwen35_moe_follows_hf_and_its_gguf_the_folder(q35moe):
    """The MoE sizes' config (experts, the shared expert and its gate) as transformers
    reads it; the exact path's logits as close to transformers' fp64 as its own fp32; the
    converter's f32 file (`qwen35moe`: the stacks, `ffn_*_shexp`, `ffn_gate_inp_shexp`)
    the folder's bit for bit."""
    folder, files = q35moe
    hf = load_hf(folder)
    llm = LLM(model=folder, kv="off", exact=True, progress=False)
    x, h = llm.config.experts, hf.config
    assert llm.config.architecture == "qwen35moe" and llm.config.deltanet is not None
    assert (x.count, x.top_k, x.intermediate, x.shared, x.shared_gate, x.normalize) == (
        h.num_experts, h.num_experts_per_tok, h.moe_intermediate_size,
        h.shared_expert_intermediate_size, True, True)  # fmt: skip
    ids = prompt_ids(llm)
    ours = llm.runner.logits(ids, llm.new_cache("off"))
    # HF's own fp32 error, and three nudges of its first DeltaNet's input (numerics.nudged)
    norm, refs = hf.model.layers[0].input_layernorm, []
    for nudge in [contextlib.nullcontext(), *(nudged(norm, s) for s in range(3))]:
        with torch.no_grad(), nudge:
            refs.append(hf(torch.tensor([ids])).logits[0])
    assert_as_exact_as(ours, refs, exact_logits(folder, ids))
    gguf = LLM(model=files["f32"], kv="off", exact=True, progress=False)
    assert gguf.config.experts == x
    assert torch.equal(gguf.runner.logits(ids, gguf.new_cache("off")), ours)


@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_qwen35_moe_decodes_on_the_fused_step(q35moe, mode):
    """The Q8_0 file on the fused step (the DeltaNet's state, the routed experts and the
    shared one behind its gate, all in C): its logits over 30 greedy steps follow the
    torch step's by the top-5 rule both ways."""
    from helpers import assert_top_k_both_ways, fused_and_torch

    _, files = q35moe
    llm = LLM(model=files["q8_0"], kv=mode, progress=False)
    assert llm.runner.fused_reason is None
    _, fused, ref, _, _ = fused_and_torch(llm, prompt_ids(llm, 16), 30, mode)
    assert_top_k_both_ways(fused, ref)


def test_qwen35_moe_pool_fused_step_as_alone(q35moe, monkeypatch):
    """On the pool's fused step (a DeltaNet slot a sequence, experts and the shared one):
    batched, n = 2, prompt lookup's and a draft model's drafts = each prompt alone, bit for
    bit."""
    from helpers import assert_pool_fused_as_alone

    _, files = q35moe
    llm = LLM(model=files["q8_0"], kv="paged", progress=False)
    assert_pool_fused_as_alone(llm, monkeypatch, "int8")


def test_qwen35_moe_with_its_mtp_head_loads_and_drafts_as_plain(q35moe, tmp_path):
    """A checkpoint with its multi-token-prediction head, whose block routes through
    experts too (the MoE sizes' heads do): the folder and the converter's file with the
    head (blk.N.ffn_*_exps past the model's blocks) load it, the two heads alike, and
    `--speculative mtp` gives plain greedy decoding's tokens on the pool."""
    from helpers import with_mtp
    from kvlm.engine.speculative import SpeculativeConfig
    from kvlm.model.experts import Experts

    folder = with_mtp(q35moe[0], tmp_path / "mtp")
    path = converter.convert(folder, "f32", pre="qwen35")
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(model=folder, kv="paged", progress=False)
    spec = LLM(model=folder, kv="paged", speculative=SpeculativeConfig("mtp", num_draft=3),
               progress=False)  # fmt: skip
    head = spec.model.mtp
    assert head is not None and isinstance(head.blocks[0].mlp, Experts)
    gguf = LLM(model=path, kv="off", exact=True, progress=False).model.mtp
    ours = LLM(model=folder, kv="off", exact=True, progress=False).model.mtp
    assert gguf is not None
    for a, b in zip(gguf.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    prompts = [FRANCE, "One two three, one two three, one two"]
    assert on_pool(spec, prompts, greedy, speculative=SpeculativeConfig("mtp", num_draft=3))[
        0] == on_pool(plain, prompts, greedy)[0]  # fmt: skip


def test_the_step_refuses_a_shared_expert_of_another_shape(q35moe):
    """The kernels check the shared expert's products against shared_inter, and refuse a
    gate without a shared expert."""
    import ctypes

    from kvlm.model.fused import FusedDecoder

    _, files = q35moe
    dec = FusedDecoder(LLM(model=files["q8_0"], progress=False).model, 64)
    lib, spec, layer = dec.lib, dec.spec, dec._layers[0]
    assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) > 0
    good = layer.shared_inter
    for bad in (good + 16, -1):
        layer.shared_inter = bad
        assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) == -2, bad
    layer.shared_inter = 0  # a gate left without its expert
    assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) == -2
    layer.shared_inter = good
    assert lib.kvlm_decode_scratch(ctypes.byref(spec), 1) > 0


# ------------------------------------------------------------- Granite 4.0-H's MoE sizes


@pytest.fixture(scope="module")
def granite_moe(tmp_path_factory):
    """A tiny Granite 4.0-H MoE (Mamba2, attention, Mamba2, Mamba2; every FFN 8 experts of
    96, the top 2, gate|up stacked as one tensor, and the shared MLP beside them)."""
    return save_tiny_model(tmp_path_factory.mktemp("granite-moe"), "granitemoehybrid",
                           seed=60, num_local_experts=8, num_experts_per_tok=2)  # fmt: skip


def test_granite_moe_follows_hf(granite_moe):
    """Its config (the experts of intermediate_size, the shared MLP their ungated shared
    expert) as transformers reads it, and the exact path's logits as close to
    transformers' fp64 as its own fp32 (its router's softmax over the top k's logits is
    the renormalised softmax)."""
    hf = load_hf(granite_moe)
    llm = LLM(model=granite_moe, kv="off", exact=True, progress=False)
    x, h = llm.config.experts, hf.config
    assert (x.count, x.top_k, x.intermediate, x.shared, x.shared_gate, x.normalize) == (
        h.num_local_experts, h.num_experts_per_tok, h.intermediate_size,
        h.shared_intermediate_size, False, True)  # fmt: skip
    ids = prompt_ids(llm)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_as_exact_as(llm.runner.logits(ids, llm.new_cache("off")), ref,
                       exact_logits(granite_moe, ids))  # fmt: skip


def test_granite_moe_on_the_fused_step(granite_moe, monkeypatch):
    """int8 weights: the fused step (the Mamba2 state, the experts and the ungated shared
    expert in C) follows the torch step by the top-5 rule both ways; the pool's fused
    step batched, forked and drafted = alone bit for bit."""
    from helpers import assert_pool_fused_as_alone, assert_top_k_both_ways, fused_and_torch

    llm = LLM(model=granite_moe, weights="int8", progress=False)
    assert llm.runner.fused_reason is None
    _, fused, ref, _, _ = fused_and_torch(llm, prompt_ids(llm, 16), 30)
    assert_top_k_both_ways(fused, ref)
    pool = LLM(model=granite_moe, kv="paged", weights="int8", progress=False)
    assert_pool_fused_as_alone(pool, monkeypatch, "int4")


# ---------------------------------------------------------------------------- config keys


def hf_cfg(**changes) -> dict:
    cfg = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64}  # fmt: skip
    return {k: v for k, v in {**cfg, **changes}.items() if v is not None}


def gguf_meta(**changes) -> dict:
    meta = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64,
            "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 128,
            "qwen3moe.block_count": 2, "qwen3moe.vocab_size": 64, "qwen3moe.expert_count": 8,
            "qwen3moe.expert_used_count": 2,
            "qwen3moe.expert_feed_forward_length": 64}  # fmt: skip
    return {k: v for k, v in {**meta, **changes}.items() if v is not None}


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts": 1 << 20}, "num_experts"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts": None}, "num_experts"),
        ({"moe_intermediate_size": -1}, "moe_intermediate_size"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_hostile_config_keys_are_refused(changes, said):
    from kvlm.arch import config_from_hf

    refused(config_from_hf, hf_cfg(), hf_cfg(**changes), said)


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"qwen3moe.expert_count": 0}, "expert_count"),
        ({"qwen3moe.expert_used_count": 9}, "expert_used_count"),
        ({"qwen3moe.expert_count": None}, "expert_count"),
        ({"qwen3moe.expert_feed_forward_length": 0}, "expert_feed_forward_length"),
        ({"qwen3moe.expert_used_count": 2.5}, "expert_used_count"),
    ],
)
def test_hostile_gguf_keys_are_refused(changes, said):
    from kvlm.arch import config_from_gguf

    assert refused(config_from_gguf, gguf_meta(), gguf_meta(**changes), said).experts.count == 8
