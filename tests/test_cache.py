"""The cache protocol, mode by mode, without a model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlm.cache import (
    CACHE_MODES,
    CacheFileError,
    CacheSpec,
    create_cache,
    load_cache,
    planned_nbytes,
    save_cache,
)
from kvlm.cache.base import causal_mask
from kvlm.cache.storage import key_rotation
from kvlm.errors import CacheOverflowError, InvalidRequestError
from numerics import attention_bound, gamma, int8_row_error, product_bound

SPEC = CacheSpec(
    num_layers=2, num_kv_heads=2, head_dim=4, max_tokens=8, block_size=4, window=4, sinks=1
)
STATEFUL = ["basic", "contiguous", "paged", "int8", "window"]
DENSE = ["basic", "contiguous", "paged", "int8"]  # hold every token in order
FLOAT_DENSE = ["basic", "contiguous", "paged"]


def kv(n: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 2, n, 4)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def feed(cache, n: int, seed: int):
    """One 'forward' of n tokens through every layer; returns what each layer saw."""
    step = cache.begin(n)
    seen = [step.update(layer, *kv(n, seed * 10 + layer, cache.batch)) for layer in range(2)]
    cache.commit(step)
    return step, seen


def storage(cache) -> list[torch.Tensor]:
    """Every tensor a cache keeps, for before/after comparisons."""
    if cache.mode == "basic":
        return [t for t in cache.kv if t is not None]
    store = cache.pool.store if hasattr(cache, "pool") else getattr(cache, "store", None)
    if store is None:
        return []
    return [store.values] + ([store.scales] if store.scales is not None else [])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a pool's unallocated blocks may hold NaN patterns)."""
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(InvalidRequestError, match="valid modes: off, basic, contiguous, paged"):
        create_cache("paged-ish", SPEC)


def test_every_mode_is_registered():
    assert set(CACHE_MODES) == {"off", "basic", "contiguous", "paged", "int8", "window"}


@pytest.mark.parametrize("mode", FLOAT_DENSE)
def test_history_is_returned_in_order(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 3, seed=1)
    _, seen = feed(cache, 2, seed=2)
    k_all, v_all = seen[0]
    assert k_all.shape == (1, 2, 5, 4)
    assert torch.equal(k_all[:, :, :3], kv(3, 10)[0])
    assert torch.equal(k_all[:, :, 3:], kv(2, 20)[0])
    assert torch.equal(v_all[:, :, 3:], kv(2, 20)[1])
    assert cache.num_tokens == 5


def test_positions_come_from_the_cache():
    cache = create_cache("contiguous", SPEC)
    step, _ = feed(cache, 3, seed=1)
    assert step.positions.tolist() == [[0, 1, 2]]
    cache.fork(2)
    assert cache.begin(2).positions.tolist() == [[3, 4], [3, 4]]


def test_off_cache_holds_nothing():
    cache = create_cache("off", SPEC)
    step, seen = feed(cache, 5, seed=1)
    assert cache.num_tokens == 0 and cache.nbytes == 0
    assert step.is_causal and step.mask is None
    assert seen[0][0].shape[2] == 5
    with pytest.raises(CacheFileError, match="keeps no cache"):
        cache.snapshot()


@pytest.mark.parametrize("mode", ["off", *DENSE])
def test_overflow_is_refused_before_any_write(mode):
    cache = create_cache(mode, SPEC)
    if mode != "off":
        feed(cache, 6, seed=1)
    before = [t.clone() for t in storage(cache)]
    tables = [list(t) for t in getattr(cache, "tables", [])]
    too_many = SPEC.max_tokens - cache.num_tokens + 1
    assert cache.would_overflow(too_many)
    with pytest.raises(CacheOverflowError, match="exceed the cache capacity of 8"):
        cache.begin(too_many)
    assert cache.num_tokens == (6 if mode != "off" else 0)
    assert all(same_bytes(a, b) for a, b in zip(before, storage(cache), strict=True))
    assert [list(t) for t in getattr(cache, "tables", [])] == tables


def test_paged_pool_exhaustion_is_refused_before_any_allocation():
    cache = create_cache("paged", replace(SPEC, num_blocks=3, max_tokens=16))
    feed(cache, 6, seed=1)  # 2 blocks
    cache.fork(2)  # shares them
    free_before = cache.pool.num_free
    assert not cache.would_overflow(2)  # row 0 copies the shared partial block, row 1 writes
    # 9 tokens: a copy of the shared partial block + 1 new block per row = 3 > 1 free
    with pytest.raises(CacheOverflowError, match="out of blocks: this step needs 3, 1 of 3"):
        cache.begin(3)
    assert cache.pool.num_free == free_before and cache.tables == [[0, 1], [0, 1]]


