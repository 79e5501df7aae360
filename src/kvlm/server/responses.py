"""OpenAI response bodies built from engine events: one `Choices` per request.

completions:  {"id", "object": "text_completion", "created", "model",
               "choices": [{"index", "text", "finish_reason",
                            "logprobs": {"tokens", "token_logprobs", "top_logprobs",
                                         "text_offset"}}],
               "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
                         "prompt_tokens_details": {"cached_tokens"}}}
chat:         {"object": "chat.completion", "choices": [{"index",
               "message": {"role": "assistant", "content"}, "finish_reason",
               "logprobs": {"content": [{"token", "logprob", "bytes",
                                         "top_logprobs": [...]}]}}]}
streamed:     the same with "text_completion" / "chat.completion.chunk" and, for chat,
              "delta" in place of "message".
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from kvlm.engine.engine import StepOutput
from kvlm.engine.sampling import TokenLogprob
from kvlm.loading.tokenizer import Tokenizer
from kvlm.server import harmony as harmony_format
from kvlm.server.harmony import HarmonyStream
from kvlm.server.reasoning import ReasoningStream, split
from kvlm.server.tool_check import ToolChecks
from kvlm.server.tools import ToolStream, parse


@dataclass(slots=True)
class _Choice:
    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # its first event arrived (an echo opens it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    tools: ToolStream | None = None  # a chat choice that may answer with tool calls
    # a chat choice whose reasoning is split out (or, harmony, whose messages are read)
    think: ReasoningStream | HarmonyStream | None = None


@dataclass
class Choices:
    """The choices of one response: `count` of them (a request's n samples, times its
    prompts for a completions list). `want_logprobs`: each choice's. `echo`: each
    choice's text opens with this (its prompt's text, /v1/completions' echo), and with
    logprobs its prompt's logprobs (`prompts`: each choice's prompt ids). `score_only`:
    max_tokens 0, the one token the engine made is dropped. `want_prompt_logprobs`:
    vLLM's field in each choice. `tools` offered: each choice's text is read for calls
    (kvlm.server.tools), in the model's format (`tool_parser`) or, tool_choice forced
    (None), as a JSON array of calls; `tool_checks`: the calls are checked against their
    tools' whole schemas (kvlm.server.tool_check). `reasoning`: a chat choice's `<think>`
    text goes to `reasoning_content` (kvlm.server.reasoning; `thinking`: the prompt left
    it open). `harmony`: each chat choice is a run of harmony messages
    (kvlm.server.harmony): its analysis channel is the reasoning (with `reasoning`), its
    calls reach the tool parser in the hermes form (`tool_parser` "hermes")."""

    tokenizer: Tokenizer
    count: int
    chat: bool
    want_logprobs: bool
    echo: list[str] | None = None
    prompts: list[list[int]] | None = None
    score_only: bool = False
    want_prompt_logprobs: bool = False
    tools: bool = False
    tool_parser: str | None = None
    tool_checks: ToolChecks | None = None
    reasoning: bool = False
    thinking: bool = False
    harmony: bool = False
    # per engine request: its prompt tokens cached
    cached: dict[str, int] = field(default_factory=dict, init=False)
    # token id -> its text: a scored prompt names ~21 ids per position (4,000 positions:
    # 84,000 decodes, most of them the same few thousand ids)
    _texts: dict[int, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        streams = functools.partial(ToolStream, self.tool_parser, self.tool_checks)
        self.state = [_Choice(i, tools=streams() if self.tools else None, think=self._think())
                      for i in range(self.count)]  # fmt: skip

    def _think(self) -> ReasoningStream | HarmonyStream | None:
        if self.harmony:
            return HarmonyStream(self.reasoning, self.tools)
        return ReasoningStream(self.thinking) if self.reasoning else None

    def _split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole reply, as its stream reads it."""
        if self.harmony:
            return harmony_format.split(text, self.reasoning, self.tools)
        return split(text, self.thinking) if self.reasoning else (None, text)

    def head(self, request_id: str, model: str) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()), "model": model}  # fmt: skip

    @property
    def chunk_object(self) -> str:
        """The `object` of a streamed chunk (the usage chunk at the end included)."""
        return "chat.completion.chunk" if self.chat else "text_completion"

    # ------------------------------------------------------------------ accumulate

    def add(self, event: StepOutput) -> tuple[str, list[TokenLogprob]]:
        """Take one event into its choice; return the text and logprob entries it adds
        (a choice's first also carries its echo)."""
        if event.request_id:
            self.cached[event.request_id] = event.cached_tokens
        choice = self.state[event.index]
        text, entries, made = event.text, list(event.logprobs), len(event.token_ids)
        if self.score_only:
            text, entries, made = "", [], 0
        if not choice.started:
            choice.started = True
            if event.prompt_logprobs is not None:  # the first token's: nothing predicts it
                first = (self.prompts[event.index] if self.prompts else [0])[0]
                choice.prompt_logprobs = [TokenLogprob(first, None, {}), *event.prompt_logprobs[1:]]
            if self.echo:
                text = self.echo[event.index] + text
                if self.want_logprobs and choice.prompt_logprobs is not None:
                    entries = [*choice.prompt_logprobs, *entries]
        choice.text += text
        choice.tokens += made
        choice.logprobs += entries
        if event.finish_reason is not None:
            choice.finish_reason = "length" if self.score_only else event.finish_reason
        return text, entries

    def usage(self, prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.tokens for c in self.state)
        thought = 0
        if self.reasoning:  # their reasoning's tokens, as the tokenizer writes it again
            parts = (self._split(c.text)[0] for c in self.state)
            thought = sum(
                len(self.tokenizer.encode(p, add_special_tokens=False)) for p in parts if p
            )
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values()),
                                      "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": thought, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0},
        }  # fmt: skip

    # ------------------------------------------------------------------ whole responses

    def final(self) -> list[dict[str, Any]]:
        out = []
        for c in self.state:
            reasoning, text = self._split(c.text)
            body = self._choice(c.index, text, c.logprobs, c.finish_reason)
            if self.tools:
                self._with_calls(body, text, c.finish_reason)
            if reasoning is not None:
                body["message"]["reasoning_content"] = reasoning
            if self.want_prompt_logprobs:
                body["prompt_logprobs"] = self._vllm_prompt_logprobs(c.prompt_logprobs)
            out.append(body)
        return out

    def _with_calls(self, body: dict[str, Any], text: str, finish: str | None) -> None:
        """A whole chat reply's tool calls into its message (finish_reason "tool_calls")."""
        content, calls = parse(text, self.tool_parser, self.tool_checks)  # None: forced
        if self.tool_parser is None and not calls:
            # forced, no call: cut before its name (content None, as its stream sends no
            # text), or calls that break their schemas (their text, as streamed)
            body["message"]["content"] = content
        if calls:
            body["message"] = {"role": "assistant", "content": content,
                               "tool_calls": [c.to_dict() for c in calls]}  # fmt: skip
            if finish == "stop":
                body["finish_reason"] = "tool_calls"

    def _vllm_prompt_logprobs(self, entries: list[TokenLogprob] | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id:
        {logprob, rank, decoded_token}} for the token and the top alternatives."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for e in entries[1:]:
            ranked = enumerate(sorted(e.top.items(), key=lambda kv: -kv[1]), 1)
            picks = [*((t, lp, r) for r, (t, lp) in ranked), (e.token_id, e.logprob, e.rank)]
            # the token last: its rank where it is an alternative too
            out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": self._token(t)}
                        for t, lp, r in picks})  # fmt: skip
        return out

    def _choice(
        self, index: int, text: str, logprobs: list[TokenLogprob], finish: str | None, *,
        delta: bool = False, offset: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {"index": index}
        if self.chat:
            key = "delta" if delta else "message"
            out[key] = {"content": text} if delta else {"role": "assistant", "content": text}
        else:
            out["text"] = text
        out["logprobs"] = self._logprobs(logprobs, offset) if self.want_logprobs else None
        out["finish_reason"] = finish
        return out

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                None if e.logprob is None else {self._token(t): lp for t, lp in e.top.items()}
                for e in entries
            ],
            "text_offset": list(accumulate(map(len, tokens[:-1]), initial=offset))[: len(tokens)],
        }

    def entries(self, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        """Logprob entries in the chat shape, {token, logprob, bytes, top_logprobs}, for a
        chat or completions choice alike (Ollama's logprobs are this shape)."""
        return [self._chat_entry(e) for e in logprobs]

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        top = [self._entry(t, lp) for t, lp in e.top.items()]
        return self._entry(e.token_id, e.logprob) | {"top_logprobs": top}

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def _token(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._texts[token_id]

    # ------------------------------------------------------------------ streaming

    def opening(self, head: dict[str, Any]) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.chat:
            return []
        head = head | {"object": self.chunk_object}
        return [
            head | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}
            for c in self.state
        ]  # fmt: skip

    def chunk(self, head: dict[str, Any], event: StepOutput) -> dict[str, Any] | None:
        """The chunk for one event; None when it has nothing to show yet (text held back
        by a possible stop string, and no logprobs or finish to report)."""
        choice = self.state[event.index]
        offset = len(choice.text)
        text, entries = self.add(event)
        finish = choice.finish_reason if event.finish_reason is not None else None
        calls: list[dict[str, Any]] = []
        thought = ""
        if choice.think is not None:  # <think> text (harmony: messages) apart; the rest
            # goes on as content
            thought, text = choice.think.push(text)
            if finish is not None:
                more, rest = choice.think.finish()
                thought, text = thought + more, text + rest
        if choice.tools is not None:  # content as it comes; calls as OpenAI streams them
            tools = choice.tools
            text = tools.push(text)
            calls = tools.deltas()
            if finish is not None:
                rest, whole = tools.finish()
                text += rest
                calls += [{"index": tools.began + i, **c.to_dict()} for i, c in enumerate(whole)]
                if (whole or tools.began) and finish == "stop":
                    finish = "tool_calls"
        if (
            not (text or thought or calls)
            and finish is None
            and not (self.want_logprobs and entries)
        ):
            return None
        body = self._choice(event.index, text, entries, finish, delta=True, offset=offset)
        if thought:
            body["delta"]["reasoning_content"] = thought
        if calls:
            body["delta"]["tool_calls"] = calls
        if self.want_prompt_logprobs and event.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt_logprobs)
        return head | {"object": self.chunk_object, "choices": [body]}


JSON_SLICE = 256  # list items per json.dumps call in encode_json (~10-50 ms of a scored prompt)


def encode_json(obj: Any) -> str:
    """`obj` (plain JSON types: dicts, lists, str, numbers, None) as compact JSON, the text
    json.dumps makes, with long lists encoded JSON_SLICE items per call. The C encoder
    holds the GIL for a whole call: one call over a scored prompt's ~8 MB answer kept
    every other thread, the event loop's included, waiting for ~1 s; in slices Python
    switches threads between them. NaN or infinity raise, as in Starlette's JSONResponse."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out)


def _encode(obj: Any, out: list[str]) -> None:
    if isinstance(obj, dict):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _encode(value, out)
        out.append("}")
    elif isinstance(obj, list) and len(obj) > JSON_SLICE:
        parts = [_dumps(obj[a : a + JSON_SLICE])[1:-1] for a in range(0, len(obj), JSON_SLICE)]
        out.append("[" + ",".join(parts) + "]")
    else:
        out.append(_dumps(obj))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
