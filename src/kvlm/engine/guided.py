"""Grammar-constrained decoding (JSON schema, JSON object, regex, choice, Lark grammar)
through llguidance.

Why llguidance: on this project's CPUs both maintained libraries made for this (xgrammar,
what vLLM and SGLang default to, and llguidance) cost far less than a decode step per
token (benchmarks/bench_grammar.py, docs/BENCHMARKS.md: a 49k vocabulary, a nested JSON
schema: llguidance 9.8 us median / 76 us p90 per mask, xgrammar 1.3 / 7.8 us, against a
~3 ms step), and llguidance is one 3 MB wheel with no dependencies where xgrammar
requires torch's triton and a TVM runtime. It also compiles a schema in ~1 ms (lazily),
which a server meeting a new schema per request wants.

Each sample keeps its own matcher: before sampling, its allowed-token bitmask turns every
other logit into -inf (a per-row operation, the same in any batch); after, the matcher
consumes the token, and the next bitmask is computed on a mask thread while the engine
runs its next step (vLLM and SGLang overlap the grammar's bitmask with the forward in the
same way); a sample whose mask is not ready sits that step out (GuideState.ready). When
the grammar is complete only the end-of-sequence tokens are allowed, so the sample stops
there.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from kvlm.engine.guide_limits import MAX_GUIDE_CHARS, check_bounds
from kvlm.engine.guide_worker import WORKER_STACK, WORKERS, GuideWorkers, build_matcher

MASK_THREADS = 2  # masks computed at once (the engine's guided samples share them)

__all__ = ["MAX_GUIDE_CHARS", "Guide", "GuideState", "compile_guide"]

COMPILE_STACK = 8 * WORKER_STACK  # the server's compile thread: 8x what the worker survived
# Compiled guides kept per tokenizer, by kind and spec, least recently used let go: an
# agent sends the same tools (tool_choice auto's lazy grammar) and output schema every
# turn, and a hit skips the worker's check and the compile (10-19 ms for one tool's auto
# grammar on the default model's 49k vocabulary, model-207 Xeon). A compiled matcher is
# never fed (each sample deep-copies it), so requests share it safely.
KEEP_COMPILED = 64


@dataclass(frozen=True, slots=True)
class Compiled:
    """A guide's matcher, compiled and never fed: each sample takes a deep copy of it."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int
    first_mask: bytes | None = None  # its mask at the start (compute_bitmask's bytes)
    # what llguidance says it left out of the grammar (a lenient schema's keywords it does
    # not implement: 'Unimplemented keys: ["propertyNames"]'); () where nothing
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Guide:
    """What the output must match. `spec`: a JSON schema (dict) for json_schema, nothing
    for json_object, a regular expression, a list of strings (choice), a Lark grammar.
    `compiled`: set by compile_guide (a copy of the guide), what the engine's samples use."""

    kind: str
    spec: Any = None
    param: str = "response_format"  # the request field it came from (errors name it)
    compiled: Compiled | None = dataclasses.field(default=None, compare=False, repr=False)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the model's tokenizer (~0.3 s to build: kept on the tokenizer),
    over the model's whole vocabulary (its logits; a GGUF may pad past the tokenizer's),
    ending at the tokenizer's end-of-sequence tokens."""
    import llguidance

    return _kept(tokenizer, "_ll_tokenizers", vocab_size, llguidance.LLTokenizer)


def guide_workers(tokenizer, vocab_size: int) -> GuideWorkers:
    """The compile workers for this tokenizer and vocabulary (kept on the tokenizer)."""
    return _kept(tokenizer, "_guide_workers", vocab_size, GuideWorkers)


def _kept(tokenizer, name: str, vocab_size: int, make: Callable[..., Any]) -> Any:
    """make(the tokenizer as JSON, vocab_size, its end-of-sequence ids or None), made once
    per vocabulary size and kept on the tokenizer (in its dict `name`)."""
    made = vars(tokenizer).setdefault(name, {})
    if vocab_size not in made:
        eos = sorted(tokenizer.eos_token_ids) or None
        made[vocab_size] = make(tokenizer.backend.to_str(), vocab_size, eos)
    return made[vocab_size]


_compile_lock = threading.Lock()


class _Threads:
    """`count` daemon threads made with a `stack`-byte stack (llguidance recurses; a
    thread's stack size is fixed when it is made), started at the first submit."""

    def __init__(self, name: str, count: int, stack: int) -> None:
        self.name, self.count, self.stack = name, count, stack
        self._jobs: SimpleQueue | None = None

    def submit(self, fn: Callable, *args) -> Future:
        """fn(*args) on one of the threads; its future."""
        with _compile_lock:
            if self._jobs is None:
                self._jobs = SimpleQueue()
                old = threading.stack_size(self.stack)
                try:
                    for i in range(self.count):
                        threading.Thread(target=_work, args=(self._jobs,), daemon=True,
                                         name=f"{self.name}-{i}").start()  # fmt: skip
                finally:
                    threading.stack_size(old)
        done: Future = Future()
        self._jobs.put((fn, args, done))
        return done


def _work(jobs: SimpleQueue) -> None:
    while True:
        fn, args, done = jobs.get()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller as is
            done.set_exception(exc)


