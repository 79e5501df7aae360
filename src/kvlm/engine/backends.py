"""Where an engine keeps K/V: the paged pool (many sequences, block tables, the prefix
cache, the tiers) or one cache of any mode (off, basic, contiguous, paged, int8, window)
holding one request's sequence, n of them after a fan-out.

The engine's step is the same over both: the scheduler admits through the backend's
`manager` (allocate, append_slot, seal, trim, fork, free; kvlm.cache.prefix.BlockManager's
interface) and the engine runs a step's forwards through `forward` (its prompt chunks
and its decode rows; what comes back: StepLogits).

    PoolBackend:  BlockManager over a BlockPool; ModelRunner.run(PoolBatch(...)), a
                  step's chunks and decode rows in one MixedBatch on a GPU
    CacheBackend: one KVCache; ModelRunner.run(CacheBatch(...)), a draft's DraftBatch

One cache admits one request at a time. Its rows decode in lockstep (the cache's rows all
grow together): a sample that finished keeps feeding its last token, and its row's output
is never read. A cache that keeps nothing (`off`) is fed every row's whole sequence at
each forward: the backend feeds what the cache does not hold, whatever the mode.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvlm.cache import KVCache
from kvlm.cache.base import blocks_for
from kvlm.cache.paged import BlockPool
from kvlm.cache.prefix import BlockManager, BlockTable, PrefixStats
from kvlm.engine.runner import CacheBatch, DraftBatch, MixedBatch, ModelRunner, PoolBatch
from kvlm.engine.sequence import Sequence
from kvlm.errors import CacheOverflowError, InvalidRequestError

log = logging.getLogger("kvlm.engine")

# What decode() gives per sequence: its logits (rows, V) or the exception its forward raised
Result = torch.Tensor | Exception


class PoolBackend:
    """Many sequences on one paged pool, each through its own block table."""

    def __init__(self, runner: ModelRunner, manager: BlockManager, spec) -> None:
        self.runner = runner
        self.manager = manager
        self.pool: BlockPool = manager.pool
        self.spec = spec
        self.drafts = True  # speculative rows on each sequence's own table
        # the latest decode's rows' states per sequence (runner.keep_hidden; each_piece)
        self.decoded_hidden: list[torch.Tensor | None] = []

    def check(self, prompt_ids: list[int], n: int, reserve: int) -> None:
        need = blocks_for(len(prompt_ids), self.pool.block_size) + n - 1
        if need + reserve > self.pool.num_blocks:
            raise InvalidRequestError(
                f"the prompt and n = {n} samples need {need} KV blocks; the pool has "
                f"{self.pool.num_blocks} (raise --kv-memory or lower n)",
                param="n",
            )

    def forward(self, chunks: list[Chunk], seqs: list[Sequence]) -> StepLogits:
        """A step: its prompt chunks and its decode rows. With no chunk, the decode batch
        (CUDA graphs, the fused step); where the runner takes ragged steps (a GPU), one
        mixed batch; else a forward per chunk and one for the decode rows. A mixed batch
        that raises is run again piece by piece, so the request that raised fails alone."""
        if not chunks or not self.runner.ragged_steps():
            return each_piece(self, chunks, seqs)
        rows, tables, starts, spans = self._rows(seqs)
        k, d = len(chunks), len(rows)
        blocks, windowed = self._where([c.seq.table for c in chunks] + tables)
        mixed = MixedBatch(
            [c.tokens for c in chunks] + rows, self.pool, self.spec, blocks,
            [c.seq.num_computed for c in chunks] + starts, windowed,
            every_row=[c.all_rows for c in chunks] + [False] * d,
        )  # fmt: skip
        try:
            out = self.runner.run(mixed)
        except Exception:
            log.warning("a step of %d rows failed; running it piece by piece", k + d,
                        exc_info=True)  # fmt: skip
            return each_piece(self, chunks, seqs)
        decoded = [torch.stack(out[k + a : k + b]) for a, b in spans]
        firsts = [o[-1] if c.all_rows else o for o, c in zip(out, chunks, strict=False)]
        firsts += [x[0] for x in decoded]
        argmax = _argmax(firsts, range(len(firsts)))
        result = StepLogits(out[:k], argmax[:k], decoded, argmax[k:])
        if self.runner.keep_hidden and self.runner.hidden is not None:
            h, at = self.runner.hidden, 0  # the chunks' rows, then a row a decode row
            result.prefill_hidden = []
            for c in chunks:
                result.prefill_hidden.append(h[at : at + len(c.tokens)])
                at += len(c.tokens)
            result.decode_hidden = [h[at + a : at + b] for a, b in spans]
        return result

    def prefill(self, seq: Sequence, tokens: list[int], all_rows: bool) -> torch.Tensor:
        """A chunk of a sequence's prompt: its last logits (V,), or every row's (T, V)."""
        return self._run([tokens], [seq.table], [seq.num_computed], prompt=True,
                         all_rows=all_rows)[0]  # fmt: skip

    def _run(
        self,
        rows: list,
        tables: list[BlockTable],
        starts: list,
        prompt: bool | None = None,
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Rows on the pool, row b at starts[b] through tables[b] (a sequence's BlockTable:
        its table of each layer group)."""
        blocks, windowed = self._where(tables)
        batch = PoolBatch(rows, self.pool, self.spec, blocks, starts, windowed, prompt, all_rows)
        return self.runner.run(batch)

    def _where(self, tables: list[BlockTable]) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Rows' block tables as a batch on the pool takes them: group 0's, and each other
        layer group's (windowed[g - 1][b]: a window's blocks, a conv group's slot)."""
        windowed = [[t.others[g] for t in tables] for g in range(len(self.pool.groups) - 1)]
        return [t.blocks for t in tables], windowed

    @staticmethod
    def _rows(seqs: list[Sequence]) -> tuple[list, list, list, list[tuple[int, int]]]:
        """One row per sequence (its last token) and one per draft token after it, at the
        next positions on the same block table: (rows, tables, starts, each sequence's
        span of rows)."""
        rows: list[list[int]] = []
        tables: list[BlockTable] = []
        starts: list[int] = []
        spans = []
        for s in seqs:
            first = len(rows)
            for i, token in enumerate([s.token_ids[-1], *s.draft]):
                rows.append([token])
                tables.append(s.table)
                starts.append(s.num_computed + i)
            spans.append((first, len(rows)))
        return rows, tables, starts, spans

    def decode(self, seqs: list[Sequence]) -> tuple[list[Result], list[int | None]]:
        """The decode rows (`_rows`) in one forward. A batch that raises is run again
        sequence by sequence, so the one that raised fails alone. Returns each sequence's
        logits and, on a GPU, its first row's argmax (one transfer for all)."""
        rows, tables, starts, spans = self._rows(seqs)
        h = None
        try:
            out = self._run(rows, tables, starts)
            h = self.runner.hidden
        except Exception:
            log.warning("a decode batch of %d rows failed; running them one by one", len(rows),
                        exc_info=True)  # fmt: skip
        else:
            self.decoded_hidden = [None if h is None else h[a:b] for a, b in spans]
            return [out[a:b] for a, b in spans], _argmax(out, [a for a, _ in spans])
        results, self.decoded_hidden = [], []
        for a, b in spans:
            results.append(_tried(self._run, rows[a:b], tables[a:b], starts[a:b]))
            h = self.runner.hidden
            ok = h is not None and not isinstance(results[-1], Exception)
            self.decoded_hidden.append(h if ok else None)
        return results, [None] * len(seqs)


