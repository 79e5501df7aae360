"""The OpenAI-compatible server (`kvlm serve`): kvlm.server.app has the routes."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.errors import KvlmError
from kvlm.llm import LLM
from kvlm.server.limits import ServerLimits


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
) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM): HTTP on a thread, the engine on this
    one (see AsyncEngine.run_forever)."""
    import uvicorn

    from kvlm.server.app import create_app
    from kvlm.server.limits import HeadTimeoutH11Protocol

    limits = limits or ServerLimits()
    engine = AsyncEngine(Engine(llm, config))
    name = model_name or llm.model_name
    app = create_app(engine, name, api_key, limits, tool_parser)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=2,
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
    pool = engine.engine.pool
    print(
        f"kvlm: serving {name} on http://{host}:{port}/v1 "
        f"(KV pool {pool.num_blocks} blocks of {pool.block_size} tokens, "
        f"{pool.store.nbytes / 2**20:,.0f} MiB; context {engine.engine.max_model_len})",
        file=sys.stderr,
        flush=True,
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    try:
        engine.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.stop()
        http.should_exit = True
        thread.join(timeout=5)
        engine.engine.close()  # the KV tiers' queued writes land before the process ends
