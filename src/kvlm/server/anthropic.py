"""Anthropic's Messages API over the chat road: `POST /v1/messages` and
`/v1/messages/count_tokens`.

A Messages request is translated into the ChatCompletionRequest it means (`to_chat`): the
system prompt, the turns with their text, tool_use and tool_result blocks, the tools, and
tool_choice, validated by the chat request's own checks. From there it runs exactly the
chat route's road (template, grammar for a forced tool, engine, the reply's tool-call
parser, kvlm.server.responses.Choices); only the answer is written in Anthropic's shape:
a message with content blocks, stop_reason, and usage that says how many input tokens the
prefix cache served (`cache_read_input_tokens`), whole or as Anthropic's event stream
(message_start, content_block_start/delta/stop, message_delta, message_stop).

What a text model cannot take is a 400 naming the field: image, document and search
result blocks, server tools (web search, code execution, ...), MCP servers, containers.
Every prompt's blocks are reused by the prefix cache without being asked; `cache_control`
marks (at most 4, "ephemeral", a ttl of "5m" or "1h"; the request's own: its last block)
pin the prefix up to each marked block for its ttl (`breakpoints`: the conversation cut
after the block, rendered without a generation prompt, as far as it is a prefix of the
prompt; a tool's or a system block's mark: the system turn and the tools), so eviction
passes them by (Engine.pin, within the stored responses' share of the pool), and usage
says what the marks wrote: `cache_creation_input_tokens` the marked prefix's tokens the
cache did not serve, `input_tokens` those after it. Thinking blocks in the history are dropped (as
Anthropic's own API drops earlier turns' thinking); `thinking` reaches the chat template as
`enable_thinking`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvlm.engine.engine import StepOutput
from kvlm.server.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    StopString,
    Text,
    Unsupported,
    _Body,
)
from kvlm.server.responses import Choices

MAX_STOP_SEQUENCES = 16  # stop strings one request may give (each at most MAX_STOP_CHARS)
ANTHROPIC_PATHS = "/v1/messages"  # errors under this path are written in Anthropic's shape
# Anthropic's error types by HTTP status (anything else: api_error)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}  # fmt: skip
_STOPS = {"length": "max_tokens", "abort": "end_turn"}
# sent while a stream waits for its next event (a long prefill), as Anthropic's API does
PING = 'event: ping\ndata: {"type": "ping"}\n\n'


class CacheControl(_Body):
    """A cache breakpoint: the prefix up to the block it marks is kept for `ttl` (other
    keys a client adds are Anthropic's bookkeeping: no effect)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> float:
        return TTL_S[self.ttl]


TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # Anthropic's: more cache_control marks in one request are a 400


class _Marked(_Body):
    cache_control: CacheControl | None = None


class TextBlock(_Marked):
    type: Literal["text"]
    text: Text
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Marked):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    caller: dict[str, Any] | None = None  # programmatic tool calling: no effect here
    toolset_name: Text | None = None


class ToolResultBlock(_Marked):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    toolset_name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: Text | None = None
    signature: Text | None = None
    data: Text | None = None


class OtherBlock(BaseModel):
    """An image, document, search result or server tool block: named in a 400."""

    model_config = ConfigDict(extra="allow")
    type: Text


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | OtherBlock


class Message(_Body):
    # "system": a mid-conversation system turn (Anthropic's newer API; Claude Code sends
    # its environment that way after the first user turn): text only
    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[Block], Field(min_length=1)]

    @model_validator(mode="after")
    def _system_is_text(self) -> Message:
        if self.role == "system" and not all(isinstance(b, TextBlock) for b in self.blocks()):
            raise ValueError("a system turn's content is text or text blocks")
        return self

    def blocks(self) -> list[Block]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolDef(_Marked):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None  # the call's input always matches when forced (the grammar)
    # accepted; no effect (Anthropic's tool search and programmatic calling)
    allowed_callers: list[Any] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class ContextEdit(BaseModel):
    """A context management edit (Anthropic's beta): `clear_thinking_20251015` is what kvlm
    does anyway (earlier turns' thinking never reaches the template), so any `keep` is
    accepted; an edit that would rewrite the conversation (clearing tool results,
    compaction) is refused, naming it."""

    model_config = ConfigDict(extra="allow")
    type: Text


class ContextManagement(_Body):
    edits: Annotated[list[ContextEdit], Field(max_length=16)] | None = None


class JsonFormat(_Body):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None  # structured output: through the grammar


