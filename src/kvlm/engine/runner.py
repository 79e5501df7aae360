"""ModelRunner: feeds token rows through the model and one cache step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlm.cache import CacheSpec, KVCache
from kvlm.cache.basic import BasicCache, BasicDraftRowsStep
from kvlm.cache.contiguous import ContiguousCache, DraftRowsStep
from kvlm.cache.paged import BlockPool, PagedCache, TableStep
from kvlm.cache.window import WindowCache, WindowDraftRowsStep
from kvlm.errors import InvalidRequestError
from kvlm.model import fused, graphs
from kvlm.model.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.device = model.device
        # One token per row, of a contiguous or paged cache or of the engine's batch over
        # its pool: one C call (kvlm.model.fused).
        self.fused_reason = fused.why_not(model)
        self._fused: dict[int, fused.FusedDecoder] = {}
        # On a GPU, decode steps replay CUDA graphs (kvlm.model.graphs)
        self.graphs = graphs.GraphDecoder(model) if graphs.enabled(model.device) else None

    def _decoder(self, slots: int) -> fused.FusedDecoder | None:
        if self.fused_reason is not None:
            return None
        decoder = self._fused.get(slots)
        if decoder is None:
            decoder = self._fused[slots] = fused.FusedDecoder(self.model, slots)
        return decoder

    def _decodes_alike(self, prompt: bool | None) -> bool:
        """Whether one prompt token may take the fused (decode) step: only when prompt
        and decode rows have the same numerics (no bf16 prompt products; int8 activations
        for both or for neither)."""
        lin = self.model.layers[0].attn.qkv
        return not prompt or (not lin.prefill_bf16 and lin.prefill_int8 == lin.act_int8)

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

    @torch.inference_mode()
    def forward_rows(
        self,
        rows: Sequence[Sequence[int]],
        cache: KVCache,
        prompt: bool | None = None,
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Run each row's tokens after what `cache` holds for that row (one row per cached
        sequence, all the same length); return each row's last logits, (B, V), or with
        `all_rows` every position's, (B, T, V) (a prompt's own logprobs). `prompt`:
        the tokens are a prompt's (a one-token chunk of a prompt too: it takes the prompt's
        numerics, kvlm.model.layers.feeding_prompt); None: more than one token per row.

        The cache commits the tokens only if the whole forward succeeded.
        """
        if len(rows) != cache.batch or len({len(r) for r in rows}) != 1:
            raise ValueError(f"need {cache.batch} rows of one length, got {[len(r) for r in rows]}")
        one = len(rows[0]) == 1 and not all_rows
        if one and not prompt and self.graphs and self.graphs.accepts(cache):
            return self.graphs.step([r[0] for r in rows], cache)
        if one and self._decodes_alike(prompt) and (decoder := self.fused_for(cache)):
            return decoder.step([r[0] for r in rows], cache)
        step = cache.begin(len(rows[0]))  # raises on overflow before any write
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        with self.model.step_context(ids.numel()):
            logits = self.model(ids, step.positions, step, last_only=not all_rows, prompt=prompt)
        cache.commit(step)
        return logits if all_rows else logits[:, -1]

    @torch.inference_mode()
    def forward_draft(self, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One sequence's last token and its draft (speculative decoding on a single
        stream) as len(tokens) decode rows at consecutive positions, each computing what
        decoding its token alone would (the fused step's rows, or the torch step's rows
        over their own keys): logits (n, V). The cache commits all n; the caller rolls back
        what it rejects. A contiguous or paged cache of one sequence."""
        kinds = (ContiguousCache, PagedCache, BasicCache, WindowCache)
        if cache.batch != 1 or not isinstance(cache, kinds):
            raise InvalidRequestError(
                f"a draft is checked on a contiguous, paged, basic or window cache of one "
                f"sequence, not {cache.mode} ({cache.batch} rows)"
            )
        if isinstance(cache, (BasicCache, WindowCache)):  # steps that stage: the step itself
            if cache.would_overflow(len(tokens)):
                cache.begin(len(tokens))  # raises, with the cache's own message
            kind = BasicDraftRowsStep if isinstance(cache, BasicCache) else WindowDraftRowsStep
            step = kind(cache, len(tokens))
        else:
            step = cache.begin(len(tokens))  # raises on overflow (paged: allocates)
        starts = [step.start + i for i in range(len(tokens))]
        decoder = self.fused_for(cache)
        if decoder is not None:
            logits = decoder.step_rows(tokens, cache, starts)
        else:
            if isinstance(cache, PagedCache):
                n = len(tokens)
                rows = TableStep(cache.pool, cache.spec, [cache.tables[0]] * n, starts, 1)
            elif isinstance(cache, (BasicCache, WindowCache)):
                rows = step
            else:
                rows = DraftRowsStep(cache, len(tokens))
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
            with self.model.step_context(len(tokens)):
                logits = self.model(ids, rows.positions, rows, prompt=False)[:, -1]
        cache.commit(step)
        return logits

    @torch.inference_mode()
    def forward_table(
        self,
        pool: BlockPool,
        spec: CacheSpec,
        rows: Sequence[Sequence[int]],
        tables: Sequence[list[int]],
        starts: Sequence[int],
        prompt: bool | None = None,
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Sequences of different lengths in one pool (the scheduler's batch): row b feeds
        its tokens at positions starts[b].. through block table tables[b]. Every row has the
        same number of tokens. Returns each row's last logits, (B, V), or with `all_rows`
        every position's, (B, T, V) (a prompt's own logprobs).

        One token per row (the decode batch) is one call of the fused step when it applies,
        or on a GPU one replay of a captured step."""
        one = len(rows[0]) == 1 and not prompt and not all_rows
        if one and self.graphs and pool.scratch is not None and self.graphs.reads(pool.store):
            tokens = [r[0] for r in rows]
            out = self.graphs.step_table(
                pool.store, pool.scratch, tokens, tables, starts, spec.sliding_window
            )
            if out is not None:
                return out
        if (
            len(rows[0]) == 1 and len(rows) <= fused.MAX_ROWS and self._decodes_alike(prompt)
            and not all_rows
        ):  # fmt: skip
            decoder = self._decoder(spec.max_tokens)
            if decoder is not None and decoder.reads(pool.store):
                tokens = [r[0] for r in rows]
                return decoder.step_table(pool, tokens, tables, starts, spec.sliding_window)
        step = TableStep(pool, spec, list(tables), list(starts), len(rows[0]))
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        with self.model.step_context(ids.numel()):
            logits = self.model(ids, step.positions, step, last_only=not all_rows, prompt=prompt)
        return logits if all_rows else logits[:, -1]

    def forward(self, token_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One sequence: its last logits, (V,)."""
        return self.forward_rows([token_ids], cache)[0]

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int], cache: KVCache) -> torch.Tensor:
        """Teacher-forced logits for every position, (T, V): the reference tests' view."""
        step = cache.begin(len(token_ids))
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(ids, step.positions, step, last_only=False)
        cache.commit(step)
        return out[0]
