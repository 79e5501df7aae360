"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine.

Why FastAPI on uvicorn: streaming is an async generator handed to a StreamingResponse,
which also notices a client that goes away and cancels the generator (whose `finally`
aborts the request, freeing its blocks); request bodies are pydantic models, so malformed
or unknown fields become a 400 that names the field; and it is what vLLM and most
OpenAI-compatible servers run, so clients meet the same HTTP behaviour.

    POST /v1/completions        POST /v1/chat/completions     (stream: SSE, "data: [DONE]")
    GET  /v1/models             GET  /health                  GET  /metrics (Prometheus text)
    GET  /openapi.json          (kvlm.server.openapi)

What a client can do to the server is bounded (kvlm.server.limits): body size, time to send
a request, open connections. Tokenizing and rendering the chat template run on a worker
thread, so a long prompt never stalls the event loop (every other stream and /health).
Any failure answers with OpenAI's error body, never a plain-text 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlm.engine.async_engine import AsyncEngine
from kvlm.engine.engine import StepOutput
from kvlm.engine.sampling import MAX_SAMPLES, SamplingParams
from kvlm.engine.scheduler import QueueFullError
from kvlm.errors import InvalidRequestError, KvlmError
from kvlm.server import openapi
from kvlm.server.limits import RequestLimits, ServerLimits
from kvlm.server.metrics import render_metrics
from kvlm.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvlm.server.responses import Choices

log = logging.getLogger("kvlm.server")
# Normalisation can shrink a text (NFKC composes sequences), so the character bound that
# proves a prompt too long without tokenizing it keeps this much margin.
_CHARS_MARGIN = 4


class ServerError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def create_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="kvlm", version="1", docs_url=None, redoc_url=None)
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.max_model_len
    max_samples = min(MAX_SAMPLES, engine.engine.scheduler.config.max_num_seqs)
    openapi.install(app, model_name, max_len, max_samples)
    app.add_middleware(RequestLimits, limits=limits)
    started = int(time.time())
    _install_error_handlers(app)
    expected = f"Bearer {api_key}".encode() if api_key else None

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`,
    # and a request behind it never saw its client disconnect (tests/test_server.py).
    async def check_api_key(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):  # constant time: no timing oracle
            raise ServerError(401, "invalid or missing API key", "authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    guarded = [] if limits.public_metrics else [Depends(check_api_key)]

    @app.get("/health", responses={200: {"model": openapi.Health}, 503: {"model": openapi.Health}})
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics",
        dependencies=guarded,
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                   **openapi.errors(401)},
    )  # fmt: skip
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @v1.get("/models", responses={200: {"model": openapi.ModelList}, **openapi.errors(401)})
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "kvlm"}
        return {"object": "list", "data": [card | {"max_model_len": max_len}]}

    def check_length(chars: int, param: str) -> None:
        """Refuse a text too long to fit without tokenizing it: each token decodes to at
        most max_token_chars characters, so c characters are at least c / that tokens."""
        bound = max_len * tokenizer.max_token_chars * _CHARS_MARGIN
        if chars > bound:
            raise ServerError(
                400,
                f"this model's maximum context length is {max_len} tokens; the prompt has "
                f"{chars} characters, more than {max_len} tokens can hold",
                "invalid_request_error", param, "context_length_exceeded",
            )  # fmt: skip

    @v1.post("/completions", responses=openapi.generation(openapi.CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        if isinstance(body.prompt, list):
            ids = body.prompt
        else:
            check_length(len(body.prompt), "prompt")
            ids = await run_in_threadpool(tokenizer.encode, body.prompt)
        params = _params(body, ids, max_len, body.logprobs)
        choices = Choices(tokenizer, params.n, chat=False, logprobs=body.logprobs is not None)
        return await _respond(engine, request, body, ids, params, choices, model_name)

    @v1.post("/chat/completions", responses=openapi.generation(openapi.ChatCompletionResponse))
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        conversation = body.conversation()
        check_length(sum(len(m["content"]) for m in conversation), "messages")
        ids = await run_in_threadpool(tokenizer.encode_chat, conversation)
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
    except InvalidRequestError as exc:
        raise ServerError(400, str(exc), "invalid_request_error", exc.param) from exc
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
        events = await engine.generate(ids, params, cache_salt=body.cache_salt)
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
        raise ServerError(500, ENGINE_FAILED, "server_error")
    return head | {"choices": choices.final(), "usage": choices.usage(len(ids), result)}


ENGINE_FAILED = "the engine failed on this request (other requests are unaffected)"


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
            if event.finish_reason == "error":  # the request failed: say so, OpenAI's way
                yield _data(error_body(ENGINE_FAILED, "server_error"))
                yield "data: [DONE]\n\n"
                return
            last = event
            chunk = choices.chunk(head, event)
            if chunk is not None:
                yield _data(chunk)
        if include_usage and last is not None:
            usage = choices.usage(prompt_tokens, last)
            yield _data(head | {"object": choices.chunk_object, "choices": [], "usage": usage})
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
        return JSONResponse(_validation_body(exc.errors()), status_code=400)

    @app.exception_handler(InvalidRequestError)
    async def bad_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), param=exc.param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), kind)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets OpenAI's shape, not plain text
        log.error("unhandled error in a request", exc_info=exc)
        return JSONResponse(error_body(ENGINE_FAILED, "server_error"), status_code=500)


# pydantic names a union member in an error's location ("function-after[...]", "str",
# "list[TextPart]"): not a field a client wrote.
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_body(errors: list[dict]) -> dict:
    """The first error that is not a union member's type mismatch (a list given where the
    union's string failed is not what the client got wrong), as OpenAI's body."""
    if not errors:
        return error_body("invalid request")
    first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0])
    where = [
        str(p) for p in first.get("loc", ())
        if isinstance(p, int) or (p != "body" and _FIELD.fullmatch(p) and p not in _TYPE_NAMES)
    ]  # fmt: skip
    param = ".".join(where) or None
    kind = first.get("type")
    if kind == "json_invalid":
        message = "the request body is not valid JSON"
    elif kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    else:
        what = str(first.get("msg")).removeprefix("Value error, ")
        message = f"{param}: {what}" if param else what
    return error_body(message, param=param)
