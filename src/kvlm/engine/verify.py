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
from typing import TYPE_CHECKING

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
