"""The scheduler: admission by free blocks, chunked prefill budget, batched decode,
preemption by recompute, abort, with exact block ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlm.cache.base import CacheSpec
from kvlm.cache.paged import BlockPool
from kvlm.cache.prefix import BlockManager
from kvlm.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from kvlm.engine.sequence import Sequence, Status

BS = 4


def make(num_blocks: int = 16, **config) -> Scheduler:
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, max_tokens=64, block_size=BS)
    cfg = SchedulerConfig(**{"reserve_blocks": 0, **config})
    return Scheduler(BlockManager(BlockPool(spec, num_blocks)), cfg)


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    sample = SimpleNamespace(seq=list(tokens), out=SimpleNamespace(index=0, token_ids=[]),
                             params=SimpleNamespace(prompt_logprobs=None))  # fmt: skip
    return Sequence(rid, sample, sampler=SimpleNamespace(mask_job=None), num_prompt=len(tokens))


def run(s: Scheduler, batch) -> None:
    """What the engine does after a step: count the fed tokens, sample one token."""
    for q, n in batch.prefill:
        q.num_computed += n
        s.manager.seal(q.table, q.token_ids, q.num_computed)
        if q.num_pending == 0:
            q.token_ids.append(7)
    for q in batch.decode:
        q.num_computed += 1
        s.manager.seal(q.table, q.token_ids, q.num_computed)
        q.token_ids.append(7)


def test_prefill_is_chunked_and_decode_runs_beside_it():
    s = make(prefill_chunk=6)
    a, b = seq(list(range(5)), "a"), seq(list(range(100, 110)), "b")
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [(q.request_id, n) for q, n in batch.prefill] == [("a", 5), ("b", 1)]
    assert a.table.blocks == [0, 1] and b.table.blocks == [2, 3, 4]
    run(s, batch)
    batch = s.schedule()  # a decodes; b continues its prompt with the whole budget
    assert batch.decode == [a]
    assert [(q.request_id, n) for q, n in batch.prefill] == [("b", 6)]
    run(s, batch)
    batch = s.schedule()
    assert batch.decode == [a] and [(q.request_id, n) for q, n in batch.prefill] == [("b", 3)]
    run(s, batch)
    assert s.schedule().decode == [a, b]


def test_admission_waits_for_blocks_first_come_first_served():
    s = make(num_blocks=4)
    a, b, c = seq(list(range(12)), "a"), seq(list(range(8)), "b"), seq([1], "c")
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()
    assert [q.request_id for q, _ in batch.prefill] == ["a"]  # b needs 2 blocks, 1 is free
    assert list(s.waiting) == [b, c]  # c would fit, but waits behind b
    s.finish(a)
    assert s.manager.pool.num_free == 4
    batch = s.schedule()
    assert [q.request_id for q, _ in batch.prefill] == ["b"]
    assert [q.request_id for q in s.running] == ["b", "c"]  # c has one token: decodes next


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq([i, i, i], str(i)))
    s.schedule()
    assert [q.request_id for q in s.running] == ["0", "1"]
    assert [q.request_id for q in s.waiting] == ["2"]


def test_queue_full_is_refused():
    s = make(max_num_seqs=1, max_waiting=2)
    for i in range(3):  # one seat and two in the queue, admitted or not
        s.add(seq([i]))
    with pytest.raises(QueueFullError):
        s.add(seq([3]))
    s.schedule()
    with pytest.raises(QueueFullError):
        s.add(seq([3]))


def test_decode_without_blocks_preempts_the_newest_and_it_recomputes():
    s = make(num_blocks=4)
    a, b = seq(list(range(8)), "a"), seq(list(range(100, 108)), "b")
    s.add(a)
    s.add(b)
    run(s, s.schedule())  # both prompts in: 4 blocks used, a and b hold one token each
    assert s.manager.pool.num_free == 0
    batch = s.schedule()  # a's 9th token needs a block: b (newest) is preempted
    assert batch.decode == [a] and s.preemptions == 1
    assert b.status is Status.WAITING and b.num_computed == 0 and b.table.blocks == []
    assert a.table.blocks == [0, 1, 3]  # b's blocks were freed tail first: 3 goes first
    assert list(s.waiting) == [b]  # not readmitted: 3 blocks needed, 1 free
    run(s, batch)
    s.finish(a)
    batch = s.schedule()  # b is readmitted; its first block is still cached (its second
    # was taken by a, and its hash with it), so it recomputes 5 of its 9 tokens
    assert [(q.request_id, n) for q, n in batch.prefill] == [("b", 5)]
    assert b.num_cached == 4 and b.table.blocks[0] == 2


def test_a_lone_sequence_that_cannot_grow_preempts_itself():
    s = make(num_blocks=2)
    a = seq(list(range(8)), "a")
    s.add(a)
    run(s, s.schedule())
    batch = s.schedule()
    assert not batch.decode and a.status is Status.WAITING
    assert s.manager.pool.num_used == 0


def test_finish_frees_a_waiting_or_running_sequence():
    s = make()
    a, b = seq(list(range(6)), "a"), seq(list(range(6)), "b")
    s.add(a)
    s.schedule()
    s.add(b)
    s.finish(a)
    s.finish(b)
    assert s.manager.pool.num_used == 0 and not s.running and not s.waiting
    assert a.status is Status.FINISHED and b.status is Status.FINISHED


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_one():
    s = make()
    a = seq(list(range(6)), "a")
    s.add(a)
    run(s, s.schedule())
    b = seq(list(a.token_ids), "a")
    s.fork(a, b)
    assert b.table.blocks == a.table.blocks == [0, 1]
    batch = s.schedule()
    assert batch.decode == [a, b]
    assert a.table.blocks == [0, 2] and b.table.blocks == [0, 1]  # a copied, b in place
    assert s.manager.pool.refs[:3] == [2, 1, 1]


def test_chunk_size_feeds_a_prompt_as_a_single_stream_does():
    """Chunks of chunk_size at multiples of it; one that does not fit the step's budget
    waits rather than being cut."""
    s = make(prefill_chunk=6, chunk_size=6)
    a, b = seq(list(range(5)), "a"), seq(list(range(100, 110)), "b")
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [(q.request_id, n) for q, n in batch.prefill] == [("a", 5)]  # b's 6 would not fit
    assert [q.request_id for q in s.waiting] == ["b"]
    run(s, batch)
    batch = s.schedule()
    assert batch.decode == [a] and [(q.request_id, n) for q, n in batch.prefill] == [("b", 6)]
    run(s, batch)
    batch = s.schedule()
    assert [(q.request_id, n) for q, n in batch.prefill] == [("b", 4)]  # positions 6..9


def test_a_budget_of_several_chunks_feeds_several_prompts_a_step():
    s = make(prefill_chunk=12, chunk_size=4)
    a, b, c = seq(list(range(10)), "a"), seq(list(range(3)), "b"), seq(list(range(9)), "c")
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()  # one chunk each: 4 + 3 + 4 of 12
    assert [(q.request_id, n) for q, n in batch.prefill] == [("a", 4), ("b", 3), ("c", 4)]
    run(s, batch)
    batch = s.schedule()
    assert [(q.request_id, n) for q, n in batch.prefill] == [("a", 4), ("c", 4)]
    with pytest.raises(ValueError, match="chunk_size"):
        SchedulerConfig(prefill_chunk=4, chunk_size=5)


def test_reserve_full_admits_only_what_can_finish_without_preemption():
    def sampled(tokens, rid, max_tokens):
        q = seq(tokens, rid)
        q.sample.params = SimpleNamespace(max_tokens=max_tokens, prompt_logprobs=None)
        return q

    s = make(num_blocks=6, reserve_full=True)
    s.max_model_len = 64
    a, b = sampled(list(range(8)), "a", 8), sampled(list(range(8)), "b", 8)
    s.add(a)
    s.add(b)
    s.schedule()
    # a: 2 blocks now, up to 16 tokens (4 blocks) + one copy: 3 more. b would take 2 now and
    # 3 later: 2 + 3 + 3 > 6 - 2, so b waits although its prompt fits.
    assert [q.request_id for q in s.running] == ["a"] and list(s.waiting) == [b]
    while a.num_tokens < 16:
        run(s, s.schedule())
    s.finish(a)
    s.schedule()
    assert [q.request_id for q in s.running] == ["b"] and s.preemptions == 0
