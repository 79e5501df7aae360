"""How far a cache mode moves a model's output from the `off` oracle, on the user's model.

The mode generates greedily, keeping every step's logits. Then one teacher-forced `off`
forward over the same tokens gives the reference logits for every step at once. So each
step compares the two on the same prefix: agreement is how often the oracle's argmax is
the token the mode chose; drift is the largest logit difference. A divergence does not
cascade into the following steps, and the oracle costs one forward, not one per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvlm.engine.served import ServedModel


@dataclass(slots=True)
class VerifyResult:
    mode: str
    kv_dtype: str
    prompt_tokens: int
    steps: int
    agreement: float  # fraction of steps where the oracle's argmax is the mode's token
    first_disagreement: int | None
    worst_rank: int  # the largest rank, in the oracle's order, of a token the mode chose
    max_logit_drift: float
    mean_logit_drift: float  # mean over steps of the per-step max |difference|
    kv_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def verify_mode(llm: ServedModel, prompt_ids: Sequence[int], mode: str, steps: int) -> VerifyResult:
    from kvlm.dtypes import dtype_name

    cache = llm.new_cache(mode)
    seq, step_logits = list(prompt_ids), []
    for _ in range(steps):
        pending = seq[cache.num_tokens :]
        if cache.would_overflow(len(pending)):
            break
        logits = llm.runner.forward(pending, cache)
        step_logits.append(logits)
        seq.append(int(torch.argmax(logits)))
    ours = torch.stack(step_logits)  # (steps, V)
    # the oracle's logits at every step, from one teacher-forced forward: (steps, V)
    ref = llm.runner.logits(seq[:-1], llm.new_cache("off"))[len(prompt_ids) - 1 :]
    chosen = torch.tensor(seq[len(prompt_ids) :], device=ref.device)
    agree = torch.argmax(ref, dim=-1) == chosen
    rank = (ref > ref.gather(-1, chosen[:, None])).sum(-1)  # 0: the oracle's own choice
    drift = (ours - ref).abs().amax(dim=-1)  # per step
    misses = (~agree).nonzero()
    return VerifyResult(
        mode=mode,
        kv_dtype=dtype_name(cache.spec.dtype),
        prompt_tokens=len(prompt_ids),
        steps=len(step_logits),
        agreement=float(agree.float().mean()),
        first_disagreement=int(misses[0]) if len(misses) else None,
        worst_rank=int(rank.max()),
        max_logit_drift=float(drift.max()),
        mean_logit_drift=float(drift.mean()),
        kv_bytes=cache.nbytes,
    )


# ------------------------------------------------- numerics against the fp32 reference


@dataclass(slots=True)
class Agreement:
    """How often greedy answers equal the reference's over a prompt set (`compare`)."""

    prompts: int
    max_tokens: int  # each answer: up to this many tokens, or to the end-of-sequence token
    first_token: float  # share of prompts whose first answer token is the reference's
    whole_answer: float  # share of prompts answered token for token as the reference does
    forced_agreement: float  # share of answer tokens that are the reference's argmax on the
    #                          same prefix (teacher-forced: a divergence does not cascade)
    worst_rank: int  # the largest rank, in the reference's order, of a token chosen
    differing: list[int]  # the prompts (indices) whose answer differs

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def greedy_answers(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """An LLM's (kvlm.llm, a layer above: its `generate`) greedy answer to each prompt,
    alone (no batch: each row's numerics as one stream's), up to `max_tokens` or the
    end-of-sequence token."""
    from kvlm.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [llm.generate(prompt_token_ids=[list(ids)], sampling_params=params,
                         use_tqdm=False)[0].token_ids for ids in prompts]  # fmt: skip


@torch.inference_mode()
def compare(
    reference: ServedModel, prompts: Sequence[Sequence[int]], expected: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]], max_tokens: int,
) -> Agreement:  # fmt: skip
    """`answers` (any engine's, on the same prompt ids) against `expected` (the reference's
    greedy answers), and each answer teacher-forced through the reference: one no-cache
    forward over prompt + answer gives the reference's argmax at every step of it."""
    first = whole = forced = steps = worst = 0
    differing = []
    for i, (ids, ref, ours) in enumerate(zip(prompts, expected, answers, strict=True)):
        first += bool(ref) and bool(ours) and ref[0] == ours[0]
        same = list(ref) == list(ours)
        whole += same
        if not same:
            differing.append(i)
        if not ours:
            continue
        seq = list(ids) + list(ours)
        logits = reference.runner.logits(seq[:-1], reference.new_cache("off"))[len(ids) - 1 :]
        chosen = torch.tensor(list(ours), device=logits.device)
        rank = (logits > logits.gather(-1, chosen[:, None])).sum(-1)
        forced += int((rank == 0).sum())
        steps += len(ours)
        worst = max(worst, int(rank.max()))
    n = len(prompts)
    return Agreement(n, max_tokens, first / n, whole / n, forced / max(steps, 1), worst,
                     differing)  # fmt: skip
