"""OpenAI's Responses API over the chat road: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`.

A request is turned into the ChatCompletionRequest it means (`to_chat`): `instructions` as
the system turn, the stored conversation of `previous_response_id`, then `input` (a text,
or items: messages, function calls and their outputs, references to stored items), the
function tools, `tool_choice`, `text.format` (json_schema through the grammar), sampling.
It then takes the chat road (kvlm.server.app `_chat_parts`: template, grammar, engine, the
reply's tool-call parser); only the answer is written as a Response: output items (a
message with output_text, function calls), `status`, `usage` with the input tokens the
prefix cache served, whole or as OpenAI's event stream.

The KV cache is the point: a stored response (`store`, the default) keeps its
conversation, and its conversation's K/V blocks are pinned in the pool
(BlockManager.pin), so a follow-up naming it as `previous_response_id` re-renders the
conversation and finds every block of it in the prefix cache: it prefills only its new
input, and `usage.input_tokens_details.cached_tokens` says how much it did not. What is
kept is bounded (`ResponseStore`: a count, a share of the pool's blocks pinned, a TTL);
the oldest pins go first (their blocks stay in the prefix cache, and in the KV tiers where
configured, until evicted), then the oldest responses.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvlm.engine.engine import StepOutput
from kvlm.errors import InvalidRequestError
from kvlm.server import protocol
from kvlm.server.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionDef,
    StreamOptions,
    Text,
    Unsupported,
    _Body,
)
from kvlm.server.responses import Choices

MAX_ITEMS = 4096  # input items in one request
PIN_SHARE = 0.25  # of the pool's blocks, at most this many pinned by stored responses
KEEP = 1024  # stored responses
KEEP_BYTES = 256 << 20  # what they hold (text in and out, logprobs), the oldest go past it
TTL_S = 3600.0  # a stored response's life
# the item types kvlm reads; any other (web_search_call, computer_call, ...) is refused
_ITEMS = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
# OpenAI's tool kinds that are not functions (openai-python's responses.Tool): accepted,
# not offered to the model (HostedTool)
_HOSTED = ("web_search", "web_search_2025_08_26", "web_search_preview",
           "web_search_preview_2025_03_11", "file_search", "code_interpreter",
           "image_generation", "mcp", "computer", "computer_use_preview", "local_shell",
           "shell", "custom", "apply_patch", "tool_search",
           "programmatic_tool_calling")  # fmt: skip
# The tools OpenAI runs itself that a tool_choice may name (openai-python's
# ToolChoiceTypes, and its ToolChoiceMcp): "the model should use a built-in tool to generate
# a response" (HostedChoice). The others of _HOSTED are called by the client (custom,
# shell, apply_patch, ...): kvlm does not offer them, so a call of one cannot be forced.
_RUN_BY_OPENAI = ("web_search", "web_search_2025_08_26", "web_search_preview",
                  "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                  "image_generation", "mcp", "computer", "computer_use",
                  "computer_use_preview")  # fmt: skip


class _Part(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Refusal(_Body):
    type: Literal["refusal"]
    refusal: Text


class _Media(BaseModel):
    """An image, file or audio part: named in a 400 (kvlm serves text models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[_Part | _Refusal | _Media]
    id: Text | None = None
    status: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> MessageItem:
        for part in self.content if isinstance(self.content, list) else []:
            if isinstance(part, _Media):
                raise Unsupported("input", f"{part.type} parts are not supported: kvlm "
                                  "serves text models")  # fmt: skip
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, _Part) else p.refusal for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    namespace: Text | None = None  # its function's namespace: the model saw `name` alone
    id: Text | None = None
    status: Text | None = None


class FunctionOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[_Part]
    id: Text | None = None
    status: Text | None = None


class ReasoningItem(BaseModel):
    """A reasoning item of an earlier turn: dropped (as templates drop earlier thinking)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


class ItemReference(_Body):
    type: Literal["item_reference"]
    id: Text


Item = MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem | ItemReference


class FunctionTool(FunctionDef):
    """A function tool, the Responses way: the chat's function with its type beside."""

    type: Literal["function"]
    defer_loading: bool | None = None  # for OpenAI's tool search: every function is offered


