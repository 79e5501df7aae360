"""Prompt scoring beside other requests: a scored prompt (prompt_logprobs, echo with
logprobs) prefills in chunks no bigger than any prompt's, a request that arrives meanwhile
is admitted and decodes at once (not after the scored prompt's last chunk), and through a
real `kvlm serve` a neighbour stream keeps its tokens and its pace while /health answers."""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import time

import pytest
import torch

from kvlm import LLM, SamplingParams
from kvlm.config import ModelConfig
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.engine.pacing import MIN_TOKENS, Pacing
from kvlm.engine.scheduler import SchedulerConfig
from numerics import assert_as_exact_as
from serving import kvlm_serve
from test_prompt_logprobs import _teacher_forced

CHUNK = 16


def _engine(llm: LLM) -> Engine:
    return Engine(llm, EngineConfig(num_blocks=64,
                                    scheduler=SchedulerConfig(prefill_chunk=CHUNK)))  # fmt: skip


def _alone(llm: LLM, ids: list[int], params: SamplingParams) -> list[int]:
    engine = _engine(llm)
    engine.add_request("alone", ids, params)
    tokens = []
    while engine.has_work():
        tokens += [t for e in engine.step() for t in e.token_ids]
    return tokens


def test_a_request_arriving_while_a_prompt_is_scored_decodes_beside_it(tiny, exact):
    """Every step feeds at most one chunk of prompt tokens; the neighbour, added after the
    scored prompt's first chunk, has its first token within two steps and one more at
    every step after while the scored prompt still prefills; both get their own results."""
    scored_ids = tiny.tokenizer.encode("Once upon a time there was a long prompt. " * 16)[:200]
    near_ids = tiny.tokenizer.encode("Water boils at")
    near = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = _engine(tiny)
    engine.add_request("scored", scored_ids, SamplingParams(temperature=0, max_tokens=1,
                                                            prompt_logprobs=5))  # fmt: skip
    engine.step()
    engine.add_request("near", near_ids, near)
    near_steps, tokens, entries, scored_done = [], [], None, None
    for step in range(1, 100):
        if not engine.has_work():
            break
        events = engine.step()
        fed = sum(n for _, n in engine.last_plan.prefill)
        assert fed <= CHUNK, f"step {step} fed {fed} prompt tokens, more than one chunk"
        for e in events:
            if e.request_id == "near" and e.token_ids:
                near_steps.append(step)
                tokens += e.token_ids
            if e.request_id == "scored" and e.prompt_logprobs is not None:
                entries, scored_done = e.prompt_logprobs, step
    assert scored_done is not None and near_steps, (scored_done, near_steps)
    assert near_steps[0] <= 2, f"the neighbour's first token came at step {near_steps[0]}"
    assert near_steps == list(range(near_steps[0], near_steps[0] + 6))  # a token every step
    assert near_steps[-1] < scored_done  # all while the scored prompt prefilled
    assert tokens == _alone(tiny, near_ids, near)
    got = torch.tensor([e.logprob for e in entries[1:]], dtype=torch.float32)
    ref = _teacher_forced(tiny, scored_ids).float()
    assert_as_exact_as(got, ref, _teacher_forced(exact, scored_ids))


# ------------------------------------------------------------------ a real server

PROMPT_TOKENS = 2000


def _post(port: int, body: dict, stream: bool = False) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}),
                 {"Content-Type": "application/json"})  # fmt: skip
    return conn.getresponse()


def _stream(port: int, body: dict) -> tuple[str, list[float]]:
    """A streamed completion's text and its chunks' times, the request's send first."""
    times = [time.perf_counter()]
    resp, text = _post(port, body, stream=True), []
    assert resp.status == 200
    for line in resp:
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), times


@pytest.mark.slow
def test_a_scored_prompt_does_not_freeze_a_neighbour_stream():
    """A 2,000-token prompt scored (echo, logprobs 5, prompt_logprobs 20: ~4 MB of answer)
    and a greedy stream sent a second later: the stream gets its tokens alone, its worst
    wait between chunks (its first included) is a small part of the scoring request's time
    (before: the whole prefill, it waited for admission behind it), it ends first, and
    /health answers quickly throughout (before: the answer's encoding held the event loop
    for seconds)."""
    model = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with kvlm_serve("--max-num-seqs", "4", "--threads", "2", "--prefill-chunk", "64",
                    "--log-level", "warning") as (port, _):  # fmt: skip
        near = {"model": model, "prompt": "Once upon a time", "max_tokens": 16,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        alone, _ = _stream(port, near)
        rng = random.Random(0)
        ids = [rng.randrange(200, 40000) for _ in range(PROMPT_TOKENS)]
        scored: dict = {}

        def score() -> None:
            t0 = time.perf_counter()
            body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True,
                    "logprobs": 5, "prompt_logprobs": 20, "temperature": 0}  # fmt: skip
            resp = _post(port, body)
            scored["status"], raw = resp.status, resp.read()
            scored["seconds"], scored["end"] = time.perf_counter() - t0, time.perf_counter()
            scored["body"] = json.loads(raw)

        scoring = threading.Thread(target=score)
        scoring.start()
        health: list[float] = []

        def poll() -> None:
            while scoring.is_alive() and len(health) < 10_000:
                t0 = time.perf_counter()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("GET", "/health")
                assert conn.getresponse().status == 200
                conn.close()
                health.append(time.perf_counter() - t0)
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(1.0)
        text, times = _stream(port, near)
        scoring.join(timeout=600)
        poller.join(timeout=60)
    assert scored["status"] == 200
    choice = scored["body"]["choices"][0]
    assert len(choice["prompt_logprobs"]) == PROMPT_TOKENS
    assert len(choice["logprobs"]["tokens"]) == PROMPT_TOKENS + 1
    worst = max(b - a for a, b in itertools.pairwise(times))
    print(f"scoring {scored['seconds']:.1f} s; neighbour worst gap {worst:.2f} s; "
          f"/health worst {max(health):.2f} s over {len(health)}")  # fmt: skip
    assert text == alone
    assert times[-1] < scored["end"], "the neighbour waited for the scored prompt"
    assert worst < 0.25 * scored["seconds"], (worst, scored["seconds"])
    assert health and max(health) < 1.0, max(health)


