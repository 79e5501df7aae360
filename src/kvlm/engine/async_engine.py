"""AsyncEngine: the Engine on a thread of its own, fed and read from an asyncio loop.

    event loop (HTTP)                       engine thread
    submit() --(_add, ...)----> inbox ---> drain inbox, engine.step(), ...
    abort()  --(_abort, id)---> inbox       |
    stream queue <--- call_soon_threadsafe -+ StepOutput events

The loop never waits for a step: requests and aborts go through a queue the engine thread
drains before every step, and events come back through the loop's own queue per request.
A request whose consumer goes away (a client that disconnects) is aborted in the
consumer's `finally`, so its blocks are freed by the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from kvlm.engine.engine import Engine, StepOutput
from kvlm.engine.guided import Guide, compile_guide
from kvlm.engine.sampling import SamplingParams
from kvlm.engine.scheduler import QueueFullError
from kvlm.errors import KvlmError

log = logging.getLogger("kvlm.engine")
T = TypeVar("T")

# How often a thread that wants the GIL makes the holder hand it over (Python's default:
# 5 ms). Every torch op of a step releases the GIL and takes it back, so while another
# thread runs Python (a scored prompt's logprobs made into JSON, a tokenizer, the router)
# each op of the engine waited up to the interval: a 55 ms step of 13 decode rows took
# 399 ms (up to 2.7 s) beside one busy Python thread on a 2-core Zen 3, and 199 ms (up to
# 0.7 s) at 0.5 ms. Set for the process while an engine loop runs (it serves beside HTTP).
SWITCH_INTERVAL_S = 0.0005


class EngineBusyError(KvlmError):
    """The engine thread did not come between two steps within the caller's deadline (a
    long step under way): try again (the server answers 503 with a Retry-After)."""


class EngineStoppedError(KvlmError):
    """The engine has stopped (the server is shutting down): nothing more runs on it."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[StepOutput | BaseException]
    remaining: int  # samples not yet finished


