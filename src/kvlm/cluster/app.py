"""The two Ray Serve deployments of `kvlm serve --replicas N`: one ingress, N replicas.

    client ──HTTP──▶ Serve proxy ──▶ Ingress (FastAPI)            KvlmReplica  x N
                                     body ≤ --max-body             AsyncEngine (its thread)
                                     route key, replica tag       kvlm's own FastAPI app
                                     KvlmRouter picks a replica ─▶ http(): the request
                                     ◀── {status, headers}, chunk, chunk, ... ───┘ through
                                         relayed as they come (SSE streams)         the app

A replica runs each request through kvlm.server.app's app in process (call_asgi), so every
route, field check and error body is exactly `kvlm serve`'s. The ingress only adds the
cluster's view: /metrics summed over the replicas (kvlm.cluster.metrics), /health that
answers while one replica does, and clean endings when a replica dies:

- nothing sent yet: 503 with OpenAI's error body (code "replica_failed") and a Retry-After
  (RETRY_FAILED_S: the retry goes to another replica);
- mid-SSE: a last `data: {"error": ...}` event, then the end of the stream;
- under /v1/messages both in Anthropic's shape (its body; an `event: error`, the only
  failure its clients read in a stream), as kvlm serve writes its own errors there;
- a client that hangs up: the ingress cancels its call, Ray Serve cancels the replica's
  generator, and the replica's app then reads `http.disconnect`, as uvicorn would report
  it, so kvlm aborts the request and frees its blocks on that replica.

Ray Serve restarts a dead replica (its health check is the engine thread's).
"""

# No `from __future__ import annotations`: Ray Serve pickles the deployment classes by
# value, keeping only the globals their code names, so FastAPI could not resolve a string
# annotation (`request: Request`) in the ingress; evaluated ones travel with the class.
import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from kvlm.cluster import metrics as cluster_metrics  # a module: this class is pickled by value
from kvlm.cluster.keys import affinity, route_key, slot_of
from kvlm.cluster.router import slot_replica
from kvlm.server import anthropic
from kvlm.server.limits import RequestLimits
from kvlm.server.protocol import error_body

log = logging.getLogger("kvlm.cluster")

REPLICA_FAILED = "the replica serving this request failed; retry (the others are unaffected)"
SCRAPE_TIMEOUT_S = 10.0  # /metrics and /health: a replica slower than this is not counted
FINISH_TIMEOUT_S = 5.0  # a request's app, told its client left, to abort and return
# the Retry-After of the ingress's own 503s, as kvlm serve's own (server/app.py: 1 s for a
# full queue or a busy engine, 5 s while it shuts down): a replica died under the request
# (Ray Serve sends the retry to a live one), or no replica answered (Serve is starting new
# ones, each loading its model)
RETRY_FAILED_S = 1
RETRY_NONE_S = 5
# hop-by-hop, or no longer true once relayed in chunks
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]  # the replica says 405
_DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length"}


# a whole response (status, body, its headers) and the replica's id
Reply = tuple[int, bytes, dict[str, str], str]


def _relayed(headers: list[tuple[str, str]]) -> dict[str, str]:
    """A replica's response headers as the ingress passes them on (Retry-After, the
    content type, WWW-Authenticate), less those no longer true once relayed."""
    return {k: v for k, v in headers if k.lower() not in _DROPPED_HEADERS}


@dataclass(slots=True, frozen=True)
class RawRequest:
    """An HTTP request as the ingress received it, body read (and bounded) in full."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""


@serve.deployment
class KvlmReplica:
    """One kvlm engine and kvlm's own app, built from `kvlm serve`'s arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvlm.cluster.keys import replica_tag
        from kvlm.server import log_to_stderr
        from kvlm.server.app import engine_app
        from kvlm.server.config import serve_config, serve_model, serve_sampling

        log_to_stderr(args.log_level)
        # the ids of what this replica stores name it (the ingress routes by them)
        tag = replica_tag(serve.get_replica_context().replica_id.unique_id)
        self.engine = None  # an AsyncEngine once the model has loaded
        config, limits = serve_config(args)
        llm = serve_model(args, config)
        options = (args.served_model_name, args.api_key, limits, args.tool_call_parser,
                   args.reasoning_parser, serve_sampling(args, llm))  # fmt: skip
        self.engine, self.app = engine_app(llm, config, *options, replica_tag=tag)
        self.engine.start()

    async def http(
        self,
        raw: RawRequest,
        route_key: bytes | None = None,
        replica: str | None = None,
        slot: int | None = None,
    ) -> AsyncIterator[Any]:
        """The response to `raw`: {"status", "headers"}, then its body chunks. `route_key`,
        `replica` and `slot` were the router's."""
        async for item in call_asgi(self.app, raw):
            yield item

    async def call(self, raw: RawRequest) -> Reply:
        """The whole response to `raw` (status, body, headers) and this replica's id (a
        stable name for the ingress's /v1/kv): the ingress's scrapes."""
        status, body, headers = 500, b"", {}
        async for item in call_asgi(self.app, raw):
            if isinstance(item, dict):
                status, headers = item["status"], _relayed(item["headers"])
            else:
                body += item
        return status, body, headers, serve.get_replica_context().replica_id.unique_id

    def check_health(self) -> None:
        if self.engine is None or not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        if self.engine is not None:  # None: the constructor failed before it started
            self.engine.stop()
            self.engine.close()  # the KV tiers' queued writes land


