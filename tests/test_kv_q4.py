"""4-bit K/V (`--kv-dtype q4`, kvlm.cache.storage: q4_0's rule per group of 32, two codes a
byte, an fp16 scale per group, K through the int8 caches' rotation R): the rounding itself,
every mode that stores K/V against fp16 K/V by the top-5 rule and against its own
dequantized values exactly, cache files and the disk tier round-tripping the codes, and
speculative rollback (q4 for K and V, and for one of them: tests/test_kv_split.py). The
fused C step's q4 scores and p.V: tests/test_fused_arch.py and tests/test_quant.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import assert_greedy_agreement, assert_same_greedy, forward_in_chunks, prompt_ids
from kvlm import LLM, SamplingParams
from kvlm.cache import CacheFileError
from kvlm.cache.base import CacheSpec
from kvlm.cache.factory import create_cache
from kvlm.cache.files import load_cache, save_cache
from kvlm.cache.storage import (
    PARAM_DTYPE,
    V_ROTATED,
    Store,
    dequantize_q4,
    itemsize,
    key_rotation,
    q4_group,
    quantize_q4,
    v_rotated,
    value_rotation,
)
from kvlm.dtypes import Q4, dtype_name, parse_kv_dtype
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.speculative import SpeculativeConfig
from kvlm.errors import InvalidRequestError
from numerics import U32, attention_bound, fp64_reorder_bound, gamma, max_error


def test_the_rounding_is_q4_0s_and_reads_back_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    packed, scales = quantize_q4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 3, 32)
    assert scales.dtype == PARAM_DTYPE and scales.shape == (4, 3, 2)  # a scale per 32
    y = dequantize_q4(packed, scales, torch.float32)
    groups, back = x.view(4, 3, 2, 32), y.view(4, 3, 2, 32)
    d = scales.float()[..., None]
    # the group's value of largest magnitude is code 0: -8 d, up to the fp16 rounding of d
    peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
    assert torch.allclose(-8 * d, peak, rtol=2**-10, atol=0)
    # each value within one step (half a step, a whole one at the clamped +8 end) plus the
    # fp16 rounding of the step times the code's distance from 0 (at most 8)
    assert ((groups - back).abs() <= d.abs() * (1 + 8 * 2**-11)).all()
    # stored values are a fixed point: quantizing them again gives the same bytes
    again = quantize_q4(y)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scales)
    # a row whose head_dim is not a multiple of 32 is one group; zeros stay zeros
    p16, s16 = quantize_q4(torch.zeros(2, 16))
    assert s16.shape == (2, 1)
    assert torch.equal(dequantize_q4(p16, s16, torch.float32), torch.zeros(2, 16))
    assert itemsize(Q4, 64) == 0.5625 and itemsize(Q4, 16) == 0.625
    assert parse_kv_dtype("q4") is Q4 and dtype_name(Q4) == "q4"
    with pytest.raises(ValueError, match="even head_dim"):
        Store((1, 2, 1, 1, 4, 15), Q4, torch.device("cpu"))


SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, max_tokens=48, block_size=8,
                 window=12, sinks=2, dtype=Q4)  # fmt: skip


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_a_cache_returns_its_own_dequantized_rows_exactly(mode):
    """What a step's update returns is what was stored, read back: K and V rotated by R,
    each the store's round trip of the fp32 rows, bit for bit; the bytes are q4's."""
    cache = create_cache(mode, SPEC)
    r = key_rotation(SPEC.head_dim)
    for step_no, n in enumerate((5, 1, 3)):
        step = cache.begin(n)
        for layer in range(SPEC.num_layers):
            k, v = kv(n, 10 * step_no + layer)
            keys, values = step.update(layer, k, v)
            stored = dequantize_q4(*quantize_q4(k @ r), k.dtype)
            if step.key_rotation is None:  # a window hands K back in the plain basis: R^T
                back = stored @ r.t()  # one D-term product's rounding away
                tol = SPEC.head_dim * 2**-24 * float(stored.abs().max()) * 4
                assert torch.allclose(keys[..., -n:, :], back, rtol=0, atol=tol)
            else:
                assert torch.equal(keys[..., -n:, :], stored)
            assert step.value_rotation is not None  # V through R too (a power-of-two D)
            assert torch.equal(values[..., -n:, :], dequantize_q4(*quantize_q4(v @ r), v.dtype))
        cache.commit(step)
    fp16 = create_cache(mode, replace(SPEC, dtype=torch.float16))
    d = SPEC.head_dim  # a row: d / 2 bytes of codes and one fp16 scale per 32 values
    assert cache.spec.bytes_per_token * 2 * d == fp16.spec.bytes_per_token * (d // 2 + 2)


def test_a_cache_file_keeps_the_codes_and_a_damaged_one_is_refused(tmp_path):
    cache = create_cache("contiguous", SPEC)
    for i, n in enumerate((6, 1)):
        step = cache.begin(n)
        for layer in range(SPEC.num_layers):
            step.update(layer, *kv(n, 100 + 10 * i + layer))
        cache.commit(step)
    path = tmp_path / "c.kv"
    save_cache(cache, path, "fp")
    back = create_cache("contiguous", SPEC)
    load_cache(back, path, "fp")
    assert back.num_tokens == 7
    for name, t in cache.store.parts.items():
        assert torch.equal(t[..., :7, :], back.store.parts[name][..., :7, :]), name
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    inf = tensors["scales"].clone().fill_(float("inf"))
    short = tensors["values"][..., :8].contiguous()
    for bad, says in (({"scales": inf}, "not all finite"), ({"values": short}, "have shape")):
        save_file({**tensors, **bad}, str(tmp_path / "bad.kv"), metadata=meta)
        with pytest.raises(CacheFileError, match=says):
            load_cache(create_cache("contiguous", SPEC), tmp_path / "bad.kv", "fp")


@pytest.fixture(scope="module")
def q4_default():
    return LLM(progress=False, max_context=512, kv_dtype="q4")


@pytest.fixture(scope="module")
def fp16_default():
    return LLM(progress=False, max_context=512, kv_dtype="fp16")


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_the_default_model_on_q4_follows_fp16_by_the_top_5_rule(q4_default, fp16_default, mode):
    """24 greedy steps of fp16 K/V (the reference's own answer), each step's logits on q4
    K/V against fp16 K/V's on the same prefix (teacher-forced through a cache of the mode):
    the same best tokens until the first divergence, there each side's best in the other's
    top 5 (the rule for paths that round on purpose, tests/numerics.py). Not every later
    step: on a flat step 4-bit K/V reorders near-ties as any quantizer does (an AMX Xeon,
    step 15: fp16's top six within 0.71, its best 6th on q4, the step's KL 0.12 as its
    neighbours'). The prefix is fp16's, not q4's own: q4's greedy answer comes from the
    fused C step, so its rounding chose the prefix every mode is then checked on (the C
    rotation as butterflies moved one near-tie at step 10, and the window mode, which the
    C step does not run, met a flat step 13 on that prefix: fp16's six within 0.96, q4's
    best the 6th, 0.09 under the 5th, the step's KL 0.09 as its neighbours')."""
    ids = fp16_default.encode("Explain what a KV cache is in two sentences.", chat=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = fp16_default.generate(prompt_token_ids=[ids], sampling_params=params,
                                   use_tqdm=False)[0].token_ids  # fmt: skip
    seq = ids + tokens[:-1]
    ours = _stepped(q4_default, mode, seq, len(ids))
    theirs = torch.stack(_stepped(fp16_default, mode, seq, len(ids)))
    assert_greedy_agreement([int(x.argmax()) for x in ours],
                            [torch.topk(x, 5).indices.tolist() for x in ours],
                            [int(y.argmax()) for y in theirs], theirs)  # fmt: skip


def _stepped(llm: LLM, mode: str, seq: list[int], prompt: int) -> list[torch.Tensor]:
    cache = llm.new_cache(mode)
    out = [llm.runner.forward(seq[:prompt], cache)]
    out += [llm.runner.forward([t], cache) for t in seq[prompt:]]
    return out


def test_basic_refuses_q4():
    with pytest.raises(InvalidRequestError, match="q4 needs --kv contiguous"):
        create_cache("basic", SPEC)


@pytest.mark.parametrize("kv_dtype", ["q4", "q4/int8"])  # K/V alike, and apart
def test_speculative_rollback_on_q4_is_plain_decoding(tiny_model_dir, kv_dtype):
    """Drafts written to a q4 cache and rejected leave it as plain decoding would."""
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, kv_dtype=kv_dtype)
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", None), ("spec", SpeculativeConfig(num_draft=4, ngram_min=1))):
        engine = Engine(llm, EngineConfig(num_blocks=64, speculative=spec))
        engine.add_request("a", ids, params)
        outs[name] = [t for _ in iter(engine.has_work, False) for ev in engine.step()
                      for t in ev.token_ids]  # fmt: skip
        if spec is not None:
            assert engine.stats.spec.drafted > engine.stats.spec.accepted  # some rolled back
        engine.close()
    assert outs["spec"] == outs["plain"] and len(outs["plain"]) == 100


@pytest.mark.parametrize("kv_dtype", ["q4", "fp16/q4"])  # K/V alike, and apart
def test_the_disk_tier_round_trips_q4_blocks(tiny_model_dir, tmp_path, monkeypatch, kv_dtype):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, kv_dtype=kv_dtype)
    prompt = [(7 * i + 3) % 200 + 10 for i in range(101)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run() -> tuple[list[int], int, Engine]:
        engine = Engine(llm, EngineConfig(num_blocks=64, kv_tiers=(f"disk:{tmp_path / 't'}",)))
        engine.add_request("a", prompt, params)
        out, cached = [], None
        while engine.has_work():
            for ev in engine.step():
                out += ev.token_ids
                cached = ev.cached_tokens if cached is None else cached
        return out, cached, engine

    want, cached, first = run()
    first.close()
    got, cached_again, second = run()
    assert cached == 0 and cached_again == 96 and got == want
    assert second.pool.store.v_dtype == Q4 and second.tiers.stats["disk"].hits == 6
    second.close()


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_the_value_rotation_round_trips(d):
    """x R R^T = x within fp32 rounding: two D-term products, each element of |x| |R| |R^T|
    being ||x||_1 (|R_ij| = D^-1/2), plus R's own entries rounded (1/sqrt(D) within u)."""
    r = value_rotation(d)
    x = torch.randn(16, d, generator=torch.Generator().manual_seed(d))
    back = (x @ r) @ r.T
    bound = (2 * gamma(d) + 2 * U32) * x.abs().sum(-1, keepdim=True)
    assert ((back - x).abs() <= bound).all()
    assert value_rotation(96) is None and not v_rotated(Q4, 96)  # no symmetric R: V plain
    assert v_rotated(Q4, d) and v_rotated(torch.int8, d) and not v_rotated(torch.float16, d)


@pytest.mark.parametrize("mode", ["contiguous", "paged"])  # a window's V: the test above
def test_attention_over_rotated_q4_v_is_attention_over_fp32_v_within_its_step(mode):
    """fp32 K, q4 V stored as v R: softmax(q k) (v R)^ R^T against softmax(q k) v differs by
    the rows' quantization error carried back through R^T: at most max_s ||e_s||_1 / sqrt(D)
    with |e| <= |d_g| (half a step, a clamped code a step, m's own fp16 rounding within)
    per element of group g, plus both sides' fp32 rounding (attention_bound) and R^T's."""
    spec = replace(SPEC, dtype=torch.float32, v_dtype=Q4)
    cache = create_cache(mode, spec)
    g = torch.Generator().manual_seed(3)
    n, d = 9, spec.head_dim
    k, v = (torch.randn(1, spec.num_kv_heads, n, d, generator=g) for _ in range(2))
    q = torch.randn(1, spec.num_kv_heads, n, d, generator=g)
    step = cache.begin(n)
    keys, values = step.update(0, k, v)
    r = step.value_rotation
    assert r is not None
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=True) @ r.T
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    _, scales = quantize_q4(v @ r)
    err_l1 = (scales.float().abs() * q4_group(d)).sum(-1).max() / d**0.5
    slack = attention_bound(q, k, v) + 2 * gamma(d) * float((v @ r).abs().sum(-1).max())
    assert float((out - ref).abs().max()) <= float(err_l1) + slack


@pytest.fixture(scope="module")
def rotated_tiny(tiny_model_dir):
    """kv_dtype -> the tiny llama (head_dim 16: a quantized V stored rotated) on those K/V,
    (fp64, fp32, int4 weights: its decode steps the fused C step's), each made once."""
    made: dict[str, tuple[LLM, LLM, LLM]] = {}

    def get(kv_dtype: str) -> tuple[LLM, LLM, LLM]:
        if kv_dtype not in made:
            common = {"model": tiny_model_dir("llama"), "progress": False,
                      "max_context": 256, "kv_dtype": kv_dtype}  # fmt: skip
            made[kv_dtype] = (LLM(**common, dtype="fp64"), LLM(**common),
                              LLM(**common, weights="int4"))  # fmt: skip
        return made[kv_dtype]

    return get


@pytest.mark.parametrize("kv_dtype", ["q4", "int8/q4"])
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_chunked_prefill_on_rotated_v_equals_one_shot(rotated_tiny, kv_dtype, mode):
    """A 40-token prompt in chunks of 7 (across q4's groups and the paged blocks of 16)
    against one shot, V stored as v R: test_cache_family's contract for a quantized cache.
    In fp64 within fp64 reordering of one shot (codes from values equal to ~1e-16 round
    alike); in fp32 (int4 weights: the fused C step decodes, rotating the new V rows and
    un-rotating the outputs) 13 greedy tokens by the top-5 rule, a code on a rounding
    boundary free to take the other side."""
    llm64, llm32, fused = rotated_tiny(kv_dtype)
    assert llm64.cache_spec(mode).kv_format.endswith(V_ROTATED)
    ids = prompt_ids(llm32, 40)
    exact = forward_in_chunks(llm64, ids, mode, len(ids))
    err32 = max_error(forward_in_chunks(llm32, ids, mode, len(ids)), exact)
    assert max_error(forward_in_chunks(llm64, ids, mode, 7), exact) <= fp64_reorder_bound(err32)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=5)
    assert fused.runner.fused_for(fused.new_cache(mode)) is not None, fused.runner.fused_reason
    assert_same_greedy(fused, ids, mode, params, 7)
