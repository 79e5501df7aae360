"""K and V stored in dtypes of their own (`--k-dtype`, `--v-dtype`, or `kv_dtype="K/V"`, as
llama.cpp's -ctk/-ctv): the store keeps each in its own tensors (storage.part_layout), every
mode that stores K/V returns each one's own dequantized rows exactly, bytes per token add
up, cache files round-trip both and a file of another pair is refused. Speculative
rollback and the disk tier with a pair: tests/test_kv_q4.py; the fused C step's scores and
p.V per dtype: tests/test_fused_arch.py (SPLIT_KV) and tests/test_quant.py (the portable
build)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import assert_top_k_both_ways
from kvlm import LLM, SamplingParams
from kvlm.cache import CacheFileError
from kvlm.cache.base import CacheSpec
from kvlm.cache.factory import create_cache
from kvlm.cache.files import load_cache, save_cache
from kvlm.cache.storage import CODECS, Store, key_rotation, part_layout
from kvlm.cli import main
from kvlm.dtypes import Q4, kv_dtype_name, parse_kv_dtypes
from kvlm.errors import InvalidRequestError
from kvlm.loading import load_model

I8, F16 = torch.int8, torch.float16
PAIRS = [(I8, Q4), (Q4, F16), (F16, I8)]  # (K, V)
SHAPE = (2, 2, 3, 2, 8, 32)  # layers, K/V, rows, kv heads, slots, head_dim


def _roundtrip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in CODECS:
        quantize, dequantize = CODECS[dtype]
        return dequantize(*quantize(x), x.dtype)
    return x.to(dtype).to(x.dtype)


def test_names_parse_both_ways():
    assert parse_kv_dtypes("int8/q4") == (I8, Q4)
    assert parse_kv_dtypes("fp16") == (F16, F16)
    assert kv_dtype_name(I8, Q4) == "int8/q4" and kv_dtype_name(Q4, Q4) == "q4"
    with pytest.raises(InvalidRequestError, match="unknown dtype 'q5'"):
        parse_kv_dtypes("int8/q5")
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, max_tokens=8, dtype=I8,
                     v_dtype=Q4)  # fmt: skip
    # a row of 64: int8 64 codes + (step, zero) in fp16; q4 32 bytes + 2 fp16 scales
    assert spec.bytes_per_token == 2 * 2 * ((64 + 4) + (32 + 4)) and spec.kv_name == "int8/q4"


@pytest.mark.parametrize(("k", "v"), PAIRS)
def test_a_split_store_keeps_each_as_a_store_of_its_dtype_would(k, v):
    """Each half reads back what a store of its own dtype reads back, bit for bit; the
    parts are part_layout's; snapshots' raw parts move between stores; zero_ clears both."""
    store = Store(SHAPE, k, torch.device("cpu"), v_dtype=v)
    assert store.split and set(store.parts) == set(part_layout(SHAPE, k, v))
    assert {n: (tuple(t.shape), t.dtype) for n, t in store.parts.items()} == part_layout(
        SHAPE, k, v
    )
    singles = [Store(SHAPE, dt, torch.device("cpu")) for dt in (k, v)]
    assert store.nbytes == sum(s.nbytes for s in singles) // 2
    g = torch.Generator().manual_seed(0)
    for kv in (0, 1):
        x = torch.randn(3, 2, 5, 32, generator=g)
        index = (1, kv, slice(None), slice(None), slice(2, 7))
        store.put(index, x)
        singles[kv].put(index, x)
        got = store.get(index, torch.float32)
        assert torch.equal(got, singles[kv].get(index, torch.float32))
        assert torch.equal(got, _roundtrip(x, (k, v)[kv]))
        assert torch.equal(store.roundtrip(x, kv), got)
    other = Store(SHAPE, k, torch.device("cpu"), v_dtype=v)
    rows = (slice(None), slice(None), torch.tensor([0, 2]))
    other.put_raw(rows, store.raw(rows))
    for name, t in store.parts.items():
        assert torch.equal(other.parts[name][:, :, [0, 2]], t[:, :, [0, 2]]), name
    store.zero_((slice(None),))
    assert all(not t.any() for t in store.parts.values())
    with pytest.raises(AttributeError, match="apart"):
        _ = store.values


SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, max_tokens=48, block_size=8,
                 window=12, sinks=2)  # fmt: skip


def kv_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize(("k", "v"), PAIRS)
@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_a_cache_returns_each_ones_own_dequantized_rows_exactly(mode, k, v):
    """What a step's update returns is what was stored, read back: K in its dtype, V in its
    own (each through R when quantized), each the store's round trip of the fp32 rows."""
    cache = create_cache(mode, replace(SPEC, dtype=k, v_dtype=v))
    r = key_rotation(SPEC.head_dim)
    for step_no, n in enumerate((5, 1, 3)):
        step = cache.begin(n)
        for layer in range(SPEC.num_layers):
            k_new, v_new = kv_rows(n, 10 * step_no + layer)
            keys, values = step.update(layer, k_new, v_new)
            assert (step.key_rotation is not None) == (k in CODECS and mode != "window")
            if k in CODECS:
                stored = _roundtrip(k_new @ r, k)
                if step.key_rotation is None:  # a window hands K back in the plain basis
                    tol = SPEC.head_dim * 2**-24 * float(stored.abs().max()) * 4
                    assert torch.allclose(keys[..., -n:, :], stored @ r.t(), rtol=0, atol=tol)
                else:
                    assert torch.equal(keys[..., -n:, :], stored)
            else:
                assert torch.equal(keys[..., -n:, :], _roundtrip(k_new, k))
            # a quantized V through R too (value_rotation: head_dim a power of two)
            assert (step.value_rotation is not None) == (v in CODECS)
            v_in = v_new @ r if v in CODECS else v_new
            assert torch.equal(values[..., -n:, :], _roundtrip(v_in, v))
        cache.commit(step)
    assert cache.spec.kv_name == f"{kv_dtype_name(k)}/{kv_dtype_name(v)}"


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_a_cache_file_keeps_both_and_another_pair_is_refused(mode, tmp_path):
    spec = replace(SPEC, dtype=I8, v_dtype=Q4)
    cache = create_cache(mode, spec)
    for i, n in enumerate((6, 1)):
        step = cache.begin(n)
        for layer in range(SPEC.num_layers):
            step.update(layer, *kv_rows(n, 100 + 10 * i + layer))
        cache.commit(step)
    path = tmp_path / "c.kv"
    save_cache(cache, path, "fp")
    back = create_cache(mode, spec)
    load_cache(back, path, "fp")
    assert back.num_tokens == 7
    assert torch.equal(back.snapshot().tensors["k.values"], cache.snapshot().tensors["k.values"])
    assert torch.equal(back.snapshot().tensors["v.scales"], cache.snapshot().tensors["v.scales"])
    with pytest.raises(
        CacheFileError, match=r"holds int8/q4\+vrot values but this cache stores q4/int8\+vrot"
    ):
        load_cache(create_cache(mode, replace(SPEC, dtype=Q4, v_dtype=I8)), path, "fp")
    if mode != "contiguous":
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    inf = tensors["v.scales"].clone().fill_(float("inf"))
    wide = tensors["k.values"].to(torch.int16)
    for bad, says in (({"v.scales": inf}, "not all finite"), ({"k.values": wide}, "not int8"),
                      ({"values": tensors["k.values"].clone()}, "unexpected tensor")):  # fmt: skip
        save_file({**tensors, **bad}, str(tmp_path / "bad.kv"), metadata=meta)
        with pytest.raises(CacheFileError, match=says):
            load_cache(create_cache("contiguous", spec), tmp_path / "bad.kv", "fp")
    for name in ("int8/int8", "int8/q5", "/q4"):  # one spelling; names kvlm stores
        save_file(tensors, str(tmp_path / "bad.kv"), metadata={**meta, "dtype": name})
        with pytest.raises(CacheFileError, match="is not one kvlm stores"):
            load_cache(create_cache("contiguous", spec), tmp_path / "bad.kv", "fp")


