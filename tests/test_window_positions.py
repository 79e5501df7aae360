"""The window cache's RoPE positions: counted inside the cache (StreamingLLM, the default)
or absolute (kvlm.cache.window).

What is claimed and checked here:
- in-cache positions stay below S + W + n_new over a stream 10x the window, keep every
  distance between a query and the ring or new keys it sees, and put the sinks at 0..S-1;
- before the ring wraps both modes use the same positions and compute the same attention;
- after it wraps, a decode step's attention is StreamingLLM's: a from-scratch dense
  attention over the kept tokens placed at 0..S+W-1 (the absolute mode's is not), for every
  storage dtype the window takes;
- a cache file remembers its mode; rollback refuses what it refused before.

Tolerances are bounds derived from the arithmetic (see `attention_bound`), never read off
one CPU's output: the suite runs on CPUs whose kernels round differently.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import low_bit_llm, save_tiny_model
from kvlm import LLM
from kvlm.cache import CacheFileError, CacheSpec, create_cache, load_cache, save_cache
from kvlm.errors import InvalidRequestError
from kvlm.llm import CacheOptions
from kvlm.model import attention
from numerics import U32, attention_bound

S, W = 2, 6  # sinks, ring
SPEC = CacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, max_tokens=8, window=W, sinks=S)
MODES = ("cache", "absolute")


def spec(positions: str, **changes) -> CacheSpec:
    return replace(SPEC, window_positions=positions, **changes)


def feed(cache, n: int, seed: int):
    """One step of n random tokens; returns the step (after commit)."""
    g = torch.Generator().manual_seed(seed)
    shape = (cache.batch, SPEC.num_kv_heads, n, SPEC.head_dim)
    step = cache.begin(n)
    step.update(0, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    cache.commit(step)
    return step


CHUNKS = [1, 3, 7, 1, 1, 16, 2, 1, 5]  # prefill chunks longer and shorter than the ring


def stream(cache, tokens: int):
    """Feed `tokens` tokens in CHUNKS-sized steps; yield each step."""
    i = 0
    while cache.num_tokens < tokens:
        n = min(CHUNKS[i % len(CHUNKS)], tokens - cache.num_tokens)
        yield feed(cache, n, seed=i)
        i += 1


# ---------------------------------------------------------------------------- positions


def test_cache_positions_stay_bounded_and_keep_every_distance():
    absolute = create_cache("window", spec("absolute"))
    cache = create_cache("window", spec("cache"))
    decode_steps_after_wrap = 0
    for step, ref in zip(stream(cache, 10 * W), stream(absolute, 10 * W), strict=True):
        n = step.n_new
        q_abs = torch.arange(step.start, step.start + n)
        q_at, k_at, k_abs = step.positions[0], step.key_rope_positions, step.key_positions
        # the same keys and the same mask in both modes: only the positions differ
        assert torch.equal(k_abs, ref.key_positions) and torch.equal(step.mask, ref.mask)
        assert ref.key_rope_positions is None and torch.equal(ref.positions[0], q_abs)
        sees = step.mask  # (T, keys)
        assert int(q_at.max()) < S + W + n
        assert int(k_at[sees.any(0)].max()) < S + W + n
        sink = (k_abs >= 0) & (k_abs < S)
        assert torch.equal(k_at[sink], k_abs[sink])
        ring = sees & ~sink[None, :]
        dist_at, dist_abs = q_at[:, None] - k_at[None, :], q_abs[:, None] - k_abs[None, :]
        assert torch.equal(dist_at[ring], dist_abs[ring])
        if step.start < S + W:  # nothing dropped from view yet: the same positions
            assert torch.equal(q_at, q_abs) and torch.equal(k_at[k_abs >= 0], k_abs[k_abs >= 0])
        elif n == 1:  # StreamingLLM's placement: the kept tokens at 0..S+W-1, query last
            assert sorted(k_at[sees[0]].tolist()) == list(range(S + W))
            assert q_at.tolist() == [S + W - 1]
            decode_steps_after_wrap += 1
    assert cache.num_tokens == 10 * W and decode_steps_after_wrap >= 5


def test_positions_after_rollback_are_those_of_a_straight_stream():
    """(What rollback refuses, in both modes: tests/test_cache.py.)"""
    for positions in MODES:
        cache = create_cache("window", spec(positions))
        feed(cache, 4, seed=1)
        cache.rollback(3)  # nothing evicted yet: exact
        feed(cache, 12, seed=2)  # 13 tokens > 8 slots: the ring has wrapped
        cache.rollback(1)  # the most a wrapped ring allows
        straight = create_cache("window", spec(positions))
        feed(straight, 12, seed=3)
        a, b = cache.begin(2), straight.begin(2)
        assert torch.equal(a.positions, b.positions) and torch.equal(a.mask, b.mask)
        if positions == "cache":
            seen = a.mask.any(0)
            assert torch.equal(a.key_rope_positions[seen], b.key_rope_positions[seen])


# ---------------------------------------------------------------------------- files, options


def test_cache_files_remember_the_position_mode(tmp_path):
    for saved, other in (("cache", "absolute"), ("absolute", "cache")):
        a = create_cache("window", spec(saved))
        feed(a, 9, seed=1)
        path = tmp_path / f"{saved}.kv"
        save_cache(a, path, "m")
        with pytest.raises(CacheFileError):  # the layout_extra check (kvlm.cache.base)
            load_cache(create_cache("window", spec(other)), path, "m")
        b = create_cache("window", spec(saved))  # while its own mode takes it
        load_cache(b, path, "m")
        assert b.num_tokens == 9 and torch.equal(b.slot_pos, a.slot_pos)
    # absolute files keep the layout of files written before the option existed
    assert create_cache("window", spec("absolute"))._layout_extra() == {"sinks": S, "window": W}


def test_unknown_position_mode_is_refused(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="window positions"):
        LLM(model=tiny_model_dir("llama"), progress=False,
            cache_options=CacheOptions(window_positions="relative"))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="window positions"):
        spec("relative")
    from kvlm.cli import _load, build_parser

    args = build_parser().parse_args(
        ["generate", "hi", "--model", str(tiny_model_dir("llama")), "--kv", "window",
         "--window-positions", "absolute"]
    )  # fmt: skip
    assert _load(args).new_cache().spec.window_positions == "absolute"
    assert CacheOptions().window_positions == "cache"


# ---------------------------------------------------------------------------- attention


@pytest.fixture
def attention_calls(monkeypatch):
    """Every attend() call of the model, in order: (q, k, v, mask, out)."""
    calls: list[tuple[torch.Tensor, ...]] = []
    real = attention.attend

    def record(q, k, v, mask, is_causal, expand=None, softcap=None, bf16_from=None, prompt=None,
               sinks=None):  # fmt: skip
        out = real(q, k, v, mask, is_causal, expand, softcap, bf16_from, prompt, sinks=sinks)
        calls.append((q, k, v, mask, out))
        return out

    monkeypatch.setattr(attention, "attend", record)
    return calls


def load_llm(folder, positions: str, kv_dtype: str = "fp32", window: int = W) -> LLM:
    opts = CacheOptions(window=window, sinks=S, window_positions=positions)
    return LLM(model=folder, kv="window", kv_dtype=kv_dtype, progress=False, cache_options=opts)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral-window", "llama3-rope"])
def test_cache_positions_equal_absolute_before_the_ring_wraps(
    tiny_model_dir, attention_calls, family
):
    """The same positions, so the first layer's attention agrees up to fp32 rounding (the
    keys' cos/sin come from another call in the in-cache mode). Layer 0 is where both modes
    get the same input; later layers inherit its rounding. (A narrow storage dtype rounds K
    before RoPE in one mode and after it in the other: see the from-scratch test for those.)"""
    window = 12  # above mistral-window's own sliding window of 8, so both masks matter
    ids = torch.randint(3, 300, (S + window + 5,), generator=torch.Generator().manual_seed(1))
    steps = {}
    for positions in MODES:
        llm = load_llm(tiny_model_dir(family), positions, window=window)
        cache, layers = llm.new_cache(), llm.config.num_layers
        start = 0
        for n in (5, 1, 3, 4, 6):  # every step starts before S + window: no shift yet
            assert start < S + window
            llm.runner.logits(ids[start : start + n].tolist(), cache)
            start += n
        steps[positions] = attention_calls[::layers]  # layer 0 of each forward
        attention_calls.clear()
    assert start > S + window  # the last chunk runs past the ring: still the same positions
    for (q, k, v, mask, out), (*_, mask_c, out_c) in zip(
        steps["absolute"], steps["cache"], strict=True
    ):
        assert torch.equal(mask, mask_c)
        assert float((out - out_c).abs().max()) <= attention_bound(q, k, v)


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory):
    """One layer: each token's K/V depend on that token alone, so the cached K/V of a stream
    are exactly what a from-scratch forward over the kept tokens computes."""
    return save_tiny_model(tmp_path_factory.mktemp("one-layer"), "llama", seed=7,
                           num_hidden_layers=1)  # fmt: skip


def last_attention(llm: LLM, cache, tokens: list[int], calls: list) -> tuple[torch.Tensor, ...]:
    """Feed `tokens` one at a time; the last forward's attend() call (q, k, v, mask, out)."""
    for token in tokens:
        llm.runner.logits([token], cache)
    call = calls[-1]
    calls.clear()
    return call


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "int8"])
def test_after_the_wrap_attention_is_streamingllm_from_scratch(
    one_layer_model, attention_calls, kv_dtype
):
    """Decode 10x the window one token at a time. At each step t past the wrap, StreamingLLM's
    reference: a fresh cache fed only the kept tokens (sinks, then t-W+1 .. t), at positions
    0..S+W-1 -- a window of the same storage dtype, which holds them all without wrapping
    (so K/V round the same way), and for fp32 also a `basic` cache (RoPE applied before
    storing, the dense path). The in-cache mode's attention output equals them within fp32
    rounding; the absolute mode's does not."""
    ids = torch.randint(3, 300, (10 * W,), generator=torch.Generator().manual_seed(2)).tolist()
    worst = {}
    for positions in MODES:
        llm = load_llm(one_layer_model, positions, kv_dtype)
        fresh = load_llm(one_layer_model, "cache", kv_dtype)
        stream_cache = llm.new_cache()
        last_attention(llm, stream_cache, ids[: S + W], attention_calls)
        worst[positions] = 0.0
        for t in range(S + W, len(ids)):
            *_, got = last_attention(llm, stream_cache, [ids[t]], attention_calls)
            if t % 3:  # every third step is plenty, and keeps the test fast
                continue
            kept = [*ids[:S], *ids[t - W + 1 : t + 1]]
            refs = ["window", "basic"] if kv_dtype == "fp32" else ["window"]
            for mode in refs:
                q, k, v, _, want = last_attention(
                    fresh, fresh.new_cache(mode), kept, attention_calls
                )
                # int8: both sides turn the same codes back with R^T, in products of other
                # shapes: each element within D u |k| of exact, 2 D^1.5 u |k| apart in 2-norm
                d = k.shape[-1]
                k_err = 2 * d**1.5 * U32 * float(k.norm(dim=-1).max()) if kv_dtype == "int8" else 0
                bound = attention_bound(q, k, v, k_err, n_keys=S + W + 1)
                err = float((got - want).abs().max())
                if positions == "cache":
                    assert err <= bound, (t, mode, err, bound)
                worst[positions] = max(worst[positions], err / bound)
    assert worst["absolute"] > 10  # it meets its sinks at the wrong distance