async def call_asgi(app: Callable, raw: RawRequest) -> AsyncIterator[Any]:
    """Run one request through an in-process ASGI app: yield its head, then its body
    chunks as the app sends them. Leaving early (the caller was cancelled) is the client
    disconnecting: the app's `receive` returns http.disconnect from then on."""
    replies: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    request = [{"type": "http.request", "body": raw.body, "more_body": False}]

    async def receive() -> dict:
        if request:
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        replies.put_nowait(message)

    task = asyncio.ensure_future(app(_scope(raw), receive, send))
    task.add_done_callback(lambda _: replies.put_nowait(None))
    answered = False
    try:
        while (message := await replies.get()) is not None:
            if message["type"] == "http.response.start":
                answered = True
                headers = [
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                ]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        if not answered:  # the app raised before answering (it logged why)
            yield {"status": 500, "headers": [("content-type", "application/json")]}
            yield json.dumps(error_body(REPLICA_FAILED, "server_error")).encode()
    finally:
        gone.set()
        await _finish(task)


def _scope(raw: RawRequest) -> dict:
    return {
        "type": "http",
        # 2.3: Starlette's StreamingResponse then listens for http.disconnect (2.4 would
        # have it wait for a failed write, which never comes in process)
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": raw.method,
        "scheme": "http",
        "path": raw.path,
        "raw_path": raw.path.encode(),
        "query_string": raw.query,
        "root_path": "",
        "headers": raw.headers,
        "client": None,
        "server": None,
    }


