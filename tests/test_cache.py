"""The cache protocol, mode by mode, without a model."""

from __future__ import annotations

import pytest
import torch

from kvlm.cache import CACHE_MODES, CacheSpec, create_cache
from kvlm.cache.base import causal_mask
from kvlm.errors import CacheOverflowError, InvalidRequestError

SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, max_tokens=8)
STATEFUL = ["basic", "contiguous"]


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)


def feed(cache, n: int, seed: int):
    """One 'forward' of n tokens through every layer; returns what layer 0 saw."""
    step = cache.begin(n)
    seen = []
    for layer in range(SPEC.num_layers):
        k, v = kv(n, seed * 10 + layer)
        seen.append(step.update(layer, k, v))
    cache.commit(step)
    return step, seen


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(InvalidRequestError, match="valid modes: off, basic, contiguous"):
        create_cache("paged-ish", SPEC)


@pytest.mark.parametrize("mode", STATEFUL)
def test_history_is_returned_in_order(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 3, seed=1)
    _, seen = feed(cache, 1, seed=2)
    k_all, v_all = seen[0]
    assert k_all.shape == (1, 2, 4, 4)
    torch.testing.assert_close(k_all[:, :, :3], kv(3, 10)[0], rtol=0, atol=0)
    torch.testing.assert_close(k_all[:, :, 3:], kv(1, 20)[0], rtol=0, atol=0)
    torch.testing.assert_close(v_all[:, :, 3:], kv(1, 20)[1], rtol=0, atol=0)
    assert cache.num_tokens == 4


def test_positions_come_from_the_cache():
    cache = create_cache("contiguous", SPEC)
    step, _ = feed(cache, 3, seed=1)
    assert step.positions.tolist() == [[0, 1, 2]]
    step = cache.begin(2)
    assert step.positions.tolist() == [[3, 4]]


def test_off_cache_holds_nothing():
    cache = create_cache("off", SPEC)
    step, seen = feed(cache, 5, seed=1)
    assert cache.num_tokens == 0 and cache.nbytes == 0
    assert step.is_causal and step.mask is None
    assert seen[0][0].shape[2] == 5


@pytest.mark.parametrize("mode", list(CACHE_MODES))
def test_overflow_is_refused_before_any_write(mode):
    cache = create_cache(mode, SPEC)
    if mode != "off":
        feed(cache, 6, seed=1)
    before = [t.clone() for t in _storage(cache)]
    assert cache.would_overflow(SPEC.max_tokens - cache.num_tokens + 1)
    with pytest.raises(CacheOverflowError, match="exceed the cache capacity of 8"):
        cache.begin(SPEC.max_tokens - cache.num_tokens + 1)
    assert cache.num_tokens == (6 if mode != "off" else 0)
    for old, new in zip(before, _storage(cache), strict=True):
        assert torch.equal(old, new)


def _storage(cache) -> list[torch.Tensor]:
    if cache.mode == "contiguous":
        return [cache.buffer]
    if cache.mode == "basic":
        return [t for t in (*cache.k, *cache.v) if t is not None]
    return []


@pytest.mark.parametrize("mode", STATEFUL)
def test_a_forward_that_raises_changes_nothing(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 3, seed=1)
    step = cache.begin(2)
    step.update(0, *kv(2, 5))  # layer 0 written, then the forward dies
    assert cache.num_tokens == 3
    _, seen = feed(cache, 1, seed=7)  # the next forward starts where the cache really is
    assert seen[0][0].shape[2] == 4
    torch.testing.assert_close(seen[0][0][:, :, 3:], kv(1, 70)[0], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="stale"):
        cache.commit(step)


@pytest.mark.parametrize("mode", STATEFUL)
def test_rollback_then_rewrite(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 5, seed=1)
    cache.rollback(2)
    assert cache.num_tokens == 3
    _, seen = feed(cache, 2, seed=9)
    k_all = seen[0][0]
    assert k_all.shape[2] == 5
    torch.testing.assert_close(k_all[:, :, :3], kv(5, 10)[0][:, :, :3], rtol=0, atol=0)
    torch.testing.assert_close(k_all[:, :, 3:], kv(2, 90)[0], rtol=0, atol=0)
    with pytest.raises(InvalidRequestError):
        cache.rollback(6)
    with pytest.raises(InvalidRequestError):
        cache.rollback(-1)
    cache.reset()
    assert cache.num_tokens == 0


def test_nbytes_is_exact():
    contiguous = create_cache("contiguous", SPEC)
    assert contiguous.nbytes == 2 * 2 * 1 * 2 * 8 * 4 * 4  # layers, K/V, batch, heads, len, D, fp32
    assert contiguous.nbytes == SPEC.bytes_per_token * SPEC.max_tokens
    basic = create_cache("basic", SPEC)
    assert basic.nbytes == 0
    feed(basic, 3, seed=1)
    assert basic.nbytes == 3 * SPEC.bytes_per_token
    basic.rollback(1)
    assert basic.nbytes == 2 * SPEC.bytes_per_token


@pytest.mark.parametrize("mode", STATEFUL)
def test_narrow_cache_dtype(mode):
    """A bf16 cache stores bf16 and hands fp32 back to an fp32 model."""
    spec = CacheSpec(2, 2, 4, 8, dtype=torch.bfloat16)
    cache = create_cache(mode, spec)
    step = cache.begin(3)
    k, v = kv(3, 1)
    k_all, _ = step.update(0, k, v)
    assert k_all.dtype == torch.float32
    torch.testing.assert_close(k_all, k.to(torch.bfloat16).float(), rtol=0, atol=0)
    if mode == "contiguous":
        assert cache.buffer.dtype == torch.bfloat16
        assert cache.nbytes == spec.bytes_per_token * 8 == 2 * 2 * 2 * 8 * 4 * 2


def test_causal_mask_forms():
    assert causal_mask(0, 5, 5, None, torch.device("cpu")) == (None, True)
    assert causal_mask(7, 1, 8, None, torch.device("cpu")) == (None, False)
    mask, is_causal = causal_mask(4, 3, 7, None, torch.device("cpu"))
    assert not is_causal
    assert mask.int().tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ]
    mask, _ = causal_mask(5, 1, 6, 3, torch.device("cpu"))  # window 3: keys 3, 4, 5
    assert mask.int().tolist() == [[0, 0, 0, 1, 1, 1]]


def test_cache_spec_rejects_nonsense():
    from kvlm.config import ModelConfig

    cfg = ModelConfig("llama", 10, 8, 16, 1, 2, 1, 4, 1e-6, 1e4, 64, False)
    with pytest.raises(InvalidRequestError):
        CacheSpec.for_model(cfg, 0)
