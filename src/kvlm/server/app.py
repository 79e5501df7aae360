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
import base64
import dataclasses
import functools
import hashlib
import hmac
import importlib.resources
import json
import logging
import re
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlm import __version__
from kvlm.engine.async_engine import AsyncEngine, EngineBusyError, EngineStoppedError
from kvlm.engine.engine import Engine, EngineConfig, StepOutput
from kvlm.engine.sampling import MAX_SAMPLES, SamplingParams
from kvlm.engine.scheduler import QueueFullError
from kvlm.engine.sequence import common_prefix
from kvlm.engine.served import ServedModel
from kvlm.errors import InvalidRequestError, KvlmError
from kvlm.server import anthropic, defaults, harmony, ollama, openapi, reasoning, responses_api
from kvlm.server import slots as slots_mod
from kvlm.server import tools as tools_mod
from kvlm.server.limits import RequestLimits, ServerLimits
from kvlm.server.metrics import render_metrics
from kvlm.server.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Unsupported,
    error_body,
)
from kvlm.server.responses import Choices, encode_json
from kvlm.server.tool_check import tool_checks

log = logging.getLogger("kvlm.server")
_PROMPT_TAIL = 32  # the prompt's last tokens read for an open <think>
# Normalisation can shrink a text (NFKC composes sequences), so the character bound that
# proves a prompt too long without tokenizing it keeps this much margin.
_CHARS_MARGIN = 4
_NONE: Mapping[str, Any] = MappingProxyType({})  # a dialect with no sampling defaults


class ServerError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None
    ) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


