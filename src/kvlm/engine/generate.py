"""One request on one cache: prefill, fan-out to n samples, decode, stream, stop.

Every step feeds each row's `tokens[cache.num_tokens:]`. After a prefill that is one token
per row, so the loop is "prefill, then decode" for every cache that keeps state, and
"recompute everything" for `off`, whose cache always reports zero tokens. The loop never
knows which mode it runs.

n > 1 samples (the nanochat fan-out): the prompt is prefilled once, n first tokens are
drawn from its logits, then `cache.fork(n)` turns the one sequence into n that share the
prompt (paged: the same blocks) and they decode in lockstep. A sample that finishes keeps
feeding its last token so the rows stay the same length; its output stops growing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlm.cache import KVCache
from kvlm.engine.guided import compile_guide
from kvlm.engine.metrics import Metrics
from kvlm.engine.runner import ModelRunner
from kvlm.engine.sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from kvlm.engine.speculative import Speculator
from kvlm.errors import CacheOverflowError, InvalidRequestError
from kvlm.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
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

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self._emitted: list[str] = []
        self._pending = ""  # text not yet shown: a possible start of a stop string
        self._tail = ""  # the last longest-1 characters of the text
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything accepted so far (cut at a stop string once one is found)."""
        return "".join(self._emitted) + self._pending

    def push(self, delta: str) -> str:
        """Add decoded text; return what is now safe to show (nothing once stopped)."""
        if self.stopped:
            return ""
        if not self.stops:
            return self._emit(self._pending + delta, hold=0)
        window = self._tail + delta
        hits = [i for s in self.stops if (i := window.find(s)) >= 0]
        # The pending text is the tail's last characters: window index i is pending index
        # i - offset (a stop never starts before the pending text: that part was shown
        # only because no stop could start there).
        offset = len(self._tail) - len(self._pending)
        if hits:
            self.stopped = True
            return self._emit((self._pending + delta)[: min(hits) - offset], hold=0)
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
        self.decoder = tokenizer.decode_stream(skip_special_tokens=True)
        self.stop = StopText(params.stop)
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
        piece = self.decoder.step(self.tokenizer.backend, token)
        delta = self.stop.push(piece) if piece else ""
        if token in self.stop_ids or self.stop.stopped:
            out.finish_reason = "stop"
        elif len(out.token_ids) >= self.params.max_tokens:
            out.finish_reason = "length"
        return delta

    def clone(self, index: int) -> SampleState:
        """A fresh sample of the same prompt (parallel sampling)."""
        return SampleState(index, self.seq, self.params, self.tokenizer, self.stop_ids)

    def finish(self) -> str:
        tail = self.stop.flush()
        self.sync()
        return tail

    def sync(self) -> None:
        """Bring out.text up to date (joined here, not at every token: an interrupted turn
        calls this to keep the text it had)."""
        self.out.text = self.stop.text


