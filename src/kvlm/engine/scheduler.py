"""The scheduler: which sequences run in the next step, and with how many tokens.

    waiting (FIFO)                        running (admission order)
    [ s7 s8 s9 ]  -- admit while blocks -->  [ s1 s2 s3 s4 ... ]
         ^          and seats are free             |
         +---- preempt the newest (recompute) -----+   when a decode finds no free block

`schedule()` plans a step (`StepPlan`) in two parts, which the engine hands its backend
in one call (kvlm.engine.backends: one ragged forward on a GPU's pool, else a forward per
prompt chunk and one for all the decode rows):

- decode: every running sequence with one token pending, one token each, and its draft
  where the engine speculates (`propose`; its positions made writable here), batched. A
  guided one whose next mask is still being computed sits the step out (on one cache's
  lockstep rows, `lockstep`, the step waits for it instead);
- prefill: up to `prefill_chunk` prompt tokens, from sequences part way through their
  prompt and from newly admitted ones: alone, a sequence takes the whole budget; beside
  others, each takes an equal share first and what is left goes in order (with
  `chunk_size`, whole chunks in order). A long prompt is fed over several steps, so the
  decode streams keep moving while it prefills. With `step_time`, a step in which streams
  decode takes only the prompt tokens that fit in that time at the costs measured so far
  (kvlm.engine.pacing). A hybrid pool's windowed layers take their blocks for each chunk
  as it is planned (`prepare`).

Admission first asks the KV tiers (if any) for the prompt's blocks the pool lacks, once:
the lookup runs off the engine thread and the request waits at the head of the queue
until it is back (kvlm.cache.prefix.TierFetch), while the running sequences step on.
Admission takes a request only when the pool can hold its whole prompt (less what the
prefix cache already holds) and a reserve is left for the running sequences to grow, and
counts a request of n samples as the n rows (seats, first blocks) it becomes. When a
decode step still finds no free block, the most recently admitted sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed later
(the prefix cache usually still holds most of its blocks). Nothing crashes for lack of
memory, and the oldest requests keep their progress.

Two options make a sequence's forwards exactly those it would run alone on one cache
(LLM.generate turns them on, so a batch gives every prompt its single-stream bits):

- `chunk_size`: a prompt is fed in chunks of `chunk_size` tokens at positions that are
  multiples of it (the last one shorter), as a single stream with that prefill chunk feeds
  it; a chunk that does not fit what is left of the step's budget (`prefill_chunk`) waits
  for the next step. Without it a chunk is cut to the budget, and attention summed over
  other chunk boundaries rounds differently in the last bits.
- `reserve_full`: a request is admitted only when the pool holds, beside what it takes
  now, every block it may still take (each sample's prompt and max_tokens, within the
  context limit) and every block the running sequences may still take: no sequence is
  preempted and recomputed (a recompute feeds generated tokens as a prefill chunk). The
  first request of an empty batch is admitted regardless, as without the option.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvlm.cache.prefix import BlockManager
from kvlm.engine.pacing import Pacing
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
    chunk_size: int | None = None  # prompts fed in aligned whole chunks of it (see above)
    # while streams decode, a step's prompt tokens are what fits in this many seconds
    # (kvlm.engine.pacing); None: prefill_chunk whatever they cost
    step_time: float | None = None
    reserve_full: bool = False  # admit only with room for everyone's worst case (see above)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.step_time is not None and not 0 < self.step_time < float("inf"):
            raise ValueError("step_time must be a positive number of seconds")
        if self.chunk_size is not None and not 0 < self.chunk_size <= self.prefill_chunk:
            raise ValueError("chunk_size must be 1..prefill_chunk (a step's budget)")


@dataclass(slots=True)
class StepPlan:
    """What one step runs: the sequences that decode a token (and their drafts), and the
    prompt chunks, each a sequence and how many of its pending tokens it feeds."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(
        self,
        manager: BlockManager,
        config: SchedulerConfig | None = None,
        max_model_len: int | None = None,
        lockstep: bool = False,
    ) -> None:
        """`lockstep`: every running sequence decodes in every step (one cache's rows,
        kvlm.engine.backends.CacheBackend): a guided one waits for its mask in the step
        instead of sitting it out."""
        self.manager = manager
        self.lockstep = lockstep
        self.config = config or SchedulerConfig()
        self.max_model_len = max_model_len  # the context limit (reserve_full's worst case)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        # speculative decoding: (sequence, most tokens) -> its draft; set by the engine
        self.propose: Callable[[Sequence, int], list[int]] | None = None
        # the step's prompt tokens from its time (config.step_time); set by the engine
        self.pacing: Pacing | None = None

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

    def blocked_on(self) -> list[Future]:
        """What sequences wait for off the engine thread: the tier lookup of the first
        waiting request, the masks of guided sequences that sit steps out. An engine with
        nothing else to run waits on them a moment rather than spin."""
        job = self.waiting[0].tier_fetch if self.waiting else None
        out = [job.waiting] if job is not None and job.waiting is not None else []
        return out + [f for s in self.running if (f := s.sampler.mask_job) is not None]

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._schedule_decode(plan)
        self._schedule_prefill(plan)
        return plan

    def _schedule_decode(self, plan: StepPlan) -> None:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            unready = not self.lockstep and seq.sampler.mask_job is not None
            if seq.prefilling or unready:  # unready: its guide's mask is being computed,
                i += 1  # it sits this step out (kvlm.engine.guided)
                continue
            while not self.manager.can_append(seq.table, seq.num_computed):
                victim = self.running[-1]  # the newest; never one already in this step
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.manager.append_slot(seq.table, seq.num_computed)
                if self.propose is not None:
                    self._draft(seq)
                plan.decode.append(seq)
                i += 1

    def _draft(self, seq: Sequence) -> None:
        """Propose the sequence's draft (speculative decoding) and make its positions
        writable; a position that would need a block the pool lacks ends the draft there
        (speculation never preempts anyone)."""
        p = seq.sample.params
        room = p.max_tokens - len(seq.sample.out.token_ids) - 1  # the model adds one
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens - 1)
        draft = self.propose(seq, room) if room > 0 else []
        for i in range(1, len(draft) + 1):
            if not self.manager.can_append(seq.table, seq.num_computed + i):
                draft = draft[: i - 1]
                break
            self.manager.append_slot(seq.table, seq.num_computed + i)
        seq.draft = draft

    def _schedule_prefill(self, plan: StepPlan) -> None:
        """The step's prompt tokens, at most `prefill_chunk` in all. Alone, a prefilling
        sequence takes the whole budget. Beside others (prompts part way through, requests
        waiting to be admitted) each first takes an equal share, and what is left goes in
        order: a long prompt (a 4,000-token prompt being scored) would otherwise hold every
        newcomer in the queue until its last chunk, so a neighbour's first token waited
        for the whole prompt. vLLM caps one prompt's chunk for the same reason
        (long_prefill_token_threshold). With `chunk_size` a chunk is whole or waits, so
        there the budget goes in order as before."""
        going = [s for s in self.running if s.prefilling]
        budget = most = self._paced(plan, going)
        share = budget
        if self.config.chunk_size is None and going and (len(going) > 1 or self.waiting):
            share = max(1, budget // (len(going) + bool(self.waiting)))
        fed: dict[Sequence, int] = {}
        for seq in going:
            if budget and (n := self._chunk(seq, min(budget, share))):
                fed[seq] = n
                budget -= n
        admitted = self._admit(min(budget, share))
        budget -= sum(admitted.values())
        if self.config.chunk_size is None:  # what the shares left, in order
            for part in (fed, admitted):
                for seq in part:
                    more = min(budget, seq.num_pending - part[seq])
                    part[seq] += more
                    budget -= more
            if budget and share < most:
                admitted.update(self._admit(budget))
        plan.prefill += [*fed.items(), *admitted.items()]
        for seq, n in plan.prefill:  # a hybrid pool's windowed layers take their blocks now
            self.manager.prepare(seq.table, seq.num_computed, n)

    def _paced(self, plan: StepPlan, going: list[Sequence]) -> int:
        """The step's prompt tokens at most: `prefill_chunk`, or while streams decode in it
        what `pacing` (kvlm.engine.pacing) says fits in the step's time; with `chunk_size`,
        never less than one whole chunk."""
        most = self.config.prefill_chunk
        if self.pacing is None or not plan.decode:
            return most
        probe = [(s.num_computed, s.sample.params.prompt_logprobs is not None) for s in going]
        if self.waiting:
            probe.append((0, self.waiting[0].sample.params.prompt_logprobs is not None))
        return max(self.pacing.budget(most, probe), self.config.chunk_size or 0)

    def _admit(self, budget: int) -> dict[Sequence, int]:
        """Admit waiting requests, first come first served, while `budget` prompt tokens
        last and they fit (seats, blocks); each admitted one's first chunk."""
        fed: dict[Sequence, int] = {}
        # A request of n samples becomes n rows once its prompt is in: it takes n seats
        # from admission on, and each sample will write its first token into a block of its
        # own (a new one, or a copy of the shared partial one): n - 1 more than the prompt's.
        seats = sum(s.fan_out for s in self.running)
        while budget and self.waiting:
            seq = self.waiting[0]
            if seats + seq.fan_out > self.config.max_num_seqs:
                break
            reserve = self.config.reserve_blocks + seq.fan_out - 1
            if self.config.reserve_full and self.running:
                reserve = self.config.reserve_blocks + self._growth(seq)
                reserve += sum(self._growth(s) for s in self.running)
            reuse = seq.sample.params.prompt_logprobs is None  # else every row's logits
            if reuse and not seq.tiers_asked:  # once per admission: blocks below the pool
                seq.tier_fetch = self.manager.start_fetch(seq.token_ids, seq.cache_salt)
                seq.tiers_asked = True
            if seq.tier_fetch is not None:
                if not seq.tier_fetch.poll():
                    break  # its blocks are on their way: it waits, the step goes on
                seq.tier_fetch = None
            if not self.manager.can_admit(seq.token_ids, reserve, seq.cache_salt, reuse):
                break  # first come, first served: later requests wait behind it
            if self.config.chunk_size and seq.num_pending > 1 and not self._chunk(seq, budget):
                break  # its first chunk waits for a step with room for all of it
            self.waiting.popleft()
            seq.table, seq.num_cached = self.manager.allocate(
                seq.token_ids, seq.cache_salt, reuse, seq.turn_start
            )
            seq.num_computed = seq.num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            seats += seq.fan_out
            n = self._chunk(seq, budget)
            if seq.num_pending == 1:  # a one-token prompt (or all cached): decode next step
                continue
            fed[seq] = n
            budget -= n
        return fed

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq`'s pending prompt to feed this step; 0: none fit (chunk_size)."""
        size = self.config.chunk_size
        if size is None:
            return min(seq.num_pending, budget)
        n = min(seq.num_pending, size - seq.num_computed % size)  # up to the next multiple
        return n if n <= budget else 0

    def _growth(self, seq: Sequence) -> int:
        """Blocks `seq` and the samples it will fork into may still take, at most: up to its
        last token (prompt + max_tokens, within the context limit) each, plus one copy of a
        shared partial block each."""
        final = seq.num_prompt + seq.sample.params.max_tokens
        if self.max_model_len is not None:
            final = min(final, self.max_model_len)
        bs = self.manager.block_size
        held = len(seq.table.blocks) if seq.table.blocks else -(-seq.num_tokens // bs)
        return seq.fan_out * max(0, -(-final // bs) - held + 1)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to be recomputed."""
        self.running.remove(seq)
        self.manager.free(seq.table)
        seq.num_computed = 0
        seq.draft = []
        seq.tiers_asked = False
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
            if seq.tier_fetch is not None:  # what its tier lookup held is let go
                seq.tier_fetch.cancel()
                seq.tier_fetch = None
        self.manager.free(seq.table)
        seq.status = Status.FINISHED