class MessagesRequest(_Body):
    model: Text
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: Text | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    tools: Annotated[list[ToolDef | OtherBlock], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    # sampling: gone from Anthropic's newest API, still sent by older clients
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    # the request's own mark: its last block (automatic caching)
    cache_control: CacheControl | None = None
    # accepted; no effect (bookkeeping on Anthropic's side)
    diagnostics: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Text | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: Text | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None
    # what kvlm does not run: refused, naming the field
    mcp_servers: Any = None
    container: Any = None

    @model_validator(mode="after")
    def _what_kvlm_does_not_do(self) -> MessagesRequest:
        for field in ("mcp_servers", "container"):
            if getattr(self, field) is not None:
                raise Unsupported(field, "kvlm runs no server-side tools or containers")
        for edit in (self.context_management or ContextManagement()).edits or []:
            if not edit.type.startswith("clear_thinking_"):
                why = (
                    f"{edit.type!r} is not supported: kvlm does not rewrite the conversation "
                    "(earlier turns' thinking, which it drops, is the one edit it makes)"
                )
                raise Unsupported("context_management.edits", why)
        for tool in self.tools or []:
            if isinstance(tool, OtherBlock):
                raise Unsupported("tools", f"server tool {tool.type!r} is not supported: "
                                  "kvlm serves client tools (name, input_schema)")  # fmt: skip
        for turn in self.messages:
            for block in turn.blocks():
                if isinstance(block, OtherBlock):
                    raise Unsupported("messages.content", f"{block.type} blocks are not "
                                      "supported: kvlm serves text models")  # fmt: skip
        marks = len(_marks(self)) + (self.cache_control is not None)
        if marks > MAX_BREAKPOINTS:
            raise ValueError(f"a maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                             f"provided, {marks} were")  # fmt: skip
        return self


class CountTokensRequest(MessagesRequest):
    """count_tokens: a Messages body without max_tokens (given, it has no effect)."""

    max_tokens: int | None = None  # type: ignore[assignment]


SAMPLING = ("temperature", "top_p", "top_k")  # the Messages API's sampling fields


def _marks(body: MessagesRequest) -> list[tuple[int, int, CacheControl]]:
    """The marked blocks in order, (turn, block, mark): a tool's or a system block's as
    turn -1 (the system turn and the tools)."""
    out = [(-1, 0, t.cache_control) for t in body.tools or []
           if isinstance(t, ToolDef) and t.cache_control is not None]  # fmt: skip
    if isinstance(body.system, list):
        out += [(-1, 0, b.cache_control) for b in body.system if b.cache_control is not None]
    for i, turn in enumerate(body.messages):
        out += [(i, j, getattr(b, "cache_control", None)) for j, b in enumerate(turn.blocks())
                if getattr(b, "cache_control", None) is not None]  # fmt: skip
    return out


def breakpoints(body: MessagesRequest) -> list[tuple[ChatCompletionRequest, float]]:
    """The prefixes the request's cache_control marks ask to keep, each the chat request
    of the conversation cut after the marked block (a tool's or the system's: the system
    turn and the tools alone), with its life in seconds; the request's own mark is its
    last block. A cut the chat road refuses (a template that needs a user turn) is left
    out: there is no prefix to keep."""
    marks = _marks(body)
    if body.cache_control is not None:
        last = body.messages[-1]
        marks.append((len(body.messages) - 1, len(last.blocks()) - 1, body.cache_control))
    out = []
    for turn, block, mark in marks:
        messages = body.messages[:turn]
        if turn >= 0:
            cut = body.messages[turn]
            messages = [*messages, cut.model_copy(update={"content": cut.blocks()[: block + 1]})]
        try:
            chat = to_chat(body.model_copy(update={"messages": messages}))
        except ValueError:
            continue
        out.append((chat, mark.seconds))
    return out


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request `body` means (its checks run on it)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(
            b.text for b in body.system)  # fmt: skip
        messages.append({"role": "system", "content": system})
    for turn in body.messages:
        messages += _turn(turn)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    # only the sampling the client set: an unset field takes the server's default
    chat |= {k: getattr(body, k) for k in SAMPLING if k in body.model_fields_set}
    if body.max_tokens is not None:
        chat["max_tokens"] = body.max_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools]  # fmt: skip
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise Unsupported("tool_choice.name", "tool_choice type 'tool' needs a name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    config = body.output_config
    if config is not None and config.effort is not None:
        chat["reasoning_effort"] = {"max": "xhigh"}.get(config.effort, config.effort)
    if config is not None and config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": config.format.schema_}}  # fmt: skip
    return ChatCompletionRequest.model_validate(chat)


def _turn(turn: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool
    messages (before its text), an assistant's tool_use blocks its tool calls."""
    out: list[dict[str, Any]] = []
    text, calls = [], []
    for block in turn.blocks():
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            result = block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result})  # fmt: skip
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})  # fmt: skip
    if turn.role == "system":  # in place: the turns before it stay a cached prefix
        out.append({"role": "system", "content": "".join(text)})
    elif turn.role == "assistant":
        if text or calls:
            out.append({"role": "assistant", "content": "".join(text) or None,
                        "tool_calls": calls or None})  # fmt: skip
    elif text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _stop(choice: dict[str, Any], event: StepOutput | None, full: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice; `full`: its max_tokens was the
    room the prompt left (clamped), so a reply cut by it stopped at the context window
    (Anthropic's model_context_window_exceeded, for a max_tokens past it)."""
    finish = choice["finish_reason"]
    if finish == "length" and full:
        return "model_context_window_exceeded", None
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "stop" and event is not None and event.stop_reason is not None:
        return "stop_sequence", event.stop_reason
    return _STOPS.get(finish, "end_turn"), None


def usage(prompt_tokens: int, cached: int, output: int, marked: int = 0) -> dict[str, Any]:
    """Anthropic's usage: the prompt's tokens the cache served (`cached`), those of the
    marked prefix (the longest cache_control breakpoint's, `marked` tokens) it did not
    (written to the cache for the marks), and those after (input_tokens)."""
    written = max(0, min(marked, prompt_tokens) - cached)
    return {"input_tokens": prompt_tokens - cached - written, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": written}  # fmt: skip


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):  # kvlm.server.reasoning: a thinking block
        out.append({"type": "thinking", "thinking": message["reasoning_content"],
                    "signature": ""})  # fmt: skip
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        out.append(_tool_use(call, whole=True))
    return out


def _tool_use(call: dict[str, Any], whole: bool) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if whole else {}
    except (ValueError, RecursionError):  # cut off, or nested too deep
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}


def message(
    head: dict[str, Any], choices: Choices, last: StepOutput | None, prompt_tokens: int,
    full: bool = False, marked: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The whole reply (`full`: _stop's; `marked`: usage's)."""
    choice = choices.final()[0]
    reason, sequence = _stop(choice, last, full)
    cached = sum(choices.cached.values())
    return head | {"content": _blocks(choice["message"]), "stop_reason": reason,
                   "stop_sequence": sequence,
                   "usage": usage(prompt_tokens, cached, choices.state[0].tokens,
                                  marked)}  # fmt: skip


def new_head(model: str) -> dict[str, Any]:
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
            "model": model}  # fmt: skip


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data, ensure_ascii=False)}\n\n"


async def stream(
    events: AsyncIterator[StepOutput], choices: Choices, head: dict[str, Any],
    prompt_tokens: int, failed: str, full: bool = False, marked: int = 0,
) -> AsyncIterator[str]:  # fmt: skip
    """Anthropic's event stream of one reply: its reasoning as it comes in a thinking
    block, its text in a text block, then each tool call as a tool_use block, its input
    as input_json_delta events as it comes."""
    start = head | {"content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": usage(prompt_tokens, 0, 0)}  # fmt: skip
    yield _event("message_start", {"message": start})
    blocks = _Blocks()
    last, finish = None, None
    try:
        async for event in events:
            if event.finish_reason == "error":
                yield _event("error", {"error": error_body(500, failed)["error"]})
                return
            last = event
            chunk = choices.chunk({}, event)
            choice = chunk["choices"][0] if chunk else {"delta": {}, "finish_reason": None}
            finish = choice["finish_reason"] or finish
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                for line in blocks.to({"type": "thinking", "thinking": "", "signature": ""}):
                    yield line
                yield _delta(blocks.index, {"type": "thinking_delta",
                                            "thinking": delta["reasoning_content"]})  # fmt: skip
            if delta.get("content"):
                for line in blocks.to({"type": "text", "text": ""}):
                    yield line
                yield _delta(blocks.index, {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:  # a call begun, then its arguments
                if "id" in call:
                    for line in blocks.to(_tool_use(call, whole=False), again=True):
                        yield line
                args = call["function"].get("arguments")
                if args:
                    yield _delta(blocks.index, {"type": "input_json_delta", "partial_json": args})
        for line in blocks.close():
            yield line
        state = choices.state[0]
        reason, sequence = _stop({"finish_reason": finish or state.finish_reason}, last, full)
        yield _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(prompt_tokens, sum(choices.cached.values()), state.tokens,
                           marked)})  # fmt: skip
        yield _event("message_stop", {})
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # a disconnect: aborted


class _Blocks:
    """The streamed message's content blocks: the one open, its index."""

    def __init__(self) -> None:
        self.index, self.open = -1, None

    def to(self, block: dict[str, Any], again: bool = False) -> list[str]:
        """Events that make `block`'s kind the open block (a new one each time: `again`)."""
        if self.open == block["type"] and not again:
            return []
        lines = self.close()
        self.index, self.open = self.index + 1, block["type"]
        return [*lines, _start(self.index, block)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        lines = []
        if self.open == "thinking":  # Anthropic's clients expect its signature
            lines.append(_delta(self.index, {"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*lines, _event("content_block_stop", {"index": self.index})]


def _start(index: int, block: dict[str, Any]) -> str:
    return _event("content_block_start", {"index": index, "content_block": block})


def _delta(index: int, delta: dict[str, Any]) -> str:
    return _event("content_block_delta", {"index": index, "delta": delta})
