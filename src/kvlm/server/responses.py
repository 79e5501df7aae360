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

import time
from dataclasses import dataclass, field
from typing import Any

from kvlm.engine.engine import StepOutput
from kvlm.engine.sampling import TokenLogprob
from kvlm.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class _Choice:
    index: int
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class Choices:
    """The choices of one response: `count` of them (a request's n samples, times its
    prompts for a completions list). `echo`: each choice's text opens with this (its
    prompt's text, /v1/completions' echo)."""

    def __init__(
        self, tokenizer: Tokenizer, count: int, chat: bool, logprobs: bool,
        echo: list[str] | None = None,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.chat = chat
        self.want_logprobs = logprobs
        self.echo = echo
        self.state = [_Choice(i, echo[i] if echo else "") for i in range(count)]
        self.cached: dict[str, int] = {}  # per engine request: its prompt tokens cached

    def head(self, request_id: str, model: str) -> dict[str, Any]:
        return {"id": request_id, "object": self._object(False), "created": int(time.time()),
                "model": model}  # fmt: skip

    @property
    def chunk_object(self) -> str:
        """The `object` of a streamed chunk (the usage chunk at the end included)."""
        return self._object(True)

    def _object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    # ------------------------------------------------------------------ accumulate

    def add(self, event: StepOutput) -> _Choice:
        if event.request_id:
            self.cached[event.request_id] = event.cached_tokens
        choice = self.state[event.index]
        choice.text += event.text
        choice.tokens += len(event.token_ids)
        choice.logprobs += event.logprobs
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        return choice

    def usage(self, prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.tokens for c in self.state)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values()),
                                      "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0},
        }  # fmt: skip

    # ------------------------------------------------------------------ whole responses

    def final(self) -> list[dict[str, Any]]:
        return [self._choice(c.index, c.text, c.logprobs, c.finish_reason) for c in self.state]

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
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t): lp for t, lp in e.top.items()} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        token = self._token(e.token_id)
        return {
            "token": token,
            "logprob": e.logprob,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := self._token(t)), "logprob": lp, "bytes": list(s.encode("utf-8"))}
                for t, lp in e.top.items()
            ],
        }

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ streaming

    def opening(self, head: dict[str, Any]) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do; an echo
        opens each completion choice with its prompt."""
        if not self.chat:
            if not self.echo:
                return []
            return [
                head | {"choices": [{"index": c.index, "text": c.text, "logprobs": None,
                                     "finish_reason": None}]}
                for c in self.state
            ]  # fmt: skip
        head = head | {"object": self._object(True)}
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
        self.add(event)
        if (
            not event.text
            and event.finish_reason is None
            and not (self.want_logprobs and event.logprobs)
        ):
            return None
        finish = event.finish_reason
        body = self._choice(event.index, event.text, event.logprobs, finish, delta=True,
                            offset=offset)  # fmt: skip
        return head | {"object": self._object(True), "choices": [body]}
