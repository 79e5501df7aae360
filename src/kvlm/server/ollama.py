"""Ollama's API over the chat road: `/api/chat`, `/api/generate`, and what Ollama's
clients ask of a server before they chat (`/api/version`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/pull`, `GET`/`HEAD /`).

A chat request is translated into the ChatCompletionRequest it means (`to_chat`): the
messages with their tool calls and tool replies, the tools, `format` as response_format,
`think` as the template's enable_thinking (and reasoning_effort for a level), `options`
as sampling fields, validated by the chat request's own checks. A generate request is one
user turn (with its `system`) on the same road, or with `raw` its prompt as it is, on the
completions road (`to_completion`). From there it runs exactly the chat route's road
(template, grammar, engine, the reply's tool-call parser, kvlm.server.responses.Choices);
only the answer is written in Ollama's shape (`Reply`): one JSON object, or NDJSON lines,
the last `done: true` with `done_reason` and the counts and durations (nanoseconds).

Two options bound the request where the chat road has no field for them: `num_predict`
clips the completion (<= 0: up to the context, as Ollama's runner reads it), `num_ctx`
narrows the context this request may fill (the server's own is the bound; a larger one is
not an error). Unset sampling options take the server's defaults (kvlm serve's flags, the
model file's recommendation: kvlm.server.defaults), as a Modelfile's PARAMETER lines do in
Ollama, else Ollama's documented defaults (`DEFAULTS`), so a client moved from Ollama
samples as it did. Options that tune Ollama's loader or
samplers kvlm does not have are accepted with no effect (`Options`, docs/API.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from kvlm.cache.memory import parameter_count
from kvlm.config import ModelConfig
from kvlm.engine.engine import StepOutput
from kvlm.engine.sampling import MAX_LOGPROBS, MAX_REPETITION, SEED_MAX, SEED_MIN
from kvlm.server.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
    StopString,
    Text,
    Tool,
    Unsupported,
    _Body,
)
from kvlm.server.responses import Choices

OLLAMA_PATHS = "/api/"  # errors under this path are written in Ollama's shape
# The Ollama API level this module follows (GitHub Copilot asks for at least 0.6.4)
API_VERSION = "0.13.0"
MAX_STOP_SEQUENCES = 16  # stop strings one request may give (each at most MAX_STOP_CHARS)
# Ollama's defaults for the sampling options a request leaves unset (its Modelfile docs),
# under the server's own (kvlm.server.app._params)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# kvlm's sampling fields Ollama names otherwise
_NAMES = {"repetition_penalty": "repeat_penalty"}
NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: kvlm keeps its model loaded
_DONE = {"length": "length"}  # finish_reason -> done_reason (else "stop")

Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Ollama(_Body):
    """Ollama's bodies take unknown fields and ignore them, as Ollama's server does (its
    clients add fields as Ollama grows: `truncate`, `shift`, ...): a field kvlm knows and
    cannot honour is still a 400 naming it."""

    model_config = ConfigDict(extra="ignore", strict=True)


class Options(_Ollama):
    """Ollama's `options`: sampling honoured; loader and other samplers' knobs accepted
    with no effect (kvlm loads its model once, at `kvlm serve`)."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: int | None = None  # <= 0: off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    typical_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX - 1)] | None = None
    num_predict: int | None = None  # <= 0: up to the context
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = (
        None
    )
    repeat_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    num_ctx: Annotated[int, Field(ge=1)] | None = (
        None  # this request's context, at most the server's
    )
    # accepted; no effect (loader settings; samplers kvlm does not have)
    repeat_last_n: int | None = None
    num_keep: int | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None

    def sampling(self) -> dict[str, Any]:
        """The chat request's sampling fields: those given (the unset ones take the
        server's defaults, then Ollama's: kvlm.server.app._params)."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                 "typical_p": self.typical_p, "seed": self.seed,
                 "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repeat_penalty,
                 "top_k": None if self.top_k is None else max(self.top_k, 0)}  # fmt: skip
        return {k: v for k, v in given.items() if v is not None}

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class Function(_Ollama):
    name: Text
    arguments: dict[str, Any] | Text = Field(default_factory=dict)  # Ollama's: an object
    index: int | None = None


class ToolCall(_Ollama):
    function: Function
    id: Text | None = None
    type: Literal["function"] | None = None


class Message(_Ollama):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    thinking: Text | None = None  # an earlier turn's: the template's to keep or drop
    images: list[Text] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: Text | None = None  # a tool reply's tool
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _text_only(self) -> Message:
        if self.images:
            raise Unsupported("images", "kvlm serves text models")
        return self


Format = Literal["", "json"] | dict[str, Any]
Think = bool | Literal["low", "medium", "high"]


class _Generation(_Ollama):
    model: Text
    format: Format | None = None
    options: Options | None = None
    stream: bool = True  # Ollama's default
    keep_alive: float | Text | None = None  # accepted; no effect (the model stays loaded)
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def common(self, model: str) -> dict[str, Any]:
        """The fields the chat and completions requests share."""
        out = {"model": model} | (self.options or Options()).sampling()
        if self.think is not None:
            kwargs = {"enable_thinking": self.think is not False}
            out["chat_template_kwargs"] = kwargs
        return out


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list, max_length=100_000)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None


class GenerateRequest(_Generation):
    prompt: Text = ""
    system: Text | None = None
    raw: bool = False
    suffix: Text | None = None
    template: Text | None = None
    context: list[int] | None = None
    images: list[Text] | None = None
    # Ollama's image generation: refused
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    @model_validator(mode="after")
    def _what_kvlm_does_not_do(self) -> GenerateRequest:
        refused = {
            "suffix": (self.suffix, "insertion (fill in the middle) is not supported"),
            "template": (self.template, "kvlm renders the model's own chat template (Go "
                         "templates are not run); send raw: true with the prompt written out"),
            "context": (self.context, "send the conversation to /api/chat instead"),
            "images": (self.images, "kvlm serves text models"),
        }  # fmt: skip
        for field, (value, why) in refused.items():
            if value:
                raise Unsupported(field, why)
        for field in ("width", "height", "steps"):
            if getattr(self, field) is not None:
                raise Unsupported(field, "kvlm serves text models: no image generation")
        return self


class ShowRequest(_Ollama):
    model: Text | None = None
    name: Text | None = None  # the older name of `model`
    verbose: bool = False

    @model_validator(mode="after")
    def _named(self) -> ShowRequest:
        if (self.model or self.name) is None:
            raise ValueError("model is required")
        return self

    @property
    def which(self) -> str:
        return self.model or self.name or ""


class PullRequest(ShowRequest):
    insecure: bool = False  # accepted; no effect (nothing is downloaded)
    stream: bool = True


def parameters(values: dict[str, Any]) -> str:
    """/api/show's `parameters`: a Modelfile's PARAMETER lines, Ollama's names."""
    return "\n".join(f"{_NAMES.get(k, k)} {v}" for k, v in values.items())