# ------------------------------------------------------------- pacing (SchedulerConfig.step_time)


def _paced_run(llm: LLM, ids: list[int], step_time: float | None) -> tuple[dict, list]:
    """A stream decoding when a 200-token prompt arrives: {id: tokens} and each step's
    (decode rows, prompt tokens fed)."""
    sched = SchedulerConfig(prefill_chunk=128, step_time=step_time)
    engine = Engine(llm, EngineConfig(num_blocks=64, scheduler=sched))
    stream = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("stream", llm.tokenizer.encode("Water boils at"), stream)
    engine.step()  # its prompt, alone: the pacing measures it
    engine.add_request("long", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    out, fed = {"stream": [], "long": []}, []
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
        batch = engine.last_plan
        fed.append((len(batch.decode), sum(n for _, n in batch.prefill)))
    return out, fed


def test_a_step_beside_decoding_streams_takes_the_prompt_tokens_that_fit_its_time(tiny):
    """With `step_time`, a step in which streams decode takes the prompt tokens its
    measured costs fit in that time, never fewer than MIN_TOKENS: here a time no step
    meets, so MIN_TOKENS while the stream decodes and the whole prefill_chunk once it has
    ended; both requests get the tokens they get unpaced (a row's bits follow its
    position, never its chunk)."""
    ids = tiny.tokenizer.encode("Once upon a time there was a long prompt. " * 20)[:200]
    want, unpaced = _paced_run(tiny, ids, None)
    got, fed = _paced_run(tiny, ids, 1e-9)
    assert got == want
    assert unpaced[0] == (1, 128)  # unpaced, the stream's step took a whole chunk
    beside = [n for rows, n in fed if rows and n]
    alone = [n for rows, n in fed if not rows and n]
    assert beside and all(n == MIN_TOKENS for n in beside), fed
    assert alone and alone[:-1] == [128] * (len(alone) - 1), fed  # the last: what was left
    assert sum(beside) + sum(alone) == len(ids)


def test_the_pacing_takes_what_fits_at_the_costliest_prompt():
    """Pacing.budget from measured costs, on the default model's shape: a step of prompt
    work alone sets the seconds per unit, a step of decode rows alone their seconds; a
    step's budget is what fits in step_time less the decode rows' seconds at the costliest
    prompt's next position (attention over its prefix, its rows scored), never below
    MIN_TOKENS or above the most asked."""
    shape = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                        rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
                        tie_word_embeddings=True)  # fmt: skip
    pacing = Pacing(shape, step_time=1.0)
    assert pacing.budget(256, [(0, False)]) == 256  # nothing measured yet
    assert pacing.units(0, 100, False) == pytest.approx(100 * (1 + pacing.attend * 50.5))
    pacing.record(0.5, 0, pacing.units(0, 100, False))  # 100 fresh tokens in 0.5 s
    pacing.record(0.25, 3, 0.0)  # three decode rows alone: 0.25 s
    fresh = pacing.budget(1000, [(0, False)])
    assert 145 <= fresh <= 150  # 0.75 s left at ~5 ms a token
    assert (
        pacing.units(0, fresh, False) <= 0.75 / pacing.per_unit < pacing.units(0, fresh + 1, False)
    )
    assert pacing.budget(100, [(0, False)]) == 100
    far = pacing.budget(1000, [(0, False), (3000, False)])  # attention over 3,000 positions
    scored = pacing.budget(1000, [(0, True)])  # every row through the vocabulary
    assert MIN_TOKENS < far < fresh and MIN_TOKENS < scored < fresh
    pacing.decode_s = 0.9  # decode rows that take nearly the whole step time
    assert pacing.budget(1000, [(0, False)]) == pacing._tokens(0, False, 0.5 / pacing.per_unit)
    assert 95 <= pacing.budget(1000, [(0, False)]) <= 100  # half of step time still theirs
    pacing.record(10.0, 3, pacing.units(0, 32, True))  # a machine that became slow
    assert pacing.budget(1000, [(0, True)]) == MIN_TOKENS
    assert pacing.budget(20, [(0, True)]) == 20