def test_basic_refuses_a_pair():
    with pytest.raises(InvalidRequestError, match="fp16/bf16 needs --kv contiguous"):
        create_cache("basic", replace(SPEC, dtype=F16, v_dtype=torch.bfloat16))


def test_the_default_model_on_int8_k_and_q4_v_follows_fp16(tmp_path):
    """24 greedy steps with K int8 and V q4 on the paged pool, teacher-forced against fp16
    K/V: the top-5 rule both ways; the LLM's settings name the pair."""
    split = LLM(progress=False, max_context=256, kv_dtype="int8/q4")
    fp16 = LLM(progress=False, max_context=256, kv_dtype="fp16")
    assert split.describe()["kv_dtype"] == "int8/q4"
    ids = split.encode("Explain what a KV cache is in two sentences.", chat=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = split.generate(prompt_token_ids=[ids], sampling_params=params,
                            use_tqdm=False)[0].token_ids  # fmt: skip
    seq = ids + tokens[:-1]
    logits = []
    for llm in (split, fp16):
        cache = llm.new_cache("paged")
        out = [llm.runner.forward(seq[: len(ids)], cache)]
        out += [llm.runner.forward([t], cache) for t in seq[len(ids) :]]
        logits.append(torch.stack(out))
    assert_top_k_both_ways(*logits)


def test_the_flags_reach_the_cache(tiny_model_dir, capsys):
    """--k-dtype / --v-dtype over --kv-dtype, on the command line: `kvlm memory` counts
    each one's bytes, `kvlm generate` runs on the pair."""
    folder = str(tiny_model_dir("llama"))
    args = ["memory", "--model", folder, "--context", "64", "--kv", "paged", "--json"]
    assert main([*args, "--kv-dtype", "int8", "--v-dtype", "q4"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["kv_dtype"] == "int8/q4"
    both = CacheSpec.for_model(load_model(folder).config, 64, (I8, Q4))
    assert out["bytes_per_token"] == both.bytes_per_token
    gen = ["generate", "--model", folder, "--max-new-tokens", "4", "--kv", "paged", "hello"]
    assert main([*gen, "--k-dtype", "q4", "--v-dtype", "fp16"]) == 0
    assert main([*gen, "--k-dtype", "q5"]) == 2
    assert "unknown dtype 'q5'" in capsys.readouterr().err
