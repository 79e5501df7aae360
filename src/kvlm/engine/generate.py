"""One request on one cache: the prefill-then-decode loop, streaming, and stop conditions.

Every iteration feeds `tokens[cache.num_tokens:]`. After a prefill that is one token, so
the loop is "prefill, then decode" for every cache that keeps state, and "recompute
everything" for `off`, whose cache always reports zero tokens. The loop itself never
knows which mode it is running.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlm.cache import KVCache
from kvlm.engine.metrics import Metrics
from kvlm.engine.runner import ModelRunner
from kvlm.engine.sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from kvlm.errors import CacheOverflowError, InvalidRequestError
from kvlm.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """The result of one request: generated ids and text, why it ended, and its timings."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" (EOS or stop string) | "length" | None while running
    logprobs: list[TokenLogprob] | None = None
    metrics: Metrics = field(default_factory=Metrics)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.token_ids),
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": None if self.logprobs is None else [lp.to_dict() for lp in self.logprobs],
            "metrics": self.metrics.to_dict(),
        }


class StopText:
    """Accumulates generated text, cuts it at the first stop string, and holds back any
    tail that could still become one, so a stream never shows text it must take back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add decoded text; return what is now safe to show (nothing once stopped)."""
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            return self._emit(len(self.text))
        longest = max(len(s) for s in self.stops)
        search_from = max(0, len(self.text) - len(delta) - longest + 1)
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._partial_stop_suffix())

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, end: int) -> str:
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


class Generation:
    """Iterate for text deltas as tokens are produced; `output` holds the result.

    The cache must hold a prefix of `prompt_ids` (nothing, for a fresh request); the
    caller owns that invariant (LLM resets, a chat session rolls back to the shared part).
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        cache: KVCache,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        _check_prompt(prompt_ids, vocab_size)
        if cache.num_tokens >= len(prompt_ids):
            raise InvalidRequestError("the cache already holds the whole prompt; roll it back")
        if cache.would_overflow(len(prompt_ids) - cache.num_tokens):
            raise CacheOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the cache holds at most "
                f"{cache.capacity} (raise --max-context, up to the model's limit)"
            )
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.params = params
        self.tokens: list[int] = list(prompt_ids)  # prompt + generated, grows as we go
        self.output = RequestOutput(
            prompt=prompt,
            prompt_token_ids=list(prompt_ids),
            token_ids=[],
            text="",
            finish_reason=None,
            logprobs=[] if params.logprobs is not None else None,
        )
        self.output.metrics.prompt_tokens = len(prompt_ids)
        self.output.metrics.prefill_tokens = len(prompt_ids) - cache.num_tokens
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(tokenizer.eos_token_ids)

    def __iter__(self) -> Iterator[str]:
        out, params, cache = self.output, self.params, self.cache
        sampler = Sampler(params, self.runner.device)
        decoder = self.tokenizer.decode_stream(skip_special_tokens=True)
        text = StopText(params.stop)
        while out.finish_reason is None:
            pending = self.tokens[cache.num_tokens :]
            if out.token_ids and cache.would_overflow(len(pending)):
                out.finish_reason = "length"  # context full: end, as max_tokens would
                break
            t0 = time.perf_counter()
            logits = self.runner.forward(pending, cache)
            out.metrics.record_forward(time.perf_counter() - t0)
            token = sampler(logits)
            out.metrics.record_token()
            self.tokens.append(token)
            out.token_ids.append(token)
            if out.logprobs is not None:
                out.logprobs.append(token_logprob(logits, token, params.logprobs or 0))
            piece = decoder.step(self.tokenizer.backend, token)
            delta = text.push(piece) if piece else ""
            out.text = text.text  # kept current, so an interrupted turn still has its text
            if token in self._stop_ids or text.stopped:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= params.max_tokens:
                out.finish_reason = "length"
            if delta:
                yield delta
        tail = text.flush()
        if tail:
            yield tail
        out.text = text.text
        out.metrics.finish()

    def run(self) -> RequestOutput:
        for _ in self:
            pass
        return self.output


def _check_prompt(prompt_ids: Sequence[int], vocab_size: int | None) -> None:
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0]
    if vocab_size is not None:
        bad += [t for t in prompt_ids if isinstance(t, int) and t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary")
