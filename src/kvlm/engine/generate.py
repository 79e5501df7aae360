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

import torch

from kvlm.cache import KVCache
from kvlm.engine.guided import compile_guide
from kvlm.engine.request import (
    RequestOutput,
    SampleState,
    check_fits,
    check_prompt,
    stop_token_ids,
)
from kvlm.engine.runner import ModelRunner
from kvlm.engine.sampling import Sampler, SamplingParams
from kvlm.engine.speculative import Speculator
from kvlm.errors import InvalidRequestError
from kvlm.loading.tokenizer import Tokenizer


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
