"""The published API description (/openapi.json): what API tools, client generators and
fuzzers (tests/test_server_fuzz.py runs schemathesis against it) read.

Request bodies are kvlm.server.protocol's models. The responses below are documentation
only (the routes build plain dicts, kvlm.server.responses): each route lists its JSON and
SSE bodies and every error status it can answer, with OpenAI's error body. FastAPI's own
422 is dropped: kvlm answers a bad request with 400, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
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


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


_SSE = {"text/event-stream": {"schema": {"type": "string"}}}
_ERRORS = {
    400: "A malformed or out-of-range request; `param` names the field.",
    401: "A missing or wrong API key.",
    404: "An unknown model, route or method.",
    408: "The request body stopped arriving.",
    413: "The request body is over the server's limit.",
    500: "The engine failed on this request (only this request).",
    503: "The server holds as many requests as it takes; try again later.",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def generation(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route: JSON, or SSE with `stream: true`; and its errors."""
    ok = {"model": model, "description": "The completion, or its SSE stream.", "content": _SSE}
    return {200: ok, **errors(400, 401, 404, 408, 413, 500, 503)}


def install(app: FastAPI) -> None:
    """Serve the schema without FastAPI's 422 validation responses."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in doc.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
