"""The captured decode step's logic (kvlm.model.graphs) on the CPU: the static steps run
eagerly (there is nothing to capture here), so what the graphs replay on a GPU is checked
against the cache steps it replaces: the same keys written to the same slots, the same
logits within the rounding of a reordered forward, the padding rows in the scratch block.

tests/test_gpu.py runs the captured graphs themselves on a GPU."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.cache.paged import BlockPool
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.runner import CacheBatch
from kvlm.model import graphs
from kvlm.model.attention import attend, attend_decode
from kvlm.model.graphs import GraphDecoder
from numerics import assert_as_exact_as

PROMPT = "Once upon a time there was a small town by the sea"


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("mistral")  # GQA and a sliding window


@pytest.fixture(scope="module")
def exact(folder):
    return LLM(model=folder, progress=False, max_context=256, dtype="fp64")


def _llm(folder, **kw):
    return LLM(model=folder, progress=False, max_context=256, **kw)


def test_buckets():
    assert [graphs.bucket(n, 128, 256) for n in (1, 128, 129, 256, 300)] == [128] * 2 + [256] * 3
    assert [graphs.bucket(n, 1, 64) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]


def test_attend_decode_is_sdpa_over_the_visible_keys():
    torch.manual_seed(0)
    B, H, Hkv, S, D = 3, 8, 2, 40, 16
    q = torch.randn(B, H, 1, D, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, S, D, dtype=torch.float64), torch.randn(B, Hkv, S, D)
    v = v.double()
    lengths = [5, 40, 17]
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    got = attend_decode(q, k, v, mask[:, None, None, :])
    for b, n in enumerate(lengths):
        want = attend(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], None, False)
        torch.testing.assert_close(got[b : b + 1], want, rtol=0, atol=1e-12)  # fp64: exact


def test_static_contiguous_step_follows_the_cache_step(folder, exact):
    """Greedy decoding through the static step (n = 2 rows after a fork, across the first
    key bucket): the cache step's tokens, logits as exact as its own."""
    eager, static = _llm(folder), _llm(folder)
    static.runner.graphs = GraphDecoder(static.model, capture=False)
    params = SamplingParams(temperature=0, max_tokens=graphs.MIN_KEYS + 10, ignore_eos=True)
    ids = eager.tokenizer.encode(PROMPT)
    a = eager.generate(PROMPT, params)[0].token_ids
    b = static.generate(PROMPT, params)[0].token_ids
    assert a == b
    assert static.runner.graphs.replays == len(b) - 1  # every decode step
    assert static.runner.graphs.captured == 2  # the 128- and the 256-key bucket
    seq = ids + a[:-1]
    ref = eager.runner.logits(seq, eager.new_cache("off"))[-1]
    want = exact.runner.logits(seq, exact.new_cache("off"))[-1]
    # the last decode step's logits, from the static path, two rows (a fork)
    cache = static.new_cache("contiguous")
    static.runner.forward(seq[:-1], cache)
    cache.fork(2)
    got = static.runner.run(CacheBatch([seq[-1:]] * 2, cache))
    assert torch.equal(got[0], got[1])
    assert_as_exact_as(got[0], ref, want.double())


def test_static_pool_step_pads_into_the_scratch_block(folder, monkeypatch):
    """The engine's batch of rows at different lengths through the pool layout: 3 rows
    padded to 4, the padding writing only the scratch block; each request's tokens as the
    eager engine gives them."""
    eager, static = _llm(folder, kv="paged"), _llm(folder, kv="paged")
    static.runner.graphs = GraphDecoder(static.model, capture=False)
    prompts = [PROMPT, "def f(x):", "Red, green and blue are"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 8, 16)]
    outs = []
    for llm in (eager, static):
        scratch = llm is static  # what a GPU pool has: one block more, never handed out
        monkeypatch.setattr("kvlm.engine.engine.BlockPool", partial(BlockPool, scratch=scratch))
        engine = Engine(llm, EngineConfig(num_blocks=40))
        assert (engine.pool.scratch == 40) == scratch
        for i, p in enumerate(prompts):
            engine.add_request(str(i), llm.tokenizer.encode(p), params[i])
        tokens = {str(i): [] for i in range(len(prompts))}
        while engine.has_work():
            for ev in engine.step():
                tokens[ev.request_id] += ev.token_ids
        assert engine.pool.num_used == 0
        outs.append(tokens)
    assert outs[0] == outs[1]
    assert static.runner.graphs.replays > 0
    assert static.runner.graphs.captured == 3  # 3 rows (padded to 4), then 2, then 1
    assert engine.pool.store.values[:, :, 40].abs().sum() > 0  # the padding wrote there


def test_the_graphs_take_what_has_one_layer_group(tiny_model_dir, monkeypatch):
    """The runner asks a cache's and a pool's layer groups, not the model's config, whether
    the graphs read it (one store, one table per row: graphs.ONE_GROUP). A Gemma 3 has a
    GraphDecoder, and its caches and pools (a view per group) decode eagerly, the tokens
    the graphs-less runner gives; a Gemma 2 whose layers share one window (its config
    changed in place: one group, the window the masks') replays them."""
    monkeypatch.setattr(graphs, "enabled", lambda device: True)  # as on a GPU
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hybrid = _llm(tiny_model_dir("gemma3"))
    assert hybrid.runner.graphs is not None
    monkeypatch.undo()
    eager = _llm(tiny_model_dir("gemma3"))
    assert hybrid.runner.decode_step(hybrid.new_cache("contiguous")) != "cuda graphs"
    for prompts in ([PROMPT], [PROMPT, "def f(x):"]):  # one cache; the engine's pool
        assert [o.outputs[0].token_ids for o in hybrid.generate(prompts, params)] == [
            o.outputs[0].token_ids for o in eager.generate(prompts, params)]  # fmt: skip
    assert hybrid.runner.graphs.captured == 0
    one, eager = _llm(tiny_model_dir("gemma2")), _llm(tiny_model_dir("gemma2"))
    for llm in (one, eager):
        assert llm.config.layer_windows == (8, None)
        llm.config = llm.model.config = replace(llm.config, layer_windows=(8, 8))
    one.runner.graphs = GraphDecoder(one.model, capture=False)
    assert one.runner.decode_step(one.new_cache("contiguous")) == "cuda graphs"
    many = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert one.generate(PROMPT, many)[0].token_ids == eager.generate(PROMPT, many)[0].token_ids
    assert one.runner.graphs.replays == 23


def test_the_pool_defaults_to_a_share_of_the_gpus_free_memory():
    from kvlm.engine.engine import GPU_MEMORY_SHARE, default_kv_memory

    assert default_kv_memory(torch.device("cpu")) == 1 << 30
    free = 10 << 30
    assert default_kv_memory(torch.device("cuda"), free) == int(free * GPU_MEMORY_SHARE)


def test_kvlm_memory_on_a_gpu_this_machine_lacks_is_one_line(capsys):
    from kvlm.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["memory", "--device", "cuda"]) != 0
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err
