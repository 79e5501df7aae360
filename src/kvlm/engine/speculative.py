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
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlm.engine.sequence import Status, common_prefix

METHODS = ("ngram", "draft", "mtp")


# The most tokens a sequence may propose in one step (SpeculativeConfig.num_draft)
MAX_DRAFT = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`ngram`: prompt lookup. `draft`: a draft model proposes greedily, `draft_model` (a
    file with the same tokenizer; None: the served model's own file) at `draft_weights`
    (a cheaper format of the same file is self-speculation). `mtp`: the model file's own
    multi-token-prediction head proposes greedily from the model's states (MtpDrafter)."""

    method: str = "ngram"
    num_draft: int = 8  # the most tokens a sequence proposes in one step
    ngram_max: int = 4
    ngram_min: int = 2
    draft_model: str | None = None
    draft_weights: str | None = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError("a draft model needs the draft method (--speculative draft)")
        if not 1 <= self.num_draft <= MAX_DRAFT:
            raise ValueError(f"num_draft must be 1..{MAX_DRAFT}")
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


class DraftModel:
    """A draft model proposing for the engine's sequences: one contiguous cache per
    sequence, fed the sequence's tokens as they are accepted (its prompt the first time),
    then k greedy steps; after verification the cache is rolled back to what the
    sequence kept. A greedy draft is a deterministic proposal (a one-hot q), so the
    engine's acceptance rule stays exact for sampled requests too."""

    def __init__(self, draft, vocab_size: int) -> None:
        # draft: a kvlm.engine.served.ServedModel (not imported: that module names this one)
        self.llm = draft
        self.vocab_size = vocab_size
        self.states: dict[int, tuple] = {}  # seq_id -> (cache, fed ids, sequence)

    def propose(self, seq, k: int) -> list[int]:
        for sid in [s for s, (_, _, q) in self.states.items() if q.status is Status.FINISHED]:
            self.states.pop(sid)[0].free()  # the finished sequences' caches
        tokens = seq.token_ids
        if seq.seq_id not in self.states:
            cache = self.llm.new_cache("contiguous")
            cache.hold_rollback(MAX_DRAFT)  # a DeltaNet state keeps its drafts' states
            self.states[seq.seq_id] = (cache, [], seq)
        cache, fed, _ = self.states[seq.seq_id]
        keep = common_prefix(fed, tokens[:-1])  # the cache's tokens the sequence still has
        if not cache.can_roll_back(cache.num_tokens - keep):
            keep = 0  # a state kept no further back: fed again
        cache.rollback(cache.num_tokens - keep)
        del fed[keep:]
        pending = tokens[keep:]
        k = min(k, cache.capacity - cache.num_tokens - len(pending))
        if k < 1:
            return []
        runner = self.llm.runner
        logits = runner.forward(pending, cache)
        fed += pending
        draft = []
        for i in range(k):
            token = int(logits.argmax())
            if token >= self.vocab_size:
                break
            draft.append(token)
            if i + 1 < k:
                logits = runner.forward([token], cache)
                fed.append(token)
        return draft


def check_mtp(model) -> None:
    """InvalidRequestError unless `model` (a Transformer) carries an MTP head to draft
    with (--speculative mtp)."""
    if model.mtp is None:
        from kvlm.errors import InvalidRequestError

        raise InvalidRequestError(
            "--speculative mtp: this model file carries no multi-token-prediction head (its "
            "checkpoints' mtp.*, a GGUF's nextn blocks: `kvlm inspect` says)",
            param="speculative",
        )


@dataclass(slots=True)
class _Head:
    """One sequence's MTP head: its cache, holding the positions `offset` .. `offset` +
    its tokens (slot j: position offset + j), and the model's states recorded past them,
    for positions `first` .. (rows of (n, H) in order)."""

    cache: object  # a kvlm.cache KVCache
    seq: object  # the kvlm.engine.sequence.Sequence
    offset: int = 0
    first: int = 0
    held: list = field(default_factory=list)

    @property
    def end(self) -> int:
        """The position after the last one the cache holds."""
        return self.offset + self.cache.num_tokens  # type: ignore[attr-defined]

    @property
    def recorded(self) -> int:
        """The position after the last state recorded."""
        return self.first + sum(len(r) for r in self.held)


class MtpDrafter:
    """The model file's multi-token-prediction head proposing for the engine's sequences
    (kvlm.model.mtp): each sequence's head keeps a cache of its own (its K/V of the
    positions before n, n the sequence's computed tokens), fed position i the model's
    final-normed state h_i (the engine's step leaves every fed token's:
    ModelRunner.keep_hidden, `record`, which feeds the head at once up to the last state
    it records) and the token x_{i+1}. To propose k tokens after x_n: the head at position
    n - 1 (its pair (h_{n-1}, x_n)) drafts d_1, then k - 1 steps on its own states (d_j at
    position n - 1 + j), rolled back after: the positions it keeps are the model's
    verified ones. Greedy drafts are a
    one-hot proposal, so the engine's acceptance stays exact for sampled requests too.

    Positions whose states the step never computed (a prefix the cache or a tier held, so
    this process never ran them) are not fed: the head's cache starts at the first
    position it has a state for (`_Head.offset`), each key rotated at its own position, so
    it attends over the recent part it was fed (as a head trained on shorter contexts
    would), which costs acceptance, never tokens."""

    def __init__(self, model, max_tokens: int, vocab_size: int) -> None:
        # model: the served kvlm.model.transformer.Transformer (its `mtp` head)
        self.model = model
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.heads: dict[int, _Head] = {}  # seq_id -> its head

    def _head(self, seq) -> _Head:
        for sid in [s for s, h in self.heads.items() if h.seq.status is Status.FINISHED]:
            self.heads.pop(sid).cache.free()  # the finished sequences' caches
        if seq.seq_id not in self.heads:
            self.heads[seq.seq_id] = _Head(self._new_cache(), seq)
        return self.heads[seq.seq_id]

    def _new_cache(self):
        from kvlm.cache import create_cache
        from kvlm.model.mtp import head_spec

        spec = head_spec(self.model.config, self.max_tokens, self.model.dtype, self.model.device)
        return create_cache("contiguous", spec)

    def record(self, seq, start: int, rows) -> None:
        """The model's states of the sequence's positions start .. start + len(rows) - 1
        (rows (n, H), a step's: its chunk's, or its kept decode rows); the head fed at once
        up to the last of them (kept for the next proposal, which drafts from its output),
        so a long prompt's states are never all held."""
        if rows is None or not len(rows):
            return
        head = self._head(seq)
        if not head.held or start != head.recorded:  # a gap, or positions again: from here
            head.first, head.held = start, []
        head.held.append(rows.detach().clone())
        self._feed(head, seq, min(start + len(rows), len(seq.token_ids)) - 1)

    @torch.inference_mode()
    def _feed(self, head: _Head, seq, upto: int):
        """Feed the head the positions from where its cache ends to `upto` (the states
        recorded, each with the token after it) -> (logits of the last, the head's states),
        or None where there was nothing to feed. Positions the recorded states do not
        reach back to (a prefix hit's) are not fed: the cache starts over at the first
        recorded (`offset`); positions fed again (a recompute) roll it back first."""
        first = head.first
        if head.end > first and head.offset <= first:  # positions again: back to them
            head.cache.rollback(head.end - first)
        if head.end != first:  # a gap before the states (or before the cache): start there
            head.cache.free()
            head.cache, head.offset = self._new_cache(), first
        fed, have = head.end, head.recorded
        upto = min(upto, have)
        if upto <= fed or upto - head.offset > head.cache.capacity:
            return None
        rows = torch.cat(head.held)
        step = head.cache.begin(upto - fed)
        ids = torch.tensor([seq.token_ids[fed + 1 : upto + 1]])
        positions = torch.arange(fed, upto)[None]
        logits, normed = self.model.mtp_forward(
            ids, positions, rows[None, fed - first : upto - first], step
        )
        head.cache.commit(step)
        head.first, head.held = upto, [rows[upto - first :]] if upto < have else []
        return logits, normed

    @torch.inference_mode()
    def propose(self, seq, k: int) -> list[int]:
        head = self._head(seq)
        n, tokens = seq.num_computed, seq.token_ids
        if n < 1 or len(tokens) != n + 1 or head.cache.capacity - (n - head.offset) < 1:
            return []
        if head.end >= n:  # position n - 1 fed already (asked again before a step): none
            return []
        out = self._feed(head, seq, n)
        if out is None or head.end != n:  # no state of position n - 1
            return []
        logits, normed = out
        cache = head.cache
        k = min(k, cache.capacity - cache.num_tokens)
        draft: list[int] = []
        for j in range(k):
            token = int(logits[0, -1].argmax())
            if token >= self.vocab_size:
                break
            draft.append(token)
            if j + 1 < k:
                step = cache.begin(1)
                logits, normed = self.model.mtp_forward(torch.tensor([[token]]),
                                                        torch.tensor([[n + j]]),
                                                        normed[:, -1:], step, j + 1)  # fmt: skip
                cache.commit(step)
        cache.rollback(head.end - n)  # the drafts' positions: the model's to verify
        return draft
