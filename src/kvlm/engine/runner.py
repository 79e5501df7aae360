"""ModelRunner: feeds a batch of token rows through the model and one cache step.

`ModelRunner.run(batch)` is the one forward. Where the rows' K/V lives is the batch's
type, and picks the road:

    CacheBatch(rows, cache)              rows of one cache, after what it holds
    DraftBatch(tokens, cache)            one sequence's last token and its draft, a token
                                         per row at consecutive positions
    PoolBatch(rows, pool, spec, tables, starts)    the engine's pool, a table per row
    MixedBatch(rows, pool, spec, tables, starts)   a step's prompt chunks and decode rows
                                         together, rows of any length (one ragged forward)

and inside, one token per row replays a CUDA graph or takes the fused C step where they
apply; anything else is the torch model over a cache step. A mixed step is one ragged
forward (every projection reads the weights once for all the step's tokens); the engine's
pool backend makes one where `ragged_steps()` holds (a GPU), else it runs each chunk alone
and the decode rows together (the CPU: a row's bits as it gets them alone). `forward` and
`logits` are one sequence's shorthands for run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch

from kvlm.cache import CacheSpec, KVCache
from kvlm.cache.paged import BlockPool, RaggedStep, TableStep
from kvlm.model import fused, graphs
from kvlm.model.transformer import Transformer


@dataclass(slots=True)
class CacheBatch:
    """Rows after what one cache holds, one per cached sequence, every row the same
    number of tokens (a prompt's chunk, a lockstep decode). `prompt`: the tokens are a
    prompt's (its numerics, kvlm.model.layers.feeding_prompt; None: more than one token a
    row); `all_rows`: every position's logits, (B, T, V), else each row's last, (B, V).
    The cache commits the tokens only if the whole forward succeeded."""

    rows: Sequence[Sequence[int]]
    cache: KVCache
    prompt: bool | None = None
    all_rows: bool = False


@dataclass(slots=True)
class DraftBatch:
    """One sequence's last token and its draft (speculative decoding on one cache of one
    row), a token per row at consecutive positions, each row computing what decoding its
    token alone would: logits (n, V). The cache commits all n; the caller rolls back the
    rejected."""

    tokens: Sequence[int]
    cache: KVCache


@dataclass(slots=True)
class _OnPool:
    """Rows on the engine's pool: row b at starts[b] through its block table tables[b]
    (group 0's), and a hybrid pool's other layer groups' tables, group by group:
    windowed[g - 1][b] is row b's table of group g (kvlm.cache.paged.BlockPool.groups; a
    conv group's: the row's slot of rows, kvlm.cache.conv.ConvSlots)."""

    rows: Sequence[Sequence[int]]
    pool: BlockPool
    spec: CacheSpec
    tables: Sequence[list[int]]
    starts: Sequence[int]
    windowed: Sequence[Sequence[list[int]]] = ()


@dataclass(slots=True)
class PoolBatch(_OnPool):
    """Sequences of different lengths on the pool, every row the same number of tokens
    (the engine's decode rows and drafts, a prompt's chunk); `prompt` and `all_rows` as
    CacheBatch's."""

    prompt: bool | None = None
    all_rows: bool = False


@dataclass(slots=True)
class MixedBatch(_OnPool):
    """A step's prompt chunks and decode rows on the pool, rows of any length, as one
    ragged forward (kvlm.cache.paged.RaggedStep; every row takes the prompt's numerics):
    a list of each row's last logits (V,), or every position's (T, V) where
    every_row[i]."""

    every_row: Sequence[bool] = ()


# What ModelRunner.run takes: where the rows' K/V lives is the type
Batch = CacheBatch | DraftBatch | PoolBatch | MixedBatch