def test_storage_dtypes_decode_past_the_wrap_in_constant_memory(tiny_model_dir):
    """Every storage dtype through the real model, long past the ring, in chunks: finite
    logits, and the memory of S + W slots."""
    for kv_dtype in ("fp32", "bf16", "fp16", "int8"):
        llm = load_llm(tiny_model_dir("llama"), "cache", kv_dtype)
        cache = llm.new_cache()
        nbytes = cache.nbytes
        ids = torch.randint(3, 300, (8 * W,), generator=torch.Generator().manual_seed(3))
        for i in range(0, len(ids), 5):
            logits = llm.runner.logits(ids[i : i + 5].tolist(), cache)
            assert torch.isfinite(logits).all()
        assert cache.num_tokens == 8 * W and cache.nbytes == nbytes


def test_the_fused_decode_step_never_takes_a_window_cache(tiny_model_dir):
    """The C decode step reads K rotated at write: window caches stay on the torch path."""
    llm = low_bit_llm(model=tiny_model_dir("llama"), weights="int8", kv="window")
    if llm.runner.fused_reason is not None:
        pytest.skip(f"no fused step here: {llm.runner.fused_reason}")
    assert llm.runner.fused_for(llm.new_cache("contiguous")) is not None
    for positions in MODES:
        spec = replace(llm.cache_spec("window"), window_positions=positions)
        assert llm.runner.fused_for(create_cache("window", spec)) is None
