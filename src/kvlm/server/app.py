"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine.

Why FastAPI on uvicorn: streaming is an async generator handed to a StreamingResponse,
which also notices a client that goes away and cancels the generator (whose `finally`
aborts the request, freeing its blocks); request bodies are pydantic models, so malformed
or unknown fields become a 400 that names the field; and it is what vLLM and most
OpenAI-compatible servers run, so clients meet the same HTTP behaviour.

    POST /v1/completions        POST /v1/chat/completions     (stream: SSE, "data: [DONE]")
    GET  /v1/models             GET  /health                  GET  /metrics (Prometheus text)
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import StepOutput
from kvlm.engine.sampling import SamplingParams
from kvlm.engine.scheduler import QueueFullError
from kvlm.errors import InvalidRequestError, KvlmError
from kvlm.server.metrics import render_metrics
from kvlm.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvlm.server.responses import Choices


class ServerError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvlm", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.max_model_len
    started = int(time.time())
    _install_error_handlers(app)

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`,
    # and a request behind it never saw its client disconnect (tests/test_server.py).
    async def check_api_key(request: Request) -> None:
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ServerError(401, "invalid or missing API key", "authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "kvlm"}
        return {"object": "list", "data": [card | {"max_model_len": max_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        ids = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        params = _params(body, ids, max_len, body.logprobs)
        choices = Choices(tokenizer, params.n, chat=False, logprobs=body.logprobs is not None)
        return await _respond(engine, request, body, ids, params, choices, model_name)

    @v1.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        ids = tokenizer.encode_chat(body.conversation())
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _params(body, ids, max_len, top)
        choices = Choices(tokenizer, params.n, chat=True, logprobs=body.logprobs)
        return await _respond(engine, request, body, ids, params, choices, model_name)

    app.include_router(v1)
    return app


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ServerError(
            404,
            f"the model {requested!r} does not exist; this server serves {served!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _params(body: Any, ids: list[int], max_len: int, logprobs: int | None) -> SamplingParams:
    room = max_len - len(ids)
    if room < 1:
        raise ServerError(
            400,
            f"this model's maximum context length is {max_len} tokens; the prompt has "
            f"{len(ids)} tokens",
            "invalid_request_error",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    wanted = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if wanted is not None and wanted > room:
        raise ServerError(
            400,
            f"this model's maximum context length is {max_len} tokens; you requested "
            f"{len(ids) + wanted} ({len(ids)} in the prompt, {wanted} for the completion)",
            "invalid_request_error",
            "max_tokens",
            "context_length_exceeded",
        )
    try:
        params = body.sampling_params(wanted or room, logprobs)
    except ValueError as exc:
        raise ServerError(400, str(exc), "invalid_request_error") from exc
    return params


async def _respond(
    engine: AsyncEngine,
    request: Request,
    body: Any,
    ids: list[int],
    params: SamplingParams,
    choices: Choices,
    model_name: str,
) -> Any:
    try:
        events = await engine.generate(ids, params)
    except QueueFullError as exc:
        raise ServerError(503, str(exc), "server_busy", code="queue_full") from exc
    rid = ("chatcmpl-" if choices.chat else "cmpl-") + uuid.uuid4().hex
    head = choices.head(rid, model_name)
    if body.stream:
        sse = _sse(events, choices, head, body.include_usage, len(ids))
        return StreamingResponse(sse, media_type="text/event-stream")
    try:
        result = await _collect(events, choices, request)
    except QueueFullError as exc:  # filled between the check and the engine's intake
        raise ServerError(503, str(exc), "server_busy", code="queue_full") from exc
    if result is None:  # the client went away: its request was aborted
        return JSONResponse({}, status_code=499)
    if any(c.finish_reason == "error" for c in choices.state):
        raise ServerError(500, "the engine failed on this request", "server_error")
    return head | {"choices": choices.final(), "usage": choices.usage(len(ids), result)}


async def _collect(
    events: AsyncIterator[StepOutput], choices: Choices, request: Request
) -> StepOutput | None:
    """Run a non-streamed request to the end; abort it if the client disconnects."""

    async def consume() -> StepOutput | None:
        last = None
        async for event in events:
            choices.add(event)
            last = event
        return last

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        # Gone (seen here, or the server cancelled this handler): cancelling raises inside
        # the event stream, whose `finally` aborts the request and frees its blocks.
        if not task.done():
            task.cancel()


async def _sse(
    events: AsyncIterator[StepOutput],
    choices: Choices,
    head: dict,
    include_usage: bool,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    try:
        for chunk in choices.opening(head):
            yield _data(chunk)
        last = None
        async for event in events:
            last = event
            chunk = choices.chunk(head, event)
            if chunk is not None:
                yield _data(chunk)
        if include_usage and last is not None:
            yield _data(head | {"choices": [], "usage": choices.usage(prompt_tokens, last)})
        yield "data: [DONE]\n\n"
    except KvlmError as exc:
        yield _data(error_body(str(exc), "server_error"))
    finally:
        await events.aclose()  # a disconnect lands here: the request is aborted


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(_: Request, exc: ServerError) -> JSONResponse:
        body = error_body(str(exc), exc.type, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(where) or None
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif first.get("type") == "extra_forbidden":
            message = f"unrecognized request argument supplied: {param}"
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(InvalidRequestError)
    async def bad_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)
