"""The block manager and prefix cache: exact block ids, sharing, eviction order (as vLLM's
tests/v1/core/test_prefix_caching.py asserts them); keys, the chain check under forced
collisions, cache salts."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
import torch

from kvlm.cache import prefix
from kvlm.cache.base import CacheSpec
from kvlm.cache.paged import BlockPool
from kvlm.cache.prefix import MAX_SALT_CHARS, BlockManager, block_key, check_salt, root_key

BS = 4


def chain_hash(parent: bytes | None, tokens: list[int] | tuple[int, ...]) -> bytes:
    """The key of a full block after `parent` (None: the first block, without a salt;
    root_key(salt) for a salted first block)."""
    return block_key(root_key(None) if parent is None else parent, tuple(tokens))


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
    assert m.pool.prefix.cached == {h0: 0, h1: 1}


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
    m.pool.prefix.block_tokens[0] = (9, 9, 9, 9)  # as if another prefix had collided on h0
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
    assert m.pool.prefix.evictions == 1  # block 2 held a hash; 5 and 3 did not
    h0 = chain_hash(None, (0, 1, 2, 3))
    h1 = chain_hash(h0, (4, 5, 6, 7))
    assert chain_hash(h1, (8, 9, 10, 11)) not in m.pool.prefix.cached  # block 2's is gone
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
    assert cached == 0 and not m.pool.prefix.cached


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


# ---------------------------------------------------------------------- keys, chain, salt


def test_keys_are_sha256_over_fixed_width_fields():
    root = hashlib.sha256(b"kvlm/prefix/v1\x00").digest()
    h0 = hashlib.sha256(root + struct.pack("<4I", 0, 1, 2, 3)).digest()
    assert chain_hash(None, (0, 1, 2, 3)) == h0 and len(h0) == 32
    assert (
        chain_hash(h0, [4, 5, 6, 7]) == hashlib.sha256(h0 + struct.pack("<4I", 4, 5, 6, 7)).digest()
    )
    salted = hashlib.sha256(b"kvlm/prefix/v1\x01" + (2).to_bytes(4, "little") + b"ab").digest()
    assert root_key("ab") == salted and root_key(None) == root
    assert len({root_key(None), root_key("a"), root_key("ab"), root_key("\ud800")}) == 4


def test_keys_are_the_same_in_another_process():
    """Not Python's hash(): seeded per process for str (a salt), and predictable for ints."""
    code = (
        "from kvlm.cache.prefix import block_key, root_key;"
        "print(block_key(block_key(root_key('tenant'), (0, 1, 2, 3)), (4, 5, 6, 7)).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    here = block_key(block_key(root_key("tenant"), (0, 1, 2, 3)), (4, 5, 6, 7))
    assert out.stdout.strip() == here.hex()


def test_a_colliding_key_after_another_parent_is_a_miss():
    """A key that leads to a block with the right tokens after the wrong parent (as a
    collision would): the token check alone serves it; the parent link refuses it."""
    m = manager()
    a = [0, 1, 2, 3, 4, 5, 6, 7, 8]  # blocks 0 1 2: a0 = (0..3), shared block (4..7)
    ta, _ = m.allocate(a)
    fill(m, ta, a)
    b = [9, 9, 9, 9, 50, 51, 52, 53, 8]  # blocks 3 4 5: b0 = (9, 9, 9, 9)
    tb, _ = m.allocate(b)
    fill(m, tb, b)
    b0 = chain_hash(None, (9, 9, 9, 9))
    m.pool.prefix.cached[chain_hash(b0, (4, 5, 6, 7))] = 1  # b0 then (4..7) "collides" with a's
    tc, cached = m.allocate([9, 9, 9, 9, 4, 5, 6, 7, 8])
    assert cached == 4 and tc.blocks == [3, 6, 7]  # b0 shared; block 1 (after a0) refused


def test_a_forced_collision_after_another_parent_is_a_miss(monkeypatch):
    """The same as above through the key function: (4..7) after b0 keys like (4..7) after
    a0. Same tokens, other parent: a miss."""
    real = prefix.block_key
    a0, b0 = real(root_key(None), (0, 1, 2, 3)), real(root_key(None), (9, 9, 9, 9))

    def colliding(parent, tokens):
        return real(a0 if parent == b0 else parent, tokens)

    monkeypatch.setattr(prefix, "block_key", colliding)
    m = manager()
    for tokens in ([0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 50, 51, 52, 53, 8]):
        table, _ = m.allocate(tokens)  # blocks 0 1 2, then 3 4 5
        fill(m, table, tokens)
    tc, cached = m.allocate([9, 9, 9, 9, 4, 5, 6, 7, 8])
    assert cached == 4 and tc.blocks == [3, 6, 7]


def test_with_every_key_colliding_only_the_true_prefix_is_served(monkeypatch):
    monkeypatch.setattr(prefix, "block_key", lambda parent, tokens: b"\x00" * 32)
    m = manager()
    a = list(range(9))
    ta, _ = m.allocate(a)
    fill(m, ta, a)
    assert m.pool.prefix.cached == {b"\x00" * 32: 0}  # block 1's key was taken by block 0
    assert m.match(a)[0] == [0]  # block 0 again; block 1 is not (4..7)
    assert m.match([*a[4:8], *a[:4], 9])[0] == []  # (0..3) as a second block: no
    assert m.match(a, salt="t")[0] == []  # (0..3) first, but under another salt: no


def test_a_block_after_a_parent_that_lost_a_collision_is_never_registered(monkeypatch):
    """x0 and y0 collide: y0 cannot take the key, so y1 (computed after y0) must not be
    found after x0, which a check of the parent's key alone would allow."""
    real = prefix.block_key
    x0, y0 = (0, 1, 2, 3), (5, 5, 5, 5)

    def colliding(parent, tokens):
        return real(parent, x0 if tokens == y0 and parent == root_key(None) else tokens)

    monkeypatch.setattr(prefix, "block_key", colliding)
    m = manager()
    tx, _ = m.allocate([*x0, 9])
    fill(m, tx, [*x0, 9])  # block 0 holds the key of x0 (and y0)
    y = [*y0, 20, 21, 22, 23, 9]
    ty, _ = m.allocate(y)  # blocks 2 3 4
    fill(m, ty, y)
    assert m.pool.prefix.cached == {chain_hash(None, x0): 0}  # neither 2 nor 3 registered
    tz, cached = m.allocate([*x0, 20, 21, 22, 23, 9])
    assert cached == 4 and tz.blocks == [0, 5, 6]


def test_a_prefix_computed_twice_at_once_still_links_the_blocks_after_it():
    """Two requests with one prefix admitted before either sealed: the second's copy of the
    prefix is not registered, but the block after it is, and is found after the first's."""
    m = manager(num_blocks=12)
    p = list(range(8))
    ta, _ = m.allocate([*p, 100, 101, 102, 103, 1])  # blocks 0 1 2 3
    tb, _ = m.allocate([*p, 200, 201, 202, 203, 2])  # blocks 4 5 6 7
    fill(m, ta, [*p, 100, 101, 102, 103, 1])
    fill(m, tb, [*p, 200, 201, 202, 203, 2])
    assert sorted(m.pool.prefix.cached.values()) == [0, 1, 2, 6]
    tc, cached = m.allocate([*p, 200, 201, 202, 203, 3])
    assert cached == 12 and tc.blocks == [0, 1, 6, 8]


def test_salts_share_blocks_only_with_the_same_salt():
    m = manager(num_blocks=16)
    tokens = list(range(9))  # 2 full blocks + 1
    tables = {}
    for salt in (None, "a", "b"):
        table, cached = m.allocate(tokens, salt=salt)
        fill(m, table, tokens)
        assert cached == 0 and table.salt == salt
        tables[salt] = table.blocks
    assert tables == {None: [0, 1, 2], "a": [3, 4, 5], "b": [6, 7, 8]}
    assert len(m.pool.prefix.cached) == 6
    for salt in (None, "a", "b"):
        table, cached = m.allocate(tokens, salt=salt)
        assert cached == 8 and table.blocks[:2] == tables[salt][:2]
    assert m.match(tokens, salt="c") == ([], [])


def test_the_salt_is_carried_by_fork_and_seal():
    m = manager()
    tokens = list(range(6))
    parent, _ = m.allocate(tokens, salt="t")  # blocks 0 1 (1 partial)
    child = m.fork(parent)
    assert child.salt == "t"
    for n in (6, 7, 8):  # 6: copy on write (block 2); 8: a new block (3)
        m.append_slot(child, n)
    grown = [*tokens, 60, 61, 62]
    fill(m, child, grown)  # child's (0..3) and (4, 5, 60, 61) are full
    assert child.blocks == [0, 2, 3] and child.hashes[0] == chain_hash(root_key("t"), tokens[:4])
    assert m.match(grown, salt="t")[0] == [0, 2]
    assert m.match(grown)[0] == [] and m.match(grown, salt="u")[0] == []


@pytest.mark.parametrize(
    ("salt", "error"),
    [("", ValueError), ("x" * 257, ValueError), (7, TypeError), (b"a", TypeError)],
)
def test_invalid_salts_are_refused(salt, error):
    m = manager()
    for call in (m.match, m.blocks_to_admit, m.allocate):
        with pytest.raises(error):
            call([1, 2, 3, 4, 5], salt=salt)
    with pytest.raises(error):
        m.can_admit([1, 2, 3, 4, 5], salt=salt)
    with pytest.raises(error):
        check_salt(salt)
    assert m.pool.num_free == 10


def test_the_longest_salt_is_accepted():
    m = manager()
    _, cached = m.allocate([1, 2, 3, 4, 5], salt="x" * MAX_SALT_CHARS)
    assert cached == 0