class Generation:
    """Iterate for the first sample's text deltas as tokens are produced; `output` holds the
    result. All n samples run; only sample 0 streams.

    The cache must hold a prefix of `prompt_ids` (nothing, for a fresh request), for one
    sequence; the caller owns that (LLM resets, a chat session rolls back to the shared
    part, a resumed conversation loads a file).
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
        prefill_chunk: int | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`speculator`: speculative decoding (kvlm.engine.speculative.Speculator; one
        sample, a contiguous or paged cache): each decode step checks a draft."""
        check_prompt(prompt_ids, vocab_size)
        if params.guide is not None and vocab_size is not None:  # once, not per sample
            params.guide = compile_guide(params.guide, tokenizer, vocab_size)
        if speculator is not None and params.n != 1:
            raise InvalidRequestError("speculative decoding on one cache continues one sample")
        self.speculator = speculator
        if cache.batch != 1:
            raise InvalidRequestError("a request starts from a cache holding one sequence")
        if cache.num_tokens >= len(prompt_ids):
            raise InvalidRequestError("the cache already holds the whole prompt; roll it back")
        check_fits(prompt_ids, cache)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise InvalidRequestError("prefill_chunk must be >= 1")
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.params = params
        self.prefill_chunk = prefill_chunk
        self.stop_ids = stop_token_ids(params, tokenizer)
        self.samples = [
            SampleState(i, prompt_ids, params, tokenizer, self.stop_ids) for i in range(params.n)
        ]
        self.output = RequestOutput(
            prompt=prompt,
            prompt_token_ids=list(prompt_ids),
            outputs=[s.out for s in self.samples],
        )
        self.output.metrics.prompt_tokens = len(prompt_ids)
        self.output.metrics.prefill_tokens = len(prompt_ids) - cache.num_tokens

    @property
    def tokens(self) -> list[int]:
        """The first sample's sequence: prompt and generated tokens so far."""
        return self.samples[0].seq

    def __iter__(self) -> Iterator[str]:
        prompt = self.output.prompt_token_ids
        samplers = [
            Sampler(self.params, self.runner.device, i, prompt, self.tokenizer)
            for i in range(len(self.samples))
        ]
        logits = self._prefill()
        for sample, sampler in zip(self.samples, samplers, strict=True):  # n first tokens
            delta = sample.accept(sampler(logits[0]), logits[0])  # from the one prefill
            if sample.out.index == 0 and delta:
                yield delta
        self.output.metrics.record_token(len(self.samples))
        self.cache.fork(len(self.samples))
        while not all(s.done for s in self.samples):
            if self.speculator is not None:
                drafted = yield from self._speculate(samplers[0])
                if drafted:
                    continue
            rows = [s.seq[self.cache.num_tokens :] for s in self.samples]
            if self.cache.would_overflow(len(rows[0])):
                for s in self.samples:  # context full: end, as max_tokens would
                    s.out.finish_reason = s.out.finish_reason or "length"
                break
            logits = self._forward(rows)
            live = [s for s in self.samples if not s.done]
            for s in self.samples:
                if s.done:  # keep the rows in lockstep; nothing is recorded
                    s.seq.append(s.seq[-1])
                    continue
                i = s.out.index
                delta = s.accept(samplers[i](logits[i]), logits[i])
                if s.out.index == 0 and delta:
                    yield delta
            self.output.metrics.record_token(len(live))
        for s in self.samples:
            tail = s.finish()
            if s.out.index == 0 and tail:
                yield tail
        self.output.metrics.finish()

    def _speculate(self, sampler: Sampler) -> Iterator[str]:
        """One step of speculative decoding: propose a draft after the sample's tokens,
        check it with its last token in one forward (each row as decoding it alone), take
        the draft while the model agrees and then the model's own token, and roll the cache
        back past what was not taken. Returns False (having done nothing) when there is no
        draft: the caller runs a plain step."""
        s, cache = self.samples[0], self.cache
        room = min(
            s.params.max_tokens - len(s.out.token_ids) - 1,  # the model adds one
            cache.capacity - cache.num_tokens - 1,  # the last token and the draft fit
        )
        draft = self.speculator.propose(s.seq, room) if room > 0 else []
        if not draft:
            return False
        t0 = time.perf_counter()
        logits = self.runner.forward_draft([s.seq[-1], *draft], cache)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.output.metrics.record_forward(time.perf_counter() - t0)
        agreed = emitted = 0
        for i in range(len(draft) + 1):
            token, ok = sampler.verify(logits[i], draft[i] if i < len(draft) else None)
            delta = s.accept(token, logits[i])
            emitted += 1
            if delta:
                yield delta
            if s.done or not ok:
                break
            agreed += 1
        cache.rollback(cache.num_tokens - (len(s.seq) - 1))  # it holds all but the last
        self.speculator.record(len(draft), min(agreed, len(draft)), emitted)
        self.output.metrics.record_token(emitted)
        return True

    def _prefill(self) -> torch.Tensor:
        """Feed the prompt (in chunks of prefill_chunk) and return the last logits (1, V)."""
        pending = self.samples[0].seq[self.cache.num_tokens :]
        chunk = self.prefill_chunk or len(pending)
        if self.cache.mode == "off":
            chunk = len(pending)  # nothing is kept between forwards: chunks cannot help
        logits = None
        for start in range(0, len(pending), chunk):
            logits = self._forward([pending[start : start + chunk]], prompt=True)
        return logits

    def _forward(self, rows: list[list[int]], prompt: bool = False) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runner.forward_rows(rows, self.cache, prompt=prompt)
        if logits.is_cuda:  # kernels run asynchronously: time their work, not their launch
            torch.cuda.synchronize(logits.device)
        self.output.metrics.record_forward(time.perf_counter() - t0)
        return logits

    def run(self) -> RequestOutput:
        for _ in self:
            pass
        return self.output

    def sync(self) -> None:
        """Bring every sample's text up to date (after an interrupted iteration)."""
        for s in self.samples:
            s.sync()


def check_prompt(prompt_ids: Sequence[int], vocab_size: int | None) -> None:
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0]
    if vocab_size is not None:
        bad += [t for t in prompt_ids if isinstance(t, int) and t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary")


def check_fits(prompt_ids: Sequence[int], cache: KVCache | int) -> None:
    """The prompt fits what `cache` holds after its current tokens (or in `cache` tokens)."""
    if isinstance(cache, int):
        over, capacity = len(prompt_ids) > cache, cache
    else:
        over, capacity = cache.would_overflow(len(prompt_ids) - cache.num_tokens), cache.capacity
    if over:
        raise CacheOverflowError(
            f"the prompt has {len(prompt_ids)} tokens but the cache holds at most "
            f"{capacity} (raise --max-context, up to the model's limit)"
        )


def stop_token_ids(params: SamplingParams, tokenizer: Tokenizer) -> set[int]:
    """The ids that end a sample: the request's own, and EOS unless it is ignored."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(tokenizer.eos_token_ids)
    return ids
