"""OpenAI request bodies, validated at the door (pydantic), and the error body.

Every field of OpenAI's chat and completions requests is accepted (docs/API.md lists what
kvlm does with each): those kvlm honours change the output; those that are bookkeeping on
OpenAI's side (metadata, store, service_tier, ...) are accepted and have no effect; those
asking for what a text model cannot make (audio, image parts, predicted outputs, ...) are
a 400 that names the field and says why (`Unsupported`). An explicit null is the field's
default. Fields neither OpenAI's nor vLLM's are refused rather than ignored: a client that
sends one expects it to do something. Limits are checked here so that an absurd value is a
400 that names the field, never a failure deep in the engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from kvlm.cache.prefix import MAX_SALT_CHARS
from kvlm.engine.guided import MAX_GUIDE_CHARS, Guide
from kvlm.engine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION,
    MAX_SAMPLES,
    MAX_STOP_CHARS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from kvlm.errors import InvalidRequestError
from kvlm.loading.tokenizer import Tokenizer

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_PROMPTS = 64  # prompts in one completions request (each is a request of n samples)
MAX_TOOLS = 128  # OpenAI's limit on tools
MAX_STOP_IDS = 64  # stop_token_ids
_NONE: Mapping[str, Any] = MappingProxyType({})  # no values given


def _unicode(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"); Python keeps it in a str, and
    the tokenizer (and any UTF-8 writer) then fails. Refuse it here, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Body(BaseModel):
    # strict: the types the published schema says (kvlm.server.openapi), no coercion of
    # "3" to 3, 2.0 to 2 or 0 to false; an int is still a valid float, as in JSON
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """An explicit null means the field's default, as OpenAI's API reads it (clients
        send `"stop": null`, `"logprobs": null`, ...). Only for fields the model has: an
        unknown name stays, null or not, and is refused (extra="forbid")."""
        if isinstance(data, dict):
            known = _field_names(cls)
            return {k: v for k, v in data.items() if v is not None or k not in known}
        return data


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """A request model's field names and aliases (what an explicit null may stand for)."""
    return frozenset(n for name, f in model.model_fields.items() for n in (name, f.alias) if n)


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's padding against side channels: not sent


StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
# OpenAI's: token id (as a JSON object's key, a string) -> bias in [-100, 100]
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=MAX_LOGIT_BIAS),
]


class Unsupported(ValueError):
    """A request field kvlm cannot honour: a 400 that names it and says why."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param


# the request fields SamplingParams takes as they are
_AS_GIVEN = ("temperature", "top_p", "seed", "ignore_eos", "n", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
             "skip_special_tokens", "include_stop_str_in_output", "typical_p")  # fmt: skip
# vLLM's guided decoding fields, in the order a request giving several is told of them
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Sampling(_Body):
    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    # torch's generators take 64 bits, and sample i of n is seeded with seed + i
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX - MAX_SAMPLES)] | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    user: Text | None = None
    # vLLM's and llama.cpp's sampling extensions
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1 (vLLM's) = off
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION)] = 1.0
    ignore_eos: bool = False  # for benchmarks, as vLLM's
    # vLLM's: every prompt token's logprob (and this many alternatives), from the prefill
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's guided decoding: the output matches a JSON schema, a regex, one of the
    # choices, a Lark grammar (at most one of them, or response_format's)
    guided_json: dict[str, Any] | Annotated[Text, Field(max_length=MAX_GUIDE_CHARS)] | None = None
    guided_regex: Annotated[Text, Field(min_length=1, max_length=MAX_GUIDE_CHARS)] | None = None
    guided_choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1,
                             max_length=1024)] | None = None  # fmt: skip
    guided_grammar: Annotated[Text, Field(min_length=1, max_length=MAX_GUIDE_CHARS)] | None = None
    # vLLM's: prefix-cache blocks are shared only between requests of the same salt
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_SALT_CHARS)] | None = None
    # llama-server's: the slot the request runs under (kvlm.server.slots; -1: any)
    id_slot: Annotated[int, Field(ge=-1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")] | None = None
    priority: int = 0  # accepted; no effect (kvlm schedules first come, first served)
    # llama.cpp's
    typical_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n_predict: Annotated[int, Field(ge=-1)] | None = None  # max_tokens; -1: up to the context
    cache_prompt: bool = True  # accepted; no effect (cached prefixes give the same tokens)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, unset: Mapping[str, Any] = _NONE
    ) -> SamplingParams:
        """The engine's parameters; `unset`: the values of fields this request did not
        set (the server's defaults, kvlm.server.app._params), over the fields' own."""
        fields = {name: getattr(self, name) for name in _AS_GIVEN} | {
            "top_k": max(self.top_k, 0)}  # fmt: skip
        return SamplingParams(
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            stop_token_ids=list(self.stop_token_ids or []),
            prompt_logprobs=self.scored_prompt(),
            guide=self.guide(),
            **(fields | dict(unset)),
        )

    def guide(self) -> Guide | None:
        """What the output must match: vLLM's guided_* fields (response_format's on chat)."""
        given = [name for name in GUIDED if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give one of {', '.join(given)}, not several", given[1])
        if not given:
            return None
        name = given[0]
        value = getattr(self, name)
        if name == "guided_json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):  # RecursionError: '[' * 100_000
                raise InvalidRequestError(
                    "guided_json: not a JSON schema (not JSON)", param=name
                ) from None
        kind = "json_schema" if name == "guided_json" else name.removeprefix("guided_")
        return Guide(kind, value, name)

    def scored_prompt(self) -> int | None:
        """How many alternatives each prompt token's logprob needs, or None: not asked."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