class HostedTool(BaseModel):
    """A tool kvlm cannot offer the model: one OpenAI runs itself (web search, file
    search, ...) or one whose calls are items of their own kinds (custom, shell,
    apply_patch). Accepted and left out of the prompt: the model calls only functions, as
    a local server can (Codex sends `web_search` on every request)."""

    model_config = ConfigDict(extra="allow")
    type: Literal[_HOSTED]


class NamespaceTool(_Body):
    """Function tools grouped under a name: offered to the model as functions under their
    own names; a call of one is a function_call item carrying `namespace`."""

    type: Literal["namespace"]
    name: Text
    description: Text | None = None
    tools: Annotated[list[FunctionTool | HostedTool], Field(min_length=1, max_length=MAX_TOOLS)]


ToolParam = FunctionTool | NamespaceTool | HostedTool


class NamedFunction(protocol.NamedFunction):
    type: Literal["function"]


class HostedChoice(BaseModel):
    """tool_choice naming a tool OpenAI runs itself (`{"type": "web_search_preview"}`, ...):
    its model uses that tool to generate its response, a message, and calls no function.
    kvlm runs no hosted tool, so the response is the model's message, as under "none" (the
    functions not offered), whether the tool is among `tools` or not; echoed as given."""

    model_config = ConfigDict(extra="allow")
    type: Literal[_RUN_BY_OPENAI]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    model: Text
    input: Text | Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | HostedChoice | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    background: bool = False
    # vLLM's extensions, as on the chat route
    seed: int | None = None
    top_k: Annotated[int, Field(ge=-1)] = 0
    cache_salt: Text | None = None
    # accepted; no effect (bookkeeping on OpenAI's side)
    metadata: Annotated[dict[str, Text], Field(max_length=16)] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    service_tier: Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None
    prompt_cache_options: dict[str, Any] | None = None  # the prefix cache needs no hints
    context_management: list[dict[str, Any]] | None = None  # no compaction (context bound)
    moderation: Any = None
    # Codex's: its session and turn ids (OpenAI's backend logs them)
    client_metadata: Annotated[dict[str, Text], Field(max_length=64)] | None = None
    # what kvlm does not serve: refused, naming the field
    conversation: Any = None
    prompt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _known_kinds(cls, data: Any) -> Any:
        """Items and tools of kinds kvlm does not run are refused by name (before the
        union's field errors, which would not say why)."""
        if not isinstance(data, dict):
            return data
        for item in data.get("input") if isinstance(data.get("input"), list) else []:
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in _ITEMS:
                raise Unsupported("input", f"{kind} items are not supported")
        for tool in data.get("tools") if isinstance(data.get("tools"), list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind not in ("function", "namespace", *_HOSTED):
                raise Unsupported("tools", f"{kind} tools are not supported: kvlm offers "
                                  "function tools (and namespaces of them)")  # fmt: skip
        choice = data.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        if isinstance(kind, str) and kind in _HOSTED and kind not in _RUN_BY_OPENAI:
            raise Unsupported("tool_choice", f"{kind} tools are accepted but not offered to "
                              "the model (kvlm offers function tools): a call of one cannot "
                              "be forced")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        if self.conversation is not None:
            raise Unsupported("conversation", "the Conversations API is not served; use "
                              "previous_response_id")  # fmt: skip
        if self.prompt is not None:
            raise Unsupported("prompt", "stored prompt templates are not served")
        if self.background and (self.stream or not self.store):
            raise Unsupported("background", "a background response needs store true and "
                              "stream false")  # fmt: skip
        if len(self.functions()) > MAX_TOOLS:
            raise Unsupported("tools", f"at most {MAX_TOOLS} functions, namespaces' included")
        return self

    def functions(self) -> dict[str, tuple[str | None, FunctionTool]]:
        """The functions the model is offered, by name, in the order given: each with its
        namespace (None at the top level). Hosted tools are not among them. A name given
        twice (two namespaces, or one and the top level) is refused: a call of it could
        not be told apart."""
        out: dict[str, tuple[str | None, FunctionTool]] = {}
        for tool in self.tools or []:
            inner = tool.tools if isinstance(tool, NamespaceTool) else [tool]
            space = tool.name if isinstance(tool, NamespaceTool) else None
            for fn in inner:
                if not isinstance(fn, FunctionTool):
                    continue
                if fn.name in out:
                    raise Unsupported("tools", f"the function {fn.name!r} is given twice")
                out[fn.name] = (space, fn)
        return out


SAMPLING = ("temperature", "top_p", "top_k")  # the Responses API's sampling fields


def to_chat(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request `body` means over `messages` (the chat messages of its previous
    response's conversation, then its own input's: `conversation`), its instructions
    the system turn."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"model": body.model, "messages": system + messages,
                            "parallel_tool_calls": body.parallel_tool_calls}  # fmt: skip
    # only the sampling the client set: an unset field takes the server's default
    chat |= {k: getattr(body, k) for k in SAMPLING if k in body.model_fields_set}
    optional = {"max_tokens": body.max_output_tokens, "seed": body.seed,
                "cache_salt": body.cache_salt}  # fmt: skip
    chat |= {k: v for k, v in optional.items() if v is not None}
    if body.top_logprobs is not None:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    if functions := body.functions():
        chat["tools"] = [{"type": "function", "function": fn.model_dump(
            exclude_none=True, exclude={"type", "defer_loading"})}
            for _, fn in functions.values()]  # fmt: skip
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, HostedChoice):  # a message, no function call (HostedChoice)
        chat["tool_choice"] = "none"
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "output", "schema": fmt.schema_ or {}}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.text is not None and body.text.verbosity is not None:
        chat["verbosity"] = body.text.verbosity
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    return ChatCompletionRequest.model_validate(chat)


