"""Property test: random append / rollback / fork / snapshot / restore / free sequences on
every stateful mode, against the `basic` cache as the reference.

- exact modes (contiguous, paged): every layer's attention inputs equal the reference's,
  bit for bit;
- int8 (paged and contiguous layouts): each element within the bound stated in
  kvlm.cache.storage (about half a quantization step of its row);
- window (float and int8, RoPE positions inside the cache or absolute): attention outputs
  equal the reference's attention with the sinks + window mask, the cache's bytes never
  change, and in-cache positions keep every distance among ring and new tokens, put the
  sinks at 0..S-1 and stay below S + W + n_new (kvlm.cache.window);
- paged: after every step each block's reference count equals the number of table
  entries naming it, the free queue holds exactly the unreferenced blocks (no leak, no
  double free), and free() gives every block back.

`off` stores nothing by definition; it is checked end to end against the others.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlm.cache import CacheSpec, create_cache
from kvlm.errors import InvalidRequestError
from numerics import attention_bound, int8_row_error

LAYERS, HEADS, HEAD_DIM = 2, 2, 8
SPEC = CacheSpec(
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    max_tokens=24,
    block_size=4,
    window=5,
    sinks=2,
)
MAX_BATCH = 4
CONFIGS = {
    "contiguous": ("contiguous", torch.float32),
    "paged": ("paged", torch.float32),
    "int8": ("int8", torch.float32),
    "contiguous-int8": ("contiguous", torch.int8),
    "window": ("window", torch.float32),  # positions inside the cache (the default)
    "window-int8": ("window", torch.int8),
    "window-absolute": ("window", torch.float32, "absolute"),
    "window-int8-absolute": ("window", torch.int8, "absolute"),
}


def random_kv(batch: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, n, HEAD_DIM)
    return torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g) * 3


def window_mask(q_start: int, n_new: int, n_keys: int) -> torch.Tensor:
    q = torch.arange(q_start, q_start + n_new)[:, None]
    k = torch.arange(n_keys)[None, :]
    return (k <= q) & ((k < SPEC.sinks) | (q - k < SPEC.window))


def int8_bound(x: torch.Tensor) -> torch.Tensor:
    """kvlm.cache.storage's stated bound for one int8 element."""
    return int8_row_error(x)


def int8_bound_unrotated(k: torch.Tensor) -> torch.Tensor:
    """The bound for one element of K stored as int8 in the rotated basis k R and turned back
    with R^T (a window with positions inside the cache): the row's error e R^T has the norm
    of e, so each element is within ||e||_2 <= sqrt(D) bound(k R) (one bound per row), plus
    the fp32 rounding of the two D-term products (D 2^-24 sum |k R| each, |R_ij| <= 1)."""
    from kvlm.cache.storage import key_rotation

    d = k.shape[-1]
    kr = k @ key_rotation(d)
    b = int8_bound(kr)  # (..., 1)
    fp32 = 2 * d * 2**-24 * (kr.abs() + b).sum(-1, keepdim=True)
    return b * d**0.5 + fp32


