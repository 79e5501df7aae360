"""Speculative decoding in the engine's batch: each decoding sequence proposes a few
tokens, the model checks them all in the step's one decode forward, the sequence keeps the
longest accepted prefix plus the model's own next token, and its cache is rolled back
past the rest.

    step t:   row p      = the sequence's last token            (the decode row it has anyway)
              rows p+1.. = its draft d1 .. dk, at the next positions, on its own block table
    accept:   d1 .. dj while the model agrees (greedy: its argmax; sampled: with
              probability p(d), a one-hot proposal), then the model's token at j+1
    rollback: num_computed = p + 1 + j; blocks past it freed, never sealed into the prefix
              cache (only computed tokens are)

Why it is exact: the rows of one sequence are rows of the fused step's batch (or the torch
step's), which writes every row's K/V of a layer before any row's attention of that layer,
and a row's attention sees the keys up to its own position. So row p+i computes exactly
what decoding d_i alone would: greedy output is token for token the plain decode's. With
sampling, accepting d with probability p(d) and otherwise drawing from p with d removed
(renormalised) draws from p itself (speculative sampling with a one-hot proposal).

Proposer: prompt lookup (n-grams): the last n tokens (n from `ngram_max` down to
`ngram_min`) are looked up in the sequence so far, and what followed their latest earlier
occurrence is proposed. No second model; the win is on input-grounded work (summaries,
extraction, code edits), where the output copies spans of the input. The draft length
adapts per sequence: it grows by one after a fully accepted draft and shrinks to what was
accepted (at least 1) after a rejection, so a proposer that keeps failing costs a row or
two per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_draft: int = 8  # the most tokens a sequence proposes in one step
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}")
        if not 1 <= self.num_draft <= 16:
            raise ValueError("num_draft must be 1..16")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError("need 1 <= ngram_min <= ngram_max <= 16")


def propose_ngram(tokens: Sequence[int], k: int, nmax: int, nmin: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens (the longest n that occurs), or []."""
    if k < 1 or len(tokens) < nmin + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(nmax, len(arr) - 1), nmin - 1, -1):
        tail = arr[-n:]
        # every start i < len - n whose n tokens equal the tail (not the tail itself)
        hits = np.ones(len(arr) - n, dtype=bool)
        for j in range(n):
            hits &= arr[j : len(arr) - n + j] == tail[j]
        found = np.flatnonzero(hits)
        if len(found):
            start = int(found[-1]) + n
            return arr[start : start + k].tolist()
    return []


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
