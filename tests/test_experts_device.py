"""The experts' device road (kvlm.model.experts: Experts.stacks, `_device`) on the CPU,
forced by experts.ROAD over dense weights (Linear kernel "torch", a GPU's): against the
loop road, layer by layer within the rounding of its products and greedy token for token;
no read on the host (a step a CUDA graph can hold); the stacked weights the experts' own,
not a second copy. tests/test_gpu.py runs the road on a GPU (its CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from helpers import family_maker
from kvlm import LLM, SamplingParams
from kvlm.model import experts, graphs, layers
from kvlm.model.experts import Experts
from kvlm.model.layers import gated
from numerics import assert_as_exact_as, fp64_reorder_bound, max_error

# the families with experts (helpers.LAYER_KIND_FAMILIES; Qwen3.5-MoE's states aside)
FAMILIES = ["qwen3_moe", "lfm2_moe", "gpt_oss", "olmoe"]
ROADS = ["gather", "grouped"]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return family_maker(tmp_path_factory)


def dense_llm(folder, monkeypatch, dtype: str = "fp32", road: str | None = "gather", **kw) -> LLM:
    """The model with a GPU's dense weights (every Linear's kernel "torch"), its experts
    stacked where `road` is set (experts.ROAD at load); ROAD None again afterwards (the
    CPU's loop road until a test sets it)."""
    monkeypatch.setattr(layers, "_pick_kernel", lambda weight, bf16: "torch")
    monkeypatch.setattr(experts, "ROAD", road)
    llm = LLM(model=folder, progress=False, max_context=256, dtype=dtype, **kw)
    monkeypatch.setattr(experts, "ROAD", None)
    return llm


def moes(llm: LLM) -> list[Experts]:
    return [m for m in llm.model.modules() if isinstance(m, Experts)]


def exact_routed(moe: Experts, x, chosen, weights) -> torch.Tensor:
    """The routed experts' weighted sum in fp64 from the stacked weights, row by row."""
    gate_up, down, gb, db = (None if t is None else t.double() for t in moe.stacks)
    e0 = moe.experts[0]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for e, w in zip(chosen[r].tolist(), weights[r].double(), strict=True):
            gu = gate_up[e] @ x[r].double() + (0 if gb is None else gb[e])
            y = down[e] @ gated(gu, e0.act, e0.swiglu) + (0 if db is None else db[e])
            out[r] += w * y
    return out


@pytest.mark.parametrize("road", ROADS)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_layer_on_the_device_road_is_the_loop_roads(family, monkeypatch, name, road):
    """One layer's routed experts over the same routing: in fp32 as close to the exact
    (fp64) sum as the loop road's; in fp64 (gather: _grouped_mm has no fp64) within two
    fp64 orders of the loop road."""
    folder = family(name)
    torch.manual_seed(0)
    llm32, llm64 = dense_llm(folder, monkeypatch), dense_llm(folder, monkeypatch, "fp64")
    for moe32, moe64 in zip(moes(llm32), moes(llm64), strict=True):
        assert moe32.stacks is not None and moe64.stacks is not None
        x = torch.randn(7, moe32.router_weight.shape[1])
        chosen, weights = moe32.route(x)
        loop = moe32._routed(x, chosen, weights)
        ours = moe32._device(x, chosen, weights, road)
        exact = exact_routed(moe32, x, chosen, weights)
        assert max_error(loop, exact) > 0  # rounding to compare against
        assert_as_exact_as(ours, loop, exact)
        if road == "grouped":
            continue  # _grouped_mm takes no fp64
        x64, w64 = x.double(), weights.double()
        loop64 = moe64._routed(x64, chosen, w64)
        ours64 = moe64._device(x64, chosen, w64, road)
        assert max_error(ours64, loop64) <= fp64_reorder_bound(max_error(loop, exact))


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_are_the_loop_roads(family, monkeypatch, name):
    """Greedy tokens in fp32 on each device road equal the loop road's, the device road
    having run (prompt and decode rows)."""
    llm = dense_llm(family(name), monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = []
    real = Experts._device
    monkeypatch.setattr(Experts, "_device", lambda *a: calls.append(a[-1]) or real(*a))
    loop = llm.generate(PROMPT, params)[0].token_ids
    assert not calls
    for road in ROADS:
        monkeypatch.setattr(experts, "ROAD", road)
        assert llm.generate(PROMPT, params)[0].token_ids == loop, road
        assert calls.count(road) >= 12 * len(moes(llm))


def _raise(*args, **kwargs):
    raise AssertionError("a read on the host")


@pytest.mark.parametrize("road", ROADS)
def test_the_device_road_reads_nothing_on_the_host(family, monkeypatch, road):
    """The device road's layer (router and routed experts) with every read of a tensor's
    values on the host refused (tolist, item, bool, int, float, nonzero, unique), and its
    routed product on meta tensors (values nowhere: any data-dependent shape or read
    raises); the loop road fails both, so the checks can fail."""
    moe = moes(dense_llm(family("qwen3_moe"), monkeypatch))[0]
    x = torch.randn(5, moe.router_weight.shape[1])
    chosen, weights = moe.route(x)
    monkeypatch.setattr(experts, "ROAD", road)
    want = moe(x)  # the whole layer, unpatched
    with monkeypatch.context() as m:
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero"):
            m.setattr(torch.Tensor, name, _raise)
        m.setattr(torch, "unique", _raise)
        m.setattr(torch, "nonzero", _raise)
        got = moe(x)
        with pytest.raises(AssertionError, match="on the host"):
            moe._routed(x, chosen, weights)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dtype = torch.bfloat16 if road == "grouped" else torch.float32  # _grouped_mm's meta: bf16
    moe.stacks = tuple(None if t is None else t.to("meta", dtype) for t in moe.stacks)
    meta = torch.device("meta")
    out = moe._device(x.to(meta, dtype), chosen.to(meta), weights.to(meta, dtype), road)
    assert out.shape == x.shape and out.device == meta
    for e in moe.experts:
        for lin in (e.gate_up, e.down):
            lin.weight = lin.weight.to(meta, dtype)
    with pytest.raises((NotImplementedError, RuntimeError)):
        moe._routed(x.to(meta, dtype), chosen.to(meta), weights.to(meta, dtype))


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages under the model's buffers and parameters and the
    experts' stacks."""
    seen = {}
    stacks = [t for m in model.modules() if isinstance(m, Experts) for t in m.stacks or ()]
    for t in [*model.buffers(), *model.parameters(), *(t for t in stacks if t is not None)]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_the_stacks_are_the_experts_weights(family, monkeypatch, name):
    """Stacked, the model holds the bytes it holds unstacked (each expert's weights and
    biases views of the stacks, no second copy), the views' values the experts' own."""
    folder = family(name)
    plain = dense_llm(folder, monkeypatch, road=None)
    stacked = dense_llm(folder, monkeypatch)
    assert all(m.stacks is None for m in moes(plain))
    assert storage_bytes(stacked.model) == storage_bytes(plain.model)
    for a, b in zip(moes(plain), moes(stacked), strict=True):
        gate_up, down, gb, db = b.stacks
        assert (gb is None) == (name != "gpt_oss") and (db is None) == (name != "gpt_oss")
        for e, (ea, eb) in enumerate(zip(a.experts, b.experts, strict=True)):
            for part, stack in (("gate_up", gate_up), ("down", down)):
                view = getattr(eb, part).weight
                assert view.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
                assert torch.equal(view, getattr(ea, part).weight) and torch.equal(view, stack[e])


def test_cuda_graphs_are_refused_only_off_the_device_road(family, monkeypatch):
    """graphs.why_not: None for a model whose every Experts is stacked; EXPERTS for the
    loop road's (the CPU's packed weights, or experts in host memory)."""
    folder = family("qwen3_moe")
    assert graphs.why_not(dense_llm(folder, monkeypatch).model) is None
    assert graphs.why_not(dense_llm(folder, monkeypatch, road=None).model) == graphs.EXPERTS
    host = dense_llm(folder, monkeypatch, "bf16", cpu_experts=1)
    assert [m.stacks is None for m in moes(host)] == [True] + [False] * (len(moes(host)) - 1)
    assert graphs.why_not(host.model) == graphs.EXPERTS