def make_machine(mode: str, dtype: torch.dtype, positions: str = "cache"):
    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            from dataclasses import replace

            self.cache = create_cache(mode, replace(SPEC, dtype=dtype, window_positions=positions))
            # the window never fills: give its reference room to run well past the ring
            ref_len = 8 * SPEC.max_tokens if mode == "window" else SPEC.max_tokens
            self.ref = create_cache("basic", replace(SPEC, max_tokens=ref_len))
            self.snaps: list = []
            self.seed = 0
            self.initial_bytes = self.cache.nbytes

        @rule(n=st.integers(1, 6))
        def append(self, n: int) -> None:
            if self.ref.would_overflow(n):
                return
            if self.cache.would_overflow(n):
                assert mode != "window"
                return
            step, ref_step = self.cache.begin(n), self.ref.begin(n)
            for layer in range(LAYERS):
                self.seed += 1
                k, v = random_kv(self.cache.batch, n, self.seed)
                got = step.update(layer, k, v)
                want = ref_step.update(layer, k, v)
                self.compare(step, ref_step, got, want, n)
            self.cache.commit(step)
            self.ref.commit(ref_step)

        def compare(self, step, ref_step, got, want, n: int) -> None:
            if mode == "window":
                self.compare_window(step, ref_step, got, want, n)
                return
            want = self.as_stored(step, want)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape
                self.assert_rows_equal(g, w)

        @staticmethod
        def as_stored(step, kv):
            """int8 caches return keys rotated by step.key_rotation (queries follow), and a
            quantized V by step.value_rotation (the output turned back)."""
            k, v = kv
            k = k if step.key_rotation is None else k @ step.key_rotation
            return (k, v if step.value_rotation is None else v @ step.value_rotation)

        def assert_rows_equal(self, got: torch.Tensor, want: torch.Tensor) -> None:
            if dtype == torch.int8 or mode == "int8":
                assert ((got - want).abs() <= int8_bound(want)).all()
            else:
                assert torch.equal(got, want)

        def compare_window(self, step, ref_step, got, want, n: int) -> None:
            """Each key the window returns is the reference's key at the position it claims,
            the mask is the sinks + window rule on those positions, and every key that rule
            makes visible is there."""
            pos = step.key_positions
            held = pos >= 0
            unrotated = dtype == torch.int8 and step.key_rotation is None  # K before RoPE
            for i, (g, w) in enumerate(zip(got, self.as_stored(step, want), strict=True)):
                g, w = g[:, :, held], w[:, :, pos[held]]
                if i == 0 and unrotated:
                    assert ((g - w).abs() <= int8_bound_unrotated(w)).all()
                else:
                    self.assert_rows_equal(g, w)
            self.check_positions(step, n)
            expected = window_mask(ref_step.start, n, ref_step.start + n)  # over 0..n_keys-1
            rule = torch.zeros_like(step.mask)
            rule[:, held] = expected[:, pos[held]]
            assert torch.equal(step.mask, rule)
            assert int(step.mask.sum()) == int(expected.sum())  # nothing needed is missing
            if dtype == torch.float32:  # and so attention itself agrees
                g = torch.Generator().manual_seed(self.seed)
                q = torch.randn(self.cache.batch, HEADS, n, HEAD_DIM, generator=g)
                out = F.scaled_dot_product_attention(q, *got, attn_mask=step.mask)
                ref = F.scaled_dot_product_attention(q, *want, attn_mask=expected)
                # the same keys (equal values) in another layout and order, plus masked ones
                assert (out - ref).abs().max() <= attention_bound(q, *want)

        def check_positions(self, step, n: int) -> None:
            """In-cache RoPE positions: sinks at their own, every distance between a query and
            a ring or new key it sees is the absolute one, and all below S + W + n_new."""
            q_abs = torch.arange(step.start, step.start + n)
            if positions == "absolute":
                assert step.key_rope_positions is None
                assert torch.equal(step.positions[0], q_abs)
                return
            q_at, k_at, k_abs = step.positions[0], step.key_rope_positions, step.key_positions
            sees = step.mask
            assert int(q_at.max()) < SPEC.sinks + SPEC.window + n
            assert int(k_at[sees.any(0)].max()) < SPEC.sinks + SPEC.window + n
            sink = (k_abs >= 0) & (k_abs < SPEC.sinks)
            assert torch.equal(k_at[sink], k_abs[sink])
            ring = sees & ~sink[None, :]
            dist_at = q_at[:, None] - k_at[None, :]
            dist_abs = q_abs[:, None] - k_abs[None, :]
            assert torch.equal(dist_at[ring], dist_abs[ring])
            if step.start < SPEC.sinks + SPEC.window:  # the ring has not dropped anything yet
                assert torch.equal(q_at, q_abs)
                assert torch.equal(k_at[k_abs >= 0], k_abs[k_abs >= 0])

        @rule(n=st.integers(0, 8))
        def rollback(self, n: int) -> None:
            n = min(n, self.ref.num_tokens)
            try:
                self.cache.rollback(n)
            except InvalidRequestError:
                # Only a window refuses, when the next query would need an evicted token. A
                # rollback it wrongly accepted fails the next append's attention check.
                assert mode == "window" and n >= 1
                return
            self.ref.rollback(n)

        @precondition(lambda self: self.cache.batch * 2 <= MAX_BATCH)
        @rule(n=st.integers(2, 3))
        def fork(self, n: int) -> None:
            if self.cache.batch * n > MAX_BATCH:
                return
            self.cache.fork(n)
            self.ref.fork(n)

        @rule()
        def snapshot(self) -> None:
            self.snaps = [*self.snaps[-2:], (self.cache.snapshot(), self.ref.snapshot())]

        @precondition(lambda self: self.snaps)
        @rule(i=st.integers(0, 2))
        def restore(self, i: int) -> None:
            snap, ref_snap = self.snaps[i % len(self.snaps)]
            self.cache.restore(snap)
            self.ref.restore(ref_snap)

        @rule()
        def free(self) -> None:
            self.cache.free()
            self.ref.free()
            if hasattr(self.cache, "pool"):
                pool = self.cache.pool
                assert pool.num_free == pool.num_blocks and not any(pool.refs)

        @invariant()
        def same_shape(self) -> None:
            assert self.cache.num_tokens == self.ref.num_tokens
            assert self.cache.batch == self.ref.batch

        @invariant()
        def pool_is_consistent(self) -> None:
            if not hasattr(self.cache, "pool"):
                return
            pool, tables = self.cache.pool, self.cache.tables
            named = [b for table in tables for b in table]
            for block in range(pool.num_blocks):
                assert pool.refs[block] == named.count(block), block
                assert (block in pool.free_queue) == (pool.refs[block] == 0), block
            assert pool.num_free + len(set(named)) == pool.num_blocks
            assert all(len(t) == -(-self.cache.num_tokens // SPEC.block_size) for t in tables)

        @invariant()
        def window_memory_is_constant(self) -> None:
            if mode == "window" and self.cache.batch == SPEC.batch:
                assert self.cache.nbytes == self.initial_bytes

    CacheMachine.__name__ = f"CacheMachine_{mode}_{dtype}_{positions}"
    return CacheMachine


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_mode_matches_basic_reference(name):
    machine = make_machine(*CONFIGS[name])
    machine.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
