"""Engine: many requests at once on one paged pool (continuous batching).

    add_request() -> scheduler.waiting
    step():  plan = scheduler.schedule()
             the prompt chunks and the decode rows, in one call to the backend: one
             ragged forward on a GPU; on the CPU one per chunk and one for the decode
             rows -> sample -> StepOutput events
             finished sequences free their blocks (full ones stay in the prefix cache)

A request with n > 1 samples prefills once; when its prompt is done the sequence is forked
into n that share its blocks, and each samples its own first token from the same logits.

The engine is single-threaded: kvlm.engine.async_engine drives it from a thread of its own
and carries requests in and events out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvlm.cache import KVCache
from kvlm.cache.base import CacheSpec, blocks_for
from kvlm.cache.conv import ConvSlots
from kvlm.cache.factory import pool_mode
from kvlm.cache.groups import layer_groups as spec_groups
from kvlm.cache.kinds import CONV_ROW_DTYPE, STATE_KINDS, RecurrentState, shown
from kvlm.cache.paged import BlockPool, window_blocks
from kvlm.cache.prefix import BlockManager, check_salt
from kvlm.cache.recurrent import StateSlots
from kvlm.cache.storage import part_layout
from kvlm.cache.tier_key import load_tier_key
from kvlm.cache.tiers import KVTiers, namespace, parse_tier
from kvlm.cache.view import block_map, layer_groups
from kvlm.engine.backends import CacheBackend, Chunk, PoolBackend
from kvlm.engine.guided import compile_guide
from kvlm.engine.metrics import GC_TIME, EngineStats
from kvlm.engine.pacing import Pacing, Work
from kvlm.engine.request import SampleState, check_prompt, stop_token_ids
from kvlm.engine.sampling import Sampler, SamplingParams, TokenLogprob, prompt_logprobs
from kvlm.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig, StepPlan
from kvlm.engine.sequence import Sequence, Status
from kvlm.engine.speculative import (
    DraftModel,
    MtpDrafter,
    SpeculativeConfig,
    check_mtp,
    propose_ngram,
)
from kvlm.engine.threads import ThreadTuner
from kvlm.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvlm.config import ModelConfig
    from kvlm.engine.served import ServedModel
    from kvlm.loading.tokenizer import Tokenizer

log = logging.getLogger("kvlm.engine")


# A step with nothing to run while a request waits for a tier lookup, or a guided one for
# its mask, waits for them this long at most, then returns (the caller takes new requests
# and aborts in between)
IDLE_WAIT_S = 0.05
SLOW_STEP_S = 1.0  # a longer step than any before it is logged (with what it held)
GPU_MEMORY_SHARE = 0.9  # of a GPU's free memory, for the pool by default (vLLM's default)
# of the KV memory, for the snapshots of a recurrent state at block ends (what a prefix hit
# on a hybrid model resumes from) by default: LightLLM's --mamba_cache_ratio and SGLang's
# --mamba-full-memory-ratio size the same store as a share of theirs
SNAPSHOT_SHARE = 0.25


def default_kv_memory(device: torch.device, free: int | None = None) -> int:
    """The pool's default size: 1 GiB on the CPU; on a GPU, GPU_MEMORY_SHARE of its free
    memory (`free`: cudaMemGetInfo's, read now when None), the model already loaded."""
    if device.type != "cuda":
        return 1 << 30
    if free is None:
        free = int(torch.cuda.mem_get_info(device)[0])
    return int(free * GPU_MEMORY_SHARE)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    num_blocks: int | None = None  # pool size; None: as many as kv_memory holds, at most
    # max_num_seqs full contexts. Blocks are committed when first used, so the resident
    # memory grows to this as the prefix cache fills and then stays.
    kv_memory: int | None = None  # None: default_kv_memory(device)
    prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # kvlm.engine.speculative
    # KV tiers below the pool (kvlm.cache.tiers): "disk:PATH[:SIZE]", "redis://HOST:PORT"
    kv_tiers: tuple[str, ...] = ()
    # the file of the key that signs tier records (kvlm.cache.tier_key); None: the default
    kv_tier_key: str | None = None
    # a hybrid model's snapshots of its recurrent state at block ends take at most this
    # share of kv_memory (and one a block at most): snapshot_plan
    snapshot_share: float = SNAPSHOT_SHARE

    def __post_init__(self) -> None:
        if not 0.0 <= self.snapshot_share < 1.0:
            share = self.snapshot_share
            raise InvalidRequestError(f"--snapshot-share (the snapshots' share of the KV "
                                      f"memory) must be in [0, 1), not {share}")  # fmt: skip


def pool_spec(llm: ServedModel) -> CacheSpec:
    """The pool's cache spec: the LLM's K/V storage in its mode's pool (--kv int8 stores
    int8 whatever --kv-dtype says: kvlm.cache.factory.pool_mode). Every layer kind has a
    store in the pool (a state kind's slots: kvlm.cache.slots)."""
    return llm.cache_spec(pool_mode(llm.kv_mode))


class PoolPlan(NamedTuple):
    """What a hybrid model's pool holds beside group 0's blocks (windowed_plan)."""

    step: int  # the most tokens one step feeds a sequence
    blocks: list[int]  # each layer group's after group 0: blocks, or slots of a state kind
    nbytes: int  # theirs together, and the snapshots'
    snapshots: int  # of each recurrent group's state at block ends (snapshot_plan)


def snapshot_plan(config: EngineConfig, spec: CacheSpec, context: int) -> int:
    """How many snapshots of the state at block ends the pool keeps for prefix hits on a
    model with recurrent layers: as many as config.snapshot_share of the KV memory holds
    (a snapshot being every recurrent group's state at one block end), at most one for
    each block the pool can have (max_num_seqs full contexts): a snapshot sits at a
    block's end. 0 without the prefix cache or a recurrent group. Fewer than the running
    sequences take (a prompt's and an answer's each) only means fewer hits: a step that
    finds every snapshot held takes none (kvlm.cache.recurrent.StateSlots.take)."""
    groups = spec_groups(spec)[1:]
    each = sum(g.snapshot_bytes(spec) for g in groups if isinstance(g.kind, RecurrentState))
    if not each or not config.prefix_caching:
        return 0
    kv_memory = config.kv_memory or default_kv_memory(spec.device)
    most = blocks_for(context, spec.block_size) * config.scheduler.max_num_seqs
    return min(int(kv_memory * config.snapshot_share) // each, most)


def windowed_plan(config: EngineConfig, spec: CacheSpec, context: int) -> PoolPlan:
    """A hybrid model's pool (kvlm.cache.paged): the most tokens one step feeds a
    sequence (a prefill chunk, a draft and its token), the blocks of each layer group
    after group 0 (each window's: each of max_num_seqs sequences at its most,
    window_blocks: never short of them; a conv or DeltaNet group's: a slot of state for
    each of max_num_seqs sequences, kvlm.cache.slots), the snapshots of a recurrent
    group's state at block ends (snapshot_plan) and the bytes of all these together;
    (step tokens, [], 0, 0) for a model of one group."""
    sched, spec_cfg = config.scheduler, config.speculative
    chunk = min(sched.prefill_chunk, sched.chunk_size or sched.prefill_chunk)
    step = min(context, max(chunk, 1 + (spec_cfg.num_draft if spec_cfg else 0)))
    bs, blocks, nbytes = spec.block_size, [], 0
    snapshots = snapshot_plan(config, spec, context)
    for group in spec_groups(spec)[1:]:
        if isinstance(group.kind, STATE_KINDS):  # a slot a sequence (its seats: max_num_seqs)
            blocks.append(sched.max_num_seqs)
            nbytes += blocks[-1] * group.sequence_bytes(spec)
            if isinstance(group.kind, RecurrentState):
                nbytes += snapshots * group.snapshot_bytes(spec)
            continue
        per_seq = min(blocks_for(context, bs), window_blocks(group.kind.keep, bs, step))
        blocks.append(per_seq * sched.max_num_seqs + sched.reserve_blocks)
        nbytes += blocks[-1] * bs * group.token_bytes(spec)
    return PoolPlan(step, blocks, nbytes, snapshots)


def block_bytes(config: EngineConfig, spec: CacheSpec) -> int:
    """What each block of group 0 costs in the pool: its K/V, and with the prefix cache a
    conv group's end rows of it (ConvSlots: what a hit at its end restores)."""
    groups = spec_groups(spec)
    nbytes = spec.block_size * groups[0].token_bytes(spec)
    return nbytes + (sum(g.end_bytes(spec) for g in groups) if config.prefix_caching else 0)


def memory_blocks(config: EngineConfig, spec: CacheSpec, context: int) -> int:
    """The blocks (of the layers that see the whole context) the KV memory holds once a
    hybrid model's other groups have their own: the pool's size by default. Where those
    groups alone fill the budget (a recurrent state of many MiB a sequence, times
    max_num_seqs: a large hybrid's at 16 seats), the default budget
    (default_kv_memory) is group 0's alone, the groups' own stores beside it (the pool
    had fallen back to one context's blocks and `kvlm serve`'s default context to one
    block); a --kv-memory the user gave is kept, and one clear error says what to
    change."""
    plan = windowed_plan(config, spec, context)
    kv_memory = config.kv_memory or default_kv_memory(spec.device)
    blocks = (kv_memory - plan.nbytes) // block_bytes(config, spec)
    if config.kv_memory is None and blocks < 1:
        return kv_memory // block_bytes(config, spec)
    if blocks < 1:
        seats = config.scheduler.max_num_seqs
        raise InvalidRequestError(
            f"--kv-memory {kv_memory / 2**20:,.0f} MiB cannot hold the layers' own stores "
            f"of {seats} sequences (their windows, recurrent states and snapshots: "
            f"{plan.nbytes / 2**20:,.0f} MiB) and any K/V block: raise --kv-memory, or "
            "lower --max-num-seqs or --snapshot-share"
        )
    return blocks


def pool_context(llm: ServedModel, config: EngineConfig, context: int) -> int:
    """The most of `context` tokens one sequence can hold in the pool `config` makes
    (--kv-blocks, else the blocks --kv-memory holds), less the blocks the scheduler keeps
    free at admission, in whole blocks: `kvlm serve`'s default context, the model's
    trained one as far as the pool holds it. At least one block (a pool short of even
    that is the engine's error)."""
    spec = pool_spec(llm)
    blocks = config.num_blocks or memory_blocks(config, spec, context)
    fits = (blocks - config.scheduler.reserve_blocks) * spec.block_size
    return max(spec.block_size, min(context, fits))


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What an engine's callers may know of it (the server's routes, its start line): they
    read this record, not the engine's attributes."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int  # prompt and completion together
    max_num_seqs: int  # sequences decoded together
    numerics: str  # the weight and activation formats, as the server's fingerprint names them
    kv: str  # the K/V storage: the pool's blocks and bytes, or the one cache's mode
    config: ModelConfig  # the architecture and its shapes (Ollama's /api/show reads them)
    weight_bytes: int = 0  # the weights' bytes in memory
    weight_bytes_gpu: int = 0  # of those, on a GPU

    @property
    def keeps_turns(self) -> bool:
        """Whether the model keeps a state that cannot forget tokens (recurrent layers:
        gated DeltaNet, Mamba2): a chat request's turn start (Engine.add_request) tells it
        where to keep it."""
        return bool(self.config.recurrent_layers)


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one sample of a request."""

    request_id: str
    index: int
    text: str  # text that became safe to show (stop strings are held back until decided)
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # with params.prompt_logprobs, on a sample's first event: one entry per prompt token,
    # None for the first (nothing before it to predict it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | None = None  # the stop string that ended the sample (vLLM's)


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    cache_salt: str | None = None
    turn_start: int | None = None
    seqs: list[Sequence] = field(default_factory=list)
    first_token: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by the prefill

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)


class Engine:
    def __init__(
        self,
        llm: ServedModel,
        config: EngineConfig | None = None,
        cache: KVCache | None = None,
        reuse: bool = False,
    ) -> None:
        """The paged pool of `config`, or with `cache` one cache of any mode that holds one
        request at a time (kvlm.engine.backends; `reuse`: a request starts from the prefix
        the cache holds, a conversation's). `llm`: the model served (an LLM)."""
        self.llm = llm
        self.config = config or EngineConfig()
        self.tokenizer = llm.tokenizer
        self.runner = llm.runner
        sched = self.config.scheduler
        if cache is None:
            self.backend = self._pool_backend(llm)
            self.max_model_len = llm.max_context
            p = self.pool
            kv = f"KV pool {p.num_blocks} blocks of {p.block_size} tokens, "
            for w in p.groups[1:]:  # a block table per layer group (kvlm.cache.paged)
                if isinstance(w, ConvSlots):
                    kv += f"{w.num_blocks} slots of the conv layers' rows, "
                elif isinstance(w, StateSlots):
                    kv += (f"{w.num_blocks} slots of the recurrent layers' state and "
                           f"{w.snap_state.shape[1]} snapshots of it, ")  # fmt: skip
                else:
                    kv += f"{w.num_blocks} for the layers with a window of {w.window}, "
            kv += f"{p.total_nbytes / 2**20:,.0f} MiB"
        else:
            self.backend = CacheBackend(self.runner, cache, reuse)
            self.max_model_len = cache.capacity
            self.pool, self.spec, self.tiers = None, cache.spec, None
            kv = f"one {cache.mode} cache"
        self.manager = self.backend.manager
        self.scheduler = Scheduler(self.manager, sched, self.max_model_len, cache is not None)
        self.pacing = Pacing(llm.config, sched.step_time) if sched.step_time else None
        self.scheduler.pacing = self.pacing
        self.work = self.pacing or Work(llm.config)
        # the CPU threads a step runs on: the user's, or measured (kvlm.engine.threads)
        self.tuner, self._threads, self._threads_set = None, llm.threads, None
        if self.runner.device.type == "cpu" and llm.threads is None:
            self.tuner = ThreadTuner(torch.get_num_threads(), free=llm.free_cores)
        self._idle = True  # nothing has run since the last step that left no work
        self.drafter: DraftModel | MtpDrafter | None = None
        spec = self.config.speculative
        if spec is not None:
            self.scheduler.propose = self._propose
            if spec.method == "draft":
                self.drafter = llm.draft_model(spec)
            elif spec.method == "mtp":
                check_mtp(llm.model)
                vocab = llm.config.vocab_size
                self.drafter = MtpDrafter(llm.model, self.max_model_len, vocab)
        self.info = ModelInfo(self.tokenizer, llm.config.vocab_size, self.max_model_len,
                              sched.max_num_seqs, str(llm.numerics), kv, llm.config,
                              *_weight_bytes(llm.model))  # fmt: skip
        self.requests: dict[str, _Request] = {}
        # blocks held for stored conversations (the Responses API), oldest first
        self.pins: OrderedDict[str, list[list[int]]] = OrderedDict()
        self.pin_until: dict[str, float] = {}  # a pin with a life: when it is let go
        self.stats = EngineStats()
        self.last_plan: StepPlan | None = None  # what the latest step ran
        GC_TIME.watch()  # a slow step's log line says how much of it was collection

    @property
    def mtp(self) -> MtpDrafter | None:
        """The drafter fed the model's states (--speculative mtp), or None."""
        return self.drafter if isinstance(self.drafter, MtpDrafter) else None

    def _pool_backend(self, llm: ServedModel) -> PoolBackend:
        spec, sched = pool_spec(llm), self.config.scheduler
        bs = spec.block_size
        least = blocks_for(llm.max_context, bs) + sched.reserve_blocks
        plan = windowed_plan(self.config, spec, llm.max_context)
        # at most max_num_seqs full contexts (and the reserve beside them: with one
        # sequence, the cap was one block short of `least`, and the engine refused to start)
        num_blocks = self.config.num_blocks or min(
            blocks_for(llm.max_context, bs) * sched.max_num_seqs + sched.reserve_blocks,
            max(least, memory_blocks(self.config, spec, llm.max_context)),
        )
        if num_blocks < least:
            raise InvalidRequestError(
                f"{num_blocks} KV blocks cannot hold one sequence of the context limit "
                f"({llm.max_context} tokens needs {least} blocks of {bs})"
            )
        pool = BlockPool(spec, num_blocks, group_blocks=plan.blocks,
                         end_rows=self.config.prefix_caching, snapshots=plan.snapshots)  # fmt: skip
        # Commit the whole pool now, as a GPU server reserves its memory at start: the
        # process's memory is what it will stay at, and a pool that does not fit fails here
        # rather than under load.
        for group in pool.groups:
            group.commit_memory()
        self.pool, self.spec = pool, spec
        self.tiers = self._tiers() if self.config.kv_tiers else None
        manager = BlockManager(pool, self.config.prefix_caching, self.tiers, plan.step)
        return PoolBackend(self.runner, manager, spec)

    def _tiers(self) -> KVTiers:
        """The KV tiers of config.kv_tiers, keyed to this model, its numerics and the
        pool's geometry (kvlm.cache.tiers); a hybrid pool's windowed layer groups each
        under a namespace of their own."""
        llm, spec = self.llm, self.spec
        numerics = llm.numerics
        layouts = []
        for g, group in enumerate(self.pool.groups):
            if isinstance(group, ConvSlots):  # a block's end rows, under group 0's namespace
                rows = (len(group.group.layers), group.kind.rows, group.kind.width)
                conv = namespace(layouts[0][0], "conv rows", g, list(group.group.layers), rows)
                layouts.append((conv, {"rows": (rows, CONV_ROW_DTYPE)}))
                continue
            if isinstance(group, StateSlots):  # the state at a block's end: a snapshot's
                parts = group.record_parts
                shapes = {k: (shape, str(dt)) for k, (shape, dt) in parts.items()}
                layers = list(group.group.layers)
                layouts.append((namespace(layouts[0][0], "deltanet state", g, layers, shapes),
                                parts))  # fmt: skip
                continue
            store = group.store
            # a block of the store's rows: its parts as the store keeps them (storage)
            block = (store.shape[0], 2, spec.num_kv_heads, spec.block_size, store.head_dim)
            parts = part_layout(block, store.k_dtype, store.v_dtype)
            ns = namespace(
                "kvlm/tiers/v2", llm.fingerprint, numerics.weights, numerics.activations,
                numerics.prefill_dtype, numerics.attention_bf16_from, llm.dtype,
                spec.device.type, spec.kv_format, block,
            )  # fmt: skip
            if g:  # a windowed group: which layers, which window
                ns = namespace(ns, "layer group", g, group.window, list(group.group.layers))
            layouts.append((ns, parts))
        key = load_tier_key(self.config.kv_tier_key)
        (ns, parts), *groups = layouts
        return KVTiers([parse_tier(t) for t in self.config.kv_tiers], ns, parts, key, groups)

    def close(self) -> None:
        """Finish the tiers' queued writes (a server stopping): at most CLOSE_FLUSH_S
        seconds (kvlm.cache.tiers), then the rest are dropped and counted."""
        if self.tiers is not None:
            self.tiers.close()

    # ------------------------------------------------------------------ requests

    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        """Raise InvalidRequestError for a request this engine can never run (one that
        would otherwise wait for admission forever)."""
        try:
            check_salt(cache_salt)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(str(exc), param="cache_salt") from None
        if self.pool is not None and len(prompt_ids) >= self.max_model_len:  # cheap first
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this server's context limit is "
                f"{self.max_model_len} tokens, prompt and completion together",
                param="prompt",
            )
        vocab = self.info.vocab_size
        check_prompt(prompt_ids, vocab)
        if params.guide is not None:  # a bad schema is this request's 400; compiled once,
            # by the caller off the engine thread (AsyncEngine.generate, LLM.generate):
            # here only where a library caller did not (then a no-op when done)
            params.guide = compile_guide(params.guide, self.tokenizer, vocab)
        for name in ("logit_bias", "stop_token_ids"):
            outside = [t for t in getattr(params, name) if not 0 <= t < vocab]
            if outside:
                raise InvalidRequestError(
                    f"{name} names token {outside[0]}, outside the vocabulary of {vocab} "
                    "tokens", param=name,
                )  # fmt: skip
        sched = self.scheduler.config
        if params.n > sched.max_num_seqs:
            raise InvalidRequestError(
                f"n = {params.n} samples exceed this server's {sched.max_num_seqs} sequences "
                "decoded together (--max-num-seqs)",
                param="n",
            )
        self.backend.check(prompt_ids, params.n, sched.reserve_blocks)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        checked: bool = False,
        turn_start: int | None = None,
    ) -> None:
        """Queue a request. `cache_salt` (vLLM's field): its prompt shares prefix-cache
        blocks only with requests of the same salt, so tenants keep their prefixes apart.
        `checked`: the caller ran check_request on these very arguments already, at its
        door (AsyncEngine.generate, LLM.generate): a request is checked once. `turn_start`:
        where a chat prompt's generation prompt begins (the next turn may part from it
        there): a DeltaNet state's prompt snapshot is taken at the last block end at most
        it (StateSlots.turn), a one-sequence cache keeps its state there."""
        if not checked:
            self.check_request(prompt_ids, params, cache_salt)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if turn_start is not None and not 0 < turn_start < len(prompt_ids):
            turn_start = None  # not within the prompt: no turn (a caller's slip, not the user's)
        req = _Request(request_id, list(prompt_ids), params, time.perf_counter(), cache_salt,
                       turn_start)  # fmt: skip
        seq = self._sequence(req, 0)
        seq.fan_out = params.n
        self.scheduler.add(seq)  # may raise QueueFullError: nothing is kept
        self.requests[request_id] = req
        self.stats.requests_added += 1

    def _sequence(self, req: _Request, index: int) -> Sequence:
        stops = stop_token_ids(req.params, self.tokenizer)
        sample = SampleState(index, req.prompt_ids, req.params, self.tokenizer, stops)
        sampler = Sampler(req.params, self.runner.device, index, req.prompt_ids,
                          self.tokenizer, stops)  # seeded seed + index  # fmt: skip
        seq = Sequence(
            req.request_id,
            sample,
            sampler,
            len(req.prompt_ids),
            cache_salt=req.cache_salt,
            turn_start=req.turn_start,
        )
        req.seqs.append(seq)
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> list[StepOutput]:
        """Stop a request now and free its blocks: one final event per sample, those not
        split off yet (the prompt was still prefilling) included, so a caller waiting for
        n finishes gets n."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        events = []
        for seq in req.seqs:
            if seq.sample.done:
                continue
            self.scheduler.finish(seq)
            seq.sample.out.finish_reason = reason
            events.append(self._event(req, seq, [], [], reason))
        for index in range(len(req.seqs), req.params.n):
            events.append(StepOutput(req.request_id, index, "", [], [], reason,
                                     prompt_tokens=len(req.prompt_ids)))  # fmt: skip
        if reason == "abort":
            self.stats.aborted += 1
        return events

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[StepOutput]:
        if self.pin_until:
            self._expire_pins()  # before the schedule may need their blocks
        plan = self.last_plan = self.scheduler.schedule()
        if not plan:  # nothing to run: maybe a tier lookup or a guide's mask is under way
            if blocked := self.scheduler.blocked_on():
                wait(blocked, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            return []
        events: list[StepOutput] = []
        drafted = sum(len(seq.draft) for seq in plan.decode)  # _run clears the drafts
        work = self._prompt_work(plan)  # before _run moves the sequences on
        measured = self.tuner is not None and not plan.prefill  # its decode steps alone
        decode_work = self._decode_work(plan) if measured else 0.0
        if self._idle and self.tuner is not None:  # back from idle: the cores others left
            self.tuner.resume()
        self._idle = False
        self._set_threads()
        gc0, cpu0, t0 = GC_TIME.seconds, time.thread_time(), time.perf_counter()
        forward_s, score_s = self._run(plan, events)
        seconds = time.perf_counter() - t0
        if self.pacing is not None:
            self.pacing.record(seconds, len(plan.decode), work)
        if measured:
            self.tuner.record(seconds, decode_work)
        if seconds > max(SLOW_STEP_S, self.stats.step_seconds_max):
            parts = (forward_s, score_s, GC_TIME.seconds - gc0, time.thread_time() - cpu0)
            self._log_slow_step(plan, drafted, seconds, *parts)
        self.stats.record_step(seconds, len(plan.decode))
        if self.tuner is not None and not self.scheduler.has_work():
            self.tuner.idle()
            self._idle = True
        return events

    def _set_threads(self) -> None:
        """The step's thread count on this thread (the OpenMP count is per thread: an
        engine on a thread of its own would otherwise run on all the cores whatever the
        user said)."""
        n = self.tuner.threads if self.tuner is not None else self._threads
        if n is not None and n != self._threads_set:
            torch.set_num_threads(n)
            self._threads_set = n

    def _decode_work(self, plan: StepPlan) -> float:
        """The work of a step of decode rows alone (each row and its draft tokens)."""
        return sum(self.work.units(seq.num_computed, 1 + len(seq.draft), False)
                   for seq in plan.decode)  # fmt: skip

    def _prompt_work(self, plan: StepPlan) -> float:
        """The work of the step's prompt tokens, in the pacing's units (0 without it)."""
        if self.pacing is None:
            return 0.0
        return sum(self.pacing.units(seq.num_computed, n, seq.sample.params.prompt_logprobs
                                     is not None) for seq, n in plan.prefill)  # fmt: skip

    @staticmethod
    def _log_slow_step(
        plan: StepPlan, drafted: int, seconds: float, forward_s: float, score_s: float,
        gc_s: float, cpu_s: float,
    ) -> None:  # fmt: skip
        """Say what the longest step so far held (every stream waited for it) and where
        its time went: the forward, scoring prompts, Python's garbage collector, and how
        much of it the engine thread was on a CPU (time.thread_time: working, not waiting).
        Logged on a new longest step only: a busy server logs a handful of lines."""
        params = [seq.sampler.params for seq, _ in plan.prefill]
        scored = sum(n for p, (_, n) in zip(params, plan.prefill, strict=True)
                     if p.prompt_logprobs is not None)  # fmt: skip
        params += [seq.sampler.params for seq in plan.decode]
        log.info(
            "longest engine step so far: %.2f s (forward %.2f s, scoring %.2f s, garbage "
            "collection %.2f s; the engine thread on a CPU %.2f s of it): %d prompt chunks of "
            "%d tokens (%d scored), %d decode rows (%d drafted tokens); %d guided sequences",
            seconds, forward_s, score_s, gc_s, cpu_s, len(plan.prefill),
            sum(n for _, n in plan.prefill), scored, len(plan.decode), drafted,
            sum(p.guide is not None for p in params),
        )  # fmt: skip

    def _run(self, plan: StepPlan, events: list[StepOutput]) -> tuple[float, float]:
        """The step's forward (its prompt chunks and its decode rows: one ragged forward
        on a GPU, kvlm.engine.backends), then sampling. A failure ends only the request it
        belongs to (the backend finds which). Returns its seconds in the forward and in
        scoring prompts (a slow step's log line)."""
        chunks = []
        for seq, n in plan.prefill:
            start = seq.num_computed
            scored = self.requests[seq.request_id].prompt_logprobs is not None
            chunks.append(Chunk(seq, seq.token_ids[start : start + n],
                                scored and start + 1 < seq.num_prompt))  # fmt: skip
        t0 = time.perf_counter()
        mtp = self.mtp
        self.runner.keep_hidden = mtp is not None  # (the runner is the model's, shared)
        out = self.backend.forward(chunks, plan.decode)
        forward_s, score_s = time.perf_counter() - t0, 0.0
        hidden = out.prefill_hidden or [None] * len(chunks)
        for chunk, logits, hint, rows in zip(chunks, out.prefilled, out.prefill_argmax, hidden,
                                             strict=True):  # fmt: skip
            seq, n = chunk.seq, len(chunk.tokens)
            if seq.status is Status.FINISHED:  # its request failed earlier in this step
                continue
            if isinstance(logits, Exception):
                events += self._fail(seq.request_id, logits)
                continue
            if mtp is not None:  # the chunk's states, for the head to draft from
                mtp.record(seq, seq.num_computed, rows)
            if chunk.all_rows:  # row j predicts prompt token start + j + 1
                try:
                    t0 = time.perf_counter()
                    logits = self._score_prompt(self.requests[seq.request_id], seq.num_computed,
                                                logits)  # fmt: skip
                    score_s += time.perf_counter() - t0
                except Exception as exc:
                    events += self._fail(seq.request_id, exc)
                    continue
            self.stats.prefill_tokens += n
            self._finish_forward(seq, n, logits, events, hint)
        hidden = out.decode_hidden or [None] * len(plan.decode)
        for seq, logits, hint, rows in zip(plan.decode, out.decoded, out.decode_argmax, hidden,
                                           strict=True):  # fmt: skip
            if seq.status is Status.FINISHED:  # its request failed earlier in this step
                continue
            if isinstance(logits, Exception):
                events += self._fail(seq.request_id, logits)
                continue
            start = seq.num_computed
            if seq.draft:
                self._finish_draft(seq, logits, events)
            else:
                self._finish_forward(seq, 1, logits[0], events, hint)
            if mtp is not None and rows is not None:  # the rows whose K/V are kept
                mtp.record(seq, start, rows[: seq.num_computed - start])
        return forward_s, score_s

    def _accept(self, seq: Sequence, token: int, logits: torch.Tensor) -> str:
        """Record a sampled token (its text, stop and max_tokens checks); "length" once the
        context is full: every slot holds a computed token, and this one, the last sampled,
        is never fed."""
        text = seq.sample.accept(token, logits)
        out = seq.sample.out
        if out.finish_reason is None and seq.num_tokens > self.max_model_len:
            out.finish_reason = "length"
        return text

    def _finish_draft(self, seq: Sequence, logits: torch.Tensor, events: list[StepOutput]) -> None:
        """A sequence's verified draft (speculative decoding): its tokens while the model
        agrees, then the model's own; the cache kept up to the last agreed one."""
        req = self.requests[seq.request_id]
        draft, seq.draft = seq.draft, []
        start, tokens, text, agreed = seq.num_computed, [], "", 0
        try:
            for i in range(len(draft) + 1):
                row = logits[i]
                token, ok = seq.sampler.verify(row, draft[i] if i < len(draft) else None)
                text += self._accept(seq, token, row)
                tokens.append(token)
                if seq.sample.out.finish_reason is not None or not ok:
                    break
                agreed += 1
        except Exception as exc:  # a sampler or stop-check bug: this request only
            events += self._fail(seq.request_id, exc)
            return
        # K/V kept: the last token's and the agreed drafts'; the rest rolled back
        seq.num_computed = start + 1 + agreed
        self.manager.trim(seq.table, seq.num_computed)
        self.manager.seal(seq.table, seq.token_ids, seq.num_computed)
        cfg = self.config.speculative
        seq.draft_len = min(cfg.num_draft, agreed + 1) if agreed == len(draft) else max(1, agreed)
        st = self.stats.spec
        st.steps += 1
        st.drafted += len(draft)
        st.accepted += agreed
        st.emitted += len(tokens)
        self._emit(req, seq, tokens, text, events)

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """The draft for one sequence this step (the scheduler asks)."""
        cfg = self.config.speculative
        k = min(room, seq.draft_len or cfg.num_draft)
        if not self.backend.drafts:  # one cache's rows decode in lockstep: n > 1 cannot
            return []
        if seq.sampler.guide is not None:  # a draft's rows would each need a mask at once,
            return []  # on this thread; a guided sample's masks are made beside the steps
        if self.drafter is not None:
            return self.drafter.propose(seq, k)
        return propose_ngram(seq.token_ids, k, cfg.ngram_max, cfg.ngram_min)

    def _score_prompt(self, req: _Request, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Record the prompt tokens' logprobs a chunk's rows (T, V) predict (fed from
        position `start`); return the last row, the one sampling reads."""
        ids = req.prompt_ids
        m = min(rows.shape[0], len(ids) - 1 - start)
        top = req.params.prompt_logprobs or 0
        scored = prompt_logprobs(rows[:m], ids[start + 1 : start + 1 + m], top)
        req.prompt_logprobs[start + 1 : start + 1 + m] = scored
        return rows[-1]

    def _finish_forward(
        self,
        seq: Sequence,
        n: int,
        logits: torch.Tensor,
        events: list[StepOutput],
        argmax: int | None = None,
    ) -> None:
        """The forward of n tokens of `seq` succeeded: record them; once none is pending,
        split off the request's other samples (its prompt is in) and sample each
        (`argmax`: the logits' argmax, when already known)."""
        try:
            seq.num_computed += n
            self.manager.seal(seq.table, seq.token_ids, seq.num_computed)
            if seq.num_pending:
                return
            req = self.requests[seq.request_id]
            family = [seq] + [self._sequence(req, index) for index in range(1, seq.fan_out)]
            for child in family[1:]:  # n > 1: the other samples share the prompt's blocks
                self.scheduler.fork(seq, child)
            seq.fan_out = 1
            if req.first_token is None:
                req.first_token = time.perf_counter()
                self.stats.record_ttft(req.first_token - req.arrival)
            for s in family:
                first = not s.sample.out.token_ids
                token = s.sampler(logits, argmax if s is seq else None)
                text = self._accept(s, token, logits)
                self._emit(req, s, [token], text, events)
                if first:  # the prompt's logprobs ride on each sample's first event
                    events[-1].prompt_logprobs = req.prompt_logprobs
        except Exception as exc:  # a sampler or stop-check bug: this request only
            events += self._fail(seq.request_id, exc)

    def _emit(
        self, req: _Request, seq: Sequence, tokens: list[int], text: str, events: list[StepOutput]
    ) -> None:
        """The event of `seq`'s new tokens (a sample that ended: its held-back text, its
        blocks freed); the request leaves once every sample has ended."""
        out = seq.sample.out
        lp = out.logprobs[-len(tokens) :] if out.logprobs is not None else []
        if out.finish_reason is not None:
            text += seq.sample.finish()
            self.scheduler.finish(seq)
        events.append(self._event(req, seq, tokens, lp, out.finish_reason, text))
        self.stats.generated_tokens += len(tokens)
        if all(s.sample.done for s in req.seqs) and not any(s.fan_out > 1 for s in req.seqs):
            del self.requests[req.request_id]
            self.stats.requests_finished += 1

    @staticmethod
    def _event(req: _Request, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob],
               finish: str | None, text: str = "") -> StepOutput:  # fmt: skip
        return StepOutput(req.request_id, seq.index, text, tokens, logprobs, finish,
                          prompt_tokens=len(req.prompt_ids),
                          cached_tokens=req.seqs[0].num_cached,
                          stop_reason=seq.sample.out.stop_reason if finish else None)  # fmt: skip

    def _fail(self, request_id: str, exc: Exception) -> list[StepOutput]:
        """End one request whose forward or sampling raised; every other goes on."""
        self.stats.errors += 1
        log.error("request %s failed; it ends with finish_reason 'error'", request_id,
                  exc_info=exc)  # fmt: skip
        return self.abort(request_id, reason="error")

    # ------------------------------------------------------------------ state

    def kv_view(self) -> dict:
        """The pool's blocks, owners, prefix tree and waste (kvlm.cache.view), the prefix
        cache's counters and the tiers': what GET /v1/kv returns. Call it between steps
        (AsyncEngine.call), not while a step runs."""
        seqs = [s for s in self.scheduler.running if s.table.blocks]
        names = {s.seq_id: f"{s.request_id}/{s.index}" for s in seqs}
        view = block_map(
            self.pool,
            {names[s.seq_id]: s.table.blocks for s in seqs},
            {names[s.seq_id]: s.num_computed for s in seqs},
        )
        view["sequences"] = [
            {"id": names[s.seq_id], "request_id": s.request_id, "index": s.index,
             "tokens": s.num_computed, "cached_tokens": s.num_cached, "blocks": s.table.blocks}
            | self._other_groups(s)
            for s in seqs
        ]  # fmt: skip
        # each group's blocks, and what its layers keep (kinds.shown: K/V, K = V, latent,
        # the later layers that read their K/V)
        view["groups"] = [g | shown(self.llm.config, g["layers"]) for g in layer_groups(self.pool)]
        snap = self.snapshot()
        counters = ["queries", "hits", "hit_rate", "evictions"]
        if self.pool.hybrid:  # lookups whose windowed layers' blocks were there, or not
            counters += ["window_lookups", "window_cut", "window_cut_tokens"]
        view["prefix_cache"] = {k: snap[f"prefix_{k}"] for k in counters}
        view["tiers"] = {name: st | {"dropped_writes": snap["tier_dropped_writes"]}
                         for name, st in (snap["tiers"] or {}).items()}  # fmt: skip
        view["dtype"] = self.spec.kv_name
        view["waiting"] = snap["waiting"]
        view["decode_step"] = self.decode_step
        return view

    @property
    def decode_step(self) -> str:
        """Which step decodes this engine's rows (ModelRunner.decode_step's words: "fused",
        "cuda graphs", or "torch step: <why>"), its pool's or its one cache's."""
        if self.pool is None:
            return self.runner.decode_step(self.backend.cache)  # type: ignore[union-attr]
        return self.runner.pool_decode_step(self.pool, self.spec.max_tokens)

    def _other_groups(self, seq: Sequence) -> dict:
        """What a sequence holds in a hybrid pool's other groups, for /v1/kv: each
        window's blocks (`windowed_blocks`), a conv group's slot and its rows' bytes
        (`conv_rows`), a DeltaNet group's slot and its state's (`deltanet_state`)."""
        out: dict = {}
        for group, table in zip(self.pool.groups[1:], seq.table.others, strict=True):
            if isinstance(group, ConvSlots):
                out["conv_rows"] = {"slot": table[0] if table else None,
                                    "bytes": group.block_nbytes if table else 0}  # fmt: skip
            elif isinstance(group, StateSlots):
                out["deltanet_state"] = {"slot": table[0] if table else None,
                                         "bytes": group.block_nbytes if table else 0}  # fmt: skip
            else:
                out.setdefault("windowed_blocks", []).append(table)
        return out

    def pin(
        self, key: str, tokens: list[int], salt: str | None, share: float,
        ttl: float | None = None,
    ) -> None:  # fmt: skip
        """Hold the pool's cached blocks of `tokens` under `key` (a stored response's
        conversation, a Messages request's cache_control prefix), so that the prefix cache
        keeps them for its follow-up, for `ttl` seconds (None: until unpinned; pinned
        again: from then); the oldest pins are let go while more than `share` of the
        pool's blocks are held."""
        if self.pool is None:
            return
        self._expire_pins()
        self.unpin(key)
        self.pins[key] = self.manager.pin(tokens, salt)
        if ttl is not None:
            self.pin_until[key] = time.monotonic() + ttl
        while self._pinned() > share * self.pool.num_blocks:
            self.unpin(next(iter(self.pins)))

    def _expire_pins(self) -> None:
        now = time.monotonic()
        for key in [k for k, until in self.pin_until.items() if until <= now]:
            self.unpin(key)

    def _pinned(self) -> int:
        """Group 0's blocks held by pins, each once (the share is of group 0's blocks): two
        stored responses of one conversation, or with one system prompt, hold the same
        leading blocks."""
        return len({b for held in self.pins.values() for b in held[0]})

    def unpin(self, key: str) -> None:
        """Let go of `key`'s blocks: they stay cached until evicted (or in the tiers)."""
        blocks = self.pins.pop(key, None)
        self.pin_until.pop(key, None)
        if blocks:
            self.manager.unpin(blocks)

    def snapshot(self) -> dict:
        """What /metrics reports, as plain values (kvlm.server.metrics renders them): the
        scheduler's and the pool's gauges, the engine's counters (EngineStats) and
        speculative decoding's, the time-to-first-token histogram, and each KV tier's
        counters (`tiers`: None without tiers)."""
        s, pool, stats, tiers = self.scheduler, self.pool, self.stats, self.tiers
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "blocks_used": pool.num_used,
            "blocks_free": pool.num_free,
            "blocks_total": pool.num_blocks,
            "blocks_pinned": self._pinned(),
            "prefix_queries": self.manager.stats.queries,
            "prefix_hits": self.manager.stats.hits,
            "prefix_hit_rate": self.manager.stats.hit_rate,
            "prefix_evictions": pool.prefix.evictions,
            # a hybrid pool's prefix lookups (kvlm.cache.prefix.PrefixStats)
            "prefix_window_lookups": self.manager.stats.window_lookups,
            "prefix_window_cut": self.manager.stats.window_cut,
            "prefix_window_cut_tokens": self.manager.stats.window_cut_tokens,
            "kv_groups": layer_groups(pool),
            "preemptions": s.preemptions,
            "fused_rows": self.runner.fused_rows,  # the model's runner's, every engine's
            **{f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)
               if type(getattr(stats, f.name)) in (int, float)},  # the counters
            "tokens_per_s": stats.tokens_per_s(),
            "spec_drafted": stats.spec.drafted,
            "spec_accepted": stats.spec.accepted,
            "spec_acceptance": stats.spec.acceptance,
            "spec_tokens_per_forward": stats.spec.tokens_per_forward,
            "ttft_counts": list(stats.ttft_counts),
            "tiers": None if tiers is None else {
                name: dataclasses.asdict(st) for name, st in tiers.stats.items()
            },
            "tier_dropped_writes": 0 if tiers is None else tiers.dropped,
        }  # fmt: skip


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all, on a GPU) bytes of the model's tensors: its parameters and buffers (a packed
    low-bit weight is a buffer), each tensor counted once."""
    seen: dict[int, torch.Tensor] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen.setdefault(id(t), t)
    return (sum(t.nbytes for t in seen.values()),
            sum(t.nbytes for t in seen.values() if t.is_cuda))  # fmt: skip


__all__ = ["Engine", "EngineConfig", "ModelInfo", "QueueFullError", "StepOutput"]
