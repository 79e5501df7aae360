"""A request's types, on every road: what comes out (RequestOutput, one CompletionOutput
per sample), one sample's decoding state (SampleState: its tokens, streamed text, stop
strings and logprobs; StopText), and the checks a prompt meets at the door."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlm.engine.metrics import Metrics
from kvlm.engine.sampling import SamplingParams, TokenLogprob, token_logprob
from kvlm.errors import InvalidRequestError
from kvlm.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
    logprobs: list[TokenLogprob] | None = None
    # vLLM's: the stop string that ended it (finish_reason "stop"), None for EOS
    stop_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "logprobs": None if self.logprobs is None else [lp.to_dict() for lp in self.logprobs],
        }


@dataclass(slots=True)
class RequestOutput:
    """The result of one request. `token_ids`, `text`, `finish_reason` and `logprobs` are
    the first sample's; `outputs` holds all n."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: Metrics = field(default_factory=Metrics)
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing before it predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    def to_dict(self) -> dict[str, Any]:
        first = self.outputs[0].to_dict()
        record = {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.token_ids),
            **{k: first[k] for k in ("token_ids", "text", "finish_reason", "logprobs")},
            "metrics": self.metrics.to_dict(),
        }
        if len(self.outputs) > 1:
            record["samples"] = [o.to_dict() for o in self.outputs]
        if self.prompt_logprobs is not None:
            record["prompt_logprobs"] = [
                None if lp is None else lp.to_dict() for lp in self.prompt_logprobs
            ]
        return record


class StopText:
    """Accumulates generated text, cuts it at the first stop string, and holds back any
    tail that could still become one, so a stream never shows text it must take back.

    A push costs the same at token 10 and token 10,000: only the last (longest stop - 1)
    characters plus the new piece are searched, and the text is kept as emitted pieces
    plus a short pending tail, joined only when `text` is read.

        emitted pieces ............................ | pending (held back) | delta
                                      tail: the last L-1 characters --+----+
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = list(stops)
        self.include = include  # the stop string stays in the text (vLLM's option)
        self.longest = max((len(s) for s in self.stops), default=0)
        self._emitted: list[str] = []
        self._pending = ""  # text not yet shown: a possible start of a stop string
        self._tail = ""  # the last longest-1 characters of the text
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    @property
    def text(self) -> str:
        """Everything accepted so far (cut at a stop string once one is found)."""
        return "".join(self._emitted) + self._pending

    def push(self, delta: str, check: bool = True) -> str:
        """Add decoded text; return what is now safe to show (nothing once stopped).
        `check` False: the text cannot end the sample yet (min_tokens), shown as it is."""
        if self.stopped:
            return ""
        if not self.stops:
            return self._emit(self._pending + delta, hold=0)
        window = self._tail + delta
        if not check:  # shown; no stop string may start in it
            self._tail = ""
            return self._emit(self._pending + delta, hold=0)
        hits = [(i, s) for s in self.stops if (i := window.find(s)) >= 0]
        # The pending text is the tail's last characters: window index i is pending index
        # i - offset (a stop never starts before the pending text: that part was shown
        # only because no stop could start there).
        offset = len(self._tail) - len(self._pending)
        if hits:
            self.stopped = True
            at, self.matched = min(hits, key=lambda hit: hit[0])
            end = at + len(self.matched) if self.include else at
            return self._emit((self._pending + delta)[: end - offset], hold=0)
        self._tail = window[max(0, len(window) - (self.longest - 1)) :] if self.longest > 1 else ""
        return self._emit(self._pending + delta, hold=self._partial_stop_suffix(window))

    def flush(self) -> str:
        return self._emit(self._pending, hold=0)

    def _partial_stop_suffix(self, window: str) -> int:
        """Length of the longest tail of `window` that is a proper prefix of a stop string
        (at most longest - 1 characters: bounded work whatever the output's length)."""
        best = 0
        for s in self.stops:
            j = window.find(s[0], max(0, len(window) - len(s) + 1))
            while j != -1 and len(window) - j > best:
                if s.startswith(window[j:]):
                    best = len(window) - j
                    break
                j = window.find(s[0], j + 1)
        return best

    def _emit(self, pending: str, hold: int) -> str:
        """Show all of `pending` but its last `hold` characters."""
        out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        if out:
            self._emitted.append(out)
        return out


class SampleState:
    """One sample's decoding state: its tokens, streamed text, stop checks, logprobs."""

    def __init__(
        self,
        index: int,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        stop_ids: set[int],
    ) -> None:
        self.seq = list(prompt_ids)  # what this sample has fed and will feed
        self.out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.decoder = tokenizer.decode_stream(params.skip_special_tokens)
        self.stop = StopText(params.stop, params.include_stop_str_in_output)
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids

    @property
    def done(self) -> bool:
        return self.out.finish_reason is not None

    def accept(self, token: int, logits: torch.Tensor) -> str:
        """Record a sampled token; return the text now safe to show."""
        out = self.out
        self.seq.append(token)
        out.token_ids.append(token)
        if out.logprobs is not None:
            out.logprobs.append(token_logprob(logits, token, self.params.logprobs or 0))
        try:
            piece = self.decoder.step(self.tokenizer.backend, token)
        except Exception:
            # a byte-fallback vocabulary: a run of byte tokens that began as valid text
            # (one byte) decodes as U+FFFD once a later byte makes the run invalid, which
            # the stream refuses; the text goes on from this token in a new stream
            self.decoder = self.tokenizer.decode_stream(self.params.skip_special_tokens)
            piece = self.decoder.step(self.tokenizer.backend, token)
        early = len(out.token_ids) < self.params.min_tokens  # no stop yet (min_tokens)
        ends = token in self.stop_ids and not early
        if ends and not self.params.include_stop_str_in_output:
            piece = ""  # a stop token's own text is not the output's (vLLM's rule)
        delta = self.stop.push(piece, check=not early) if piece else ""
        if ends or self.stop.stopped:
            out.finish_reason = "stop"
            out.stop_reason = self.stop.matched
        elif len(out.token_ids) >= self.params.max_tokens:
            out.finish_reason = "length"
        return delta

    def finish(self) -> str:
        tail = self.stop.flush()
        self.sync()
        return tail

    def sync(self) -> None:
        """Bring out.text up to date (joined here, not at every token: an interrupted turn
        calls this to keep the text it had)."""
        self.out.text = self.stop.text


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0]
    bad += [t for t in prompt_ids if isinstance(t, int) and t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary")


def stop_token_ids(params: SamplingParams, tokenizer: Tokenizer) -> set[int]:
    """The ids that end a sample: the request's own, and EOS unless it is ignored."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(tokenizer.eos_token_ids)
    return ids
