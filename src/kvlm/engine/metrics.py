"""Per-request timing: time to first token, decode rate, and every forward's duration."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field


class _GCTime:
    """Seconds Python's garbage collector has run in this process, all threads together
    (a collection holds the GIL: every Python thread, the engine's too, waits for it).
    One collection runs at a time (CPython's `collecting` flag), so start and stop pair
    up without a lock. Counted from the first engine's start (`watch`): importing kvlm
    adds nothing to a library user's collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start: float | None = None

    def watch(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


GC_TIME = _GCTime()


@dataclass(slots=True)
class SpecStats:
    steps: int = 0  # decode rows that carried a draft
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens those rows produced (accepted + the model's own)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


@dataclass(slots=True)
class Metrics:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (fewer when a prefix was cached)
    per_forward_ms: list[float] = field(default_factory=list)
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    _start: float = field(default_factory=time.perf_counter, repr=False)
    _first: float | None = field(default=None, repr=False)
    _last: float | None = field(default=None, repr=False)
    _tokens: int = field(default=0, repr=False)
    _first_count: int = field(default=0, repr=False)
    _prefill_forwards: int = field(default=0, repr=False)  # forwards before the first token

    def record_forward(self, seconds: float) -> None:
        self.per_forward_ms.append(seconds * 1000.0)

    def record_token(self, count: int = 1) -> None:
        """`count` tokens came out of the latest step: every sample's, and with speculative
        decoding every draft token a sample kept besides the model's own (a step's tokens,
        never its events: kvlm.engine.batch._step counts them)."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            self._first_count = count
            self._prefill_forwards = len(self.per_forward_ms)
            self.ttft_ms = (now - self._start) * 1000.0
        self._last = now
        self._tokens += count

    def finish(self) -> None:
        self.total_ms = (time.perf_counter() - self._start) * 1000.0

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first step's: what `decode_tokens_per_s` counts."""
        return self._tokens - self._first_count

    @property
    def decode_ms(self) -> float:
        """From the first step's tokens to the last step's: the time it counts over."""
        if self._first is None or self._last is None:
            return 0.0
        return (self._last - self._first) * 1000.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first step's, over the time since it (prefill excluded); with n
        samples, all of them together; with speculative decoding, every token kept."""
        if self.decode_tokens <= 0 or self.decode_ms <= 0:
            return 0.0
        return self.decode_tokens / (self.decode_ms / 1000.0)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed over the time of the forwards that computed them (every
        chunk of a chunked prefill)."""
        ms = sum(self.per_forward_ms[: max(1, self._prefill_forwards)])
        if not ms or not self.prefill_tokens:
            return 0.0
        return self.prefill_tokens / (ms / 1000.0)

    def to_dict(self) -> dict:
        return {
            "ttft_ms": round(self.ttft_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "decode_tokens": self.decode_tokens,
            "decode_ms": round(self.decode_ms, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "total_ms": round(self.total_ms, 3),
            "per_forward_ms": [round(ms, 3) for ms in self.per_forward_ms],
        }


# Prometheus-style cumulative buckets for time to first token, in seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class EngineStats:
    """Counters of a serving engine, read by /metrics (kvlm.server.metrics)."""

    requests_added: int = 0
    requests_finished: int = 0
    aborted: int = 0
    errors: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # time in steps, all together
    step_seconds_max: float = 0.0  # the longest step: what one step froze every stream for
    decode_rows: int = 0  # rows of every decode forward together
    max_decode_rows: int = 0  # the widest decode forward
    ttft_counts: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding
    # (time, generated_tokens) at recent steps, for a tokens/s over the last few seconds
    _recent: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def record_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1

    def record_step(self, seconds: float, decode_rows: int) -> None:
        self.steps += 1
        self.step_seconds += seconds
        self.step_seconds_max = max(self.step_seconds_max, seconds)
        self.decode_rows += decode_rows
        self.max_decode_rows = max(self.max_decode_rows, decode_rows)
        now = time.perf_counter()
        self._recent.append((now, self.generated_tokens))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.pop(0)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last 10 s (0 when idle)."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
        if len(recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
