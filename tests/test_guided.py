"""Grammar-constrained decoding (kvlm.engine.guided, llguidance): on a random-weight model
whose unconstrained output is noise, the output still parses and validates against the
JSON schema, matches the regex, is one of the choices; each sample has its own matcher, so
a guided sample's tokens are the same alone and in a batch; a bad schema is refused before
any work."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import threading
import time

import jsonschema
import pytest

from kvlm import SamplingParams
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.guide_worker import WORKERS, GuideWorkers
from kvlm.engine.guided import Guide
from kvlm.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def text(llm, params, prompt="Give me a person as JSON:"):
    return [o.text for o in llm.generate(prompt, params)[0].outputs]


def test_json_schema_output_validates(tiny):
    for temperature, seed in ((0, None), (1.0, 3), (1.3, 8)):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=120,
                                guide=Guide("json_schema", SCHEMA))  # fmt: skip
        for out in text(tiny, params):
            jsonschema.validate(json.loads(out), SCHEMA)


def test_json_object_regex_and_choice(tiny):
    # any object: nothing bounds its length, so a sample cut by max_tokens is a prefix;
    # every one that ended by itself parses (here every seed's but one is "{}")
    ended = 0
    for seed in range(6):
        out = tiny.generate("JSON:", SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                                                    guide=Guide("json_object")))  # fmt: skip
        one = out[0].outputs[0]
        if one.finish_reason == "stop":
            assert isinstance(json.loads(one.text), dict)
            ended += 1
    assert ended >= 1
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    got = text(tiny, SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                                    guide=Guide("regex", pattern)))[0]  # fmt: skip
    assert re.fullmatch(pattern, got), got
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        got = text(tiny, SamplingParams(temperature=1.0, seed=seed, max_tokens=10,
                                        guide=Guide("choice", choices)))[0]  # fmt: skip
        assert got in choices


def test_unguided_output_is_not_json(tiny):
    """The control: without the guide the random model does not write this JSON."""
    out = text(tiny, SamplingParams(temperature=1.0, seed=1, max_tokens=60))[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out), SCHEMA)


def test_guided_samples_are_the_same_in_a_batch_as_alone(tiny):
    prompts = ["A person:", "Another one:", "Plain text"]
    params = [
        SamplingParams(temperature=0.9, seed=5, max_tokens=60, n=2,
                       guide=Guide("json_schema", SCHEMA)),
        SamplingParams(temperature=0, max_tokens=40, guide=Guide("regex", r"[a-z ]{5,20}\.")),
        SamplingParams(temperature=0.7, seed=2, max_tokens=20),
    ]  # fmt: skip
    alone = [[o.token_ids for o in tiny.generate(p, q)[0].outputs]
             for p, q in zip(prompts, params, strict=True)]  # fmt: skip
    together = [[o.token_ids for o in r.outputs] for r in tiny.generate(prompts, params)]
    assert together == alone


def test_a_bad_guide_is_refused_before_any_work(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=32))
    bad = SamplingParams(guide=Guide("regex", "(unclosed", "guided_regex"))
    with pytest.raises(InvalidRequestError) as err:
        engine.check_request([1, 2, 3], bad)
    assert err.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError):
        engine.check_request([1, 2, 3], SamplingParams(
            guide=Guide("json_schema", {"type": "no-such-type"})))  # fmt: skip


def test_a_guide_is_compiled_once_and_shared_by_its_samples(tiny, monkeypatch):
    """The same kind and spec (an agent's tools, every turn) reuse one compiled matcher,
    least recently used let go past KEEP_COMPILED; each sample still feeds its own copy,
    and a bad spec is refused every time (a refusal is never kept)."""
    from kvlm.engine import guided

    monkeypatch.setattr(guided, "KEEP_COMPILED", 2)
    vars(tiny.tokenizer).pop("_compiled_guides", None)
    vocab = tiny.config.vocab_size
    one = guided.compile_guide(Guide("regex", "(yes|no)"), tiny.tokenizer, vocab)
    again = guided.compile_guide(Guide("regex", "(yes|no)", "guided_regex"), tiny.tokenizer, vocab)
    assert again.compiled is one.compiled and again.param == "guided_regex"
    other = guided.compile_guide(Guide("choice", ["yes", "no"]), tiny.tokenizer, vocab)
    assert other.compiled is not one.compiled
    guided.compile_guide(Guide("regex", "[0-9]+"), tiny.tokenizer, vocab)  # one.compiled goes
    assert guided.compile_guide(Guide("regex", "(yes|no)"), tiny.tokenizer, vocab).compiled \
        is not one.compiled  # fmt: skip
    a, b = guided.GuideState(one, tiny.tokenizer, vocab), guided.GuideState(one, tiny.tokenizer,
                                                                          vocab)  # fmt: skip
    a.accept(tiny.tokenizer.encode("yes", add_special_tokens=False)[0])
    assert a.matcher is not b.matcher and not b.matcher.is_stopped()
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            guided.compile_guide(Guide("regex", "(unclosed"), tiny.tokenizer, vocab)


def stop(pid: int) -> None:
    """SIGSTOP a compile worker and wait until the kernel says it is stopped: a process
    still on its way to stopping, woken by a frame, can answer it first."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(1000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)


def _check_into(workers, outcome: list[BaseException | None]) -> None:
    """A guide compiled on a worker of `workers` (on a thread of the test's): None into
    `outcome`, or what it raised (handed to the test)."""
    try:
        workers.check("regex", "[a-f]+", "guided_regex")
        outcome.append(None)
    except BaseException as exc:
        outcome.append(exc)


def test_a_guide_that_holds_its_worker_does_not_hold_up_the_others(tiny):
    """Two compile workers: while one is stuck on a guide (here: its process stopped, as a
    compile that runs to its timeout would hold it), another guide compiles in the other
    and returns first; the stuck one ends in its own 400 and its worker is replaced."""
    eos = sorted(tiny.tokenizer.eos_token_ids) or None
    workers = GuideWorkers(tiny.tokenizer.backend.to_str(), tiny.config.vocab_size, eos)
    try:
        for worker in workers.workers:  # both started
            worker.check("regex", "[0-9]+", "guided_regex")
        stuck = workers.workers[0]  # the first taken (the most recently used on top)
        stopped = stuck.pid
        stop(stopped)
        outcome: list[BaseException | None] = []
        held = functools.partial(_check_into, workers, outcome)
        first = threading.Thread(target=held)
        first.start()
        for _ in range(1000):  # until the thread holds the stuck worker (10 s at most)
            if workers._idle.qsize() == WORKERS - 1:
                break
            first.join(0.01)
        workers.check("json_schema", {"type": "integer"}, "guided_json")  # the other worker
        assert first.is_alive() and not outcome  # answered while the first still waits
        first.join(30)
        assert isinstance(outcome[0], InvalidRequestError)
        assert "longer than" in str(outcome[0])
        assert stuck.pid not in (None, stopped)  # killed and started again
    finally:
        workers.close()


def test_a_guided_request_imports_no_torch_compiler(tiny_model_dir):
    """A guided request imported llguidance.torch, whose import decorates a kernel with
    torch.compile and so pulls in torch._dynamo: 3.5-6 s of imports holding the GIL (Zen 3,
    Zen 4), first on the engine thread (every stream froze), then on a compile thread
    (every stream slowed: the GIL). A compile, a sample's state and its masks import
    neither; in a fresh process, so that no other test has imported them first."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import torch\n"
        "from kvlm import LLM\n"
        "from kvlm.engine.guided import Guide, GuideState, compile_guide\n"
        f"llm = LLM(model={str(tiny_model_dir('llama'))!r}, progress=False, max_context=64)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "vocab = llm.config.vocab_size\n"
        "guide = compile_guide(Guide('regex', '[a-z]+', 'guided_regex'), llm.tokenizer, vocab)\n"
        "state = GuideState(guide, llm.tokenizer, vocab)\n"
        "first = state.mask(torch.zeros(vocab))\n"
        "allowed = [t for t in range(vocab) if first[t] == 0]\n"
        "state.accept(allowed[0])\n"
        "state.mask(torch.zeros(vocab))\n"
        "print(0 < len(allowed) < vocab, sorted(m for m in ('torch._dynamo', 'llguidance.torch')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True []"


class HeldMatcher:
    """A real llguidance matcher whose masks after the first wait for `release` (a guide
    whose masks take long, as a grammar near the parser's limits does on a big
    vocabulary); `done` says when one has been computed."""

    def __init__(self, real, release: threading.Event, done: list) -> None:
        self.real, self.release, self.done = real, release, done

    def deep_copy(self) -> HeldMatcher:
        return HeldMatcher(self.real.deep_copy(), self.release, self.done)

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.release.wait(5)  # a bound for an engine that waits on it (before the fix)
        self.real.unsafe_compute_mask_ptr(ptr, size)
        self.done.append(True)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_a_slow_guide_mask_holds_its_sample_not_the_engines_steps(tiny):
    """A guided sample's next mask is computed off the engine thread: while it is held,
    each step still decodes the plain stream beside it and the guided sample sits the
    steps out; once the mask comes the sample goes on, its tokens those of a run whose
    masks were never held."""
    import dataclasses

    from kvlm.engine.guided import compile_guide

    vocab = tiny.config.vocab_size
    guide = compile_guide(Guide("regex", "[a-z]{3,12}"), tiny.tokenizer, vocab)
    guided = SamplingParams(temperature=0, max_tokens=8, guide=guide)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(engine: Engine, steps: list) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {"g": [], "s": []}
        while engine.has_work():
            events = engine.step()
            steps.append([ev.request_id for ev in events if ev.token_ids])
            for ev in events:
                out[ev.request_id] += ev.token_ids
        return out

    engine = Engine(tiny, EngineConfig(num_blocks=64))
    engine.add_request("s", [5, 6, 7, 8], plain)
    engine.add_request("g", [5, 6, 9], guided)
    want = run(engine, [])
    release, done = threading.Event(), []
    held = dataclasses.replace(guide.compiled, matcher=HeldMatcher(guide.compiled.matcher,
                                                                   release, done))  # fmt: skip
    engine.add_request("s", [5, 6, 7, 8], plain)
    engine.add_request("g", [5, 6, 9], dataclasses.replace(
        guided, guide=dataclasses.replace(guide, compiled=held)))  # fmt: skip
    first = engine.step()  # both prompts, and each sample's first token (the compiled mask)
    assert sorted(ev.request_id for ev in first if ev.token_ids) == ["g", "s"]
    for _ in range(4):
        events = engine.step()
        assert not done  # the guided sample's second mask is still held
        assert [ev.request_id for ev in events if ev.token_ids] == ["s"]
    release.set()
    steps: list = []
    got = run(engine, steps)
    assert len(got["g"]) == len(want["g"]) - 1 and got["g"] == want["g"][1:]
    assert len(got["s"]) == len(want["s"]) - 5 and done


def test_three_guides_that_hold_their_workers_leave_a_fourth_free(tiny, monkeypatch):
    """Several compile workers: three guides held at once (their processes stopped, as
    compiles that run to the timeout hold them) and a fourth guide still compiles at once,
    while the three wait; each of those ends in its own 400. (With two workers the fourth
    waited for a held one's timeout.)"""
    from kvlm.engine import guide_worker

    monkeypatch.setattr(guide_worker, "COMPILE_TIMEOUT", 6.0)  # room on a loaded machine
    eos = sorted(tiny.tokenizer.eos_token_ids) or None
    workers = GuideWorkers(tiny.tokenizer.backend.to_str(), tiny.config.vocab_size, eos)
    held_n = 3
    assert held_n < WORKERS
    try:
        for worker in workers.workers:  # all started
            worker.check("regex", "[0-9]+", "guided_regex")
        for worker in workers.workers[:held_n]:  # the first taken (most recently used on top)
            stop(worker.pid)
        outcome: list[BaseException | None] = []
        held = functools.partial(_check_into, workers, outcome)
        threads = [threading.Thread(target=held) for _ in range(held_n)]
        for t in threads:
            t.start()
        for _ in range(1000):  # until the threads hold the stuck workers (10 s at most)
            if workers._idle.qsize() == WORKERS - held_n:
                break
            threads[0].join(0.01)
        workers.check("json_schema", {"type": "integer"}, "guided_json")  # a free worker
        assert all(t.is_alive() for t in threads) and not outcome  # the three still wait
        for t in threads:
            t.join(30)
        assert len(outcome) == held_n
        assert all(isinstance(o, InvalidRequestError) and "longer than" in str(o)
                   for o in outcome)  # fmt: skip
    finally:
        workers.close()
