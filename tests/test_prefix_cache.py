"""The block manager and prefix cache: exact block ids, sharing, eviction order (as vLLM's
tests/v1/core/test_prefix_caching.py asserts them)."""

from __future__ import annotations

import pytest
import torch

from kvlm.cache.base import CacheSpec
from kvlm.cache.paged import BlockPool
from kvlm.cache.prefix import BlockManager, chain_hash

BS = 4


def manager(num_blocks: int = 10, prefix_caching: bool = True) -> BlockManager:
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, max_tokens=64, block_size=BS)
    return BlockManager(BlockPool(spec, num_blocks), prefix_caching)


def fill(m: BlockManager, table, tokens: list[int]) -> None:
    """Pretend the model computed every token: seal the full blocks."""
    m.seal(table, tokens, len(tokens))


def test_fresh_allocation_takes_blocks_in_queue_order():
    m = manager()
    table, cached = m.allocate(list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert table.blocks == [0, 1, 2] and cached == 0
    assert m.pool.num_free == 7
    assert [m.pool.refs[b] for b in range(4)] == [1, 1, 1, 0]


def test_full_blocks_are_registered_with_chained_hashes():
    m = manager()
    tokens = list(range(10))
    table, _ = m.allocate(tokens)
    fill(m, table, tokens)
    h0 = chain_hash(None, (0, 1, 2, 3))
    h1 = chain_hash(h0, (4, 5, 6, 7))
    assert table.hashes == [h0, h1]  # the partial third block has no hash
    assert m.pool.cached == {h0: 0, h1: 1}


def test_a_shared_prefix_is_taken_not_recomputed():
    m = manager()
    a = list(range(10))
    ta, _ = m.allocate(a)
    fill(m, ta, a)
    b = [*list(range(8)), 50, 51, 52]
    tb, cached = m.allocate(b)
    assert cached == 8
    assert tb.blocks == [0, 1, 3]  # the two full blocks shared, one fresh
    assert m.pool.refs[0] == m.pool.refs[1] == 2
    assert m.stats.queries == 21 and m.stats.hits == 8


def test_lookup_never_covers_the_last_token():
    m = manager()
    tokens = list(range(8))
    t, _ = m.allocate(tokens)
    fill(m, t, tokens)
    again, cached = m.allocate(tokens)  # all 8 cached, but the 8th must be fed for logits
    assert cached == 4
    assert again.blocks[0] == 0 and again.blocks[1] != 1


def test_a_hash_hit_with_other_tokens_is_refused():
    m = manager()
    tokens = list(range(8))
    t, _ = m.allocate(tokens)
    fill(m, t, tokens)
    m.pool.block_tokens[0] = (9, 9, 9, 9)  # as if another prefix had collided on h0
    _, cached = m.allocate([*tokens, 8])
    assert cached == 0


def test_freed_blocks_stay_findable_until_evicted_tail_first():
    m = manager(num_blocks=6)
    a = list(range(12))  # 3 full blocks
    ta, _ = m.allocate([*a, 99])  # 4 blocks: 0 1 2 3
    fill(m, ta, [*a, 99])
    m.free(ta)
    # Tail first: 3, 2, 1, 0 join the free queue after the never-used 4 and 5.
    assert list(m.pool.free_queue) == [4, 5, 3, 2, 1, 0]
    assert m.pool.num_used == 0
    # A new request sharing the prefix takes its blocks back out of the queue.
    tb, cached = m.allocate([*a[:8], 70, 71])
    assert cached == 8 and tb.blocks == [0, 1, 4]
    assert list(m.pool.free_queue) == [5, 3, 2]
    m.free(tb)
    # Unrelated requests evict the least recently freed cached block first: 3 (no hash,
    # the partial block), then 2 (the third full block), then the prefix.
    tc, _ = m.allocate([500 + i for i in range(12)])
    assert tc.blocks == [5, 3, 2]
    assert m.pool.evictions == 1  # block 2 held a hash; 5 and 3 did not
    h0 = chain_hash(None, (0, 1, 2, 3))
    h1 = chain_hash(h0, (4, 5, 6, 7))
    assert chain_hash(h1, (8, 9, 10, 11)) not in m.pool.cached  # block 2's is gone
    td, cached = m.allocate([*a[:8], 99])
    assert cached == 8 and td.blocks == [0, 1, 4]  # blocks 0 and 1 survived


def test_blocks_to_admit_counts_revived_blocks():
    m = manager(num_blocks=4)
    a = list(range(9))
    ta, _ = m.allocate(a)
    fill(m, ta, a)
    m.free(ta)
    # 3 blocks: 2 cached (free, so taking them still uses up free blocks) + 1 new.
    assert m.blocks_to_admit(a) == 3
    assert m.can_admit(a) and not m.can_admit(a, reserve=2)


def test_prefix_caching_off_never_matches():
    m = manager(prefix_caching=False)
    tokens = list(range(9))
    t, _ = m.allocate(tokens)
    fill(m, t, tokens)
    _, cached = m.allocate(tokens)
    assert cached == 0 and not m.pool.cached


def test_append_slot_adds_a_block_at_a_boundary_and_copies_a_shared_one():
    m = manager()
    tokens = list(range(6))
    parent, _ = m.allocate(tokens)  # blocks 0, 1 (1 partial)
    m.pool.store.values[0, 0, 1, 0, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    child = m.fork(parent)
    assert m.pool.refs[0] == m.pool.refs[1] == 2
    assert m.can_append(child, 6)
    m.append_slot(child, 6)  # writes into shared block 1: copy on write
    assert child.blocks == [0, 2] and parent.blocks == [0, 1]
    assert torch.equal(m.pool.store.values[0, 0, 2, 0, :2], m.pool.store.values[0, 0, 1, 0, :2])
    assert m.pool.refs[1] == 1
    m.append_slot(parent, 6)  # now the parent's alone: in place
    assert parent.blocks == [0, 1]
    m.append_slot(parent, 8)  # position 8 starts a third block
    assert parent.blocks == [0, 1, 3]


def test_pool_exhaustion_is_reported_not_raised_by_can_checks():
    m = manager(num_blocks=2)
    t, _ = m.allocate(list(range(8)))
    assert not m.can_append(t, 8)
    assert not m.can_admit([1, 2])
    with pytest.raises(RuntimeError):
        m.allocate([1, 2])