@pytest.mark.parametrize("mode", STATEFUL)
def test_a_forward_that_raises_changes_nothing(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 3, seed=1)
    step = cache.begin(2)
    step.update(0, *kv(2, 5))  # layer 0 written, then the forward dies
    assert cache.num_tokens == 3
    step2, seen = feed(cache, 1, seed=7)  # the next forward starts where the cache really is
    assert step2.positions.tolist() == [[3]]
    if mode in FLOAT_DENSE:
        assert seen[0][0].shape[2] == 4
        assert torch.equal(seen[0][0][:, :, 3:], kv(1, 70)[0])
    with pytest.raises(RuntimeError, match="stale"):
        cache.commit(step)


@pytest.mark.parametrize("mode", FLOAT_DENSE)
def test_rollback_then_rewrite(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 5, seed=1)
    cache.rollback(2)
    assert cache.num_tokens == 3
    _, seen = feed(cache, 2, seed=9)
    k_all = seen[0][0]
    assert k_all.shape[2] == 5
    assert torch.equal(k_all[:, :, :3], kv(5, 10)[0][:, :, :3])
    assert torch.equal(k_all[:, :, 3:], kv(2, 90)[0])
    with pytest.raises(InvalidRequestError):
        cache.rollback(6)
    with pytest.raises(InvalidRequestError):
        cache.rollback(-1)
    cache.reset()
    assert cache.num_tokens == 0


