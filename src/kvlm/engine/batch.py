"""LLM.generate's batch: many prompts through the Engine at once, results in prompt order.

    prompts -> queue -> Engine (continuous batching over the paged pool) -> events
                 ^ fed as the engine's waiting queue drains     |
                 +------ a request's n final events: its RequestOutput, the bar advances

The engine runs the same forwards for a prompt as a single stream runs for it alone (see
LLM.batch_engine: whole prefill chunks, no prefix sharing, no preemption; batch-invariant
kernels), so each prompt gets its single-stream tokens. A request that fails ends alone
with finish_reason "error" (Engine._fail); the others finish. Anything else that raises
(a scheduler bug, Ctrl-C) aborts every request still held, so the engine is left empty for
the next call, and propagates.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from kvlm.engine.engine import Engine, _Request
from kvlm.engine.metrics import Metrics
from kvlm.engine.request import CompletionOutput, RequestOutput
from kvlm.engine.sampling import SamplingParams


@dataclass(slots=True)
class _Live:
    index: int  # the prompt's place in the call
    prompt: str | None
    request: _Request
    metrics: Metrics
    finished: int = 0  # samples that ended


def run_batch(
    engine: Engine,
    prompts: Sequence[tuple[str | None, list[int]]],
    params: Sequence[SamplingParams],
    bar: tqdm,
    request_ids: Sequence[str],
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
                text, ids = prompts[i]
                rid = request_ids[i]
                engine.add_request(rid, ids, params[i])
                live[rid] = _Live(i, text, engine.requests[rid], Metrics(prompt_tokens=len(ids)))
            t0 = time.perf_counter()
            events = engine.step()
            seconds = time.perf_counter() - t0
            batch = engine.last_batch
            if batch:  # every request with a forward in this step
                ran = {s.request_id for s in batch.decode}
                ran |= {s.request_id for s, _ in batch.prefill}
                for rid in ran & live.keys():
                    live[rid].metrics.record_forward(seconds)
            tokens = Counter(ev.request_id for ev in events if ev.token_ids)
            for rid, count in tokens.items():
                live[rid].metrics.record_token(count)
            generated += sum(tokens.values())
            for ev in events:
                item = live[ev.request_id]
                item.metrics.prefill_tokens = ev.prompt_tokens - ev.cached_tokens
                if ev.finish_reason is None:
                    continue
                item.finished += 1
                if item.finished == item.request.params.n:
                    del live[ev.request_id]
                    results[item.index] = _output(item, ev.finish_reason)
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output: {generated / elapsed:.1f} toks/s", refresh=False)
    finally:
        for rid in list(live):  # an exception or interrupt: leave the engine empty
            engine.abort(rid)
    return results  # type: ignore[return-value]


def _output(item: _Live, last_reason: str) -> RequestOutput:
    req = item.request
    outputs = []
    for index in range(req.params.n):
        if index < len(req.seqs):
            sample = req.seqs[index].sample
            sample.sync()  # finished ones already are; an aborted one keeps its text so far
            outputs.append(sample.out)
        else:  # never split off: its prompt failed before it finished prefilling
            logprobs = [] if req.params.logprobs is not None else None
            outputs.append(CompletionOutput(index, finish_reason=last_reason, logprobs=logprobs))
    item.metrics.finish()
    return RequestOutput(item.prompt, list(req.prompt_ids), outputs, item.metrics)