PromptText = Annotated[Text, Field(min_length=1)]


class CompletionRequest(_Sampling):
    # one prompt (a text or token ids) or several: one choice per prompt x n
    prompt: (
        PromptText
        | TokenIds
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # the legacy API allows 5
    echo: bool = False
    # 0: no completion (with echo: the prompt scored, lm-eval's loglikelihood requests)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # the legacy API's default
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    suffix: Text | None = None

    @model_validator(mode="after")
    def _what_kvlm_does_not_do(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise Unsupported(
                "best_of", "only best_of = n is served (each sample is returned; vLLM's V1 "
                "engine takes the same)",
            )  # fmt: skip
        if self.suffix:
            raise Unsupported("suffix", "insertion (fill in the middle) is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise Unsupported("max_tokens", "0 is only allowed with echo (to score a prompt)")
        return self

    def scored_prompt(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt carries logprobs
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the list's."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: Text


class MediaPart(BaseModel):
    """An image, audio or file part: named in a 400 (kvlm serves text models)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url"]


class FunctionCall(_Body):
    name: Text
    arguments: Text  # a JSON object, as text (OpenAI's)


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    # null only for an assistant's tool calls (the history of an agent)
    content: Text | list[TextPart | RefusalPart | MediaPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None
    function_call: FunctionCall | None = None  # the deprecated form of tool_calls
    audio: dict[str, Any] | None = None  # a previous audio reply's id: refused below
    # an earlier reply's reasoning as this server returned it (vLLM's names, both taken):
    # to the template as `reasoning_content` (Qwen3's reads it) and `thinking` (harmony's
    # renders an analysis message from it before a tool call)
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and
                                         (self.tool_calls or self.function_call)):  # fmt: skip
            raise ValueError("content is required (null only for an assistant's tool calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.audio is not None:
            raise Unsupported("audio", "kvlm serves text models: no audio replies to refer to")
        for part in self.content if isinstance(self.content, list) else []:
            if isinstance(part, MediaPart):
                raise Unsupported(
                    "content", f"{part.type} parts are not supported: kvlm serves text models"
                )
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' conventions): "developer"
        is "system" (templates know only the latter), a deprecated "function" reply is a
        "tool" one, and tool calls' arguments are objects (templates `tojson` them)."""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        # null content (an assistant's tool calls) as "": templates that concatenate
        # content fail on None, and those that test it read "" alike (vLLM's choice)
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCall(id="call_0", function=self.function_call))
        tool_calls = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
            for c in calls
        ]  # fmt: skip
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        out = {"role": role, "content": self.text() or "", "name": self.name,
               "tool_calls": tool_calls or None, "tool_call_id": self.tool_call_id,
               "reasoning_content": thought, "thinking": thought}  # fmt: skip
        return {k: v for k, v in out.items() if v is not None}  # a field not given: absent


def _arguments(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments  # not JSON: the text as it is


class FunctionDef(_Body):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: Text


class NamedTool(_Body):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


def _template_name(name: str) -> str:
    if name in _TEMPLATE_OWN:
        raise ValueError(f"{name!r} is set by the server, not by chat_template_kwargs")
    return name


# the template variables the server sets itself (the conversation, the tools, the prompt)
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                 "raise_exception", "strftime_now")  # fmt: skip
TemplateName = Annotated[Text, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"),
                         AfterValidator(_template_name)]  # fmt: skip


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    functions: Annotated[list[FunctionDef], Field(max_length=MAX_TOOLS)] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    response_format: ResponseFormat | None = None
    # passed to the chat template (templates that know them use them; others ignore them)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's: more variables for the chat template (e.g. Qwen3's enable_thinking), the
    # generation prompt, or the last (assistant) message continued
    chat_template_kwargs: Annotated[dict[TemplateName, Any], Field(max_length=32)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # accepted; no effect on the output (bookkeeping on OpenAI's side)
    metadata: Annotated[dict[str, Text], Field(max_length=16)] | None = None
    store: bool = False
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: Any = None
    # output kvlm cannot make: refused, naming the field
    audio: Any = None
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false (the "
                             "last message is continued, not answered)")  # fmt: skip
        if self.audio is not None or "audio" in (self.modalities or []):
            raise Unsupported(
                "audio" if self.audio is not None else "modalities",
                "audio output is not supported: kvlm serves text models",
            )
        if self.prediction is not None:
            raise Unsupported("prediction", "predicted outputs are not supported")
        if self.web_search_options is not None:
            raise Unsupported("web_search_options", "kvlm does not search the web")
        if self.tools is not None and self.functions is not None:
            raise ValueError("give tools or the deprecated functions, not both")
        wanted = self.forced_tool()
        if wanted is not None:
            names = {t["function"]["name"] for t in self.tool_specs or []}
            if not names:
                raise ValueError("tool_choice names a tool call, but no tools are given")
            if wanted != "required" and wanted not in names:
                raise Unsupported("tool_choice", f"no tool named {wanted!r} is given")
        return self

    def guide(self) -> Guide | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super().guide()
        if super().guide() is not None:
            raise InvalidRequestError(
                "give response_format or a guided_* field, not both", param="response_format"
            )
        if fmt.type == "json_object":
            return Guide("json_object")
        spec = (fmt.model_extra or {}).get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequestError(
                'response_format: json_schema needs {"name", "schema": {...}}',
                param="response_format.json_schema",
            )
        return Guide("json_schema", spec.get("schema", {}), "response_format.json_schema")

    def forced_tool(self) -> str | None:
        """ "required", a named function's name, or None (tool_choice auto / none)."""
        choice = self.choice
        if isinstance(choice, NamedTool):
            return choice.function.name
        if isinstance(choice, NamedFunction):
            return choice.name
        return "required" if choice == "required" else None

    @property
    def choice(self) -> Any:
        return self.tool_choice if self.functions is None else self.function_call

    @functools.cached_property
    def tool_specs(self) -> list[dict[str, Any]] | None:
        """The tools as templates take them (OpenAI's shape), or None: none given, or
        tool_choice "none" (the model is not offered them, as vLLM's default)."""
        if self.choice == "none":
            return None
        if self.functions is not None:
            return [{"type": "function", "function": f.model_dump(exclude_none=True)}
                    for f in self.functions]  # fmt: skip
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @functools.cached_property
    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    @property
    def template_options(self) -> dict[str, Any]:
        """The template's extra variables: chat_template_kwargs, and reasoning_effort and
        verbosity where given."""
        options = {"reasoning_effort": self.reasoning_effort, "verbosity": self.verbosity}
        return (self.chat_template_kwargs or {}) | {
            k: v for k, v in options.items() if v is not None}  # fmt: skip

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The chat template over the conversation and the tools (the options given of
        reasoning_effort and verbosity passed on): the ids the engine runs."""
        return tokenizer.encode_chat(
            self.conversation, self.add_generation_prompt, self.tool_specs,
            self.continue_final_message, **self.template_options,
        )  # fmt: skip

    def turn_start(self, tokenizer: Tokenizer, ids: list[int]) -> int | None:
        """Where the reply's generation prompt begins in `ids` (Tokenizer.turn_start); None
        without a generation prompt."""
        if not self.add_generation_prompt or self.continue_final_message:
            return None
        return tokenizer.turn_start(ids, self.conversation, self.tool_specs,
                                    **self.template_options)  # fmt: skip


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text (`prompt`) or a conversation (`messages`, rendered by the
    chat template as /v1/chat/completions renders it)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: Annotated[dict[TemplateName, Any], Field(max_length=32)] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages (one of them)")
        return self

    def ids(self, tokenizer: Tokenizer, model: str) -> list[int]:
        if self.prompt is not None:
            return tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens)
        fields = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                  "chat_template_kwargs")  # fmt: skip
        chat = ChatCompletionRequest.model_validate(
            {"model": model} | self.model_dump(include=set(fields), exclude_none=True)
        )
        return chat.prompt_ids(tokenizer)


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