class ModelRunner:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.device = model.device
        # One token per row, of a contiguous or paged cache or of the engine's batch over
        # its pool: one C call (kvlm.model.fused).
        self.fused_reason = fused.why_not(model)
        self._fused: dict[int, fused.FusedDecoder] = {}
        self.fused_rows = 0  # rows the fused step has decoded (/metrics: fused_rows)
        # On a GPU, decode steps replay CUDA graphs (kvlm.model.graphs) over the caches and
        # pools they read: one layer group (GraphDecoder.accepts, _on_pool); not for a
        # model whose step cannot be captured (graphs_reason: graphs.why_not)
        self.graphs_reason = graphs.why_not(model)
        on = graphs.enabled(model.device) and self.graphs_reason is None
        self.graphs = graphs.GraphDecoder(model) if on else None
        # A step's prompt chunks and decode rows in one ragged forward: on a GPU (one
        # launch per op for the whole step), unless KVLM_ONE_FORWARD=0; the CPU keeps a
        # forward per chunk (a prompt's bits do not depend on its neighbours)
        self.one_forward = (
            model.device.type == "cuda" and os.environ.get("KVLM_ONE_FORWARD", "1") != "0"
        )
        # An MTP drafter's input (kvlm.engine.speculative.MtpDrafter): with `keep_hidden`,
        # every run leaves `hidden`, each fed token's final-normed state (R, H) in the
        # batch's order (row by row, a row's tokens in order); None where a run had none
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None

    def _decoder(self, slots: int) -> fused.FusedDecoder | None:
        if self.fused_reason is not None:  # set after a decoder was made: it is not used
            return None
        if slots not in self._fused:
            self._fused[slots] = fused.FusedDecoder(self.model, slots)
        return self._fused[slots]

    def ragged_steps(self) -> bool:
        """Whether a step's prompt chunks and decode rows go as one mixed batch (one ragged
        forward): `one_forward`, and prompt and decode rows sharing the model's numerics
        (kvlm.model.numerics.ModelNumerics.prompt_like_decode)."""
        return self.one_forward and self.model.numerics.prompt_like_decode

    def fused_for(self, cache: KVCache) -> fused.FusedDecoder | None:
        """The fused decode step for this cache, when it applies."""
        decoder = self._decoder(cache.spec.max_tokens)
        return decoder if decoder is not None and decoder.accepts(cache) else None

    def decode_step(self, cache: KVCache) -> str:
        """Which step decodes `cache`: "fused" (kvlm's C step), "cuda graphs", or "torch
        step: <why the fused one does not>"."""
        if self.graphs and self.graphs.accepts(cache):
            return "cuda graphs"
        if self.fused_reason is not None:
            return f"torch step: {self.fused_reason}"
        if self.fused_for(cache) is None:
            rows = f"{cache.batch} row" + ("s" if cache.batch != 1 else "")
            return f"torch step: {fused.NOT_THIS_CACHE}, not {cache.mode} ({rows})"
        return "fused"

    def pool_decode_step(self, pool: BlockPool, max_tokens: int) -> str:
        """Which step decodes the engine's pool (decode_step's words; positions up to
        `max_tokens`): "cuda graphs" (a pool of one layer group on a GPU), "fused", or
        "torch step: <why the fused one does not>" (FusedDecoder.pool_why_not). A step
        the fused one takes may still go to the torch step on its own rows (a draft longer
        than a conv slot's ring keeps: ConvSlots.view)."""
        if (self.graphs and pool.scratch is not None and len(pool.groups) == 1
                and self.graphs.reads(pool.store)):  # fmt: skip
            return "cuda graphs"
        if self.fused_reason is not None:
            return f"torch step: {self.fused_reason}"
        reason = self._decoder(max_tokens).pool_why_not(pool)  # type: ignore[union-attr]
        return "fused" if reason is None else f"torch step: {reason}"

    @overload
    def run(self, batch: MixedBatch) -> list[torch.Tensor]: ...
    @overload
    def run(self, batch: CacheBatch | DraftBatch | PoolBatch) -> torch.Tensor: ...

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor | list[torch.Tensor]:
        """The one forward: each row's last logits, (B, V), or with `all_rows` every
        position's, (B, T, V); a mixed step's list (MixedBatch). One token per row (a decode
        batch, a draft's rows) replays a captured CUDA graph or takes the fused C step where
        they apply (kvlm.model.graphs, kvlm.model.fused); everything else runs the torch
        model through a cache step."""
        self.hidden = None
        match batch:
            case CacheBatch():
                return self._on_cache(batch)
            case DraftBatch():
                return self._draft(batch)
            case PoolBatch():
                return self._on_pool(batch)
            case MixedBatch():
                return self._mixed(batch)
        raise TypeError(f"not a batch: {type(batch).__name__}")

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One sequence's tokens after what `cache` holds: its last logits, (V,)."""
        return self.run(CacheBatch([token_ids], cache))[0]

    def logits(self, token_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Teacher-forced logits for every position, (T, V): the reference tests' view."""
        return self.run(CacheBatch([token_ids], cache, all_rows=True))[0]

    def _torch(self, rows, step, prompt: bool | None, all_rows: bool) -> torch.Tensor:
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model(ids, step.positions, step, last_only=not all_rows, prompt=prompt,
                            hidden=self.keep_hidden)  # fmt: skip
        if self.keep_hidden:
            logits, hidden = logits
            self.hidden = hidden.reshape(-1, hidden.shape[-1])
        return logits if all_rows else logits[:, -1]

    def _fused_hidden(self, decoder: fused.FusedDecoder) -> None:
        """The fused step's rows' states: its residual stream after the call, final-normed
        as the step normed it for the vocabulary projection."""
        if self.keep_hidden:
            self.hidden = self.model.norm(decoder.last_x)

    def _run_fused(self, decoder, cache: KVCache, step, tokens: list[int], starts: list[int],
                   rows):  # fmt: skip
        """The fused step over `cache`: token i at starts[i], through the cache's row
        rows[i] (fused.FusedDecoder.views_of: its block table, or its slots)."""
        views = decoder.views_of(cache, step, rows)
        logits = decoder.run(views, tokens, starts, cache.spec.sliding_window)
        self.fused_rows += len(tokens)
        self._fused_hidden(decoder)
        return logits

    def _on_cache(self, b: CacheBatch) -> torch.Tensor:
        """Rows of one cache: row b's tokens after what it holds for row b (all rows one
        length, one row per cached sequence)."""
        rows, cache = b.rows, b.cache
        if len(rows) != cache.batch or len({len(r) for r in rows}) != 1:
            raise ValueError(f"need {cache.batch} rows of one length, got {[len(r) for r in rows]}")
        one = len(rows[0]) == 1 and not b.all_rows
        tokens = [r[0] for r in rows]
        graphs = self.graphs if not self.keep_hidden else None  # graphs keep no states
        if one and not b.prompt and graphs and graphs.accepts(cache):
            return self.graphs.step(tokens, cache)
        # a prompt's token never takes the fused step: a prompt row's bits are the prompt
        # road's (row-blocked products, kvlm_attend) in a chunk of one token as of many
        if one and not b.prompt and (decoder := self.fused_for(cache)):
            step = cache.begin(1)  # raises on overflow (paged: allocates, copies on write)
            n = len(rows)
            logits = self._run_fused(decoder, cache, step, tokens, [step.start] * n, range(n))
        else:
            step = cache.begin(len(rows[0]))  # raises on overflow before any write
            logits = self._torch(rows, step, b.prompt, b.all_rows)
        cache.commit(step)
        return logits

    def _draft(self, b: DraftBatch) -> torch.Tensor:
        """One sequence's last token and its draft: the fused step's rows, or the torch
        step's draft rows over their own keys (DraftBatch)."""
        cache, tokens = b.cache, list(b.tokens)
        n = len(tokens)
        step = cache.begin(n, draft=True)  # refuses other caches, raises on overflow
        decoder = self.fused_for(cache)
        if decoder is not None and decoder.drafts(cache, n):
            starts = [step.start + i for i in range(n)]
            logits = self._run_fused(decoder, cache, step, tokens, starts, [0] * n)
        else:
            logits = self._torch([[t] for t in tokens], step, False, False)
        cache.commit(step)
        return logits

    def _on_pool(self, b: PoolBatch) -> torch.Tensor:
        """Sequences of different lengths in one pool (the engine's batch): row b feeds its
        tokens at positions starts[b].. through block table tables[b]."""
        pool, spec, rows, window = b.pool, b.spec, b.rows, b.spec.sliding_window
        tokens = [r[0] for r in rows]
        one = len(rows[0]) == 1 and not b.all_rows
        # the graphs read one block table per row: a pool of one layer group (graphs.ONE_GROUP)
        replay = one and not b.prompt and pool.scratch is not None and len(pool.groups) == 1
        graphs = self.graphs if replay and not self.keep_hidden else None
        if graphs and graphs.reads(pool.store):
            out = graphs.step_table(pool.store, pool.scratch, tokens, b.tables, b.starts, window)
            if out is not None:
                return out
        if one and len(rows) <= fused.MAX_ROWS and not b.prompt:
            decoder = self._decoder(spec.max_tokens)
            if decoder is not None and decoder.pool_why_not(pool) is None:
                tables = [b.tables, *b.windowed]
                views = pool.views(tables, b.starts)  # None: a draft too long for a ring
                if views is not None:
                    logits = decoder.run(views, tokens, b.starts, window)
                    pool.stepped(tables, b.starts)  # conv rows', states' slots
                    self.fused_rows += len(tokens)
                    self._fused_hidden(decoder)
                    return logits
        step = TableStep(pool, spec, list(b.tables), list(b.starts), len(rows[0]), b.windowed)
        logits = self._torch(rows, step, b.prompt, b.all_rows)
        step.commit_rows()  # a conv group's rows, once the forward has succeeded
        return logits

    def _mixed(self, b: MixedBatch) -> list[torch.Tensor]:
        """A step's prompt chunks and decode rows on the pool as one forward (kvlm.cache.
        paged.RaggedStep), each row's logits."""
        every = list(b.every_row) or [False] * len(b.rows)
        lengths = [len(r) for r in b.rows]
        picks, end = [], 0
        for n, all_rows in zip(lengths, every, strict=True):
            end += n
            picks.append(list(range(end - n, end)) if all_rows else [end - 1])
        flat = [i for p in picks for i in p]
        step = RaggedStep(b.pool, b.spec, list(b.tables), list(b.starts), lengths, flat, b.windowed)
        ids = torch.tensor([[t for r in b.rows for t in r]], dtype=torch.long, device=self.device)
        logits = self.model(ids, step.positions, step, prompt=True, hidden=self.keep_hidden)
        if self.keep_hidden:
            logits, hidden = logits
            self.hidden = hidden[0]
        logits = logits[0]  # (R, V)
        step.commit_rows()
        out, at = [], 0
        for p, all_rows in zip(picks, every, strict=True):
            out.append(logits[at : at + len(p)] if all_rows else logits[at])
            at += len(p)
        return out