def served_name(name: str) -> str:
    """The name Ollama's clients list and send: with a tag, as Ollama names models."""
    return name if ":" in name else name + ":latest"


def resolve(requested: str, served: str) -> str:
    """The served name where `requested` names it (with or without `:latest`), else the
    request's own (which the model check then refuses, naming it)."""
    return served if requested in (served, served_name(served)) else requested


def to_chat(body: ChatRequest, served: str) -> ChatCompletionRequest:
    """The chat completion request `body` means (its checks run on it)."""
    chat = body.common(resolve(body.model, served))
    chat["messages"] = _messages(body.messages)
    if body.tools:
        chat["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(body.think, str):
        chat["reasoning_effort"] = body.think
    fmt = _format(body.format)
    if fmt is not None:
        chat["response_format"] = fmt
    if body.logprobs:
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs
    return ChatCompletionRequest.model_validate(chat)


def generate_chat(body: GenerateRequest, served: str) -> ChatCompletionRequest:
    """A generate request (not raw) as the chat it means: its system and one user turn."""
    turns = [Message(role="user", content=body.prompt)]
    if body.system:
        turns.insert(0, Message(role="system", content=body.system))
    chat = ChatRequest(model=body.model, messages=turns, format=body.format,
                       options=body.options, think=body.think, logprobs=body.logprobs,
                       top_logprobs=body.top_logprobs)  # fmt: skip
    return to_chat(chat, served)


def to_completion(body: GenerateRequest, served: str) -> CompletionRequest:
    """A raw generate request: its prompt as it is, no template (the completions road)."""
    comp = body.common(resolve(body.model, served))
    comp.pop("chat_template_kwargs", None)  # no template to pass it to
    comp["prompt"] = body.prompt
    comp["max_tokens"] = None
    fmt = body.format
    if fmt == "json":
        comp["guided_json"] = {"type": "object"}
    elif isinstance(fmt, dict):
        comp["guided_json"] = fmt
    if body.logprobs:
        comp["logprobs"] = body.top_logprobs or 0
    return CompletionRequest.model_validate(comp)


def _format(fmt: Format | None) -> dict[str, Any] | None:
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    return None


def _messages(turns: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as chat messages: an assistant's calls get ids (Ollama's have
    none), each tool reply the id of the call it answers (named by tool_name, else the
    next unanswered one)."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not answered yet
    for n, m in enumerate(turns):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking is not None and m.role == "assistant":
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            calls = []
            for i, call in enumerate(m.tool_calls):
                cid = call.id or f"call_{n}_{i}"
                args = call.function.arguments
                calls.append({"id": cid, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args)}})  # fmt: skip
                open_calls.append((cid, call.function.name))
            msg["tool_calls"] = calls
            msg["content"] = m.content or None
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or _answered(open_calls, m.tool_name, n)
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def _answered(open_calls: list[tuple[str, str]], name: str | None, n: int) -> str:
    for i, (cid, called) in enumerate(open_calls):
        if name is None or called == name:
            del open_calls[i]
            return cid
    return f"call_{n}"


