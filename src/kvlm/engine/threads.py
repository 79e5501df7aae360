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

A request that comes after the engine sat idle starts on the count the cores others left
free say (FreeCores: /proc/stat's busy time of the CPUs this process may run on, less its
own, over the idle time): its prompt runs before any decode step of it is measured, and on
two threads with a busy neighbour a 512-token prompt took 1,008 ms against 589 on one
(docs/BENCHMARKS.md 21.1). The probes go on from there as before.

The user's `--threads N` (`LLM(threads=N)`) fixes the count: no probing. Only the OpenMP
threads move (torch.set_num_threads on the engine's thread, which the C kernels read per
region), not OpenBLAS's pool (the exact path's fp32 one-row products), which keeps the
count it had at load. A row's bits are the same on any count (tests/test_one_answer.py
holds it under each CPU family's defaults and the exact path), so the count changes when
a token comes, never which.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

PROBE_STEPS = 4  # decode steps a probe measures (after one to settle)
MARGIN = 0.1  # a count must be this much faster to take over
FIRST_WAIT = 4  # decode steps before the first probe
MOST_STEPS = 1024  # the longest wait between probes, in decode steps
MOST_SECONDS = 30.0  # ... and in seconds
COST_SHARE = 20  # probes take at most 1/COST_SHARE of the time
GIVE_UP = 2.0  # a probe's step this many times the current count's median ends the probe
LOOK_S = 0.2  # the shortest time FreeCores tells the cores free over
STAT = "/proc/stat"  # Linux's CPU times: "cpuN user nice system idle iowait irq softirq steal"


class FreeCores:
    """How many of the CPUs this process may run on other processes left free: their busy
    time in /proc/stat (steal too: a hypervisor's other guests), less this process's own CPU
    time and its finished children's (the kernel build's compilers), over the time since
    the last look. Linux only; elsewhere, or over less than LOOK_S, it tells nothing."""

    def __init__(self, clock=time.monotonic, stat: str = STAT) -> None:
        self.clock, self.stat = clock, stat
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        """(now, the CPUs' busy seconds, this process's CPU seconds), or None: no
        /proc/stat, or one that does not read as Linux writes it."""
        try:
            with open(self.stat, encoding="ascii") as f:
                lines = f.read(1 << 20).splitlines()
            busy = 0
            for line in lines:
                name, _, rest = line.partition(" ")
                if name[:3] != "cpu" or not name[3:].isdigit() or int(name[3:]) not in self.cpus:
                    continue
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, rest.split()[:8])
                busy += user + nice + system + irq + softirq + steal
        except (OSError, ValueError):
            return None
        own = sum(getattr(resource.getrusage(who), f)
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))  # fmt: skip
        return self.clock(), busy / self.tick, own

    def mark(self) -> None:
        """Look from now on (the engine goes idle: the time it waits is others' to use)."""
        self.last = self._read()

    def look(self) -> float | None:
        """The cores others left free since the last look or mark (and look from here on),
        or None: nothing to tell by, or too short a time (the last look stands)."""
        now = self._read()
        if now is None or self.last is None or not self.cpus:
            return None
        wall = now[0] - self.last[0]
        if wall < LOOK_S:
            return None
        others = max(0.0, (now[1] - self.last[1]) - (now[2] - self.last[2]))
        self.last = now
        return max(0.0, len(self.cpus) - others / wall)


class ThreadTuner:
    def __init__(self, most: int, clock=time.monotonic, free: FreeCores | None = None) -> None:
        self.free = free  # the cores others leave, read when the engine comes back from idle
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

    def idle(self) -> None:
        """The engine has nothing to run: the cores are others' to use until it resumes."""
        if self.free is not None:
            self.free.mark()

    def resume(self) -> None:
        """The engine has work again after idling: start on the largest count the cores
        others left free while it waited can hold (a count of `free` + 1/2 cores or fewer;
        at least one), and probe it soon; nothing changes where that time was too short
        to tell or the count stands."""
        free = self.free.look() if self.free is not None else None
        if free is None:
            return
        fits = [c for c in self.counts if c <= free + 0.5] or [1]
        if fits[0] == self.current:
            return
        self.current, self.trial, self.confirm = fits[0], None, None
        self.recent, self.probe, self.settle = [], [], 1
        self.wait, self.since, self.hold = FIRST_WAIT, 0, 0.0
        self.switches += 1

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
