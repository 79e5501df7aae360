"""Sampling parameters (validated at the door) and the sampler that turns logits into ids."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlm.engine.guided import Guide, GuideState
from kvlm.errors import InvalidRequestError

MAX_LOGPROBS = 20  # as OpenAI's API
MAX_SAMPLES = 64
# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS). logits / 1e-45 is
# +-inf in fp32, and softmax of that is NaN: a "near-greedy" request would draw garbage.
GREEDY_BELOW = 1e-5
# Seeds torch.Generator takes: manual_seed() refuses anything outside 64 bits, and each of a
# request's n samples is seeded with seed + index.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP_CHARS = 1024  # per stop string: the per-token check reads this much of the tail


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature=0` is greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to report per token
    n: int = 1  # samples of the prompt, decoded together from one prefill
    # OpenAI's: subtract presence_penalty once from the logit of every token generated so
    # far, frequency_penalty once per time it was generated (-2 .. 2)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (CTRL's): a token in the prompt or generated so far has its logit divided by
    # this where positive, multiplied where negative; 1 = off
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: id -> -100 .. 100
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    # vLLM's: the log-probability of every prompt token after the first (and this many
    # alternatives), computed in the prefill (a request asking skips the prefix cache)
    prompt_logprobs: int | None = None
    # the output must match this (kvlm.engine.guided: JSON schema, regex, choice, grammar)
    guide: Guide | None = None
    # vLLM's: no EOS, stop token or stop string before this many tokens (their logits masked)
    min_tokens: int = 0
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    include_stop_str_in_output: bool = False  # vLLM's: the stop string kept in the text
    # llama.cpp's locally typical sampling: the tokens whose surprise is nearest the
    # distribution's entropy, up to this much probability; 1 = off
    typical_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature must be a finite number >= 0",
        )
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be >= 0 (0 = off)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            f"stop strings must be at most {MAX_STOP_CHARS} characters",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer")
        _check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX - MAX_SAMPLES,
            f"seed must be between {SEED_MIN} and {SEED_MAX - MAX_SAMPLES}",
        )
        _check(
            isinstance(self.n, int) and 1 <= self.n <= MAX_SAMPLES, f"n must be 1..{MAX_SAMPLES}"
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_real(value) and -2 <= value <= 2, f"{name} must be between -2 and 2", name)
        _check(
            _real(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION,
            f"repetition_penalty must be > 0 and <= {MAX_REPETITION} (1 = off)",
            "repetition_penalty",
        )
        _check(_real(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]", "min_p")
        _check(_real(self.typical_p) and 0 < self.typical_p <= 1, "typical_p must be in (0, 1]",
               "typical_p")  # fmt: skip
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens must be between 0 and max_tokens", "min_tokens")  # fmt: skip
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            "prompt_logprobs",
        )
        _check(isinstance(self.logit_bias, dict), "logit_bias must map token ids to numbers")
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens",
            "logit_bias",
        )
        for token, bias in self.logit_bias.items():
            _check(
                type(token) is int and token >= 0, f"logit_bias: {token!r} is not a token id",
                "logit_bias",
            )  # fmt: skip
            _check(
                _real(bias) and -100 <= bias <= 100,
                f"logit_bias: the bias of token {token} must be between -100 and 100",
                "logit_bias",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling by what came before (the
        penalties) or by the request (logit_bias)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.logit_bias
        )  # fmt: skip


MAX_REPETITION = 100.0  # beyond this a repeated token's logit is ~0 or ~-inf anyway
MAX_LOGIT_BIAS = 1024  # OpenAI's limit is 300; more only costs a longer index


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of a generated token and of the `top` most likely ones."""

    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: dict[int, float]
    rank: int | None = None  # 1 + how many tokens are more likely (prompt logprobs)

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top": [{"token_id": t, "logprob": lp} for t, lp in self.top.items()],
        }