@pytest.mark.parametrize("mode", list(CACHE_MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_nbytes_is_exact_and_matches_the_planner(mode, dtype):
    """The bytes a cache holds after 2 sequences of 6 tokens are what `kvlm memory` plans."""
    spec = replace(SPEC, dtype=dtype)
    if mode == "basic" and dtype == torch.int8:
        with pytest.raises(InvalidRequestError, match="int8 needs"):
            create_cache(mode, spec)
        return
    cache = create_cache(mode, spec)
    feed(cache, 6, seed=1)
    cache.fork(2)  # paged: shares the blocks; so write one token to un-share the tail
    feed(cache, 1, seed=2)
    if mode == "paged" or mode == "int8":
        # 7 tokens = 2 blocks per row; the first is shared, so 3 distinct blocks
        assert cache.blocks_used == 3
        expected = 3 * cache.pool.block_nbytes
    else:
        expected = planned_nbytes(mode, spec, 7, 2)
    assert cache.nbytes == expected
    fresh = create_cache(mode, spec)
    for _ in range(1):
        feed(fresh, 7, seed=3)
    assert fresh.nbytes == planned_nbytes(mode, spec, 7, 1)


def test_bytes_per_token_counts_int8_scales():
    fp32 = SPEC.bytes_per_token
    assert fp32 == 2 * 2 * 2 * 4 * 4
    int8 = replace(SPEC, dtype=torch.int8, head_dim=64).bytes_per_token
    assert int8 == 2 * 2 * 2 * (64 + 4)  # an fp16 step and zero point per token and head


@pytest.mark.parametrize("mode", ["contiguous", "paged", "window"])
def test_narrow_cache_dtype(mode):
    """A bf16 cache stores bf16 and hands fp32 back to an fp32 model."""
    cache = create_cache(mode, replace(SPEC, dtype=torch.bfloat16))
    step = cache.begin(3)
    k, v = kv(3, 1)
    k_all, _ = step.update(0, k, v)
    assert k_all.dtype == torch.float32
    assert torch.equal(k_all[:, :, -3:], k.to(torch.bfloat16).float())


def test_paged_fork_shares_blocks_and_copies_on_write():
    cache = create_cache("paged", SPEC)
    feed(cache, 6, seed=1)  # blocks 0 (full) and 1 (partial, 2 of 4 slots)
    assert cache.tables == [[0, 1]]
    cache.fork(3)
    assert cache.tables == [[0, 1]] * 3 and cache.pool.refs[:2] == [3, 3]
    assert cache.blocks_used == 2  # nothing copied
    _, seen = feed(cache, 1, seed=2)
    # rows 0 and 1 copied the shared partial block; row 2, its last holder, wrote in place
    assert cache.tables == [[0, 2], [0, 3], [0, 1]]
    assert cache.pool.refs[:4] == [3, 1, 1, 1]
    prefix = kv(6, 10)[0]
    for row in range(3):
        assert torch.equal(seen[0][0][row, :, :6], prefix[0])
    cache.free()
    assert cache.pool.num_free == cache.pool.num_blocks


def test_paged_frees_tail_blocks_first():
    cache = create_cache("paged", SPEC)
    feed(cache, 8, seed=1)  # blocks 0, 1
    cache.free()
    assert list(cache.pool.free_queue)[-2:] == [1, 0]  # the tail is evicted first


def test_paged_waste_accounting():
    cache = create_cache("paged", replace(SPEC, max_tokens=64))
    feed(cache, 9, seed=1)  # 3 blocks of 4 = 12 slots for 9 tokens
    assert cache.blocks_used == 3 and cache.tokens_stored == 9
    assert cache.waste == pytest.approx(3 / 12)
    cache.fork(2)  # shared: still 9 distinct tokens in 3 blocks
    assert cache.tokens_stored == 9 and cache.waste == pytest.approx(3 / 12)


def test_window_memory_stays_constant_past_its_size():
    cache = create_cache("window", SPEC)  # 1 sink + 4 recent
    start = cache.nbytes
    for i in range(20):
        feed(cache, 1 if i else 3, seed=i)
        assert cache.nbytes == start
    assert cache.num_tokens == 22 and not cache.would_overflow(10**6)
    assert sorted(cache.slot_pos.tolist()) == [0, 18, 19, 20, 21]


@pytest.mark.parametrize("positions", ["cache", "absolute"])
def test_window_rollback_is_refused_once_it_would_need_evicted_tokens(positions):
    cache = create_cache("window", replace(SPEC, window_positions=positions))
    feed(cache, 4, seed=1)
    cache.rollback(3)  # nothing evicted yet: exact
    feed(cache, 8, seed=2)  # 9 tokens > 5 slots: the ring has wrapped
    cache.rollback(1)
    with pytest.raises(InvalidRequestError, match="evicted"):
        cache.rollback(2)


@pytest.mark.parametrize("mode", STATEFUL)
def test_snapshot_restore(mode):
    cache = create_cache(mode, SPEC)
    feed(cache, 3, seed=1)
    snap = cache.snapshot()
    feed(cache, 2, seed=2)
    cache.restore(snap)
    assert cache.num_tokens == 3
    _, after = feed(cache, 1, seed=3)
    fresh = create_cache(mode, SPEC)
    feed(fresh, 3, seed=1)
    _, want = feed(fresh, 1, seed=3)
    assert torch.equal(after[1][0], want[1][0])


@pytest.mark.parametrize("src", FLOAT_DENSE)
@pytest.mark.parametrize("dst", FLOAT_DENSE)
def test_files_round_trip_across_dense_modes(tmp_path, src, dst):
    a = create_cache(src, SPEC)
    feed(a, 5, seed=1)
    a.fork(2)
    path = tmp_path / "c.kv"
    save_cache(a, path, "fp-1", extra={"note": "hi"})
    b = create_cache(dst, SPEC)
    assert load_cache(b, path, "fp-1") == {"note": "hi"}
    assert (b.num_tokens, b.batch) == (5, 2)
    _, got = feed(b, 1, seed=2)
    _, want = feed(a, 1, seed=2)
    assert torch.equal(got[1][0], want[1][0])


def test_cache_files_refuse_what_does_not_fit(tmp_path):
    a = create_cache("contiguous", SPEC)
    feed(a, 5, seed=1)
    path = tmp_path / "c.kv"
    save_cache(a, path, "model-A")
    with pytest.raises(CacheFileError, match="another model"):
        load_cache(create_cache("contiguous", SPEC), path, "model-B")
    with pytest.raises(CacheFileError, match="does not match this model"):
        load_cache(create_cache("contiguous", replace(SPEC, num_kv_heads=4)), path, "model-A")
    with pytest.raises(CacheFileError, match="same --kv-dtype"):
        load_cache(create_cache("contiguous", replace(SPEC, dtype=torch.bfloat16)), path, "model-A")
    with pytest.raises(CacheFileError, match="cannot be restored into --kv window"):
        load_cache(create_cache("window", SPEC), path, "model-A")
    with pytest.raises(CacheFileError, match="more than this cache's capacity"):
        load_cache(create_cache("contiguous", replace(SPEC, max_tokens=4)), path, "model-A")
    broken = tmp_path / "broken.kv"
    broken.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CacheFileError, match="not a readable cache file"):
        load_cache(create_cache("contiguous", SPEC), broken, "model-A")
    with pytest.raises(CacheFileError, match="not found"):
        load_cache(create_cache("contiguous", SPEC), tmp_path / "nope.kv", "model-A")


def test_tampered_cache_file_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    a = create_cache("contiguous", SPEC)
    feed(a, 5, seed=1)
    path = tmp_path / "c.kv"
    save_cache(a, path, "m")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    tensors["values"] = tensors["values"][:, :, :, :, :3].contiguous()  # length mismatch
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CacheFileError, match="damaged"):
        load_cache(create_cache("contiguous", SPEC), path, "m")


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
    for bad in ({"max_tokens": 0}, {"block_size": 0}, {"window": -1}, {"sinks": -1}):
        with pytest.raises(InvalidRequestError):
            CacheSpec.for_model(cfg, **{"max_tokens": 8, **bad})


