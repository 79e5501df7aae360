"""The OpenAI-compatible server (`kvlm serve`): kvlm.server.app has the routes."""

from __future__ import annotations

import logging
import sys

from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import Engine, EngineConfig
from kvlm.llm import LLM


def serve(
    llm: LLM,
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    log_level: str = "info",
) -> None:
    """Run the server until interrupted."""
    import uvicorn

    from kvlm.server.app import create_app

    engine = AsyncEngine(Engine(llm, config))
    engine.start()
    name = model_name or llm.model_name
    app = create_app(engine, name, api_key)
    pool = engine.engine.pool
    print(
        f"kvlm: serving {name} on http://{host}:{port}/v1 "
        f"(KV pool {pool.num_blocks} blocks of {pool.block_size} tokens, "
        f"{pool.store.nbytes / 2**20:,.0f} MiB; context {engine.engine.max_model_len})",
        file=sys.stderr,
    )
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
    finally:
        engine.shutdown()