def each_piece(backend: PoolBackend | CacheBackend, chunks: list[Chunk], seqs: list) -> StepLogits:
    """A step as a forward per chunk and one for the decode rows, each chunk's failure
    its own."""
    runner, prefilled, hidden = backend.runner, [], []
    for c in chunks:
        prefilled.append(_tried(backend.prefill, c.seq, c.tokens, c.all_rows))
        rows = runner.hidden if runner.keep_hidden else None  # the chunk's rows: its last n
        hidden.append(None if rows is None or isinstance(prefilled[-1], Exception)
                      else rows[-len(c.tokens) :])  # fmt: skip
    decoded, hints = backend.decode(seqs) if seqs else ([], [])
    out = StepLogits(prefilled, [None] * len(chunks), decoded, hints)
    if runner.keep_hidden:
        out.prefill_hidden, out.decode_hidden = hidden, backend.decoded_hidden if seqs else []
    return out


def _tried(fn: Callable[..., torch.Tensor], *args) -> Result:
    """fn(*args), or the exception it raised (a piece's failure is its own)."""
    try:
        return fn(*args)
    except Exception as exc:
        return exc


def _argmax(logits: torch.Tensor | list[torch.Tensor], rows: Seq[int]) -> list[int | None]:
    """The argmax of logits[r] for each r in `rows` on a GPU, in one transfer for all (a
    greedy sample takes it instead of waiting on the device again); None on the CPU, where
    it costs nothing. `logits`: a (B, V) tensor, or a list of (V,) rows."""
    if not len(logits) or not logits[0].is_cuda:
        return [None] * len(rows)
    best = (torch.stack(logits) if isinstance(logits, list) else logits).argmax(-1).tolist()
    return [best[r] for r in rows]


