"""Threads under load: how many CPU threads the engine's steps run on, chosen by measuring.

A step's products and attention are OpenMP regions, thousands a second, each waiting at
its end for its slowest thread. On cores nothing else wants, every thread helps (the
default model decodes ~1.6-1.9x faster on 2 threads than on 1, Zen 4). When another
process takes a core, a thread of each region waits for the scheduler to give it one
back, and libgomp's idle threads spin on the CPU the waited-for thread needs: with one
busy neighbour on 2 cores the default model decoded at 11-18 tok/s on 2 threads (once
0.9) where 1 thread gave 64-66 (issue [19]); `OMP_WAIT_POLICY=PASSIVE` held under load
but cost ~2.5x on a quiet box (docs/BENCHMARKS.md 12.5). Which count is faster depends
on what else runs, and that changes while a server runs, so the engine measures it:

- it runs on `most` threads (torch's count when the user gave none) and, every so often,
  a probe of PROBE_STEPS decode steps on fewer (half, then one); a step's seconds are
  divided by its work (rows, the positions they attend to: kvlm.engine.pacing.Work), so
  steps of other batch sizes and lengths compare;
- a count whose median is faster by MARGIN in two probes in a row becomes the count (the
  second comes FIRST_WAIT steps after the first); a probe that loses doubles
  the wait before the next (at most MOST_STEPS steps or MOST_SECONDS apart), and one whose
  first step is GIVE_UP times slower ends there; the next probe waits at least COST_SHARE
  times the seconds the last one took (a busy machine's step on the count that lost can
  take seconds), so probing costs at most 1/COST_SHARE of the time, a quiet box a few
  slower steps in a thousand, and the faster count is found within a few steps of the
  first and within MOST_SECONDS (or the probe's hold) of the load changing.

The user's `--threads N` (`LLM(threads=N)`) fixes the count: no probing. Only the OpenMP
threads move (torch.set_num_threads on the engine's thread, which the C kernels read per
region), not OpenBLAS's pool (the exact path's fp32 one-row products), which keeps the
count it had at load. A row's bits are the same on any count (tests/test_one_answer.py
holds it under each CPU family's defaults and the exact path), so the count changes when
a token comes, never which.
"""

from __future__ import annotations

import statistics
import time

PROBE_STEPS = 4  # decode steps a probe measures (after one to settle)
MARGIN = 0.1  # a count must be this much faster to take over
FIRST_WAIT = 4  # decode steps before the first probe
MOST_STEPS = 1024  # the longest wait between probes, in decode steps
MOST_SECONDS = 30.0  # ... and in seconds
COST_SHARE = 20  # probes take at most 1/COST_SHARE of the time
GIVE_UP = 2.0  # a probe's step this many times the current count's median ends the probe


class ThreadTuner:
    def __init__(self, most: int, clock=time.monotonic) -> None:
        self.counts = sorted({most, max(1, most // 2), 1}, reverse=True)
        self.current = most
        self.trial: int | None = None  # the count a probe is measuring
        self.clock = clock
        self.wait = FIRST_WAIT  # decode steps between probes now
        self.since, self.probed_at = 0, clock()
        self.settle = 1  # steps not measured: the first after a count changes
        self.recent: list[float] = []  # the current count's latest seconds per unit
        self.probe: list[float] = []  # the trial count's
        self.turn = 0  # which of the other counts the next probe tries
        self.cost, self.hold = 0.0, 0.0  # the last probe's seconds; the wait they ask
        self.switches = 0
        self.confirm: int | None = None  # a count that won its last probe, to win again

    @property
    def threads(self) -> int:
        """The count the next step runs on."""
        return self.current if self.trial is None else self.trial

    def record(self, seconds: float, units: float) -> None:
        """A decode step's seconds and its work (kvlm.engine.pacing.Work units), run on
        `threads`."""
        if units <= 0:
            return
        if self.trial is not None:
            self.cost += seconds
        if self.settle:
            self.settle -= 1
            return
        if self.trial is not None:
            self.probe.append(seconds / units)
            # a count far slower is known from one step (on a busy machine two threads'
            # steps took 5-15 times one thread's): the probe ends there
            hopeless = self.probe[-1] > GIVE_UP * statistics.median(self.recent)
            if hopeless or len(self.probe) >= PROBE_STEPS:
                self._decide()
            return
        self.recent = [*self.recent[-(PROBE_STEPS - 1) :], seconds / units]
        self.since += 1
        waited = self.clock() - self.probed_at
        due = self.since >= self.wait or waited >= MOST_SECONDS
        if due and waited >= self.hold and len(self.recent) >= PROBE_STEPS and len(self.counts) > 1:
            others = [c for c in self.counts if c != self.current]
            self.trial = others[self.turn % len(others)]
            self.turn += 1
            self.probe, self.settle, self.cost = [], 1, 0.0

    def _decide(self) -> None:
        trial, self.trial = self.trial, None
        won = statistics.median(self.probe) < (1 - MARGIN) * statistics.median(self.recent)
        self.since, self.probed_at = 0, self.clock()
        # the next probe waits COST_SHARE times what this one took: a busy machine's
        # steps on the count that lost can take seconds (two threads' steps on 2 cores
        # with other work: 10 ms, then 2-3 s), and probing may cost 1/COST_SHARE at most
        self.hold = COST_SHARE * self.cost
        if won and self.confirm != trial:
            # once more, FIRST_WAIT steps on, before moving: on a quiet box one probe in
            # a few won by a noisy moment (a run of 128 tokens went from 2 threads to 1
            # and back, at 0.65x)
            self.confirm, self.turn = trial, self.turn - 1
            self.since, self.hold = max(0, self.wait - FIRST_WAIT), 0.0
            self.settle = 1
        elif won:  # the wait stays: the count just left lost by as much, a moment ago
            self.current, self.recent, self.confirm = trial, self.probe, None
            self.switches += 1
        else:
            self.confirm = None
            self.wait = min(2 * self.wait, MOST_STEPS)
            self.settle = 1  # back on the current count
        self.probe = []
