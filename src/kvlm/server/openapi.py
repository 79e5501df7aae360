"""The published API description (/openapi.json): what API tools, client generators and
fuzzers (tests/test_server_fuzz.py runs schemathesis against it) read.

Request bodies are kvlm.server.protocol's models. The responses below are documentation
only (the routes build plain dicts, kvlm.server.responses): each route lists its JSON and
SSE bodies and every error status it can answer, with OpenAI's error body (Anthropic's
under /v1/messages; Ollama's routes under /api their JSON or NDJSON lines and Ollama's
error body). FastAPI's own 422 is dropped: kvlm answers a bad request with 400, as OpenAI
does.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    audio_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int
    audio_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # null at an echoed prompt's first token (nothing predicts it)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's, with `prompt_logprobs`: per prompt token (null first) token id -> entry
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class _Head(BaseModel):
    """What every response and chunk opens with (`object`: each narrows it)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class CompletionResponse(_Head):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class ChatCompletionResponse(_Head):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(CompletionResponse):
    """One SSE event of a streamed completion; the last (stream_options.include_usage)
    has no choices and the usage."""

    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class ChatCompletionChunk(_Head):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    sampling_defaults: dict[str, float] = Field(
        description="what a request's unset temperature, top_p, top_k, min_p and "
        "repetition_penalty take: kvlm serve's flags, else the model file's recommendation "
        "(those absent: the API's own defaults)"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body: the /v1/messages routes' errors."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(BaseModel):
    input_tokens: int  # not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int  # served by the prefix cache
    cache_creation_input_tokens: int


class AnthropicBlock(BaseModel):
    """A reply's content block: text, or a tool_use (id, name, input)."""

    type: Literal["text", "tool_use"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicBlock]
    stop_reason: (
        Literal[
            "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
        ]
        | None
    )
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicEvent(BaseModel):
    """One event of a streamed message: message_start, content_block_start,
    content_block_delta, content_block_stop, message_delta, message_stop, or error."""

    model_config = ConfigDict(extra="allow")
    type: str


class TokenCount(BaseModel):
    input_tokens: int


class Tokens(BaseModel):
    """vLLM's /tokenize answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Text(BaseModel):
    """vLLM's /detokenize answer."""

    prompt: str


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: served by the prefix cache
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A Response (/v1/responses): its output items (a message with output_text parts,
    function calls), status, usage; the request's own fields echoed."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "queued", "failed", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None


class ResponseEvent(BaseModel):
    """One event of a streamed Response: response.created, .in_progress,
    .output_item.added/.done, .content_part.added/.done, .output_text.delta/.done,
    .function_call_arguments.delta/.done, .completed (or .incomplete, .failed)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Deleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class OllamaError(BaseModel):
    """Ollama's error body: the /api routes' errors (and a failed stream's last line)."""

    error: str


class OllamaMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {id, function: {index, name, arguments}}


class OllamaReply(BaseModel):
    """/api/chat's answer (`message`) or /api/generate's (`response`, `thinking`); streamed,
    each NDJSON line is one, `done` false, the last `done` true with `done_reason` and the
    counts and durations (nanoseconds)."""

    model: str
    created_at: str
    message: OllamaMessage | None = None
    response: str | None = None
    thinking: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    done: bool
    done_reason: Literal["stop", "length", "load"] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaModels(BaseModel):
    """/api/tags and /api/ps: the one model served."""

    models: list[dict[str, Any]]


class OllamaShow(BaseModel):
    model_config = ConfigDict(extra="allow")
    modelfile: str
    parameters: str
    template: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]


class OllamaStatus(BaseModel):
    """/api/pull's answer (streamed: its NDJSON lines)."""

    status: str


class OllamaVersion(BaseModel):
    version: str
    kvlm: str


# An SSE event (OpenAPI before 3.2: the media type's schema describes one event): `data`
# is a chunk or an error body as JSON, or the closing "[DONE]".
STREAMS = {CompletionResponse: CompletionChunk, ChatCompletionResponse: ChatCompletionChunk,
           AnthropicMessage: AnthropicEvent, ResponseObject: ResponseEvent}  # fmt: skip
_ERRORS = {
    400: "A malformed or out-of-range request; `param` names the field.",
    401: "A missing or wrong API key.",
    404: "An unknown model, route or method.",
    408: "The request body stopped arriving.",
    413: "The request body is over the server's limit.",
    500: "The engine failed on this request (only this request).",
    503: "The server holds as many requests as it takes; try again later.",
    501: "Not supported by how this server was started (a slot save without --slot-save-path).",
}


def errors(
    *statuses: int, body: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": body, "description": _ERRORS[s]} for s in statuses}


def generation(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route: JSON, or SSE with `stream: true`; and its errors."""
    error = AnthropicError if model is AnthropicMessage else ErrorResponse
    sse = {"text/event-stream": {"schema": _event(STREAMS[model].__name__, error.__name__)}}
    ok = {"model": model, "description": "The completion, or its SSE stream.", "content": sse}
    return {200: ok, **errors(400, 401, 404, 408, 413, 500, 503, body=error)}


def ollama(
    model: type[BaseModel] | None, *statuses: int, lines: bool = False
) -> dict[int | str, dict[str, Any]]:
    """An Ollama route (/api): `model` as JSON (`lines`: or, with `stream`, NDJSON lines,
    each one `model` or the error line that ends a failed stream); its errors in Ollama's
    body. `model` None: a route that answers only errors."""
    out: dict[int | str, dict[str, Any]] = errors(*statuses, body=OllamaError)
    if model is not None:
        out[200] = {"model": model, "description": "The answer."}
    if model is not None and lines:
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        line = {"anyOf": [ref, {"$ref": "#/components/schemas/OllamaError"}]}
        out[200] |= {"description": "The answer, or with `stream` its NDJSON lines.",
                     "content": {"application/x-ndjson": {"schema": line}}}  # fmt: skip
    return out


def _event(chunk: str, error: str) -> dict[str, Any]:
    ref = "#/components/schemas/"
    payload = {"anyOf": [{"$ref": ref + chunk}, {"$ref": ref + error}]}
    data = {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
    ]}  # fmt: skip
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def install(app: FastAPI, model: str, max_samples: int, max_prompts: int) -> None:
    """Serve the schema without FastAPI's 422 validation responses, and with this server's
    own limits where the request models are generic: the one model it serves, the most
    samples it decodes together, the most prompts one request may list (the requests it
    holds). (What depends on the prompt, its length in tokens within the context, no
    schema can say: such a request is schema-valid and answered 400
    context_length_exceeded. A max_tokens past the room it leaves is clamped to it.)"""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in doc.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for name in ("CompletionRequest", "ChatCompletionRequest", "MessagesRequest",
                         "CountTokensRequest", "ResponsesRequest"):  # fmt: skip
                _server_limits(components[name]["properties"], model, max_samples)
            for option in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
                if option.get("type") == "array" and option["items"].get("type") != "integer":
                    option["maxItems"] = max_prompts  # a list of prompts
            _nulls_allowed(components)
            for chunk in STREAMS.values():  # referenced by the SSE events only
                made = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(made.pop("$defs", {}))
                components[chunk.__name__] = made
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


def _nulls_allowed(components: dict[str, Any]) -> None:
    """An optional request field may be null (its default: protocol._Body), so the
    schema says so: each non-required property of a request model also takes null."""
    from kvlm.server import anthropic, ollama, protocol, responses_api

    bodies = {name for module in (protocol, anthropic, ollama, responses_api)
              for name, obj in vars(module).items()
              if isinstance(obj, type) and issubclass(obj, protocol._Body)}  # fmt: skip
    for name in bodies & components.keys():
        schema = components[name]
        required = set(schema.get("required", ()))
        for field, prop in schema.get("properties", {}).items():
            options = prop.get("anyOf", [prop])
            if field in required or not options or any(o.get("type") == "null" for o in options):
                continue
            keep = {k: v for k, v in prop.items() if k in ("title", "default", "description")}
            rest = {k: v for k, v in prop.items() if k not in keep}
            prop.clear()
            prop.update(keep, anyOf=[*(options if "anyOf" in rest else [rest]),
                                     {"type": "null"}])  # fmt: skip


def _server_limits(fields: dict[str, Any], model: str, max_samples: int) -> None:
    """The served model; the most samples. (No most output tokens: a max_tokens past the
    room a prompt leaves in the context is clamped to it, not refused.)"""
    fields["model"] = {"type": "string", "enum": [model], "title": "Model"}
    if "n" in fields:
        fields["n"] |= {"maximum": max_samples}