# the server's matchers, built after the worker's check (64 MiB stacks)
_COMPILES = _Threads("kvlm-guide-compile", WORKERS, COMPILE_STACK)
# each sample's next mask, computed while the engine runs its step (GuideState)
_MASKS = _Threads("kvlm-guide-mask", MASK_THREADS, WORKER_STACK)


def compile_guide(guide: Guide, tokenizer, vocab_size: int) -> Guide:
    """The guide with its matcher compiled for this model: bounds first (pure Python), then
    the worker process (a crash or a runaway is this request's 400, the server lives on),
    then the server's own matcher on the big-stack compile thread. Blocks: call it off the
    event loop and off the engine thread. The one road for the server and the library."""
    done = guide.compiled
    if done is not None and done.vocab_size == vocab_size:
        return guide
    check_bounds(guide.kind, guide.spec, guide.param)
    key = (guide.kind, json.dumps(guide.spec, sort_keys=True))
    kept = _compiled_kept(tokenizer, vocab_size)
    with _compile_lock:
        compiled = kept.get(key)
        if compiled is not None:
            kept.move_to_end(key)
    if compiled is None:
        guide_workers(tokenizer, vocab_size).check(guide.kind, guide.spec, guide.param)
        tok = ll_tokenizer(tokenizer, vocab_size)
        job = _COMPILES.submit(build_matcher, guide.kind, guide.spec, guide.param, tok)
        matcher, first = job.result()
        compiled = Compiled(matcher, vocab_size, first, tuple(matcher.get_grammar_warnings()))
        with _compile_lock:
            kept[key] = compiled
            while len(kept) > KEEP_COMPILED:
                kept.popitem(last=False)
    return dataclasses.replace(guide, compiled=compiled)


def _compiled_kept(tokenizer, vocab_size: int) -> OrderedDict:
    """The guides compiled for this tokenizer and vocabulary, least recently used first."""
    with _compile_lock:
        return (
            vars(tokenizer).setdefault("_compiled_guides", {}).setdefault(vocab_size, OrderedDict())
        )


class GuideState:
    """One sample's matcher: a copy of the compiled one (never a compile here). Its next
    mask is computed on a mask thread as soon as a token is accepted, so it is made while
    the engine runs the step that gives the sample its logits: the engine thread never
    computes one. The scheduler leaves a sample whose mask is not ready out of a step
    (`ready`), so a slow grammar slows its own sample and no other."""

    def __init__(self, guide: Guide, tokenizer, vocab_size: int) -> None:
        # llguidance.numpy, not llguidance.torch: the two functions are the same, and the
        # latter's import decorates a kernel with torch.compile, so its first import pulls
        # in torch._dynamo: 3.5-6 s of imports holding the GIL (Zen 3, Zen 4), that froze
        # the engine's steps beside a server's first guided request (the soak's longest)
        import llguidance.numpy as ln
        import torch

        if guide.compiled is None or guide.compiled.vocab_size != vocab_size:
            guide = compile_guide(guide, tokenizer, vocab_size)  # a caller that did not
        self.guide = guide
        self.vocab_size = vocab_size
        self.matcher = guide.compiled.matcher.deep_copy()
        self._fill = ln.fill_next_token_bitmask
        self._words = ln.allocate_token_bitmask(1, vocab_size)  # what the matcher fills
        self.bitmask = torch.from_numpy(self._words)  # the same memory
        self._bits = torch.arange(32, dtype=torch.int32)
        first, size = guide.compiled.first_mask, self.bitmask.numel() * 4
        self._job: Future = Future()
        if first is not None and len(first) >= size:  # made at compile (a word more, unread)
            self.bitmask[0] = torch.frombuffer(bytearray(first[:size]), dtype=torch.int32)
            self._job.set_result(None)
        else:
            self._job = _MASKS.submit(self._compute)

    @property
    def ready(self) -> bool:
        """Whether the mask of the next token is computed (or its computing failed)."""
        return self._job.done()

    @property
    def job(self) -> Future:
        """The mask's computing (what an idle engine may wait on)."""
        return self._job

    def _compute(self) -> None:
        self._fill(self.matcher, self._words, 0)

    def mask(self, logits):
        """A copy of `logits` (V,) with every token the grammar does not allow at -inf
        (waits for the mask where it is not ready: a preempted sample recomputed). A
        matcher past guide_worker.PARSER_LIMITS mid-way is in llguidance's error state,
        whose mask allows only the end-of-sequence tokens: the sample ends there."""
        self._job.result()
        words = self.bitmask[0].to(self._bits.dtype)
        allowed = ((words[:, None] >> self._bits) & 1).bool().flatten()[: logits.shape[-1]]
        if not bool(allowed.any()):  # the grammar is over and its end was ignored (ignore_eos)
            return logits
        out = logits.float().clone()
        out[~allowed.to(out.device)] = float("-inf")
        return out

    def accept(self, token: int) -> None:
        """Feed the sampled token; the next mask starts on a mask thread."""
        self._job.result()  # never feed the matcher while a mask reads it
        self.matcher.consume_token(token)
        self._job = _MASKS.submit(self._compute)