class AsyncEngine:
    def __init__(self, engine: Engine, max_requests: int | None = None) -> None:
        self.engine = engine
        self.info = engine.info  # what the routes may know of the engine
        # Requests held at once (running + queued); one more is refused with QueueFullError.
        self.max_requests = max_requests or engine.scheduler.capacity
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvlm-engine", daemon=True)
        self._running_on: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine on a thread of its own (tests; `kvlm serve` uses run_forever)."""
        self._thread.start()

    def run_forever(self) -> None:
        """Run the engine on the calling thread until stop(). Prefer the main thread: an
        OpenMP team started from another thread decoded ~30% slower here (21 vs 15 tok/s,
        200 tokens of the default model), so `kvlm serve` gives the main thread to the
        engine and a thread to the HTTP loop."""
        self._running_on = threading.current_thread()
        self._run()

    def request_stop(self) -> None:
        """Ask the loop to stop after the step under way (safe from a signal handler)."""
        self._stop = True
        self._wake.set()

    def stop(self) -> None:
        """Stop the loop (waiting for the step under way), then end every open stream and
        pending call with EngineStoppedError: a client gets a last event or a 503 at once,
        not a connection cut when the HTTP server stops waiting for it."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._end_all(EngineStoppedError("the server is shutting down"))

    def _end_all(self, exc: EngineStoppedError) -> None:
        """Fail what waits on the stopped loop: queued calls and every open stream."""
        calls = [args for handler, *args in self._pending() if handler == self._call]
        for _, loop, future in calls:  # (fn, loop, future): fn never runs
            _soon(loop, _settle, future, None, exc)
        for stream in list(self._streams.values()):
            _soon(stream.loop, stream.events.put_nowait, exc)

    @property
    def alive(self) -> bool:
        on = self._running_on
        return not self._stop and (self._thread.is_alive() or (on is not None and on.is_alive()))

    def metrics(self) -> dict:
        """The engine's snapshot (Engine.snapshot: plain values, read while it may be
        stepping, each a number it wrote whole) and the requests this loop holds."""
        return self.engine.snapshot() | {"requests_held": len(self._streams)}

    # ------------------------------------------------------------------ the loop's side

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        turn_start: int | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Events of one request until all its samples finish. Raises KvlmError subclasses
        before the first event for a request that cannot run (checked at once).
        `turn_start`: Engine.add_request's."""
        rid = request_id or f"req-{next(self._ids)}"
        if self._stop:
            raise EngineStoppedError("the server is shutting down")
        if params.guide is not None:  # check_request finds it compiled
            params.guide = await self.compile_guide(params.guide)
        self.engine.check_request(prompt_ids, params, cache_salt)
        if len(self._streams) >= self.max_requests:
            raise QueueFullError(f"the server is busy ({self.max_requests} requests held)")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        self._streams[rid] = stream
        self._send((self._add, rid, prompt_ids, params, cache_salt, turn_start))
        events = self._events(rid, stream)
        # a consumer that drops its events before it starts them never runs _events'
        # finally (a stream whose response was cancelled before its body began, or one
        # the keep-alive's pending read was cancelled for): the request is let go when
        # the generator is
        weakref.finalize(events, self._let_go, rid, stream).atexit = False
        return events

    async def compile_guide(self, guide: Guide) -> Guide:
        """`guide` compiled (kvlm.engine.guided.compile_guide: a no-op once it is), on a
        worker thread: off the event loop and off the engine thread."""
        if guide.compiled is not None:
            return guide
        info = self.info
        return await asyncio.to_thread(compile_guide, guide, info.tokenizer, info.vocab_size)

    def close(self) -> None:
        """After stop(): finish the engine's tier writes (Engine.close)."""
        self.engine.close()

    async def _events(self, rid: str, stream: _Stream) -> AsyncIterator[StepOutput]:
        try:
            while stream.remaining:
                event = await stream.events.get()
                if isinstance(event, BaseException):
                    raise event
                if event.finish_reason is not None:
                    stream.remaining -= 1
                yield event
        finally:
            self._let_go(rid, stream)

    def _let_go(self, rid: str, stream: _Stream) -> None:
        """The consumer of `rid`'s events is done or gone: it is no longer held, and one that
        left early has its request aborted (its blocks freed). Once per stream."""
        if self._streams.get(rid) is not stream:
            return
        del self._streams[rid]
        if stream.remaining:
            self._send((self._abort, rid))

    async def call(self, fn: Callable[[Engine], T], timeout: float = 10.0) -> T:
        """fn(engine) run on the engine thread between two steps (what reads the pool's
        state whole, as /v1/kv does: the engine thread mutates it during a step)."""
        if self._stop:
            raise EngineStoppedError("the server is shutting down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._send((self._call, fn, loop, future))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:  # a step longer than the deadline is under way
            raise EngineBusyError(
                f"the engine is busy: it did not come between two steps within {timeout:g} s"
            ) from None

    def tell(self, fn: Callable[[Engine], None]) -> None:
        """fn(engine) run on the engine thread before its next step, nobody waiting: what
        must happen even when the engine is busy (a pin let go)."""
        if not self._stop:
            self._send((fn, self.engine))

    def _send(self, message: tuple) -> None:
        """(handler, *args): handler(*args) runs on the engine thread before its next step."""
        self._inbox.put(message)
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        """The engine loop. It survives any exception: a request's own failure ends that
        request (Engine.step isolates it); anything else (a scheduler bug) ends the requests
        held, and the loop goes on serving new ones."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        while not self._stop:
            try:
                for handler, *args in self._pending():  # (handler, *args) messages
                    handler(*args)
                if not self.engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                events = self.engine.step()
            except Exception:
                log.exception("the engine step failed; ending the requests it held")
                events = self._abort_all()
            self._deliver(events)

    def _abort_all(self) -> list[StepOutput]:
        events = []
        for rid in list(self.engine.requests):
            try:
                events += self.engine.abort(rid, reason="error")
            except Exception:  # the state is broken: at least tell the client
                log.exception("could not abort request %s", rid)
                self._tell(rid, KvlmError("the engine failed on this request"))
        return events

    def _pending(self) -> Iterator[tuple]:
        """The inbox's messages, taken until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, cache_salt, turn_start
    ) -> None:
        try:
            self.engine.add_request(rid, prompt_ids, params, cache_salt, checked=True,
                                    turn_start=turn_start)  # fmt: skip
        except KvlmError as exc:  # e.g. the queue filled since the check
            self._tell(rid, exc)
        except Exception as exc:  # a bug in admission: this request only
            log.exception("request %s could not be added", rid)
            self._tell(rid, KvlmError(f"the engine could not take this request ({exc})"))

    def _abort(self, rid: str) -> None:
        self._deliver(self.engine.abort(rid))

    def _call(self, fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        if future.done():  # its caller gave up waiting: a stale call costs a step nothing
            return
        try:
            result, error = fn(self.engine), None
        except Exception as exc:
            result, error = None, exc
        _soon(loop, _settle, future, result, error)

    def _deliver(self, events: list[StepOutput]) -> None:
        for event in events:
            self._tell(event.request_id, event)

    def _tell(self, rid: str, item: StepOutput | BaseException) -> None:
        """An event or an error for request `rid`'s stream, if it is still open."""
        stream = self._streams.get(rid)
        if stream is not None:
            _soon(stream.loop, stream.events.put_nowait, item)


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """fn(*args) on `loop`'s thread; nothing once the loop has closed (the server is
    shutting down)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """A call's answer, on its event loop (skipped if the caller has timed out)."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