# ---------------------------------------------------------------------------- the answer


def now() -> str:
    """Ollama's created_at: UTC, microseconds, a Z."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Reply:
    """One chat or generate answer in Ollama's shape: the whole reply or its NDJSON lines
    (`chat`: a `message`, else generate's `response`), with the counts and durations."""

    def __init__(self, model: str, chat: bool, choices: Choices, prompt_tokens: int,
                 started: int) -> None:  # fmt: skip
        self.model, self.chat, self.choices = model, chat, choices
        self.prompt_tokens, self.started = prompt_tokens, started
        self.submitted = self.first = self.last = 0  # time.perf_counter_ns() stamps

    async def timed(self, events: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
        """The events, the time of the first and of the last kept (the durations;
        `submitted` is set as the request enters the engine)."""
        try:
            async for event in events:
                self.last = time.perf_counter_ns()
                self.first = self.first or self.last
                yield event
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # gone: the request aborted

    def _line(self, text: str = "", thinking: str = "", calls: list | None = None,
              logprobs: list | None = None) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if logprobs:
            out["logprobs"] = logprobs
        return out | {"done": False}

    def _done(self, finish: str | None) -> dict[str, Any]:
        end = time.perf_counter_ns()
        first = self.first or end
        return {"done": True, "done_reason": _DONE.get(finish or "stop", "stop"),
                "total_duration": end - self.started, "load_duration": 0,
                "prompt_eval_count": self.prompt_tokens,
                "prompt_eval_duration": first - (self.submitted or first),
                "eval_count": self.choices.state[0].tokens,
                "eval_duration": (self.last or first) - first}  # fmt: skip

    def whole(self) -> dict[str, Any]:
        c = self.choices
        choice = c.final()[0]
        logprobs = c.entries(c.state[0].logprobs) if c.want_logprobs else None
        # a chat choice (the chat road: /api/chat, a generate's turn) or a completion's (raw)
        message = choice.get("message") or {"content": choice.get("text")}
        calls = [_call(call, i) for i, call in enumerate(message.get("tool_calls") or [])]
        line = self._line(message.get("content") or "", message.get("reasoning_content") or "",
                          calls, logprobs)  # fmt: skip
        return line | self._done(choice["finish_reason"])

    async def lines(self, events: AsyncIterator[StepOutput], failed: str) -> AsyncIterator[str]:
        """The NDJSON stream: a line per piece of text (or thinking), the tool calls in one
        line once whole, then the done line; a failure mid-stream is an `error` line."""
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        try:
            async for event in events:
                if event.finish_reason == "error":
                    yield _ndjson({"error": failed})
                    return
                logprobs = (
                    self.choices.entries(event.logprobs) if self.choices.want_logprobs else None
                )
                chunk = self.choices.chunk({}, event)
                if chunk is None:
                    continue
                choice = chunk["choices"][0]
                finish = choice["finish_reason"] or finish
                delta = choice.get("delta") or {}
                for call in delta.get("tool_calls") or []:  # pieces of a call, by index
                    whole = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    fn = call.get("function") or {}
                    whole["id"] = call.get("id") or whole["id"]
                    whole["name"] += fn.get("name") or ""
                    whole["arguments"] += fn.get("arguments") or ""
                text = delta.get("content") or choice.get("text") or ""
                thinking = delta.get("reasoning_content") or ""
                if text or thinking or logprobs:
                    yield _ndjson(self._line(text, thinking, logprobs=logprobs))
            if calls:
                made = [_call({"id": c["id"], "function": {"name": c["name"],
                                                           "arguments": c["arguments"]}}, i)
                        for i, c in sorted(calls.items())]  # fmt: skip
                yield _ndjson(self._line(calls=made))
            yield _ndjson(self._line() | self._done(finish or self.choices.state[0].finish_reason))
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # a disconnect: aborted


def loaded(model: str, chat: bool) -> dict[str, Any]:
    """The answer to a request with nothing to generate (no prompt, no messages): Ollama's
    way to load a model, which kvlm has loaded already."""
    body: dict[str, Any] = {"model": model, "created_at": now()}
    body |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return body | {"done": True, "done_reason": "load"}


def _call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An OpenAI tool call in Ollama's shape: the arguments an object."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"] or "{}")
    except (ValueError, RecursionError):  # cut off, or nested too deep
        args = {}
    return {"id": call["id"], "function": {"index": index, "name": fn["name"],
                                           "arguments": args}}  # fmt: skip


def _ndjson(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


# ------------------------------------------------------------------ what the server says


def _size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def details(config: ModelConfig) -> dict[str, Any]:
    return {"parent_model": "", "family": config.architecture,
            "families": [config.architecture],
            "parameter_size": _size(parameter_count(config))}  # fmt: skip


def model_info(config: ModelConfig, context: int) -> dict[str, Any]:
    """/api/show's model_info: GGUF's key names. The context length is the server's (what a
    request may fill), not the model's trained one."""
    arch = config.architecture
    return {"general.architecture": arch, "general.parameter_count": parameter_count(config),
            f"{arch}.context_length": context,
            f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_layers,
            f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_heads,
            f"{arch}.attention.head_count_kv": config.num_kv_heads,
            f"{arch}.vocab_size": config.vocab_size}  # fmt: skip


def capabilities(thinks: bool) -> list[str]:
    """ "completion" and "tools" (every model takes tools: a template that does not render
    them gets them in its system turn, kvlm.server.tools; VS Code Copilot lists only models
    that say "tools"); "thinking" where the model reasons (kvlm.server.reasoning)."""
    return ["completion", "tools", *(["thinking"] if thinks else [])]


def pulled(model: str, stream: bool) -> list[dict[str, Any]]:
    """/api/pull of the served model: nothing to download, said as Ollama's statuses."""
    lines = [{"status": f"{model} is already loaded: kvlm serves it, nothing to pull"},
             {"status": "success"}]  # fmt: skip
    return lines if stream else lines[-1:]