def test_int8_round_trip_stays_within_its_bound():
    from kvlm.cache.storage import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    rows = torch.cat(
        [
            torch.randn(64, 64, generator=g) * 3,
            torch.randn(16, 64, generator=g) + 50,  # offset rows, as some K channels are
            torch.full((4, 64), 7.25),  # constant
            torch.zeros(4, 64),
            torch.randn(4, 64, generator=g) * 1e-6,
            torch.randn(4, 64, generator=g) * 1e4,
        ]
    )
    q, params = quantize(rows)
    assert q.dtype == torch.int8 and params.shape == (rows.shape[0], 2)
    back = dequantize(q, params, torch.float32)
    assert ((back - rows).abs() <= int8_row_error(rows)).all()
    assert torch.equal(back[80:88], rows[80:88])  # constant and zero rows come back exactly


@pytest.mark.parametrize("head_dim", [64, 128, 80, 8])
def test_key_rotation_is_orthonormal(head_dim):
    r = key_rotation(head_dim)
    # Hadamard (a power of two): entries +-1/sqrt(D) rounded, so R R^T is I up to a D-term
    # product's rounding; QR (others): orthogonal to gamma_{D*D} (Householder QR, Higham 19.3)
    bound = product_bound(r, r) + (0 if head_dim & (head_dim - 1) == 0 else gamma(head_dim**2))
    assert ((r @ r.T - torch.eye(head_dim)).abs() <= bound).all()
    assert torch.equal(r, key_rotation(head_dim))  # deterministic: files stay readable


@pytest.mark.parametrize(
    ("mode", "positions"),
    [("int8", None), ("contiguous", None), ("window", "absolute"), ("window", "cache")],
)
def test_int8_attention_with_rotated_queries_matches_full_precision(mode, positions):
    """An int8 cache returns K rotated and asks for rotated queries: attention over it is
    attention over the original keys, up to quantization error. A window with positions
    inside the cache returns K before RoPE, so back in the plain basis, and asks nothing."""
    spec = replace(SPEC, dtype=torch.int8, head_dim=64, max_tokens=32, window=32)
    cache = create_cache(mode, replace(spec, window_positions=positions or "cache"))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 20, 64, generator=g) + torch.linspace(-3, 3, 64)  # offsets + outliers
    v = torch.randn(1, 2, 20, 64, generator=g)
    step = cache.begin(20)
    k_all, v_all = step.update(0, k, v)
    assert (step.key_rotation is None) == (positions == "cache")
    q = torch.randn(1, 2, 20, 64, generator=g)
    q_in = q if step.key_rotation is None else q @ step.key_rotation
    got = torch.nn.functional.scaled_dot_product_attention(
        q_in, k_all, v_all, attn_mask=step.mask, is_causal=step.is_causal
    )
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # K stored as int8 rows of k R (R orthonormal: the 2-norm of a key's error is at most
    # sqrt(D) times its largest element error); V as int8 rows, whose error the softmax
    # weights (summing to 1) pass on at most whole
    k_err = 64**0.5 * float(int8_row_error(k @ key_rotation(64)).max())
    bound = attention_bound(q, k, v, k_err=k_err) + float(int8_row_error(v).max())
    assert (got - want).abs().max() <= bound
