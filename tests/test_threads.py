"""The engine's thread count (kvlm.engine.threads): measured while it runs unless the user
gave one. The count's decisions are held here on given step times; that a count never
changes a token is tests/test_one_answer.py's; what it does under load is measured in
docs/BENCHMARKS.md, not asserted on time."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.engine import threads as threads_mod
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.threads import (
    COST_SHARE,
    FIRST_WAIT,
    MOST_SECONDS,
    MOST_STEPS,
    PROBE_STEPS,
    FreeCores,
    ThreadTuner,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(tuner: ThreadTuner, per_thread_count: dict[int, float], steps: int, clock=None) -> list:
    """`steps` decode steps of one unit each, a count's step taking its given seconds;
    the counts the steps ran on."""
    ran = []
    for _ in range(steps):
        n = tuner.threads
        ran.append(n)
        if clock is not None:
            clock.now += per_thread_count[n]
        tuner.record(per_thread_count[n], 1.0)
    return ran


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_less_often():
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    assert tuner.counts == [2, 1] and tuner.threads == 2
    ran = run(tuner, {2: 0.005, 1: 0.009}, 4000, clock)
    assert tuner.current == 2 and tuner.switches == 0
    probes = sum(1 for a, b in itertools.pairwise(ran) if a == 2 and b == 1)
    # waits double from FIRST_WAIT to MOST_STEPS: a handful of probes in 4,000 steps
    assert 3 <= probes <= 14, probes
    assert ran.count(1) <= probes * (PROBE_STEPS + 1)
    assert tuner.wait == MOST_STEPS
    slower = sum(0.009 - 0.005 for n in ran if n == 1)
    assert slower <= sum(0.005 if n == 2 else 0.009 for n in ran) / COST_SHARE


def test_a_busy_machine_moves_to_fewer_threads_and_back_when_it_is_quiet_again():
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    run(tuner, {2: 0.005, 1: 0.009}, 200, clock)  # quiet
    assert tuner.current == 2
    # another process takes a core: two threads wait for each other (BENCHMARKS 12.5)
    ran = run(tuner, {2: 0.060, 1: 0.012}, 400, clock)
    assert tuner.current == 1 and tuner.switches == 1
    assert ran[-100:].count(1) >= 95  # it stays there, probing two threads now and then
    run(tuner, {2: 0.005, 1: 0.009}, 2000, clock)  # the neighbour has gone
    assert tuner.current == 2 and tuner.switches == 2


def test_a_probe_comes_at_least_every_most_seconds_however_long_the_wait():
    clock = Clock()
    tuner = ThreadTuner(2, clock=clock)
    run(tuner, {2: 0.005, 1: 0.009}, 3000, clock)
    assert tuner.wait == MOST_STEPS
    # slow steps (a long context): MOST_STEPS of them would take minutes; a probe of
    # five 0.9 s steps holds the next for COST_SHARE times 4.5 s, and time brings it then
    hold = max(MOST_SECONDS, COST_SHARE * (1 + PROBE_STEPS) * 0.9)
    steps = int(3 * hold / 0.5)
    assert steps < MOST_STEPS
    ran = run(tuner, {2: 0.5, 1: 0.9}, steps, clock)
    assert ran.count(1) >= 2 * PROBE_STEPS


def test_a_probe_skips_the_step_a_count_changes_on_and_takes_only_a_clear_win():
    tuner = ThreadTuner(4)
    assert tuner.counts == [4, 2, 1]
    steps = 0
    while tuner.trial is None and steps < 100:
        tuner.record(0.010, 1.0)
        steps += 1
    assert steps == 1 + FIRST_WAIT  # the first step (the threads starting) is not measured
    assert tuner.trial == 2  # the probe: half the threads
    tuner.record(5.0, 1.0)  # its first step (threads waking) is not measured
    for _ in range(PROBE_STEPS):
        tuner.record(0.0095, 1.0)  # 5% faster: within MARGIN, no switch
    assert tuner.trial is None and tuner.current == 4
    tuner.record(0.010, 0.0)  # a step of no work (a prompt's) is not measured
    assert tuner.since == 0


def test_the_users_thread_count_is_fixed_and_set_on_the_engines_thread(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    was = torch.get_num_threads()
    try:
        llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, threads=1)
        engine = Engine(llm, EngineConfig(num_blocks=64))
        assert engine.tuner is None
        torch.set_num_threads(2)  # something else moved this thread's count
        engine.add_request("a", [1, 2, 3], params)
        engine.step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(was)


def test_without_a_count_the_engine_runs_on_the_tuners(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(threads_mod, "FIRST_WAIT", 2)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256)
        engine = Engine(llm, EngineConfig(num_blocks=64))
        assert engine.tuner is not None and engine.tuner.counts == [2, 1]
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=40,
                                                          ignore_eos=True))  # fmt: skip
        seen = set()
        for _ in range(60):
            if not engine.has_work():
                break
            engine.step()
            seen.add(torch.get_num_threads())
        assert seen == {1, 2}  # a probe ran on one thread, the steps around it on two
    finally:
        torch.set_num_threads(was)


@pytest.mark.parametrize("threads", [None, 1])
def test_the_llm_says_whose_count_it_runs_on(tiny_model_dir, threads):
    was = torch.get_num_threads()
    try:
        llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256, threads=threads)
        assert llm.threads == threads
    finally:
        torch.set_num_threads(was)


def test_one_probe_won_by_a_noisy_moment_moves_nothing_two_in_a_row_do():
    tuner = ThreadTuner(2)
    steps = 0
    while tuner.trial is None and steps < 100:
        tuner.record(0.010, 1.0)
        steps += 1
    tuner.record(0.005, 1.0)  # the probe's settling step
    for _ in range(PROBE_STEPS):
        tuner.record(0.005, 1.0)  # one thread "faster": a moment's noise
    assert tuner.current == 2 and tuner.confirm == 1 and tuner.trial is None
    ran = []
    for _ in range(FIRST_WAIT + 1 + 1 + PROBE_STEPS):  # settle back, wait, settle, probe
        ran.append(tuner.threads)
        tuner.record(0.005 if tuner.threads == 1 else 0.010, 1.0)
    assert ran.count(1) == 1 + PROBE_STEPS  # the confirming probe came FIRST_WAIT steps on
    assert tuner.current == 1 and tuner.switches == 1


# ------------------------------------------------------------------ the cores free


def _stat(path: Path, busy_ticks: int) -> None:
    """A /proc/stat as Linux writes it: every CPU this process may run on, `busy_ticks` of
    user time spread over them (the rest idle)."""
    cpus = sorted(os.sched_getaffinity(0))
    lines = [f"cpu  {busy_ticks} 0 0 0 0 0 0 0 0 0"]
    for i, cpu in enumerate(cpus):
        share = busy_ticks // len(cpus) + (i < busy_ticks % len(cpus))
        lines.append(f"cpu{cpu} {share} 0 0 {10_000 - share} 0 0 0 0 0 0")
    path.write_text("\n".join([*lines, "intr 1 0", "ctxt 5", ""]))


needs_stat = pytest.mark.skipif(not Path(threads_mod.STAT).is_file(), reason="no /proc/stat")


@needs_stat
def test_free_cores_are_the_cpus_less_what_others_used_over_the_time_since(tmp_path):
    clock, stat = Clock(), tmp_path / "stat"
    _stat(stat, 0)
    free = FreeCores(clock, str(stat))
    n = len(free.cpus)
    clock.now += 0.1
    assert free.look() is None  # too short a time to tell
    clock.now += 0.9
    _stat(stat, free.tick * 1)  # others kept one core busy for the second
    assert free.look() == pytest.approx(n - 1, abs=0.05)  # this process's own time is not theirs
    stat.write_text("cpu0 not numbers\n")
    clock.now += 1.0
    assert free.look() is None  # a file not as Linux writes it tells nothing


@needs_stat
def test_a_busy_neighbour_takes_a_core_from_the_free_count():
    free = FreeCores()
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\n"
                             "while time.time() < end: pass"])  # fmt: skip
    try:
        time.sleep(0.3)  # it has started
        free.mark()
        time.sleep(0.5)
        left = free.look()  # before it ends: a child waited for would count as this one
    finally:
        busy.kill()
        busy.wait(timeout=30)
    assert left is not None and left <= len(free.cpus) - 0.5, left


@needs_stat
def test_back_from_idle_the_tuner_starts_on_the_count_the_free_cores_hold(tmp_path):
    clock, stat = Clock(), tmp_path / "stat"
    _stat(stat, 0)
    free = FreeCores(clock, str(stat))
    n = len(free.cpus)
    tuner = ThreadTuner(2, clock=clock, free=free)
    run(tuner, {2: 0.005, 1: 0.009}, 50)
    clock.now += 2.0
    _stat(stat, free.tick * 2 * (n - 1))  # others held all the cores but one, for 2 s
    tuner.resume()
    assert tuner.threads == 1 and tuner.wait == FIRST_WAIT  # and a probe comes soon
    ran = run(tuner, {2: 0.005, 1: 0.009}, 40)  # the load went: two threads win it back
    assert ran[0] == 1 and tuner.current == 2
    tuner.idle()
    clock.now += 0.05
    tuner.resume()  # too short an idle to tell: as it was
    assert tuner.current == 2
    clock.now += 1.0
    before = (tuner.wait, tuner.since, tuner.recent)
    tuner.resume()  # nothing used meanwhile: all cores free, the count stands
    assert tuner.current == 2 and (tuner.wait, tuner.since, tuner.recent) == before


@needs_stat
def test_the_engine_starts_a_request_after_idle_on_the_free_cores(tiny_model_dir, tmp_path):
    clock, stat = Clock(), tmp_path / "stat"
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(model=tiny_model_dir("llama"), progress=False, max_context=256)
        engine = Engine(llm, EngineConfig(num_blocks=64))
        _stat(stat, 0)
        engine.tuner.free = free = FreeCores(clock, str(stat))
        # a neighbour took all cores but one for 10 s: this process's own CPU time since the
        # look began (counted out: a full suite's leftovers, a collection, ran up to 0.5 s
        # in 1 s and read as a free core) weighs a tenth
        clock.now += 10.0
        _stat(stat, free.tick * (len(free.cpus) - 1) * 10)
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        engine.step()  # the prompt's step: on one thread, before any decode step is measured
        assert torch.get_num_threads() == 1
        for _ in range(10):
            if not engine.has_work():
                break
            engine.step()
        assert engine._idle and free.last[0] == clock.now  # idle: looking from here on
    finally:
        torch.set_num_threads(was)
