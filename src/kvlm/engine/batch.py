"""Reading requests out of an engine: a batch of prompts to their ends (LLM.generate), or
one request's text as it comes (LLM.stream, a chat turn, kvlm generate).

    prompts -> queue -> Engine.step (the one loop) -> events
                 ^ fed as the engine's waiting queue drains     |
                 +------ a request's n final events: its RequestOutput

Every request is a request of an engine, whatever the cache: the paged pool batches many
(LLM.batch_engine), one cache of any mode runs them one after another
(kvlm.engine.backends.CacheBackend). A request that fails ends alone with finish_reason
"error" (Engine._fail); the others finish. Anything else that raises (a scheduler bug,
Ctrl-C, a stream closed part way) aborts every request still held, so the engine is left
empty for the next call.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from kvlm.engine.engine import Engine, StepOutput, _Request
from kvlm.engine.metrics import Metrics
from kvlm.engine.request import CompletionOutput, RequestOutput
from kvlm.engine.sampling import SamplingParams

_ids = itertools.count()


@dataclass(slots=True)
class _Live:
    index: int  # the prompt's place in the call
    prompt: str | None
    request: _Request
    metrics: Metrics
    finished: int = 0  # samples that ended


def _add(engine: Engine, index: int, prompt: str | None, ids: list[int],
         params: SamplingParams, request_id: str, checked: bool = False,
         turn_start: int | None = None) -> _Live:  # fmt: skip
    engine.add_request(request_id, ids, params, checked=checked, turn_start=turn_start)
    return _Live(index, prompt, engine.requests[request_id], Metrics(prompt_tokens=len(ids)))


def _step(engine: Engine, live: dict[str, _Live]) -> list[StepOutput]:
    """One engine step, timed into the metrics of every request it ran."""
    t0 = time.perf_counter()
    events = engine.step()
    seconds = time.perf_counter() - t0
    batch = engine.last_plan  # every request with a forward in this step
    ran = {s.request_id for s in batch.decode} | {s.request_id for s, _ in batch.prefill}
    for rid in ran & live.keys():
        live[rid].metrics.record_forward(seconds)
    tokens: Counter[str] = Counter()  # every token a request got: all samples, all drafts kept
    for ev in events:
        tokens[ev.request_id] += len(ev.token_ids)
    for rid, count in tokens.items():
        if count:
            live[rid].metrics.record_token(count)
    for ev in events:
        item = live[ev.request_id]
        item.metrics.prefill_tokens = ev.prompt_tokens - ev.cached_tokens
        if ev.finish_reason is not None:
            item.finished += 1
    return events


def run_batch(
    engine: Engine,
    prompts: Sequence[tuple[str | None, list[int]]],
    params: Sequence[SamplingParams],
    bar: tqdm,
) -> list[RequestOutput]:
    """Run every prompt (already checked: Engine.check_request passes) to its end; one
    RequestOutput each, in the order given."""
    pending = deque(range(len(prompts)))
    live: dict[str, _Live] = {}
    results: list[RequestOutput | None] = [None] * len(prompts)
    sched = engine.scheduler
    start, generated = time.perf_counter(), 0
    try:
        while pending or live:
            # Feed the queue as it drains: the scheduler holds a bounded number of requests.
            while pending and len(sched.waiting) < sched.config.max_num_seqs:
                i = pending.popleft()
                rid = f"generate-{next(_ids)}"
                live[rid] = _add(engine, i, *prompts[i], params[i], rid, checked=True)
            events = _step(engine, live)
            generated += sum(len(ev.token_ids) for ev in events)
            for ev in events:
                item = live.get(ev.request_id)
                if ev.finish_reason and item and item.finished == item.request.params.n:
                    del live[ev.request_id]
                    results[item.index] = _output(item, ev.finish_reason)
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output: {generated / elapsed:.1f} toks/s", refresh=False)
    finally:
        for rid in list(live):  # an exception or interrupt: leave the engine empty
            engine.abort(rid)
    return results  # type: ignore[return-value]


class Stream:
    """One request on an engine: iterate for its first sample's text as it is produced;
    `output` holds the result (every sample's) once the iteration ends. Leaving the
    iteration early (Ctrl-C in a chat) aborts the request: `output` keeps what was
    generated, and `sync()` brings its text up to date."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        turn_start: int | None = None,
    ) -> None:
        self.engine = engine
        rid = f"stream-{next(_ids)}"
        self._live = {rid: _add(engine, 0, prompt, list(prompt_ids), params, rid,
                                turn_start=turn_start)}  # fmt: skip
        self._item = self._live[rid]
        self.output: RequestOutput = _output(self._item, None, final=False)

    @property
    def tokens(self) -> list[int]:
        """The first sample's sequence: prompt and generated tokens so far."""
        return self._item.request.seqs[0].token_ids

    def __iter__(self) -> Iterator[str]:
        item, n = self._item, self._item.request.params.n
        rid = item.request.request_id
        try:
            while item.finished < n:
                for ev in _step(self.engine, self._live):
                    if ev.index == 0 and ev.text:
                        yield ev.text
        finally:
            self.engine.abort(rid)  # a no-op once finished
            self.output = _output(item, self.output.finish_reason)

    def run(self) -> RequestOutput:
        for _ in self:
            pass
        return self.output

    def sync(self) -> None:
        """Bring every sample's text up to date (after an interrupted iteration)."""
        for seq in self._item.request.seqs:
            seq.sample.sync()


def _output(item: _Live, last_reason: str | None, final: bool = True) -> RequestOutput:
    req = item.request
    outputs = []
    for index in range(req.params.n):
        if index < len(req.seqs):
            sample = req.seqs[index].sample
            if final:
                sample.sync()  # finished ones already are; an aborted one keeps its text
            outputs.append(sample.out)
        else:  # never split off: its prompt failed before it finished prefilling
            logprobs = [] if req.params.logprobs is not None else None
            outputs.append(CompletionOutput(index, finish_reason=last_reason, logprobs=logprobs))
    if final:
        item.metrics.finish()
    return RequestOutput(item.prompt, list(req.prompt_ids), outputs, item.metrics,
                         prompt_logprobs=req.prompt_logprobs)  # fmt: skip
