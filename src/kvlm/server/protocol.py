"""OpenAI request bodies, validated at the door (pydantic), and the error body.

Unknown fields are refused rather than ignored: a client that sends `best_of` or
`frequency_penalty` expects them to do something, and silently dropping them would give
answers it did not ask for. Limits are checked here so that an absurd value is a 400 that
names the field, never a failure deep in the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvlm.cache.prefix import MAX_SALT_CHARS
from kvlm.engine.sampling import (
    MAX_LOGPROBS,
    MAX_SAMPLES,
    MAX_STOP_CHARS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

MAX_STOP = 4  # OpenAI's limit on stop sequences


def _unicode(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"); Python keeps it in a str, and
    the tokenizer (and any UTF-8 writer) then fails. Refuse it here, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def _no_echo(echo: bool) -> bool:
    if echo:
        raise ValueError("echo is not supported: the prompt's own logprobs are not computed")
    return echo


class _Body(BaseModel):
    # strict: the types the published schema says (kvlm.server.openapi), no coercion of
    # "3" to 3, 2.0 to 2 or 0 to false; an int is still a valid float, as in JSON
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Sampling(_Body):
    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # not OpenAI's; vLLM and llama.cpp take it too
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    # torch's generators take 64 bits, and sample i of n is seeded with seed + i
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX - MAX_SAMPLES)] | None = None
    ignore_eos: bool = False  # not OpenAI's; for benchmarks, as vLLM's
    user: Text | None = None
    # vLLM's: prefix-cache blocks are shared only between requests of the same salt
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_SALT_CHARS)] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # the legacy API allows 5
    echo: Annotated[bool, AfterValidator(_no_echo)] = False
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # the legacy API's default


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def conversation(self) -> list[dict[str, Any]]:
        # "developer" is the newer name of "system"; chat templates know only the latter.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