class Sampler:
    """One sample's sampler; owns its random generator so seeds are reproducible. Sample
    `index` of a request (of its n) is seeded with seed + index, whichever path runs it (one
    cache or the engine's batch), so its tokens depend on neither n nor its neighbours."""

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device | str = "cpu",
        index: int = 0,
        prompt_ids: Sequence[int] = (),
        tokenizer: Any = None,
        stops: Sequence[int] = (),
    ) -> None:
        """`stops`: the ids that end the sample, masked while min_tokens are not made."""
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed + index)
        self.penalties = Penalties(params, prompt_ids) if params.penalized else None
        self.tokenizer = tokenizer  # for a guide's matcher
        self.guide: GuideState | None = None
        if params.guide is not None and params.guide.compiled is not None:  # its first mask
            self.guide = GuideState(params.guide, tokenizer, params.guide.compiled.vocab_size)
        self.held = sorted(stops) if params.min_tokens else []
        self.made = 0  # tokens returned

    @property
    def mask_job(self) -> Future | None:
        """A guided sample's next mask while it is being computed (GuideState); None when
        there is nothing to wait for: the sample can run in a step."""
        if self.guide is None or self.guide.ready:
            return None
        return self.guide.job

    def __call__(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """logits (V,) fp32 -> a token id. Call once per token the sample takes: the
        penalties count what it returned, a guide consumes it. `argmax`: the logits'
        argmax when the caller has it (a GPU batch's, fetched at once): a plain greedy
        sample takes it instead of waiting on the device again."""
        p = self.params
        plain = p.guide is None and self.penalties is None and self.made >= p.min_tokens
        if argmax is not None and p.greedy and plain:
            self.made += 1
            return argmax
        return self.verify(logits, None)[0]

    def verify(self, logits: torch.Tensor, draft: int | None) -> tuple[int, bool]:
        """The sample's next token from `logits`, given a proposed `draft` token (or none):
        (token, whether it is the draft, accepted). Greedy: the argmax, accepted when it
        is the draft. Sampled: the draft is accepted with its probability under the
        sample's distribution (after penalties, temperature, min_p, top-k/top-p), else the
        token is drawn from that distribution without the draft; either way the token is
        distributed as a plain draw (speculative sampling with a one-hot proposal)."""
        p = self.params
        if p.guide is not None:
            if self.guide is None:
                self.guide = GuideState(p.guide, self.tokenizer, logits.shape[-1])
            logits = self.guide.mask(logits)
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        if self.made < p.min_tokens and self.held:  # no end yet, unless a guide must end
            held = logits.clone()
            held[self.held] = float("-inf")
            logits = held if bool(torch.isfinite(held).any()) else logits
        self.made += 1
        if p.greedy:
            token = greedy(logits)
        else:
            x = logits.float() / p.temperature  # finite: p.temperature >= GREEDY_BELOW
            if p.min_p > 0:
                x = _min_p_filter(x, p.min_p)
            if p.typical_p < 1:
                x = _typical_filter(x, p.typical_p)
            ids = None
            if 0 < p.top_k < x.shape[-1] or p.top_p < 1.0:
                x, ids = _candidates(x, p.top_k, p.top_p)
            probs = torch.softmax(x, dim=-1)
            token = -1
            if draft is not None:
                at = _position(ids, draft, probs.shape[-1])
                q = float(probs[at]) if at is not None else 0.0
                wide = torch.float64
                u = float(torch.rand(1, generator=self.generator, dtype=wide, device=probs.device))
                if u < q:
                    token = draft
                elif at is not None:
                    probs = probs.clone()
                    probs[at] = 0.0  # the residual: p without the draft
            if token < 0:
                pick = _draw(probs, self.generator)
                token = pick if ids is None else int(ids[pick])
        if self.penalties is not None:
            self.penalties.count(token)
        if self.guide is not None:
            self.guide.accept(token)
        return token, draft is not None and token == draft


def _position(ids: torch.Tensor | None, token: int, size: int) -> int | None:
    """Where `token` sits in a candidate list (ids; None: the whole vocabulary)."""
    if ids is None:
        return token if 0 <= token < size else None
    where = (ids == token).nonzero()
    return int(where[0, 0]) if len(where) else None


class Penalties:
    """One sample's logit adjustments, vLLM's order: logit_bias, then the repetition
    penalty over the prompt and the output, then frequency and presence over the output.
    Whole-vocabulary tensor operations on the sample's own counts: no Python loop over
    the vocabulary, and a row's result is the same in any batch. The tensors are made at
    the first call, when the vocabulary's size (the logits') is known."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self.params = params
        self.prompt_ids = list(prompt_ids) if params.repetition_penalty != 1 else []
        self.counts: torch.Tensor | None = None  # (V,) times each token was generated
        self.seen: torch.Tensor | None = None  # (V,) in the prompt or generated
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def _start(self, logits: torch.Tensor) -> None:
        vocab, device = logits.shape[-1], logits.device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = [t for t in self.prompt_ids if 0 <= t < vocab]
        if ids:
            self.seen[torch.tensor(ids, device=device)] = True
        bias = {t: b for t, b in self.params.logit_bias.items() if t < vocab}
        if bias:
            ids_t = torch.tensor(list(bias), dtype=torch.int64, device=device)
            self.bias = ids_t, torch.tensor(list(bias.values()), dtype=torch.float32,
                                            device=device)  # fmt: skip

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new (V,) fp32 tensor; `logits` is left as it is (logprobs report the model's
        own distribution, as vLLM's do by default)."""
        if self.counts is None:
            self._start(logits)
        p = self.params
        x = logits.float().clone()
        if self.bias is not None:
            x.index_add_(0, *self.bias)
        if p.repetition_penalty != 1:
            r = p.repetition_penalty
            x = torch.where(self.seen, torch.where(x > 0, x / r, x * r), x)
        if p.frequency_penalty:
            x -= p.frequency_penalty * self.counts
        if p.presence_penalty:
            x -= p.presence_penalty * (self.counts > 0).float()
        return x

    def count(self, token: int) -> None:
        if self.counts is not None and 0 <= token < self.counts.shape[0]:
            self.counts[token] += 1
            self.seen[token] = True


def _typical_filter(x: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; llama.cpp's typical_p, transformers'
    TypicalLogitsWarper): keep the tokens whose surprise -log p is nearest the entropy,
    in that order, until their probability reaches `mass` (at least one)."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -torch.nansum(p * logp)
    order = torch.argsort((-logp - entropy).abs())
    keep = int((p[order].cumsum(0) < mass).sum()) + 1
    out = torch.full_like(x, float("-inf"))
    out[order[:keep]] = x[order[:keep]]
    return out


def _min_p_filter(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop (-inf) the tokens whose probability is below min_p times the best one's:
    p_i < min_p p_max  <=>  x_i < x_max + log(min_p), on the temperature-scaled logits."""
    cut = x.max() + math.log(min_p)
    return x.masked_fill(x < cut, -math.inf)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from probs (1-D) by inverse CDF: one uniform number, a cumulative sum
    and a binary search. torch.multinomial over a 49k vocabulary takes ~1 ms on CPU (a
    quarter of a decode step); this ~60 us. A zero-probability index is never drawn: its
    cumulative sum equals its predecessor's, so no u falls in its interval."""
    wide = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no fp64
    cdf = torch.cumsum(probs, dim=-1, dtype=wide)
    u = torch.rand(1, generator=generator, dtype=wide, device=probs.device)
    pick = torch.searchsorted(cdf, u * cdf[-1], right=True)
    return min(int(pick), probs.shape[-1] - 1)


def _candidates(x: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top-k then top-p keep, most likely first: (their logits, their ids).

    The same set as masking with top-k and then top-p over the sorted vocabulary (the
    reference in tests/test_sampling.py), without sorting the whole vocabulary (torch.sort
    of 49k logits is ~5 ms on CPU): top-p usually keeps a few dozen tokens, so take the
    best 64 and widen 4x until the kept mass is reached."""
    vocab = x.shape[-1]
    ids = None
    if 0 < top_k < vocab:  # top-k first: top-p then works on its k tokens
        x, ids = torch.topk(x, top_k)
        if top_p >= 1.0:
            return x, ids
        vocab = top_k
    total = torch.logsumexp(x, dim=-1)
    k = min(vocab, 64)
    while True:
        vals, order = torch.topk(x, k)  # sorted, descending
        probs = torch.exp(vals - total)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
        # A prefix (`before` only grows). At least the best token: a top_p that rounds to 0
        # in fp32 (1e-300) keeps nothing by this rule.
        keep = max(1, int((before < top_p).sum()))
        if keep < k or k == vocab:
            break
        k = min(vocab, 4 * k)
    return vals[:keep], (order[:keep] if ids is None else ids[order[:keep]])


def greedy(logits: torch.Tensor) -> int:
    """The first most likely token. numpy on CPU fp32: ~6 us for a 49k vocabulary, where
    torch.argmax takes ~70 (a fair share of a 4 ms decode step); same tie-break."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """Log-probabilities of the raw model distribution (before temperature/top-k/top-p)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    top_map = (
        {} if best is None else dict(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    )
    return TokenLogprob(token_id, float(logprobs[token_id]), top_map)


SCORE_ROWS = 64  # prompt rows scored together: a few (rows, V) temporaries of ~12 MiB


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of `logits` (m, V) scoring targets[i]: its log-probability, rank and the `top`
    most likely (the model's distribution, as token_logprob).

    About a prefill's cost, not a sort's: log p = x - logsumexp(x), so neither log_softmax
    nor a sort of the vocabulary is made; the rank is a count of the logits above the
    target's (a comparison, on the logits: the same order as the log-probabilities'), the
    alternatives one torch.topk. SCORE_ROWS rows at a time bound the temporaries, and each
    block's numbers come to Python in one .tolist() each (not one call per row)."""
    out: list[TokenLogprob] = []
    ids = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    for a in range(0, len(ids), SCORE_ROWS):
        x = logits[a : a + SCORE_ROWS].float()  # (r, V)
        t = ids[a : a + SCORE_ROWS]
        lse = torch.logsumexp(x, dim=-1)  # (r,)
        picked = x.gather(-1, t[:, None])  # (r, 1)
        ranks = ((x > picked).sum(-1) + 1).tolist()
        chosen = (picked[:, 0] - lse).tolist()
        tops: list[dict[int, float]] = [{} for _ in chosen]
        if top:
            best = torch.topk(x, top)  # (r, top), most likely first
            values = (best.values - lse[:, None]).tolist()
            tops = [dict(zip(i, v, strict=True))
                    for i, v in zip(best.indices.tolist(), values, strict=True)]  # fmt: skip
        for token, lp, rank, alt in zip(t.tolist(), chosen, ranks, tops, strict=True):
            out.append(TokenLogprob(token, lp, alt, rank))
    return out
