"""The scheduler: which sequences run in the next step, and with how many tokens.

    waiting (FIFO)                        running (admission order)
    [ s7 s8 s9 ]  -- admit while blocks -->  [ s1 s2 s3 s4 ... ]
         ^          and seats are free             |
         +---- preempt the newest (recompute) -----+   when a decode finds no free block

Each step has two parts, run as two forwards by the engine:

- decode: every running sequence with one token pending, one token each, batched;
- prefill: up to `prefill_chunk` prompt tokens, taken first from sequences already part
  way through their prompt, then from newly admitted ones. A long prompt is fed over
  several steps, so the decode streams keep moving while it prefills.

Admission takes a request only when the pool can hold its whole prompt (less what the
prefix cache already holds) and a reserve is left for the running sequences to grow, and
counts a request of n samples as the n rows (seats, first blocks) it becomes. When a
decode step still finds no free block, the most recently admitted sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later
(the prefix cache usually still holds most of its blocks). Nothing crashes for lack of
memory, and the oldest requests keep their progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlm.cache.prefix import BlockManager
from kvlm.engine.sequence import Sequence, Status
from kvlm.errors import KvlmError


class QueueFullError(KvlmError):
    """The server holds as many requests as it is configured to; try again later."""


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # sequences decoding together
    prefill_chunk: int = 256  # prompt tokens fed per step, over all prefilling sequences
    max_waiting: int = 64  # requests queued beyond max_num_seqs before refusing more
    reserve_blocks: int = 1  # kept free at admission for running sequences to grow into

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(slots=True)
class Batch:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, manager: BlockManager, config: SchedulerConfig | None = None) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def capacity(self) -> int:
        """Sequences held at once, running and queued; one more is refused."""
        return self.config.max_num_seqs + self.config.max_waiting

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) + len(self.running) >= self.capacity:
            raise QueueFullError(f"the server is full ({self.capacity} requests held)")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        self._schedule_decode(batch)
        self._schedule_prefill(batch)
        return batch

    def _schedule_decode(self, batch: Batch) -> None:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.prefilling:
                i += 1
                continue
            while not self.manager.can_append(seq.table, seq.num_computed):
                victim = self.running[-1]  # the newest; never one already in this batch
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.manager.append_slot(seq.table, seq.num_computed)
                batch.decode.append(seq)
                i += 1

    def _schedule_prefill(self, batch: Batch) -> None:
        budget = self.config.prefill_chunk
        for seq in self.running:
            if budget and seq.prefilling:
                n = min(seq.num_pending, budget)
                batch.prefill.append((seq, n))
                budget -= n
        # A request of n samples becomes n rows once its prompt is in: it takes n seats
        # from admission on, and each sample will write its first token into a block of its
        # own (a new one, or a copy of the shared partial one): n - 1 more than the prompt's.
        seats = sum(s.fan_out for s in self.running)
        while budget and self.waiting:
            seq = self.waiting[0]
            if seats + seq.fan_out > self.config.max_num_seqs:
                break
            reserve = self.config.reserve_blocks + seq.fan_out - 1
            if not self.manager.can_admit(seq.token_ids, reserve, salt=seq.cache_salt):
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            seq.table, seq.num_cached = self.manager.allocate(seq.token_ids, seq.cache_salt)
            seq.num_computed = seq.num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            seats += seq.fan_out
            n = min(seq.num_pending, budget)
            if seq.num_pending == 1:  # a one-token prompt (or all cached): decode next step
                continue
            batch.prefill.append((seq, n))
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to be recomputed."""
        self.running.remove(seq)
        self.manager.free(seq.table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """Run `child` beside `seq` on the same blocks (a parallel sample of its prompt)."""
        child.table = self.manager.fork(seq.table)
        child.num_computed = seq.num_computed
        child.num_cached = seq.num_cached
        child.status = Status.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done or aborted: drop it from the queues and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.manager.free(seq.table)
        seq.status = Status.FINISHED