@dataclass(slots=True)
class Chunk:
    """A prompt chunk of a step: the sequence, the tokens it feeds from num_computed, and
    whether every position's logits come back (prompt_logprobs)."""

    seq: Sequence
    tokens: list[int]
    all_rows: bool = False


@dataclass(slots=True)
class StepLogits:
    """What a step's forward gave: each chunk's logits (or the exception it raised) and
    its last row's argmax where known, and the same for each decoding sequence."""

    prefilled: list[Result]
    prefill_argmax: list[int | None]
    decoded: list[Result]
    decode_argmax: list[int | None]
    # with the runner's keep_hidden (an MTP drafter): each chunk's rows' final-normed
    # states (n, H) and each decoding sequence's (its last token and draft rows); None
    # where a piece had none (it failed, or its road keeps none)
    prefill_hidden: list[torch.Tensor | None] | None = None
    decode_hidden: list[torch.Tensor | None] | None = None


class CacheManager:
    """The scheduler's view of one cache: one request at a time, its sequence in row 0,
    the samples it forks into in rows 1.. (the cache forks when they first decode).

    `reuse`: a request starts from what the cache holds (a conversation's earlier turns;
    the caller rolls the cache back to the prefix its prompt shares), if it carries the
    `cache_salt` the held prefix was computed under. Else the cache is emptied for every
    request."""

    block_size = 1  # the scheduler's unit of growth: a token

    def __init__(self, cache: KVCache, reuse: bool) -> None:
        self.cache = cache
        self.reuse = reuse
        self.rows = 0  # rows handed out to the running request (0: the cache is free)
        self.live = 0  # of those, not freed yet
        self.salt: str | None = None  # the cache_salt of the request whose K/V it holds
        self.stats = PrefixStats()

    def start_fetch(self, tokens: Seq[int], salt: str | None = None) -> None:
        return None  # no tiers below one cache

    def can_admit(self, tokens: Seq[int], reserve: int = 0, salt=None, reuse=True) -> bool:
        return self.live == 0

    def allocate(
        self, tokens: Seq[int], salt=None, reuse: bool = True, turn_start: int | None = None
    ) -> tuple[BlockTable, int]:
        cache = self.cache
        back = cache.num_tokens - len(tokens) + 1  # the last token is fed
        if not (self.reuse and reuse) or cache.batch != 1 or salt != self.salt:
            cache.free()  # one empty sequence (a fork may have left n)
        elif back > 0 and not cache.can_roll_back(back):
            cache.free()  # a ring has let go of what the prompt's end reads: start over
        elif back > 0:
            cache.rollback(back)
        self.salt = salt
        self.rows = self.live = 1
        if turn_start is not None:  # a state that cannot forget keeps its value there
            cache.checkpoint(turn_start)
        cached = cache.num_tokens if cache.mode != "off" else 0
        self.stats.queries += len(tokens)
        self.stats.hits += cached
        return BlockTable([0]), cached

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        return True  # the engine ends a sequence at the cache's capacity ("length")

    def append_slot(self, table: BlockTable, num_tokens: int) -> None:
        pass

    def prepare(self, table: BlockTable, start: int, n: int) -> None:
        pass  # the cache makes room in begin()

    def seal(self, table: BlockTable, tokens: Seq[int], num_computed: int) -> None:
        pass

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Roll back a rejected draft (one sequence: the cache's one row)."""
        self.cache.rollback(self.cache.num_tokens - num_tokens)

    def fork(self, table: BlockTable) -> BlockTable:
        self.rows += 1
        self.live += 1
        return BlockTable([self.rows - 1])

    def free(self, table: BlockTable) -> None:
        if table.blocks:
            table.blocks.clear()
            self.live -= 1


class CacheBackend:
    """One request at a time on one cache (LLM.stream's single stream, and a conversation's
    turns), through the same engine step as the pool's."""

    def __init__(self, runner: ModelRunner, cache: KVCache, reuse: bool = False) -> None:
        self.runner = runner
        self.cache = cache
        self.manager = CacheManager(cache, reuse)
        self.pool = None
        self._rows: dict[int, Sequence] = {}  # row -> the sequence decoding in it
        self._done: dict[int, list[int]] = {}  # row -> a finished sample's fed tokens
        self.decoded_hidden: list[torch.Tensor | None] = []  # as PoolBackend's

    @property
    def drafts(self) -> bool:
        """Speculative rows only for one sequence (its draft rolls back through the
        cache); n samples decode in lockstep."""
        return self.manager.rows == 1

    def check(self, prompt_ids: list[int], n: int, reserve: int) -> None:
        if len(prompt_ids) > self.cache.capacity:
            raise CacheOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the cache holds at most "
                f"{self.cache.capacity} (raise --max-context, up to the model's limit)"
            )

    def forward(self, chunks: list[Chunk], seqs: list[Sequence]) -> StepLogits:
        """A step: its prompt's chunk or its samples' decode rows (one request at a time)."""
        return each_piece(self, chunks, seqs)

    def prefill(self, seq: Sequence, tokens: list[int], all_rows: bool) -> torch.Tensor:
        if self.manager.rows == 1:
            self._rows = {0: seq}
            self._done = {}
        held = self.cache.num_tokens
        fed = seq.token_ids[held : seq.num_computed + len(tokens)]  # off: from the start
        batch = CacheBatch([fed], self.cache, prompt=True, all_rows=all_rows)
        logits = self.runner.run(batch)
        return logits[0, -len(tokens) :] if all_rows else logits[0]

    def decode(self, seqs: list[Sequence]) -> tuple[list[Result], list[int | None]]:
        cache, hints = self.cache, [None] * len(seqs)
        self.decoded_hidden = [None] * len(seqs)
        try:
            if len(seqs) == 1 and seqs[0].draft:  # one sequence, its last token and draft
                s = seqs[0]
                out = self.runner.run(DraftBatch([s.token_ids[-1], *s.draft], cache))
                self.decoded_hidden = [self.runner.hidden]
                return [out], hints
            rows = self._lockstep(seqs)
            out = self.runner.run(CacheBatch(rows, cache, prompt=False))
            h = self.runner.hidden  # a row of the cache a row: its last token's
            if h is not None:
                per_row = h.reshape(cache.batch, -1, h.shape[-1])[:, -1]
                self.decoded_hidden = [per_row[s.table.blocks[0]][None] for s in seqs]
            return [out[s.table.blocks[0]][None] for s in seqs], hints
        except Exception as exc:  # one request holds the cache: it fails whole
            return [exc] * len(seqs), hints

    def _lockstep(self, seqs: list[Sequence]) -> list[list[int]]:
        """Every row of the cache, one more token each: a live sample's, or a finished
        sample's last one again (its output is never read)."""
        live = {s.table.blocks[0]: s for s in seqs}
        end = seqs[0].num_computed + 1
        for row, s in self._rows.items():
            if row not in live and row not in self._done:
                self._done[row] = list(s.token_ids)  # its last token, never fed
        self._rows.update(live)
        if self.cache.batch < self.manager.rows:
            self.cache.fork(self.manager.rows)
        held, rows = self.cache.num_tokens, []
        for row in range(self.cache.batch):
            if row in live:
                rows.append(live[row].token_ids[held:end])
                continue
            done = self._done[row]
            done += [done[-1]] * (end - len(done))
            rows.append(done[held:end])
        return rows


def cache_engine_limits(cache: KVCache, prefill_chunk: int | None) -> dict[str, int]:
    """SchedulerConfig for an engine on one cache: a prompt in `prefill_chunk` pieces from
    where the cache stands (whole when None; always whole for `off`, which keeps nothing
    between forwards), samples as many as a request asks (up to MAX_SAMPLES)."""
    chunk = prefill_chunk if prefill_chunk and cache.mode != "off" else sys.maxsize
    return {"max_num_seqs": MAX_SAMPLES, "prefill_chunk": chunk, "max_waiting": MAX_SAMPLES}


MAX_SAMPLES = 256  # n of one request on one cache (its rows decode in lockstep)