@dataclasses.dataclass(frozen=True, slots=True)
class _Served:
    """What the routes share: the engine, and what the server says of its model."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any
    max_len: int  # prompt and completion together
    max_prompts: int  # a completions request's prompts
    fingerprint: str  # system_fingerprint: kvlm's version, the model file, its numerics
    tool_parser: str | None  # kvlm.server.tools' format, or "harmony"
    reasoning_parser: str | None  # kvlm.server.reasoning: <think> text split out; "harmony"
    limits: ServerLimits
    started: int  # the models list's "created"
    responses: responses_api.ResponseStore  # stored responses (/v1/responses)
    sampling: defaults.SamplingDefaults  # what a request's unset sampling fields take (_params)
    slots: slots_mod.SlotTable  # llama-server's slots (/slots; kvlm.server.slots)


def create_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    tool_parser: str | None = None,
    reasoning_parser: str = "auto",
    sampling: defaults.SamplingDefaults | None = None,
    slot_save_path: str | None = None,
    replica_tag: str = "",
) -> FastAPI:
    """The app over `engine`, serving it as `model_name`; `sampling`: the server's
    defaults for a request's unset sampling fields (kvlm.server.defaults; none: the APIs'
    own); `slot_save_path`: where /slots saves and restores (kvlm.server.slots; its disk
    tier is the engine's: serve_config); `replica_tag`: the replica of `kvlm serve
    --replicas` it is, in the ids of what it stores (responses_api.new_id)."""
    limits = limits or ServerLimits()
    app = FastAPI(title="kvlm", version="1", docs_url=None, redoc_url=None)
    info = engine.info
    # what produced the tokens: kvlm's version, the model file and the numerics it runs
    made_by = f"{__version__} {model_name} {info.numerics}"
    s = _Served(
        engine, model_name, info.tokenizer, info.max_model_len,
        min(MAX_PROMPTS, engine.max_requests),
        "fp_" + hashlib.sha256(made_by.encode()).hexdigest()[:10],
        tool_parser or _tool_format(info.tokenizer.chat_template),
        _reasoning(reasoning_parser, info.tokenizer.chat_template), limits,
        int(time.time()), _response_store(engine, replica_tag),
        sampling or defaults.SamplingDefaults(),
        slots_mod.SlotTable(min(slots_mod.MAX_SLOTS, info.max_num_seqs),
                            Path(slot_save_path) if slot_save_path else None),
    )  # fmt: skip
    openapi.install(app, model_name, min(MAX_SAMPLES, info.max_num_seqs), s.max_prompts)
    app.add_middleware(RequestLimits, limits=limits)
    app.add_middleware(NotedHeaders)
    _install_error_handlers(app)
    authorized = authorizer(api_key)

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`,
    # and a request behind it never saw its client disconnect (tests/test_server.py).
    async def check_api_key(request: Request) -> None:
        if not authorized(request):
            raise ServerError(401, "invalid or missing API key", "authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    guarded = [] if limits.public_metrics else [Depends(check_api_key)]
    _status_routes(app, v1, s, authorized, guarded)
    _generation_routes(v1, s)
    app.include_router(v1)
    app.include_router(_token_routes(s, Depends(check_api_key)))
    app.include_router(_slot_routes(s, Depends(check_api_key)))
    app.include_router(ollama_routes(app, s, Depends(check_api_key)))
    return app


def _tool_format(template: str | None) -> str:
    """The tool-call format a template teaches: harmony's own (its calls are messages to
    `functions.NAME`: kvlm.server.harmony), else kvlm.server.tools'."""
    return "harmony" if harmony.is_harmony(template) else tools_mod.parser_for(template)


def _reasoning(parser: str, template: str | None) -> str | None:
    """--reasoning-parser: auto (read off the template), none, or a parser's name. A
    harmony template's replies are read as harmony whatever is named (their channels are
    their format): none keeps the analysis channel in the content."""
    if parser == "auto":
        parser = "harmony" if harmony.is_harmony(template) else reasoning.parser_for(template)
        parser = parser or "none"
        if parser != "none":
            log.info("replies' reasoning goes to reasoning_content (--reasoning-parser none "
                     "keeps it in the content)")  # fmt: skip
    elif parser != "none" and harmony.is_harmony(template):
        parser = "harmony"
    return None if parser == "none" else parser


def _response_store(engine: AsyncEngine, tag: str) -> responses_api.ResponseStore:
    """Stored responses, their conversations' blocks pinned in the engine's pool (at most
    PIN_SHARE of it; the engine lets the oldest go)."""
    share = responses_api.PIN_SHARE

    def pin(key: str, ids: list[int], salt: str | None) -> None:
        engine.tell(lambda e: e.pin(key, ids, salt, share))

    def unpin(key: str) -> None:
        engine.tell(lambda e: e.unpin(key))

    return responses_api.ResponseStore(responses_api.KEEP, responses_api.TTL_S, pin, unpin, tag)


def engine_app(
    llm: ServedModel, config: EngineConfig, model_name: str | None, *options: Any,
    replica_tag: str = "",
) -> tuple[AsyncEngine, FastAPI]:  # fmt: skip
    """An engine for `llm` (not started yet) and the app over it, serving it as
    `model_name` (None: the model file's name; `options`: create_app's api_key, limits,
    tool_parser, reasoning_parser, sampling; `replica_tag`: create_app's): `kvlm serve`'s,
    and each replica's of `kvlm serve --replicas`."""
    engine = AsyncEngine(Engine(llm, config))
    return engine, create_app(engine, model_name or llm.model_name, *options,
                              replica_tag=replica_tag)  # fmt: skip


def authorizer(api_key: str | None) -> Callable[[Request], bool]:
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorized(request: Request) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's clients), `x-api-key: KEY` (Anthropic's),
        or HTTP Basic auth with KEY as the password (a browser on /dashboard: it asks once,
        then sends it with the page's own requests to /v1/kv and /metrics)."""
        if expected is None:
            return True
        given = request.headers.get("authorization", "")
        if not given and "x-api-key" in request.headers:
            given = "Bearer " + request.headers["x-api-key"]
        if given[:6].lower() == "basic ":
            try:
                _, _, password = base64.b64decode(given[6:], validate=True).partition(b":")
            except ValueError:
                return False
            given = "Bearer " + password.decode("latin-1")
        # constant time: no timing oracle
        return hmac.compare_digest(given.encode("latin-1", "replace"), expected)

    return authorized


def _status_routes(
    app: FastAPI, v1: APIRouter, s: _Served, authorized: Callable[[Request], bool],
    guarded: list,
) -> None:  # fmt: skip
    """/health, /metrics, /v1/models, /v1/kv and /dashboard: what the server says of
    itself."""

    @app.get("/health", responses={200: {"model": openapi.Health}, 503: {"model": openapi.Health}})
    async def health() -> JSONResponse:
        if not s.engine.alive:
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
        text = render_metrics(s.engine.metrics())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # the server's settings a client may want: the context, and the sampling a request
    # that sets none gets (llama-server's /props default_generation_settings)
    card = {"id": s.model_name, "object": "model", "created": s.started, "owned_by": "kvlm",
            "max_model_len": s.max_len, "sampling_defaults": s.sampling.values}  # fmt: skip

    @v1.get("/models", responses={200: {"model": openapi.ModelList}, **openapi.errors(401)})
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model_id:path}", responses={200: {"model": openapi.ModelCard},
                                                  **openapi.errors(401, 404)})  # fmt: skip
    async def model(model_id: str) -> dict:
        _check_model(model_id, s.model_name)
        return card

    @v1.post("/embeddings", responses=openapi.errors(400, 401))
    async def embeddings() -> None:
        raise ServerError(400, "kvlm serves text generation; it does not serve embeddings",
                          code="embeddings_not_supported")  # fmt: skip

    @v1.get("/kv", responses={200: {"content": {"application/json": {"schema": {
        "type": "object", "description": "The KV pool: kvlm.cache.view"}}}},
        **openapi.errors(401, 503)})  # fmt: skip
    async def kv() -> JSONResponse:
        """The pool's blocks (owner, refcount, chain parent, fill, tier), the prefix tree
        with hit counts, waste and the tiers' counters, read whole between two steps."""
        if not s.engine.alive:
            raise ServerError(503, "the engine has stopped", "server_error")
        view = await s.engine.call(lambda e: e.kv_view(), s.limits.engine_wait_s)  # or 503
        return JSONResponse({"object": "kv_cache", "model": s.model_name} | view)

    @app.get("/dashboard", response_class=HTMLResponse,
             responses={200: {"content": {"text/html": {"schema": {"type": "string"}}}},
                        **openapi.errors(401)})  # fmt: skip
    async def dashboard(request: Request) -> HTMLResponse:
        """The live page (kvlm/server/dashboard.html): plain HTML and one script, no assets
        from anywhere; it polls /v1/kv and /metrics."""
        if not authorized(request):
            body = error_body("invalid or missing API key", "authentication_error")
            return JSONResponse(body, status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="kvlm"'})  # fmt: skip
        return HTMLResponse(_dashboard_html(), headers={"Cache-Control": "no-store"})


def _slot_routes(s: _Served, auth: Any) -> APIRouter:
    """llama-server's GET /slots and POST /slots/{id_slot}?action=save|restore|erase
    (kvlm.server.slots; no /v1 prefix, as llama-server serves them)."""
    router = APIRouter(dependencies=[auth])

    listed = {"content": {"application/json": {"schema": {"type": "array", "items": {
        "type": "object"}}}}, "description": "The slots."}  # fmt: skip
    answer = {"content": {"application/json": {"schema": {"type": "object"}}},
              "description": "llama-server's answer to the action."}  # fmt: skip

    @router.get("/slots", responses={200: listed, **openapi.errors(401)})
    async def slots() -> list:
        return s.slots.listing(s.max_len)

    @router.post("/slots/{id_slot}", responses={200: answer,
                 **openapi.errors(400, 401, 408, 413, 501)})  # fmt: skip
    async def slot_action(id_slot: int, action: str, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            raise ServerError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ServerError(400, "the body is a JSON object")
        try:
            return await slots_mod.act(s.slots, s.engine, id_slot, action, body)
        except slots_mod.NotSupported as exc:
            raise ServerError(501, str(exc), "not_supported_error") from None

    return router


def _token_routes(s: _Served, auth: Any) -> APIRouter:
    """vLLM's POST /tokenize and /detokenize (no /v1 prefix, as vLLM serves them)."""
    router = APIRouter(dependencies=[auth])

    @router.post("/tokenize", responses={200: {"model": openapi.Tokens},
                                         **openapi.errors(400, 401, 404, 408, 413)})  # fmt: skip
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            _check_model(body.model, s.model_name)
        ids = await run_in_threadpool(_chat_of, lambda: body.ids(s.tokenizer, s.model_name))
        strs = None
        if body.return_token_strs:  # a token each: off the loop
            strs = await run_in_threadpool(
                lambda: [s.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            )
        return {"count": len(ids), "max_model_len": s.max_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @router.post("/detokenize", responses={200: {"model": openapi.Text},
                                           **openapi.errors(400, 401, 404, 408, 413)})  # fmt: skip
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            _check_model(body.model, s.model_name)
        vocab = s.engine.info.vocab_size
        outside = [t for t in body.tokens if t >= vocab]
        if outside:
            raise ServerError(400, f"token {outside[0]} is outside the vocabulary of {vocab}",
                              param="tokens")  # fmt: skip
        return {"prompt": await run_in_threadpool(s.tokenizer.decode, body.tokens)}

    return router


def _chars_bound(s: _Served) -> int:
    """The most characters a prompt that fits can have: each token decodes to at most
    max_token_chars characters, so c characters are at least c / that tokens."""
    return s.max_len * s.tokenizer.max_token_chars * _CHARS_MARGIN


def _check_length(s: _Served, chars: int, param: str) -> None:
    """Refuse a text too long to fit without tokenizing it (_chars_bound)."""
    bound = _chars_bound(s)
    if chars > bound:
        why = f"the prompt has {chars} characters, more than {s.max_len} tokens can hold"
        raise _too_long(s.max_len, why, param)


def _too_long(max_len: int, why: str, param: str) -> ServerError:
    """400 context_length_exceeded: the prompt, or it and the completion asked for."""
    message = f"this model's maximum context length is {max_len} tokens; {why}"
    return ServerError(400, message, param=param, code="context_length_exceeded")


def _generation_routes(v1: APIRouter, s: _Served) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @v1.post("/completions", responses=openapi.generation(openapi.CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, s.model_name)
        prompts = body.prompts()
        if len(prompts) > s.max_prompts:
            raise ServerError(400, f"{len(prompts)} prompts: this server runs at most "
                              f"{s.max_prompts} requests at once", param="prompt")  # fmt: skip
        _check_length(s, sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        ids = [
            p if isinstance(p, list) else await run_in_threadpool(s.tokenizer.encode, p)
            for p in prompts
        ]
        params = [_params(s, body, one, body.logprobs, request) for one in ids]
        n = params[0].n
        echo = None
        if body.echo:  # each choice opens with its prompt, as the text it was sent as
            texts = [p if isinstance(p, str) else s.tokenizer.decode(p, skip_special_tokens=False)
                     for p in prompts]  # fmt: skip
            echo = [t for t in texts for _ in range(n)]
        choices = Choices(
            s.tokenizer, n * len(ids), chat=False, want_logprobs=body.logprobs is not None,
            echo=echo, prompts=[one for one in ids for _ in range(n)],
            score_only=body.max_tokens == 0, want_prompt_logprobs=body.prompt_logprobs is not None,
        )  # fmt: skip
        return await _respond(s, request, body, ids, params, choices)

    @v1.post("/chat/completions", responses=openapi.generation(openapi.ChatCompletionResponse))
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        ids, params, choices = await _chat_parts(s, body, request)
        return await _respond(s, request, body, [ids], [params], choices)

    anthropic_routes(v1, s)
    responses_routes(v1, s)


async def _chat_parts(
    s: _Served, body: ChatCompletionRequest, request: Request, api: Mapping[str, Any] = _NONE
) -> tuple[list[int], SamplingParams, Choices]:
    """A chat request's prompt ids (the template, off the loop), sampling parameters (a
    tool call's grammar among them: forced, or lazy under tool_choice auto) and the
    Choices its answer is built in: the chat road, which the Messages and Responses APIs
    take too (kvlm.server.anthropic.to_chat, kvlm.server.responses_api.to_chat). `api`:
    the dialect's own sampling defaults, under the server's (_params)."""
    _check_model(body.model, s.model_name)
    tools = body.tool_specs
    chars = sum(len(m["content"]) for m in body.conversation)
    _check_length(s, chars + len(json.dumps(tools or [])), "messages")
    ids = await run_in_threadpool(body.prompt_ids, s.tokenizer)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(s, body, ids, top, request, api)
    forced = body.forced_tool()
    calls = None  # the calls' grammar
    if forced is not None:  # tool_choice "required" or named: the output is the calls
        # (a response_format given too is for text replies, which a forced call has none
        # of: OpenAI answers such a request with the call, as agent SDKs send it)
        name = None if forced == "required" else forced
        calls = tools_mod.forced_guide(tools or [], name, body.parallel_tool_calls)
        params.guide = calls
    # a guided reply (a forced call, a format) takes its guide's shape from its first
    # token: a <think> the prompt opened does not hold for it
    think = s.reasoning_parser is not None
    # a harmony reply's messages are read off its text with their markers (special
    # tokens) kept (read off the template, or named); a forced call's JSON array is no run
    # of messages
    messages = forced is None and "harmony" in (s.tool_parser, s.reasoning_parser)
    if messages:
        params.skip_special_tokens = False
    opened = think and not messages and params.guide is None and reasoning.starts_thinking(
        s.tokenizer.decode(ids[-_PROMPT_TAIL:], skip_special_tokens=False))  # fmt: skip
    lazy = tools and forced is None and params.guide is None and not messages
    if lazy and s.tool_parser == "hermes":
        calls = tools_mod.auto_guide(tools)  # a call, once begun, is well formed
    if calls is not None:  # compiled now: what it left out of the schemas is checked after
        calls = params.guide = await s.engine.compile_guide(calls)
    choices = Choices(s.tokenizer, params.n, chat=True, want_logprobs=body.logprobs,
                      prompts=[ids] * params.n,
                      want_prompt_logprobs=body.prompt_logprobs is not None,
                      tools=tools is not None,
                      tool_parser=None if forced is not None
                      else "hermes" if messages else s.tool_parser,
                      tool_checks=tool_checks(tools, calls),
                      reasoning=think, thinking=opened, harmony=messages)  # fmt: skip
    return ids, params, choices


def _marked_prefixes(
    s: _Served, body: anthropic.MessagesRequest, ids: list[int]
) -> list[tuple[int, float]]:
    """Each cache_control mark's prefix of the prompt `ids` (anthropic.breakpoints: the
    conversation cut after the marked block, rendered without a generation prompt, as
    far as it agrees with `ids`) and its life; marks that keep nothing left out."""
    out = []
    for chat, ttl in anthropic.breakpoints(body):
        try:
            cut = s.tokenizer.encode_chat(chat.conversation, False, chat.tool_specs,
                                          **chat.template_options)  # fmt: skip
        except InvalidRequestError:  # a template that cannot render the cut: nothing kept
            continue
        n = common_prefix(cut, ids)
        if n:
            out.append((n, ttl))
    return out


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(array("I", ids).tobytes()).hexdigest()[:32]


async def _then(chunks: AsyncIterator[str], done: Callable[[], None]) -> AsyncIterator[str]:
    """`chunks`, then `done()` once they all went (a stream that ended early: not)."""
    async for chunk in chunks:
        yield chunk
    done()


def anthropic_routes(v1: APIRouter, s: _Served) -> None:
    """POST /v1/messages and /v1/messages/count_tokens (kvlm.server.anthropic)."""

    @v1.post("/messages", responses=openapi.generation(openapi.AnthropicMessage))
    async def messages(body: anthropic.MessagesRequest, request: Request) -> Any:
        chat = _as_chat(body)
        ids, params, choices = await _chat_parts(s, chat, request)
        params.stop = list(body.stop_sequences or [])  # Anthropic allows more than OpenAI's 4
        head = anthropic.new_head(s.model_name)
        full = params.max_tokens >= s.max_len - len(ids)  # up to the context: its stop's
        marks = await run_in_threadpool(_marked_prefixes, s, body, ids)
        marked = max((n for n, _ in marks), default=0)
        events = await _start(s, chat, [ids], [params])

        def pin() -> None:  # once the prompt's blocks are cached: each mark's prefix kept
            for n, ttl in marks:
                key = f"cache_control:{chat.cache_salt}:{_digest(ids[:n])}"
                s.engine.tell(lambda e, key=key, n=n, ttl=ttl: e.pin(
                    key, ids[:n], chat.cache_salt, responses_api.PIN_SHARE, ttl))  # fmt: skip

        if body.stream:
            sse = anthropic.stream(events, choices, head, len(ids), ENGINE_FAILED, full, marked)
            return _event_stream(_then(sse, pin), s, anthropic.PING)
        last = await _finished(events, choices, request)
        if last is None:
            return JSONResponse({}, status_code=499)
        pin()
        return anthropic.message(head, choices, last, len(ids), full, marked)

    @v1.post("/messages/count_tokens", responses={200: {"model": openapi.TokenCount},
             **openapi.errors(400, 401, 404, 408, 413, body=openapi.AnthropicError)})  # fmt: skip
    async def count_tokens(body: anthropic.CountTokensRequest) -> dict:
        chat = _as_chat(body)
        _check_model(chat.model, s.model_name)
        return {"input_tokens": len(await run_in_threadpool(chat.prompt_ids, s.tokenizer))}


def ollama_routes(app: FastAPI, s: _Served, auth: Any) -> APIRouter:
    """Ollama's API (kvlm.server.ollama) under /api. `GET`/`HEAD /` and `/api/version`
    answer anyone (the probes Ollama's clients send first, as /health); the rest takes the
    key as /v1 does. In /openapi.json with their answers (kvlm.server.openapi `ollama`)."""
    api = APIRouter(prefix="/api", dependencies=[auth])
    gen = openapi.ollama(openapi.OllamaReply, 400, 401, 404, 408, 413, 500, 503, lines=True)
    info, name, started = s.engine.info, ollama.served_name(s.model_name), ollama.now()
    details = ollama.details(info.config)
    entry = {"name": name, "model": name, "modified_at": started, "size": info.weight_bytes,
             "digest": hashlib.sha256(s.fingerprint.encode()).hexdigest(),
             "details": details}  # fmt: skip

    text = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}

    @app.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse, responses=text)
    async def root() -> PlainTextResponse:
        return PlainTextResponse("Ollama is running (kvlm serves Ollama's API under /api)")

    @app.api_route("/api/version", methods=["GET", "HEAD"],
                   responses={200: {"model": openapi.OllamaVersion}})  # fmt: skip
    async def version() -> dict:
        return {"version": ollama.API_VERSION, "kvlm": __version__}

    @api.api_route("/tags", methods=["GET", "HEAD"],
                   responses=openapi.ollama(openapi.OllamaModels, 401))  # fmt: skip
    async def tags() -> dict:
        return {"models": [entry]}

    @api.get("/ps", responses=openapi.ollama(openapi.OllamaModels, 401))
    async def ps() -> dict:
        return {"models": [entry | {"expires_at": ollama.NEVER, "context_length": s.max_len,
                                    "size_vram": info.weight_bytes_gpu}]}  # fmt: skip

    @api.post("/show", responses=openapi.ollama(openapi.OllamaShow, 400, 401, 404, 408, 413))
    async def show(body: ollama.ShowRequest) -> dict:
        _check_model(ollama.resolve(body.which, s.model_name), s.model_name)
        caps = ollama.capabilities(s.reasoning_parser is not None)
        return {"modelfile": f"# kvlm serves {s.model_name}\nFROM {s.model_name}\n",
                "parameters": ollama.parameters(ollama.DEFAULTS | s.sampling.values),
                "template": s.tokenizer.chat_template or "", "details": details,
                "model_info": ollama.model_info(info.config, s.max_len),
                "capabilities": caps, "modified_at": started}  # fmt: skip

    @api.post("/pull", responses=openapi.ollama(openapi.OllamaStatus, 400, 401, 404, 408, 413,
                                                 lines=True))  # fmt: skip
    async def pull(body: ollama.PullRequest) -> Any:
        if ollama.resolve(body.which, s.model_name) != s.model_name:
            raise ServerError(404, f"kvlm pulls no models: it serves {name!r}, loaded when it "
                              f"started, and {body.which!r} is not it", param="model")  # fmt: skip
        lines = ollama.pulled(name, body.stream)
        if body.stream:
            text = "".join(json.dumps(line) + "\n" for line in lines)
            return Response(text, media_type="application/x-ndjson")
        return lines[0]

    @api.post("/chat", responses=gen)
    async def chat(body: ollama.ChatRequest, request: Request) -> Any:
        started = time.perf_counter_ns()
        if not body.messages:  # Ollama's way to load a model
            return _ollama_loaded(s, name, body, chat=True)
        req = _chat_of(lambda: ollama.to_chat(body, s.model_name))
        ids, params, choices = await _chat_parts(s, req, request, ollama.DEFAULTS)
        reply = ollama.Reply(name, True, choices, len(ids), started)
        return await _ollama_run(s, request, body, req, ids, params, reply)

    @api.post("/generate", responses=gen)
    async def generate(body: ollama.GenerateRequest, request: Request) -> Any:
        started = time.perf_counter_ns()
        if not body.prompt:  # Ollama's way to load a model
            return _ollama_loaded(s, name, body, chat=False)
        req: Any
        if body.raw:  # the prompt as it is: the completions road
            req = _chat_of(lambda: ollama.to_completion(body, s.model_name))
            ids, params, choices = await _raw_parts(s, req, request, ollama.DEFAULTS)
        else:
            req = _chat_of(lambda: ollama.generate_chat(body, s.model_name))
            ids, params, choices = await _chat_parts(s, req, request, ollama.DEFAULTS)
        reply = ollama.Reply(name, False, choices, len(ids), started)
        return await _ollama_run(s, request, body, req, ids, params, reply)

    @api.post("/embed", responses=openapi.ollama(None, 400, 401))
    @api.post("/embeddings", responses=openapi.ollama(None, 400, 401))
    async def embeddings() -> None:
        raise ServerError(400, "kvlm serves text generation; it does not serve embeddings")

    refused = openapi.ollama(None, 400, 401)

    @api.post("/create", responses=refused)
    @api.post("/copy", responses=refused)
    @api.post("/push", responses=refused)
    @api.delete("/delete", responses=refused)
    async def manage() -> None:
        raise ServerError(400, f"kvlm serves one model, {name!r}, loaded when it started: it "
                          "does not create, copy, push or delete models")  # fmt: skip

    return api


async def _raw_parts(
    s: _Served, body: CompletionRequest, request: Request, api: Mapping[str, Any]
) -> tuple[list[int], SamplingParams, Choices]:
    """A raw generate request's prompt ids, parameters and Choices, as /v1/completions
    makes them for one prompt (`api`: Ollama's sampling defaults, under the server's)."""
    _check_model(body.model, s.model_name)
    prompt = body.prompts()[0]
    _check_length(s, len(prompt), "prompt")
    ids = await run_in_threadpool(s.tokenizer.encode, prompt)
    params = _params(s, body, ids, body.logprobs, request, api)
    choices = Choices(s.tokenizer, 1, chat=False, want_logprobs=body.logprobs is not None,
                      prompts=[ids])  # fmt: skip
    return ids, params, choices


def _ollama_fit(s: _Served, params: SamplingParams, prompt: int, options: Any) -> None:
    """Ollama's bounds on the request: num_ctx (the context it may fill, at most the
    server's), num_predict (> 0: at most this many tokens), stop (up to 16 strings)."""
    o = options or ollama.Options()
    window = min(o.num_ctx or s.max_len, s.max_len)
    if prompt >= window:
        why = f"the prompt has {prompt} tokens (options.num_ctx: {o.num_ctx})"
        raise _too_long(window, why, "options.num_ctx")
    room = window - prompt
    if o.num_predict is not None and o.num_predict > 0:
        room = min(room, o.num_predict)
    params.max_tokens = min(params.max_tokens, room)
    params.stop = o.stops()


def _ollama_loaded(s: _Served, name: str, body: Any, chat: bool) -> Response:
    """The answer to a chat or generate request with nothing to generate (Ollama's way to
    load a model): the model checked, `done_reason` "load", whole or as one NDJSON line."""
    _check_model(ollama.resolve(body.model, s.model_name), s.model_name)
    answer = ollama.loaded(name, chat=chat)
    if body.stream:
        return Response(json.dumps(answer) + "\n", media_type="application/x-ndjson")
    return JSONResponse(answer)


async def _ollama_run(
    s: _Served, request: Request, body: Any, req: Any, ids: list[int],
    params: SamplingParams, reply: ollama.Reply,
) -> Any:  # fmt: skip
    """Run an Ollama chat or generate request on the engine; its answer whole or as
    NDJSON lines."""
    _ollama_fit(s, params, len(ids), body.options)
    reply.submitted = time.perf_counter_ns()
    events = reply.timed(await _start(s, req, [ids], [params]))
    if body.stream:
        lines = reply.lines(events, ENGINE_FAILED)
        return StreamingResponse(lines, media_type="application/x-ndjson")
    if await _finished(events, reply.choices, request) is None:
        return JSONResponse({}, status_code=499)
    return JSONResponse(reply.whole())


def responses_routes(v1: APIRouter, s: _Served) -> None:
    """POST /v1/responses; GET, DELETE /v1/responses/{id}; GET .../input_items; POST
    .../cancel (kvlm.server.responses_api)."""
    api = responses_api
    store = s.responses

    @v1.post("/responses", responses=openapi.generation(openapi.ResponseObject))
    async def create(body: responses_api.ResponsesRequest, request: Request) -> Any:
        history: list[dict] = []
        # what the request expands to is bounded before it is expanded: the stored
        # conversation by its count, the items (references too) as they are read
        room = _chars_bound(s) - len(body.instructions or "")
        if body.previous_response_id is not None:
            prev = _stored(store, body.previous_response_id, "previous_response_id")
            if prev.reply.status in ("queued", "in_progress"):
                raise ServerError(400, f"response {prev.reply.id!r} is still in progress",
                                  param="previous_response_id")  # fmt: skip
            history, room = prev.history, room - prev.chars
            if room < 0:
                raise _too_long(s.max_len, "the previous response's conversation has more "
                                "text than it can hold", "previous_response_id")  # fmt: skip
        try:
            turn = _chat_of(lambda: api.conversation(api.input_items(body), store.item, room))
        except api.InputTooLong as exc:
            raise _too_long(s.max_len, str(exc), "input") from None
        chat = _chat_of(lambda: api.to_chat(body, [*history, *turn]))
        ids, params, choices = await _chat_parts(s, chat, request)
        reply = api.Reply(body, s.model_name, choices, len(ids), store.tag,
                          temperature=params.temperature, top_p=params.top_p)  # fmt: skip
        events = api.record(await _start(s, chat, [ids], [params]), reply)
        entry = api.Stored(reply, [*history, *turn], api.stored_items(body, store.tag))
        entry.chars = (prev.chars if history else 0) + api.history_chars(turn)

        def done(r: api.Reply) -> None:  # kept: the conversation, and its K/V pinned
            if body.store and r.status in ("completed", "incomplete"):
                entry.history.append(api.assistant_turn(r))
                entry.chars += api.history_chars(entry.history[-1:])
                store.put(entry)
                store.pin(r.id, ids + r.token_ids, chat.cache_salt)

        if body.background:  # answered now; GET polls it, cancel stops it
            reply.status = "queued"
            entry.task = asyncio.ensure_future(_background(events, reply, done))
            store.put(entry)
            return reply.response()
        if body.stream:
            return _event_stream(api.stream(events, reply, done), s)
        if await _finished(events, choices, request) is None:
            return JSONResponse({}, status_code=499)
        reply.finish()
        done(reply)
        return reply.response()

    @v1.get("/responses/{response_id}", responses={200: {"model": openapi.ResponseObject},
                                                   **openapi.errors(401, 404)})  # fmt: skip
    async def get(response_id: str) -> dict:
        return _stored(store, response_id).reply.response()

    @v1.get("/responses/{response_id}/input_items", responses={
        200: {"model": openapi.ItemList}, **openapi.errors(401, 404)})  # fmt: skip
    async def input_items(response_id: str) -> dict:
        items = _stored(store, response_id).items
        return {"object": "list", "data": items, "has_more": False,
                "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None}  # fmt: skip

    @v1.delete("/responses/{response_id}", responses={200: {"model": openapi.Deleted},
                                                      **openapi.errors(401, 404)})  # fmt: skip
    async def delete(response_id: str) -> dict:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @v1.post("/responses/{response_id}/cancel", responses={
        200: {"model": openapi.ResponseObject}, **openapi.errors(400, 401, 404)})  # fmt: skip
    async def cancel(response_id: str) -> dict:
        entry = _stored(store, response_id)
        if not entry.reply.body.background:
            raise ServerError(400, "only background responses can be cancelled")
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.wait({entry.task})
        return entry.reply.response()


async def _background(
    events: AsyncIterator[StepOutput], reply: responses_api.Reply,
    done: Callable[[responses_api.Reply], None],
) -> None:  # fmt: skip
    """A background response run to its end (or cancelled: the request aborted)."""
    reply.status = "in_progress"
    try:
        async for event in events:
            reply.choices.add(event)
        reply.finish()
        done(reply)
    except asyncio.CancelledError:
        reply.status = "cancelled"
    except Exception as exc:  # the engine refused it (stopping): the response says so
        reply.status, reply.error = "failed", {"code": "server_error", "message": str(exc)}
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _stored(
    store: responses_api.ResponseStore, response_id: str, param: str | None = None
) -> responses_api.Stored:
    entry = store.get(response_id)
    if entry is None:
        if param is not None:  # a request naming it: OpenAI's 400
            raise ServerError(400, f"previous response with id {response_id!r} not found",
                              param=param, code="previous_response_not_found")  # fmt: skip
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str) -> ServerError:
    return ServerError(404, f"response with id {response_id!r} not found", "not_found_error")


def _chat_of(make: Callable[[], Any]) -> Any:
    """make() of a dialect's body: its checks' failures a 400 naming the field."""
    try:
        return make()
    except ValidationError as exc:
        raise ServerError(400, _validation_body(exc.errors())["error"]["message"]) from None
    except Unsupported as exc:
        raise ServerError(400, str(exc), param=exc.param) from None


def _as_chat(body: anthropic.MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages body means (its checks' failures a 400)."""
    return _chat_of(lambda: anthropic.to_chat(body))


@functools.cache
def _dashboard_html() -> str:
    return (importlib.resources.files("kvlm.server") / "dashboard.html").read_text("utf-8")


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        why = f"the model {requested!r} does not exist; this server serves {served!r}"
        raise ServerError(404, why, param="model", code="model_not_found")


def _params(
    s: _Served, body: Any, ids: list[int], logprobs: int | None, request: Request,
    api: Mapping[str, Any] = _NONE,
) -> SamplingParams:  # fmt: skip
    """The request's sampling parameters for one prompt: every route takes this road.

    A sampling field the request leaves unset (not in its `model_fields_set`) takes the
    server's default (s.sampling: --temperature and the like, else the model file's),
    else the dialect's own (`api`: Ollama's), else the request model's; the response names
    the server's it took in its defaults.HEADER. A max_tokens past the room the prompt
    leaves in the context is clamped to that room, not refused (agents ask for 32,000
    whatever the model; OpenAI's and Anthropic's APIs stop at the context too), and the
    response says so in its MAX_TOKENS_HEADER (both _noted)."""
    max_len = s.max_len
    room = max_len - len(ids)
    if room < 1:
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise _too_long(max_len, f"the prompt has {len(ids)} tokens", param)
    wanted = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if body.n_predict is not None and not {"max_tokens", "max_completion_tokens"} & set(
        body.model_fields_set
    ):  # llama.cpp's max_tokens; -1: up to the context
        wanted = None if body.n_predict < 0 else max(body.n_predict, 1)
    if wanted == 0:  # echo only (checked at the door): the prompt, scored, nothing made
        wanted = 1
    if wanted is not None and wanted > room:
        noted = _noted(request)
        noted[MAX_TOKENS_HEADER] = str(min(room, int(noted.get(MAX_TOKENS_HEADER, room))))
        wanted = room
    server = s.sampling.values
    unset = {k: v for k, v in (api | server).items() if k not in body.model_fields_set}
    taken = [k for k in server if k in unset]
    if taken:
        _noted(request)[defaults.HEADER] = s.sampling.header(taken)
    try:
        return body.sampling_params(wanted or room, logprobs, unset)
    except ValueError as exc:  # InvalidRequestError names the field at fault
        raise ServerError(400, str(exc), param=getattr(exc, "param", None)) from exc


# The max_tokens a request ran with where the one it asked for did not fit the context
# (the smallest of its prompts'); absent where it fitted.
MAX_TOKENS_HEADER = "kvlm-max-tokens"


def _noted(request: Request) -> dict[str, str]:
    """The response headers a route notes on its request as it goes (NotedHeaders sends
    them with the response, streamed or whole, from whichever route)."""
    return request.scope.setdefault(NOTED, {})


NOTED = "kvlm.headers"  # the scope's key of a request's noted headers


@dataclasses.dataclass(frozen=True, slots=True)
class NotedHeaders:
    """A plain ASGI middleware: the headers a route noted (_noted) added to its response
    as it starts (a stream's head too: it goes before the first event)."""

    app: Callable

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def noting(message: dict) -> None:
            if message["type"] == "http.response.start" and scope.get(NOTED):
                extra = [(k.encode(), v.encode()) for k, v in scope[NOTED].items()]
                message = message | {"headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, noting)


async def _respond(
    s: _Served, request: Request, body: Any, prompts: list[list[int]],
    params: list[SamplingParams], choices: Choices,
) -> Any:  # fmt: skip
    """Run the request's prompts (one; several for a completions list, each n samples:
    choice i x n + j) and answer with one response or one SSE stream."""
    rid = ("chatcmpl-" if choices.chat else "cmpl-") + (body.request_id or uuid.uuid4().hex)
    head = choices.head(rid, s.model_name) | {"system_fingerprint": s.fingerprint}
    prompt_tokens = sum(len(p) for p in prompts)
    if getattr(body, "max_tokens", None) == 0 and params[0].prompt_logprobs is None:
        # echo, no completion, nothing to score: no engine work
        events: AsyncIterator[StepOutput] = _nothing(len(prompts), params[0].n)
    else:
        events = await _start(s, body, prompts, params)
    if body.stream:
        sse = _sse(events, choices, head, body.include_usage, prompt_tokens)
        return _event_stream(sse, s)
    if await _finished(events, choices, request) is None:
        return JSONResponse({}, status_code=499)
    return await run_in_threadpool(_whole, head, choices, prompt_tokens)


def _whole(head: dict, choices: Choices, prompt_tokens: int) -> Response:
    """A whole response, built and encoded on a worker thread (where _respond calls it): a
    scored 4,000-token prompt answers ~8 MB, seconds of Python that on the event loop
    would stall every other stream and /health. The body is plain JSON types already, so
    FastAPI's jsonable_encoder walk (4 s of that) is skipped; encode_json works in slices."""
    body = head | {"choices": choices.final(), "usage": choices.usage(prompt_tokens)}
    return Response(encode_json(body).encode(), media_type="application/json")


async def _start(
    s: _Served, body: Any, prompts: list[list[int]], params: list[SamplingParams]
) -> AsyncIterator[StepOutput]:
    """Each prompt's request in the engine, their events as one stream (a prompt's
    sample indices moved past the earlier prompts'). A prompt refused (the queue full, a
    bad token) ends those already started. One prompt runs under a slot (its `id_slot`,
    or the one whose conversation it continues: kvlm.server.slots), which keeps its ids
    and its first sample's reply."""
    engine = s.engine
    streams: list[AsyncIterator[StepOutput]] = []
    guide = params[0].guide
    if guide is not None:  # compiled once for all prompts, off the loop and the engine
        guide = await engine.compile_guide(guide)  # thread
        for p in params:
            p.guide = guide
    turn = None  # a chat's turn start: a DeltaNet state is kept there (StateSlots.turn)
    if isinstance(body, ChatCompletionRequest) and len(prompts) == 1 and engine.info.keeps_turns:
        turn = await run_in_threadpool(body.turn_start, engine.info.tokenizer, prompts[0])
    slot = s.slots.take(getattr(body, "id_slot", None), prompts[0]) if len(prompts) == 1 else None
    try:
        for ids, p in zip(prompts, params, strict=True):
            streams.append(await engine.generate(ids, p, cache_salt=body.cache_salt,
                                                 turn_start=turn))  # fmt: skip
    except BaseException:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
        if slot is not None:
            s.slots.done(slot, slot.ids)  # as it was
        raise
    if slot is None:
        return _merged(streams, params[0].n)
    return _into_slot(streams[0], s.slots, slot, prompts[0])


async def _into_slot(
    events: AsyncIterator[StepOutput], table: slots_mod.SlotTable, slot: slots_mod.Slot,
    ids: list[int],
) -> AsyncIterator[StepOutput]:  # fmt: skip
    """`events`, the first sample's tokens kept: the slot's conversation once they end."""
    reply: list[int] = []
    try:
        async for event in events:
            if event.index == 0:
                reply += event.token_ids
            yield event
    finally:
        table.done(slot, ids + reply)
        await events.aclose()  # type: ignore[attr-defined]


async def _merged(streams: list[AsyncIterator[StepOutput]], n: int) -> AsyncIterator[StepOutput]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StepOutput]) -> None:
        try:
            async for event in stream:
                await queue.put(dataclasses.replace(event, index=i * n + event.index))
        except Exception as exc:  # handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def _nothing(prompts: int, n: int) -> AsyncIterator[StepOutput]:
    """A request with max_tokens 0 (echo): every choice ends at once, nothing generated."""
    for i in range(prompts * n):
        yield StepOutput("", i, "", [], [], "length")


ENGINE_FAILED = "the engine failed on this request (other requests are unaffected)"


async def _finished(
    events: AsyncIterator[StepOutput], choices: Choices, request: Request
) -> StepOutput | None:
    """A non-streamed request run to its end (_collect): its last event, None where the
    client went away (aborted: answer 499); a failed sample is the request's 500."""
    last = await _collect(events, choices, request)
    if last is not None and any(c.finish_reason == "error" for c in choices.state):
        raise ServerError(500, ENGINE_FAILED, "server_error")
    return last


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


KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: OpenAI's clients skip it


def _event_stream(lines: AsyncIterator[str], s: _Served, ping: str = KEEP_ALIVE) -> Response:
    """A route's event stream, kept alive (_kept_alive) with its protocol's `ping`."""
    kept = _kept_alive(lines, s.limits.stream_ping_s, ping)
    return StreamingResponse(kept, media_type="text/event-stream")


async def _kept_alive(lines: AsyncIterator[str], every: float, ping: str) -> AsyncIterator[str]:
    """`lines`, with `ping` sent each `every` seconds that none comes: a long prefill (a
    16k-token agent prompt is minutes on a CPU), a queue or a guide's compile then keeps
    the stream alive, where a silent one had clients past their idle limit give up and
    send the request again (Claude Code did, twice in 15 minutes). The next line is
    awaited in a task of its own, so a ping does not cancel it."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(lines))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield ping
                continue
            line, pending = pending, None
            try:
                text = line.result()
            except StopAsyncIteration:
                return
            yield text
    finally:  # a disconnect lands here: the stream's own `finally` aborts the request
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})
        await lines.aclose()  # type: ignore[attr-defined]


async def _sse(
    events: AsyncIterator[StepOutput], choices: Choices, head: dict, include_usage: bool,
    prompt_tokens: int,
) -> AsyncIterator[str]:  # fmt: skip
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
            if event.prompt_logprobs is not None:  # a scored prompt's: off the event loop
                line = await run_in_threadpool(_chunk_line, choices, head, event, encode_json)
            else:
                line = _chunk_line(choices, head, event)
            if line is not None:
                yield line
        if include_usage and last is not None:
            usage = choices.usage(prompt_tokens)
            yield _data(head | {"object": choices.chunk_object, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    except KvlmError as exc:
        yield _data(error_body(str(exc), "server_error"))
    finally:
        await events.aclose()  # a disconnect lands here: the request is aborted


_JSON = functools.partial(json.dumps, ensure_ascii=False)  # an SSE event's data


def _chunk_line(
    choices: Choices, head: dict, event: StepOutput, encode: Callable[[Any], str] = _JSON
) -> str | None:
    """An event's SSE line (`encode`: its JSON encoder)."""
    chunk = choices.chunk(head, event)
    return None if chunk is None else _data(chunk, encode)


def _data(obj: dict, encode: Callable[[Any], str] = _JSON) -> str:
    return f"data: {encode(obj)}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        return _error(request, exc.body, exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, _validation_body(exc.errors()), 400)

    @app.exception_handler(InvalidRequestError)
    async def bad_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(request, error_body(str(exc), param=exc.param), 400)

    app.add_exception_handler(StarletteHTTPException, http_error)

    @app.exception_handler(QueueFullError)  # full, as _start or _collect hands a request on
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        body = error_body(str(exc), "server_busy", code="queue_full")
        return _error(request, body, 503, {"Retry-After": "1"})  # a seat frees as a stream ends

    @app.exception_handler(EngineBusyError)
    @app.exception_handler(EngineStoppedError)
    async def unavailable(request: Request, exc: KvlmError) -> JSONResponse:
        # a condition of the moment, not a bug: a 503 to retry, never a 500 and a traceback
        busy = isinstance(exc, EngineBusyError)
        body = error_body(str(exc), "server_busy" if busy else "server_error",
                          code="engine_busy" if busy else "shutting_down")  # fmt: skip
        return _error(request, body, 503, {"Retry-After": "1" if busy else "5"})

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets OpenAI's shape, not plain text
        log.error("unhandled error in a request", exc_info=exc)
        return _error(request, error_body(ENGINE_FAILED, "server_error"), 500)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404, 405 (its Allow header kept), and 408 and 413 from RequestLimits: OpenAI's error
    body (the cluster's ingress answers its own the same way)."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = error_body(str(exc.detail), kind)
    headers = exc.headers
    if exc.status_code == 405:  # every method the path takes (Starlette names one route's)
        headers = {**(headers or {}), "Allow": _allowed(request.app, request.url.path)}
    return _error(request, body, exc.status_code, headers)


def _allowed(app: FastAPI, path: str) -> str:
    """The methods the published schema gives `path` (GET /v1/responses/{id} and DELETE
    are two routes of one path)."""
    methods = set()
    for template, operations in app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            methods |= {m.upper() for m in operations}
    return ", ".join(sorted(methods))


def _error(request: Request, body: dict, status: int, headers: dict | None = None) -> JSONResponse:
    """An error answer: OpenAI's body, Anthropic's under /v1/messages, Ollama's
    `{"error": message}` under /api/ (their clients read those shapes)."""
    if request.url.path.startswith(anthropic.ANTHROPIC_PATHS):
        body = anthropic.error_body(status, body["error"]["message"])
    elif request.url.path.startswith(ollama.OLLAMA_PATHS):
        body = {"error": body["error"]["message"]}
    return JSONResponse(body, status_code=status, headers=headers)


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
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, Unsupported):  # a field kvlm cannot honour, named by the check
        return error_body(str(cause), param=".".join([*where, cause.param]))
    if kind == "json_invalid":
        message = "the request body is not valid JSON"
    elif kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    else:
        what = str(first.get("msg")).removeprefix("Value error, ")
        message = f"{param}: {what}" if param else what
    return error_body(message, param=param)