async def _finish(task: asyncio.Future) -> None:
    """Let the app end (a disconnected request aborts in its own `finally`), then make
    sure it has: cancel what is left after FINISH_TIMEOUT_S."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait({task}, timeout=FINISH_TIMEOUT_S)
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        log.warning("a request's app raised", exc_info=task.exception())


@serve.deployment
@serve.ingress()
class Ingress:
    """Every HTTP request of the cluster: forwarded to a replica the router picks, but
    /metrics, /health, /v1/kv and GET /slots, which ask every replica."""

    def __init__(self, args: argparse.Namespace, replicas: DeploymentHandle) -> None:
        from kvlm.loading import load_model
        from kvlm.server.app import authorizer
        from kvlm.server.config import serve_config

        self.limits = serve_config(args)[1]
        self.tokenizer = load_model(args.model).tokenizer  # its metadata: no weights
        self.block_size = args.block_size
        self.route_blocks = args.route_blocks
        self.authorized = authorizer(args.api_key)  # the key check the replica will make
        self.replicas = replicas

    def __serve_build_asgi_app__(self) -> FastAPI:
        from kvlm.server.app import http_error  # OpenAI's body for 408 and 413 (RequestLimits)

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the replicas' is served
        app.add_middleware(RequestLimits, limits=self.limits)
        app.add_exception_handler(HTTPException, http_error)
        app.add_exception_handler(Exception, _bug)
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/kv", self.kv, methods=["GET"])
        app.add_api_route("/slots", self.slots, methods=["GET"])
        app.add_api_route("/{path:path}", self.forward, methods=_METHODS)
        return app

    async def forward(self, request: Request) -> Response:
        raw = await _raw(request)
        key = tag = slot = None
        if self.authorized(request):  # a stranger's body is not worth reading
            tag = await run_in_threadpool(affinity, raw.method, raw.path, raw.body)
            if tag is None:
                slot = await run_in_threadpool(slot_of, raw.method, raw.path, raw.body)
            if tag is None and slot is None:
                key = await run_in_threadpool(route_key, raw.path, raw.body, self.tokenizer,
                                              self.block_size, self.route_blocks)  # fmt: skip
        call = self.replicas.options(method_name="http", stream=True)
        stream = call.remote(raw, route_key=key, replica=tag, slot=slot)
        try:
            head = await stream.__anext__()
        except asyncio.CancelledError:  # the client hung up first: the replica aborts
            stream.cancel()
            raise
        except Exception as exc:  # the replica died, or was gone before it could answer
            log.warning("a replica failed before answering: %r", exc)
            return _unavailable(_failed(path=raw.path), RETRY_FAILED_S)
        headers = _relayed(head["headers"])
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_relay(stream, sse, raw.path), head["status"], headers)

    async def metrics(self, request: Request) -> Response:
        answers = await self._answers(request)
        if isinstance(answers, Response):
            return answers
        text = cluster_metrics.aggregate(
            [a[1].decode() for a in answers], cluster_metrics.ROUTED.snapshot()
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def health(self, request: Request) -> Response:
        answers = await self._ask_all(request)
        up = sum(a[0] == 200 for a in answers)
        if not up:
            return _unavailable({"status": "no replica answers"}, RETRY_NONE_S)
        return JSONResponse({"status": "ok", "replicas": up})

    async def kv(self, request: Request) -> Response:
        """Every replica's pool (kvlm.cache.view), ordered by replica id, each with its
        "replica": the first one's fields at the top level (what /dashboard draws), all of
        them under "replicas". A routed GET would land on another replica at each poll."""
        answers = await self._answers(request)
        if isinstance(answers, Response):
            return answers
        views = [json.loads(body) | {"replica": rid} for _, body, _, rid in answers]
        return JSONResponse(views[0] | {"replicas": views})

    async def slots(self, request: Request) -> Response:
        """llama-server's GET /slots of the cluster: slot N as the replica it lives on has
        it (kvlm.cluster.router.slot_replica), so the listing is what a request naming
        slot N, or POST /slots/N, meets."""
        answers = await self._answers(request)
        if isinstance(answers, Response):
            return answers
        return JSONResponse(merged_slots({rid: json.loads(body) for _, body, _, rid in answers}))

    async def _answers(self, request: Request) -> list[Reply] | Response:
        """Each live replica's 200 answer, or what to answer instead: 503 when none
        answered, else the first refusal (401: the replicas' own key check; 503
        engine_busy)."""
        answers = await self._ask_all(request)
        if not answers:
            return _unavailable(_failed("no replica answered"), RETRY_NONE_S)
        refused = next((a for a in answers if a[0] != 200), None)
        return answers if refused is None else _refusal(*refused[:3])

    async def _ask_all(self, request: Request) -> list[Reply]:
        """Each live replica's answer to this request, ordered by replica id (those that
        fail are left out)."""
        raw = await _raw(request)
        try:
            results = await self.replicas.broadcast("call", raw).results_async(
                timeout_s=SCRAPE_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # no replica running, or none answered in time
            log.warning("no replica answered %s: %r", raw.path, exc)
            return []
        return sorted((r for r in results if not isinstance(r, BaseException)), key=lambda r: r[3])


def merged_slots(listings: dict[str, list[dict]]) -> list[dict]:
    """GET /slots over the replicas (replica id -> its listing): each slot's entry from
    the replica it lives on (slot_replica), as many slots as one replica has."""
    ids = list(listings)
    n = min(len(v) for v in listings.values())
    return [listings[slot_replica(i, ids)][i] for i in range(n)]


def _refusal(status: int, body: bytes, headers: dict[str, str]) -> Response:
    """A replica's refusal of a scrape, passed on whole: its status, body and headers
    (a 503's Retry-After, a 401's WWW-Authenticate)."""
    return Response(body, status, headers, media_type="application/json")


async def _raw(request: Request) -> RawRequest:
    body = await request.body()  # read through RequestLimits: at most --max-body
    return RawRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                      list(request.scope["headers"]), body)  # fmt: skip


async def _relay(stream: Any, sse: bool, path: str) -> AsyncIterator[bytes]:
    """The replica's body chunks; a replica that dies mid-way ends an SSE stream with an
    error event. Leaving early (the client hung up) cancels the replica's request."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:
        log.warning("a replica failed mid-response: %r", exc)
        if sse and path.startswith(anthropic.ANTHROPIC_PATHS):  # as anthropic.stream ends
            body = json.dumps(anthropic.error_body(500, REPLICA_FAILED))
            yield f"event: error\ndata: {body}\n\n".encode()
        elif sse:
            yield f"data: {json.dumps(_failed())}\n\n".encode()
    except BaseException:  # GeneratorExit, CancelledError: the client hung up
        stream.cancel()
        raise


def _failed(message: str = REPLICA_FAILED, path: str = "") -> dict:
    """The body of the ingress's own 503: OpenAI's, or Anthropic's under /v1/messages."""
    if path.startswith(anthropic.ANTHROPIC_PATHS):
        return anthropic.error_body(503, message)
    return error_body(message, "server_error", code="replica_failed")


def _unavailable(body: dict, retry_s: int) -> JSONResponse:
    """One of the ingress's own 503s: `body`, and when to retry."""
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(retry_s)})


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    """OpenAI's error body (Anthropic's under /v1/messages), never a plain-text 500
    (Starlette logs the traceback)."""
    message = "the ingress failed on this request"
    if request.url.path.startswith(anthropic.ANTHROPIC_PATHS):
        return JSONResponse(anthropic.error_body(500, message), 500)
    return JSONResponse(error_body(message, "server_error"), 500)