def input_items(body: ResponsesRequest) -> list[Item]:
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    return list(body.input)


class InputTooLong(InvalidRequestError):
    """The input expands (its item references, the previous response's conversation) to
    more text than the context can hold: refused before it is expanded."""


def conversation(
    given: list[Item], items: Callable[[str], dict[str, Any] | None], room: int
) -> list[dict[str, Any]]:
    """Items as chat messages: an assistant's function calls join its turn's tool_calls,
    a call's output is a tool message; reasoning is dropped. `room`: the characters the
    items may expand to (InputTooLong past it), counted from each item's size before a
    reference is read: 4,096 references to one stored 128 KB message are refused after
    a sum, not joined 4,096 times."""
    resolved = []
    for item in given:
        if isinstance(item, ItemReference):
            found = items(item.id)
            kind = _ITEM_TYPES.get(found.get("type", "")) if found is not None else None
            if kind is None:  # unknown, or a kind that says nothing (a reference, reasoning)
                raise Unsupported("input", f"no stored item {item.id!r} (item_reference)")
            room -= item_chars(found)
            resolved.append((kind, found))
        else:
            room -= item_chars(item.model_dump(exclude_none=True))
            resolved.append((None, item))
        if room < 0:
            raise InputTooLong("the input expands (with its item references and the previous "
                               "response's conversation) to more text than this model's "
                               "context can hold", param="input")  # fmt: skip
    return _messages(resolved)


def item_chars(item: dict[str, Any]) -> int:
    """The characters of text an item (as stored: a dict) holds, from its parts' lengths."""
    chars = 0
    for key in ("content", "output", "arguments", "name"):
        value = item.get(key)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            chars += sum(len(p.get("text") or p.get("refusal") or "") for p in value
                         if isinstance(p, dict))  # fmt: skip
    return chars


def _messages(resolved: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for kind, item in resolved:
        if kind is not None:
            item = kind.model_validate(item)
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionOutputItem):
            text = item.output if isinstance(item.output, str) else "".join(
                p.text for p in item.output)  # fmt: skip
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return out


_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionOutputItem}  # fmt: skip


def new_id(prefix: str, tag: str = "") -> str:
    """A new id: `prefix_<tag>_<hex>`. `tag`: the replica of `kvlm serve --replicas` whose
    store makes it (kvlm.cluster.keys.replica_tag; "" for a single server, `prefix_<hex>`),
    so the cluster's ingress sends a request naming a stored response or item to the
    replica that holds it (kvlm.cluster.keys.affinity)."""
    return f"{prefix}_{tag}_{uuid.uuid4().hex}" if tag else f"{prefix}_{uuid.uuid4().hex}"


def tag_of(some_id: str) -> str | None:
    """The replica tag in an id this module made (`resp_<tag>_<hex>`), or None."""
    parts = some_id.split("_")
    return parts[1] if len(parts) == 3 and parts[1] else None


# ---------------------------------------------------------------------------- the reply


