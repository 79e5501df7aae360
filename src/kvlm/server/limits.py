"""What one connection may cost the server: body size, time to send a request, idleness.

    connection ──▶ request head within `idle_timeout_s` (else closed: HeadTimeoutH11Protocol)
               ──▶ body at most `max_body_bytes` (else 413) and each piece of it within
                   `idle_timeout_s` (else 408: RequestLimits, an ASGI middleware)
               ──▶ the route: JSON parsed, validated, tokenized off the event loop
               ──▶ kept alive `keep_alive_s` after a response, then closed (uvicorn)
    a response that ends the connection before the body is in (413, 408): the rest of the
    body is read and discarded, at most `drain_bytes` within `drain_s`, then closed

A lingering close, as nginx's: closing a socket with unread data makes the kernel send a
reset, and a client that sends its whole body before reading (urllib, requests) then
fails on its send with "broken pipe" and never sees the 413. Half-closing (FIN after the
response) and reading on lets it finish sending and read the answer.

uvicorn times out a keep-alive connection only after a first response: a client that
connects and sends nothing, or a request head one byte a minute, held its socket forever
(and enough of them exhaust the file descriptors). `max_connections` bounds how many are
open at once (uvicorn answers 503 beyond it).

RequestLimits is a plain ASGI middleware, not Starlette's BaseHTTPMiddleware: that one
wraps `receive` so that a streaming route never sees its client disconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvlm.server.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# a refused body's connection is not kept alive: the rest of the body is drained, then closed
CLOSE = {"Connection": "close"}


@dataclass(slots=True, frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 << 20  # a request body; a 4096-token prompt is ~20 KB of text
    idle_timeout_s: float = 30.0  # to send a request head, or the next piece of a body
    keep_alive_s: float = 5.0  # an idle connection after a response (uvicorn's default)
    max_connections: int = 512  # open at once; more get 503
    drain_bytes: int = 64 << 20  # of a refused body, read and discarded before closing
    drain_s: float = 5.0  # the longest a refused body is drained
    public_metrics: bool = False  # /metrics without the API key (for a scraper)
    engine_wait_s: float = 10.0  # a route waiting for the engine between steps (/v1/kv); then 503
    stream_ping_s: float = 5.0  # a stream without an event this long gets a keep-alive

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("the body limit must be at least 1 KiB")
        for name in ("idle_timeout_s", "keep_alive_s", "drain_s", "engine_wait_s",
                     "stream_ping_s"):  # fmt: skip
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.drain_bytes < 0:
            raise ValueError("drain_bytes must be >= 0")


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """413 for a body over `max_body_bytes` (by its Content-Length, or as it arrives);
    408 for a body that stops arriving. The body is read by the route, so the limits are
    checked in the `receive` the route calls; a response is never started twice."""

    app: Callable
    limits: ServerLimits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        too_big = f"the request body is over the limit of {limit} bytes"
        # the first Content-Length (h11 has checked it is a number)
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > limit:
            await _error(send, 413, too_big)
            return
        received, done = 0, False

        async def limited() -> Message:
            nonlocal received, done
            if done:  # the body is in: from here on only a disconnect can come
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.limits.idle_timeout_s)
            except TimeoutError:
                raise HTTPException(408, "the request body stopped arriving", CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if received > limit:
                    raise HTTPException(413, too_big, CLOSE)
            return message

        await self.app(scope, limited, send)


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(message))
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within `idle_timeout_s` of opening (or of its last response), and closing one whose
    response came before its whole body with a lingering close (the module's docstring).
    Its limits are `config.kvlm_limits` (a ServerLimits)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._limits: ServerLimits = getattr(self.config, "kvlm_limits", ServerLimits())
        self._head_timer: asyncio.TimerHandle | None = None
        self._drain_left: int | None = None  # bytes still to discard; None: not draining
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self._limits.idle_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:  # no request under way
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_timer()  # a request head arrived: the route takes it from here
            if not isinstance(self.cycle.transport, _LingeringClose):
                # the cycle closes the connection after a `Connection: close` response
                self.cycle.transport = _LingeringClose(self.transport, self)

    def close_after_body(self) -> None:
        """Close now if the request was read whole, else half-close and drain its body."""
        if self.transport.is_closing():
            return
        body_in = self.cycle is None or not self.cycle.more_body  # its end was read
        if body_in or self._limits.drain_bytes == 0:
            self.transport.close()
            return
        self._drain_left = self._limits.drain_bytes
        self.flow.resume_reading()  # uvicorn pauses reading past 64 KiB of unread body
        if self.transport.can_write_eof():  # type: ignore[attr-defined]
            self.transport.write_eof()  # type: ignore[attr-defined]  # FIN after the answer
        self.loop.call_later(self._limits.drain_s, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._drain_left is None:
            super().data_received(data)
            return
        self._drain_left -= len(data)  # discarded unparsed: the answer has been sent
        if self._drain_left < 0:
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_head_timer()
        if self._drain_left is not None:  # only the drain's own bounds apply now
            self._unset_keepalive_if_required()
        elif not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


class _LingeringClose:
    """The transport as a request's cycle sees it: its close() is the protocol's
    close_after_body(); everything else is the transport's."""

    def __init__(self, transport: asyncio.BaseTransport, protocol: HeadTimeoutH11Protocol):
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_after_body()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
