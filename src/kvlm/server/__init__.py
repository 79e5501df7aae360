"""The OpenAI-compatible server (`kvlm serve`): kvlm.server.app has the routes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any, NoReturn

from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import EngineConfig
from kvlm.errors import KvlmError
from kvlm.llm import LLM
from kvlm.server.defaults import SamplingDefaults
from kvlm.server.limits import ServerLimits

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Shutting down within 2 s: the engine ends every open stream (a last event) before the
# HTTP server stops, so it seldom waits; a handler still busy after this is cancelled.
HTTP_STOP_S = 1


def log_to_stderr(log_level: str) -> None:
    """kvlm's own lines at `log_level` (info: the engine's longest steps and what they
    held), other libraries' at warning, on stderr: `kvlm serve`, and each replica of
    `kvlm serve --replicas` (Ray hands a replica's stderr on to the driver's output)."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("kvlm").setLevel("DEBUG" if log_level == "trace" else log_level.upper())


def serve(
    llm: LLM,
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    tool_parser: str | None = None,
    reasoning_parser: str = "auto",
    sampling: SamplingDefaults | None = None,
    slot_save_path: str | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM): HTTP on a thread, the engine on this
    one (see AsyncEngine.run_forever). Returns once shut down; or ends the process itself
    (exit 0) where the engine thread is still inside a step then, and at a second signal
    (exit 1): see _Stopper."""
    import uvicorn

    from kvlm.server.app import engine_app
    from kvlm.server.limits import HeadTimeoutH11Protocol

    limits = limits or ServerLimits()
    name = model_name or llm.model_name
    engine, app = engine_app(llm, config, name, api_key, limits, tool_parser, reasoning_parser,
                             sampling, slot_save_path)  # fmt: skip
    log_to_stderr(log_level)
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=HTTP_STOP_S,
        http=HeadTimeoutH11Protocol,
        timeout_keep_alive=int(limits.keep_alive_s),
        limit_concurrency=limits.max_connections,
    )
    uv.kvlm_limits = limits  # read by HeadTimeoutH11Protocol
    http = uvicorn.Server(uv)
    thread = threading.Thread(target=http.run, name="kvlm-http", daemon=True)
    thread.start()
    while not http.started:  # bound and listening, or failed trying
        if not thread.is_alive():
            raise KvlmError(f"could not serve on {host}:{port} (is the port in use?)")
        time.sleep(0.05)
    info = engine.info
    where = f"http://{host}:{port}/v1 ({info.kv}; context {info.max_model_len})"
    print(f"kvlm: serving {name} on {where}", file=sys.stderr, flush=True)
    # the engine loop on this thread until SIGINT/SIGTERM, then the shutdown (_Stopper)
    stopper = _Stopper(engine, http, thread)
    previous = stopper.install()
    try:
        engine.run_forever()
    finally:
        stopper.returned.set()
        stopper.stop_all()  # done already by the stopper's thread, or done here
        stopper.uninstall(previous)


class _Stopper:
    """SIGINT/SIGTERM, handled off the engine thread. A decode step is one call into the
    fused C kernel (kvlm.model.fused) and Python runs a signal handler only between two
    bytecodes, so a handler on the engine thread waited for the step under way: 1-5 s per
    step on a loaded 2-vCPU machine. Python's own C-level handler also writes the signal's
    number to the wakeup fd at once, so a thread reading it starts the shutdown while the
    step runs: stop the loop after this step, end every open stream with a last event and
    every queued call with a 503 (engine.stop), stop the HTTP server, let the KV tiers'
    queued writes land (bounded). If the engine thread is still inside its step then, the
    process leaves without it (its results have no reader). A second signal: leave at once.
    """

    def __init__(self, engine: AsyncEngine, http: Any, thread: threading.Thread) -> None:
        self.engine, self.http, self.thread = engine, http, thread
        self.returned = threading.Event()  # run_forever has returned
        self._lock = threading.Lock()
        self._stopped = False
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)  # set_wakeup_fd requires it

    def install(self) -> dict:
        self._wakeup = signal.set_wakeup_fd(self._write.fileno())
        previous = {sig: signal.signal(sig, self._on_main) for sig in STOP_SIGNALS}
        threading.Thread(target=self._watch, name="kvlm-signals", daemon=True).start()
        return previous

    def uninstall(self, previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._wakeup)

    def _on_main(self, signum: int, frame: FrameType | None) -> None:
        self.engine.request_stop()  # (the watcher has seen it already)

    def _watch(self) -> None:
        seen = 0
        while data := self._read.recv(64):
            seen += sum(byte in STOP_SIGNALS for byte in data)
            if seen == 1:
                threading.Thread(target=self._shutdown, name="kvlm-stop", daemon=True).start()
            elif seen > 1:
                exit_now(1)  # asked twice: leave without waiting for anything

    def _shutdown(self) -> None:
        self.stop_all()
        if not self.returned.wait(0.2):  # the engine thread is inside a step
            exit_now(0)

    def stop_all(self) -> None:
        """The shutdown, once, whichever thread comes first (each part bounded)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.engine.stop()  # open streams get their last event, queued calls a 503
            self.http.should_exit = True  # uvicorn checks it every 0.1 s
            self.thread.join(timeout=HTTP_STOP_S + 1)
            self.engine.close()  # tiers: at most CLOSE_FLUSH_S


def exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's teardown, once what must land has (streams ended,
    the HTTP thread stopped, the tiers flushed): the teardown after torch (its op
    registry's finalizers, then every module) took 1.2-2.2 s here, more than all the rest
    of a shutdown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
