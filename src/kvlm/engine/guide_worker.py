"""The compile workers: long-lived child processes that compile each guide first, so a
grammar that crashes llguidance's native code (a stack overflow is SIGSEGV, no exception)
or runs away ends a child, not the server. There are WORKERS of them per tokenizer
(`GuideWorkers`), so a guide that holds its worker for the whole COMPILE_TIMEOUT does not
hold up everyone else's guides.

    server                                  worker (python -m kvlm.engine.guide_worker)
    check_bounds (pure Python)
    GuideWorker.check(guide)  --frame-->    build_matcher on an 8 MiB-stack thread:
                              <--frame--    grammar, LLMatcher, first mask (the lazy compile)
    build_matcher on a 64 MiB-stack thread  (killed past COMPILE_TIMEOUT, restarted at once)

A frame is a 4-byte big-endian length and UTF-8 JSON. The first one carries the tokenizer
(llguidance's LLTokenizer takes ~0.3 s to build: once per worker). The worker's stack is
the engine thread's (8 MiB) and the server's compile thread has 8 times more, so what the
worker survives the server does with room to spare. This module imports no torch: the
worker starts in well under a second.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from kvlm.errors import InvalidRequestError, KvlmError

COMPILE_TIMEOUT = 3.0  # seconds for the worker's compile and first mask
START_TIMEOUT = 60.0  # a worker's start and tokenizer (a loaded 2-core machine: seconds)
WORKER_STACK = 8 << 20  # the engine thread's stack (Linux's default)
# Compile workers per tokenizer, and compile threads in the server: a hostile guide holds
# one of each for up to COMPILE_TIMEOUT; the others go on serving the rest. With two, a
# client sending hostile guides two at a time held every other guided request up to 3 s
# each (the soak of [12]); four leave one free beside three. Each worker is a Python
# process with its own LLTokenizer (~40 MB), started only when that many compile at once.
WORKERS = 4

# JSON as json.dumps writes it: ", " and ": ", no other whitespace. Free whitespace lets a
# small model spend its tokens on newlines and indents (a random-weight one never closes
# the object); a schema's own "x-guidance" options still override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own resource limits, per matcher (LLParserLimits; defaults in brackets):
# the lexer's fuel to build its first regexes [1,000,000, ~20 ms] and per mask step
# [200,000, ~14 ms], Earley items per step [50,000], lexer states [250,000, 1-2 kB each].
# Lower here: one mask stays a few ms on the engine thread, a lexer a few tens of MB; a
# grammar past them is an error at compile (a 400) or ends its sample (GuideState.mask).
PARSER_LIMITS = {
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 100_000,
    "step_max_items": 20_000,
    "max_lexer_states": 20_000,
}

log = logging.getLogger("kvlm.guided")


def _write(stream, obj: Any) -> None:
    data = json.dumps(obj).encode()
    stream.write(len(data).to_bytes(4, "big") + data)
    stream.flush()


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    out = b""
    while len(out) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, size - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def _read(fd: int, deadline: float | None = None) -> Any:
    size = int.from_bytes(_read_exact(fd, 4, deadline), "big")
    return json.loads(_read_exact(fd, size, deadline))


class GuideWorker:
    """One worker process for one tokenizer; `check` is serialised (one compile at a time)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int] | None) -> None:
        self._init = {"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": eos}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ready = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def check(self, kind: str, spec: Any, param: str) -> None:
        """Compile the guide in the worker: InvalidRequestError naming `param` for a bad
        guide, one that crashes the worker, or one past COMPILE_TIMEOUT."""
        with self._lock:
            proc = self._started()
            try:
                _write(proc.stdin, {"kind": kind, "spec": spec, "param": param})
                reply = _read(proc.stdout.fileno(), time.monotonic() + COMPILE_TIMEOUT)
            except TimeoutError:
                self._restart()
                raise InvalidRequestError(
                    f"{param}: compiling it took longer than {COMPILE_TIMEOUT:g} s; "
                    "simplify it", param=param) from None  # fmt: skip
            except (EOFError, OSError):
                code = proc.wait()
                self._restart()
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
                log.warning("the guide compiler crashed (%s) on a %s; restarted", how, param)
                raise InvalidRequestError(
                    f"{param}: the grammar compiler crashed on it ({how}); simplify it",
                    param=param,
                ) from None
        if reply.get("error"):
            raise InvalidRequestError(reply["error"], param=param)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _started(self) -> subprocess.Popen:
        if self._proc is None:
            self._spawn()
        if not self._ready:
            try:
                _read(self._proc.stdout.fileno(), time.monotonic() + START_TIMEOUT)
            except (TimeoutError, EOFError, OSError):
                self._stop()
                raise KvlmError("the guide compile worker did not start") from None
            self._ready = True
        return self._proc

    def _spawn(self) -> None:
        # -m: the package's __init__ is lazy, so the child imports llguidance and no torch
        cmd = [sys.executable, "-m", "kvlm.engine.guide_worker"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)  # fmt: skip
        self._ready = False
        _write(self._proc.stdin, self._init)  # it builds its tokenizer while we go on

    def _restart(self) -> None:
        self._stop()
        self._spawn()  # at once: the next request finds it (nearly) ready

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class GuideWorkers:
    """WORKERS compile workers for one tokenizer: `check` takes an idle one (the most
    recently used first, so a second process starts only when two guides compile at
    once) and waits while all are busy."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int] | None) -> None:
        self.workers = [GuideWorker(tokenizer_json, vocab_size, eos) for _ in range(WORKERS)]
        self._idle: queue.LifoQueue[GuideWorker] = queue.LifoQueue()
        for worker in reversed(self.workers):  # workers[0] on top: the first one used
            self._idle.put(worker)

    def check(self, kind: str, spec: Any, param: str) -> None:
        worker = self._idle.get()
        try:
            worker.check(kind, spec, param)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def grammar_of(kind: str, spec: Any, param: str) -> str:
    import llguidance

    m = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            return m.grammar_from_json_schema(json.dumps(spec), defaults=JSON_STYLE)
        if kind == "json_object":
            return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE)
        if kind == "regex":
            return m.grammar_from_regex(spec)
        if kind == "choice":
            return m.grammar_from_regex("|".join(re.escape(c) for c in spec))
        if kind == "grammar":
            return m.grammar_from_lark(spec)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None
    raise InvalidRequestError(f"unknown guide {kind!r}", param=param)


def build_matcher(kind: str, spec: Any, param: str, tok: Any) -> tuple[Any, bytes]:
    """The matcher for a guide and its first mask (computing it runs llguidance's lazy
    compile); InvalidRequestError naming `param` for a guide it refuses. Run by the worker
    first, then by the server (the same function: the same outcome)."""
    import llguidance

    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    matcher = llguidance.LLMatcher(tok, grammar_of(kind, spec, param), log_level=0,
                                   limits=limits)  # fmt: skip
    first = b"" if matcher.is_error() else matcher.compute_bitmask()
    if matcher.is_error():
        raise InvalidRequestError(f"{param}: {matcher.get_error()}", param=param)
    return matcher, first


def _serve() -> None:
    """The child: the tokenizer once, then one compile per frame until stdin closes."""
    import llguidance

    fd, out = sys.stdin.fileno(), sys.stdout.buffer
    init = _read(fd)
    tok = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["vocab_size"],
                                 eos_token=init["eos"])  # fmt: skip
    _write(out, {"ready": True})
    while True:
        try:
            req = _read(fd)
        except EOFError:  # the server went away
            return
        try:
            build_matcher(req["kind"], req["spec"], req["param"], tok)
            _write(out, {"error": None})
        except InvalidRequestError as exc:
            _write(out, {"error": str(exc)})


if __name__ == "__main__":
    threading.stack_size(WORKER_STACK)  # the compile's stack: the engine thread's
    worker = threading.Thread(target=_serve)
    worker.start()
    worker.join()