@dataclass
class Reply:
    """One response being made: its ids, the request's echo fields, and the Choices its
    output accumulates in (kvlm.server.responses)."""

    body: ResponsesRequest
    model: str
    choices: Choices
    prompt_tokens: int
    tag: str = ""  # the replica's, in every id it makes (new_id)
    id: str = ""
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = ""
    reasoning_id: str = ""
    call_ids: list[str] = field(default_factory=list)  # the output's function_call items'
    call_refs: dict[int, str] = field(default_factory=dict)  # their call_id, by index
    token_ids: list[int] = field(default_factory=list)  # what the model made
    status: str = "in_progress"
    error: dict[str, Any] | None = None
    # what it samples with: the request's, else the server's defaults (the response's echo)
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        self.id = self.id or new_id("resp", self.tag)
        self.message_id = self.message_id or new_id("msg", self.tag)
        self.reasoning_id = self.reasoning_id or new_id("rs", self.tag)

    def call_id(self, index: int) -> str:
        while len(self.call_ids) <= index:
            self.call_ids.append(new_id("fc", self.tag))
        return self.call_ids[index]

    def output(self) -> list[dict[str, Any]]:
        """The output items so far (whole: the reply's text parsed for calls)."""
        if not self.choices.state[0].started:
            return []
        final = self.choices.final()[0]
        message = final["message"]
        done = "completed" if self.status != "in_progress" else "in_progress"
        out = []
        if message.get("reasoning_content"):  # kvlm.server.reasoning: what it thought
            out.append(self.reasoning_item(message["reasoning_content"], done))
        if message.get("content"):
            logprobs = (final.get("logprobs") or {}).get("content") or []
            out.append(self.message_item(message["content"], done, logprobs))
        for i, call in enumerate(message.get("tool_calls") or []):
            out.append(self.call_item(i, call, done))
        return out

    def reasoning_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [],
                "content": content, "status": status}  # fmt: skip

    def message_item(
        self, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The message item; `logprobs` (top_logprobs asked for): the reply's tokens' (its
        reasoning's and calls' too), each {token, logprob, bytes, top_logprobs}."""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        content = [] if text is None else [part]
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}  # fmt: skip

    def call_item(self, index: int, call: dict[str, Any], status: str) -> dict[str, Any]:
        fn = call["function"]
        call_id = self.call_refs.setdefault(index, call["id"])  # as first streamed
        item = {"id": self.call_id(index), "type": "function_call", "call_id": call_id,
                "name": fn["name"], "arguments": fn["arguments"], "status": status}  # fmt: skip
        space = self.body.functions().get(fn["name"], (None,))[0]
        return item | {"namespace": space} if space is not None else item

    def finish(self) -> None:
        """Set the status from how the sample ended."""
        reason = self.choices.state[0].finish_reason
        if reason == "error":
            self.status = "failed"
            self.error = {"code": "server_error", "message": "the engine failed on this request"}
        elif reason == "abort":
            self.status = "cancelled"
        else:
            self.status = "incomplete" if reason == "length" else "completed"

    def response(self) -> dict[str, Any]:
        b, state = self.body, self.choices.state[0]
        cached = sum(self.choices.cached.values())
        usage = None
        if self.status not in ("in_progress", "queued"):
            usage = {"input_tokens": self.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": state.tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.prompt_tokens + state.tokens}  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if (
            b.text and b.text.format) else {"type": "text"}  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "background": b.background, "error": self.error,
            "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "max_tool_calls": b.max_tool_calls,
            "model": self.model, "output": self.output(),
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": b.store, "temperature": self.temperature, "text": {"format": fmt},
            "tool_choice": _echo_choice(b.tool_choice),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_logprobs": b.top_logprobs or 0, "top_p": self.top_p,
            "truncation": b.truncation or "disabled", "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }  # fmt: skip


def _echo_choice(choice: Any) -> Any:
    if isinstance(choice, (NamedFunction, HostedChoice)):
        return choice.model_dump()
    return choice or "auto"


async def record(events: AsyncIterator[StepOutput], reply: Reply) -> AsyncIterator[StepOutput]:
    """The events, their token ids kept in the reply (the conversation's, to pin)."""
    async for event in events:
        reply.token_ids += event.token_ids
        yield event


async def stream(events: AsyncIterator[StepOutput], reply: Reply,
                 done: Callable[[Reply], None]) -> AsyncIterator[str]:  # fmt: skip
    """OpenAI's Responses event stream: response.created and .in_progress; a reasoning
    item (its reasoning_text deltas) where the reply thinks, the message item, its
    output_text part and its deltas as they come; each function call as an item, its
    arguments' deltas as they come; then response.completed (or
    .incomplete, .failed). `done(reply)` runs at the end (the store)."""
    items = _Items(reply)
    yield items.event("response.created", response=reply.response())
    yield items.event("response.in_progress", response=reply.response())
    try:
        async for step in events:
            chunk = reply.choices.chunk({}, step)
            delta = chunk["choices"][0]["delta"] if chunk else {}
            for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
                if delta.get(key):
                    for line in [*items.to(kind), items.text(delta[key])]:
                        yield line
            for call in delta.get("tool_calls") or []:
                for line in items.call(call):
                    yield line
        for line in items.close():
            yield line
        reply.finish()
        done(reply)
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            reply.status, "response.completed")  # fmt: skip
        yield items.event(kind, response=reply.response())
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # a disconnect: aborted


class _Items:
    """A streamed response's output items: the one open (reasoning or message) and its
    text so far, the numbering of items and of events."""

    def __init__(self, reply: Reply) -> None:
        self.reply, self.seq, self.index, self.calls = reply, 0, -1, 0
        self.open: str | None = None  # "reasoning", "message" or "call"
        self.written = ""
        self.begun: dict[str, Any] = {}  # the open call's item

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq} | data
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _item(self, status: str) -> dict[str, Any]:
        make = self.reply.reasoning_item if self.open == "reasoning" else self.reply.message_item
        return make(self.written or None, status)

    def _where(self) -> dict[str, Any]:
        item_id = self.reply.reasoning_id if self.open == "reasoning" else self.reply.message_id
        return {"item_id": item_id, "output_index": self.index, "content_index": 0}

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if self.open == "reasoning" else _part(text)

    def to(self, kind: str) -> list[str]:
        """Events that make `kind` the open item."""
        if self.open == kind:
            return []
        lines = self.close()
        self.index, self.open, self.written = self.index + 1, kind, ""
        return [*lines, self.event("response.output_item.added", output_index=self.index,
                                   item=self._item("in_progress")),
                self.event("response.content_part.added", **self._where(),
                           part=self._part(""))]  # fmt: skip

    def text(self, delta: str) -> str:
        self.written += delta
        if self.open == "reasoning":
            return self.event("response.reasoning_text.delta", **self._where(), delta=delta)
        return self.event("response.output_text.delta", **self._where(), delta=delta,
                          logprobs=[])  # fmt: skip

    def close(self) -> list[str]:
        if self.open is None:
            return []
        text = self.written
        if self.open == "call":
            item = self.begun | {"arguments": text, "status": "completed"}
            at = {"item_id": item["id"], "output_index": self.index}
            lines = [self.event("response.function_call_arguments.done", **at,
                                name=item["name"], arguments=text),
                     self.event("response.output_item.done", output_index=self.index,
                                item=item)]  # fmt: skip
        else:
            where = self._where()
            extra = {} if self.open == "reasoning" else {"logprobs": []}
            kind = "reasoning_text" if self.open == "reasoning" else "output_text"
            lines = [self.event(f"response.{kind}.done", **where, text=text, **extra),
                     self.event("response.content_part.done", **where, part=self._part(text)),
                     self.event("response.output_item.done", output_index=self.index,
                                item=self._item("completed"))]  # fmt: skip
        self.open = None
        return lines

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A call's delta (kvlm.server.tools.ToolStream): its item opened when it begins,
        then its arguments as they come."""
        lines = []
        if "id" in delta:
            lines = self.close()
            self.index, self.open, self.written = self.index + 1, "call", ""
            begun = {"id": delta["id"], "function": delta["function"] | {"arguments": ""}}
            self.begun = self.reply.call_item(self.calls, begun, "in_progress")
            self.calls += 1
            lines.append(self.event("response.output_item.added", output_index=self.index,
                                    item=self.begun))  # fmt: skip
        piece = delta["function"].get("arguments")
        if piece and self.open == "call":
            self.written += piece
            lines.append(self.event("response.function_call_arguments.delta",
                                    item_id=self.begun["id"], output_index=self.index,
                                    delta=piece))  # fmt: skip
        return lines


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


# ---------------------------------------------------------------------------- the store


@dataclass
class Stored:
    reply: Reply
    history: list[dict[str, Any]]  # the conversation as chat messages, this reply's turn in
    items: list[dict[str, Any]]  # its input items, for input_items
    expires: float = 0.0
    task: asyncio.Task | None = None  # a background response's
    nbytes: int = 0  # what it holds: its own text (input items, reply) as JSON, logprobs
    chars: int = 0  # its conversation's text (instructions and history), for follow-ups
    item_ids: list[str] = field(default_factory=list)  # what index() made reachable


class ResponseStore:
    """Stored responses, oldest first, bounded by count, bytes and age; their K/V pinned in the
    pool through `pin(response id, token ids, salt)` and let go through `unpin(response
    id)` (the engine's Engine.pin / unpin, which also bound the pinned blocks: the oldest
    pins go first)."""

    def __init__(
        self, keep: int, ttl_s: float, pin: Callable[[str, list[int], str | None], None],
        unpin: Callable[[str], None], tag: str = "",
    ) -> None:  # fmt: skip
        self.keep, self.ttl_s = keep, ttl_s
        self.tag = tag  # the replica's (new_id): in the ids of what it stores
        self.pin, self._unpin = pin, unpin
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self._items: dict[str, dict[str, Any]] = {}
        self.nbytes = 0  # the entries' own text

    def get(self, response_id: str) -> Stored | None:
        entry = self.entries.get(response_id)
        if entry is not None and entry.expires < time.monotonic():
            self.delete(response_id)
            return None
        return entry

    def item(self, item_id: str) -> dict[str, Any] | None:
        return self._items.get(item_id)

    def put(self, entry: Stored) -> None:
        """Keep `entry` (the oldest go while more than `keep` are kept or they hold more
        than KEEP_BYTES of their own text, and once expired)."""
        entry.expires = time.monotonic() + self.ttl_s
        again = self.entries.pop(entry.reply.id, None)  # a background response, now done
        self.nbytes -= again.nbytes if again is not None else 0
        entry.nbytes = len(json.dumps([entry.items, entry.history[-1:]])) + held_logprobs(
            entry.reply
        )  # its own turn
        self.entries[entry.reply.id] = entry
        self.nbytes += entry.nbytes
        self.index(entry)
        now = time.monotonic()
        for response_id, old in list(self.entries.items()):
            full = len(self.entries) > self.keep or self.nbytes > KEEP_BYTES
            if (full and old is not entry) or old.expires < now:
                self.delete(response_id)

    def index(self, entry: Stored) -> None:
        """Make its items (input and output) reachable by id (item_reference)."""
        items = [*entry.items, *entry.reply.output()]
        self._items.update((item["id"], item) for item in items)
        entry.item_ids = [item["id"] for item in items]

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        if entry.task is not None:
            entry.task.cancel()
        for item_id in entry.item_ids:
            self._items.pop(item_id, None)
        self._unpin(response_id)
        return True


def stored_items(body: ResponsesRequest, tag: str = "") -> list[dict[str, Any]]:
    """The request's input items as the API lists them (each with an id; `tag`: new_id's)."""
    out = []
    for item in input_items(body):
        data = item.model_dump(by_alias=True, exclude_none=True)
        kind = "msg" if data.get("type", "message") == "message" else "fc"
        data.setdefault("id", new_id(kind, tag))
        data.setdefault("type", "message")
        out.append(data)
    return out


# What a token's logprobs hold in memory (TokenLogprob, its float, its `top` dict): about
# 3.2 KB a token at top_logprobs 20 (measured as RSS, 6.3 MB for 2,000 tokens)
LOGPROB_BYTES, TOP_BYTES = 160, 152


def held_logprobs(reply: Reply) -> int:
    """The bytes the reply's logprobs hold (the store's bound counts them)."""
    return sum(LOGPROB_BYTES + TOP_BYTES * len(e.top) for c in reply.choices.state
               for e in c.logprobs)  # fmt: skip


def history_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of text chat messages hold (their content, their calls')."""
    chars = 0
    for m in messages:
        chars += len(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return chars


def assistant_turn(reply: Reply) -> dict[str, Any]:
    """The reply as the chat message that continues its conversation."""
    message = reply.choices.final()[0]["message"]
    turn = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn
