"""The cache protocol: what every KV cache mode answers, and the per-step view the model sees.

One forward pass goes through a cache like this:

    step = cache.begin(n_new)        # capacity checked here: overflow raises, nothing written
    logits = model(ids, step.positions, step)
        # each layer:  k_all, v_all = step.update(layer, k_new, v_new)
        #              attention(q, k_all, v_all, step.mask, step.is_causal)
    cache.commit(step)               # only now does the cache hold n_new more tokens

If the forward raises, `commit` never runs and the cache holds what it held before (a
layout may have written past its counter, or allocated blocks it keeps; nothing reads them).

A cache holds `batch` sequences of one length, advanced in lockstep: one after a prefill,
n after `fork(n)` (n samples decoding from one prompt). Positions are owned by the cache,
never inferred from tensor contents: the new tokens sit at num_tokens .. num_tokens+n-1.
That one rule makes prefill, decode, chunked prefill and a resumed conversation the same
code path. A cache that stores nothing (`off`) always reports 0 tokens, so its caller
re-feeds the whole sequence.

Beyond the forward: rollback(n), reset(), free(), fork(n), snapshot()/restore() (which
kvlm.cache.files writes to and reads from a file), nbytes (exact), and planned_nbytes()
(what a cache of this mode allocates for a workload, the figure `kvlm memory` prints).

A caller that reads and writes K/V itself (the fused C decode step, kvlm.model.fused)
asks a cache where they are: `kv_views(rows)`, a `KVView` per layer group (a store, each
row's blocks, a ring's size and its window; None where its layout is no such view), a
`ConvView` for a group of conv layers (their rows, kvlm.cache.conv) and a `StateView` for
a group of recurrent layers (their states and rows, kvlm.cache.recurrent); after begin()
it tells the cache `written_in_place(step)` first (a ring that stages its writes for
commit, and the conv rows, then only record the positions; a state group stages the
buffer the step writes its states into) and then asks `kv_views(rows, step)`.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlm.cache.kinds import FullAttention, LayerKind, cache_geometry, layer_kinds
from kvlm.cache.storage import V_ROTATED, Store, key_rotation, v_rotated, value_rotation
from kvlm.config import ModelConfig
from kvlm.dtypes import kv_dtype_name
from kvlm.errors import CacheOverflowError, InvalidRequestError, KvlmError

WINDOW_POSITIONS = ("cache", "absolute")  # kvlm.cache.window
KVPair = tuple[torch.Tensor, torch.Tensor]  # a layer's keys and values


class CacheFileError(KvlmError):
    """A cache file (kvlm.cache.files) or snapshot that cannot be used here: unreadable,
    corrupt, or from another model."""


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """The shape of one cache: the model's K/V geometry, how many tokens a sequence may
    hold, and the mode-specific sizes (each mode reads the fields it needs)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int
    batch: int = 1
    # storage: fp32, bf16, fp16, int8 or q4 (+ fp16 params): K's, and V's unless v_dtype
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable
    # The model's own attention window (Mistral), applied in the mask; not the window cache.
    sliding_window: int | None = None
    # Per layer: what it keeps (kvlm.cache.kinds), where the layers' kinds differ (a
    # hybrid model's local and global layers: kinds.layer_kinds); empty: every layer keeps
    # every row, its masks those of sliding_window
    layer_kinds: tuple[LayerKind, ...] = ()
    block_size: int = 16  # paged: tokens per block
    num_blocks: int | None = None  # paged: pool size (None: room for 8 full-length sequences)
    window: int = 256  # window: recent tokens kept
    sinks: int = 4  # window: first tokens kept forever
    # window: RoPE positions "cache" (counted inside the cache, StreamingLLM; K kept before
    # RoPE) or "absolute" (each token's position in the text); kvlm.cache.window.
    window_positions: str = "cache"
    v_dtype: torch.dtype | None = None  # V's own storage (--v-dtype); None: dtype's

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """K's and V's storage dtypes."""
        return self.dtype, self.dtype if self.v_dtype is None else self.v_dtype

    @property
    def kv_name(self) -> str:
        """The storage as one name: "fp16", or K's and V's, "int8/q4"."""
        return kv_dtype_name(*self.kv_dtypes)

    @property
    def kv_format(self) -> str:
        """The storage as files and tier records name it: kv_name, marked "+vrot" where V
        is stored rotated (kvlm.cache.storage.value_rotation): "q4+vrot", "fp16/q4+vrot"."""
        rotated = v_rotated(self.kv_dtypes[1], self.head_dim)
        return self.kv_name + (V_ROTATED if rotated else "")

    def store(self, shape: tuple[int, ...], zero: bool = True) -> Store:
        """A Store of this spec's K/V dtypes on its device."""
        k, v = self.kv_dtypes
        return Store(shape, k, self.device, zero=zero, v_dtype=v)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "batch", "block_size", "window"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sinks < 0:
            raise InvalidRequestError(f"sinks must be >= 0, got {self.sinks}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise InvalidRequestError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.layer_kinds and (
            len(self.layer_kinds) != self.num_layers or len(set(self.layer_kinds)) < 2
        ):
            raise InvalidRequestError(
                f"layer_kinds: {len(self.layer_kinds)} kinds for {self.num_layers} layers, "
                f"{len(set(self.layer_kinds))} distinct (empty where every layer is alike)"
            )
        if self.window_positions not in WINDOW_POSITIONS:
            raise InvalidRequestError(
                f"unknown window positions {self.window_positions!r}; valid: "
                + ", ".join(WINDOW_POSITIONS)
            )

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        max_tokens: int,
        dtype: torch.dtype | tuple[torch.dtype, torch.dtype] = torch.float32,
        device: torch.device | str = "cpu",
        **sizes: int | None,
    ) -> CacheSpec:
        """`dtype`: K's and V's storage, or a (K, V) pair; `sizes`: batch, block_size,
        num_blocks, window, sinks."""
        k, v = dtype if isinstance(dtype, tuple) else (dtype, dtype)
        kinds = layer_kinds(config)
        heads, head_dim = cache_geometry(config)  # a latent attention model's: its latent rows
        window = config.sliding_window  # a window every layer shares: the masks'
        if not kinds and config.layer_windows:
            window = config.layer_windows[0]
        return cls(
            num_layers=len(config.cache_layers),  # the layers that keep K/V
            num_kv_heads=heads,
            head_dim=head_dim,
            max_tokens=max_tokens,
            dtype=k,
            v_dtype=None if v == k else v,
            device=torch.device(device),
            sliding_window=window,
            layer_kinds=kinds,
            **{k: v for k, v in sizes.items() if v is not None},
        )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, for one sequence, int8 parameters included:
        each layer's kind's (LayerKind.token_bytes)."""
        if not self.layer_kinds:
            return self.num_layers * FullAttention().token_bytes(self)
        return sum(kind.token_bytes(self) for kind in self.layer_kinds)

    def geometry(self) -> dict[str, int]:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


class CacheStep(ABC):
    """One forward's view of a cache: where the new tokens go and what they attend to."""

    def __init__(
        self,
        start: int,
        n_new: int,
        batch: int,
        device: torch.device,
        mask: torch.Tensor | None,
        is_causal: bool,
    ) -> None:
        self.start = start
        self.n_new = n_new
        pos = torch.arange(start, start + n_new, device=device)
        self.positions = pos.expand(batch, n_new)  # (B, T) int64
        self.mask = mask  # (T, S) bool, True = may attend; or None
        self.is_causal = is_causal
        # When set, the keys update() returns are k @ R (int8 caches quantize K in a rotated
        # basis, kvlm.cache.storage) and attention must use q @ R: (qR).(kR) = q.k.
        self.key_rotation: torch.Tensor | None = None
        # When set, the values update() returns are v @ R (a quantized V, power-of-two
        # head_dim: kvlm.cache.storage.value_rotation) and attention's output o R is
        # multiplied by R^T, per head.
        self.value_rotation: torch.Tensor | None = None
        # When set (S,), update() takes and returns K before RoPE, and the model rotates the
        # returned keys at these positions (the window cache's positions inside the cache).
        self.key_rope_positions: torch.Tensor | None = None
        # When set, the rows see different numbers of keys (the engine's batch of sequences
        # of different lengths, on the CPU): row b's (keys, mask, is_causal), and attention
        # runs over exactly the row's keys, as it would alone (kvlm.model.attention).
        self.rows: list[tuple[int, torch.Tensor | None, bool]] | None = None
        # When set, the step is ragged (kvlm.cache.paged.RaggedStep): one row of every
        # sequence's tokens, update() returns their keys packed, and attention runs per
        # sequence over them; logit_rows: the rows whose logits the forward computes.
        self.segments = None
        self.logit_rows: torch.Tensor | None = None
        # Per layer: its kind, where the layers' differ (CacheSpec.layer_kinds); the step's
        # own masks are those of `sliding_window`, a layer's its kind's (for_layer)
        self.kinds: tuple[LayerKind, ...] = ()
        self._views: dict[LayerKind, CacheStep] = {}
        # The conv layers' rows before the step (kvlm.cache.conv.ConvStep), where the
        # cache keeps a conv group (Transformer.forward reads them); None: none kept
        self.conv = None
        # The gated DeltaNet layers' state before the step (kvlm.model.deltanet.DeltaStep),
        # where the cache keeps a state group (kvlm.cache.recurrent); None: none kept
        self.recurrent = None

    def for_layer(self, layer: int) -> CacheStep:
        """The step as `layer` sees it: itself, or where the layers' kinds differ, a view of
        it (the same store and positions) with the window of that layer's kind in its
        masks, made once a step per kind."""
        if not self.kinds:
            return self
        kind = self.kinds[layer]
        view = self._views.get(kind)
        if view is None:
            view = self._views[kind] = copy.copy(self)
            view.kinds = ()
            view.use_window(kind.window)
        return view

    def use_window(self, window: int | None) -> None:
        """Make the masks those of a model attention window `window` (None: none)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-layer windows")

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        """Store this step's k, v (B, Hkv, T, D) for `layer`; return all visible (B, Hkv, S, D)."""

    def _over(self, store: Store) -> None:
        """This step reads and writes `store`; an int8 or q4 store keeps K rotated (and a
        quantized V, value_rotation)."""
        self.store = store
        if store.k_quantized:
            device = next(iter(store.parts.values())).device
            self.key_rotation = key_rotation(store.head_dim).to(device)
        if store.v_rotated:
            device = next(iter(store.parts.values())).device
            self.value_rotation = value_rotation(store.head_dim).to(device)

    def _keys_in(self, k: torch.Tensor) -> torch.Tensor:
        """K as the store keeps it (rotated for int8), by the rotation of its rows' width: a
        layer kind of its own head size (LayerKind.head_dim) has its own, which its view of
        the step (for_layer) keeps from its first update on, so attention reads it there."""
        r = self.key_rotation
        if r is None:
            return k
        if r.shape[0] != k.shape[-1]:
            r = self.key_rotation = key_rotation(k.shape[-1]).to(r.device)
        return k @ r.to(k.dtype)

    def _values_in(self, v: torch.Tensor) -> torch.Tensor:
        """V as the store keeps it (rotated for a quantized V, value_rotation), by the
        rotation of its rows' width, as `_keys_in` (none for a width that has none)."""
        r = self.value_rotation
        if r is not None and r.shape[0] != v.shape[-1]:
            own = value_rotation(v.shape[-1])
            r = self.value_rotation = None if own is None else own.to(r.device)
        return v if r is None else v @ r.to(v.dtype)


class DraftRows:
    """Mixin over a cache step of one sequence: its n_new tokens fed as n_new rows of one
    token (a speculative draft's check), every row's K/V stored by the step's own update
    before any row attends, row i at position start + i attending over the keys up to its
    own position (CacheStep.rows), with no mask, as decoding its token alone would."""

    def __init__(self, cache: KVCache, n_new: int) -> None:
        super().__init__(cache, n_new)  # type: ignore[call-arg] # use_window: this class's
        self.positions = self.positions.reshape(n_new, 1)  # (rows, 1)

    def use_window(self, window: int | None) -> None:
        self.mask, self.is_causal = None, False
        dev = self.positions.device
        self.rows = [(p + 1, *causal_mask(p, 1, p + 1, window, dev))
                     for p in range(self.start, self.start + self.n_new)]  # fmt: skip

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        """k, v (rows, Hkv, 1, D) -> the sequence's keys (rows, Hkv, S, D)."""
        n = k.shape[0]
        as_seq = [x[:, :, 0].transpose(0, 1)[None] for x in (k, v)]  # (1, Hkv, n, D)
        keys, values = super().update(layer, *as_seq)  # type: ignore[misc]
        return keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1)


class DenseStep(CacheStep):
    """A step whose keys are the sequence's tokens 0 .. start+n_new-1, in order (basic,
    contiguous, paged): the causal mask over positions, in its cheapest exact form."""

    def __init__(self, cache: KVCache, n_new: int) -> None:
        super().__init__(cache.num_tokens, n_new, cache.batch, cache.spec.device, None, False)
        self.use_window(cache.spec.sliding_window)

    def use_window(self, window: int | None) -> None:
        end = self.start + self.n_new
        self.mask, self.is_causal = causal_mask(
            self.start, self.n_new, end, window, self.positions.device
        )


def causal_mask(
    q_start: int, n_new: int, n_keys: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """Mask for queries at positions q_start.. over keys at positions 0..n_keys-1.

    Returns (mask, is_causal) for scaled_dot_product_attention, taking the cheap forms when
    they are exact. A chunk that continues a prefix needs the explicit form, because SDPA's
    is_causal aligns the triangle top-left:

                 k0 k1 k2 k3 | k4 k5 k6        (k0..k3 cached, k4..k6 this chunk)
            q4 [  1  1  1  1 |  1  0  0 ]
            q5 [  1  1  1  1 |  1  1  0 ]
            q6 [  1  1  1  1 |  1  1  1 ]

    With a model attention window W, key j is visible to query i only if i - j < W.
    """
    if window is None or n_keys <= window:
        if n_new == 1:
            return None, False  # one query sees every key
        if q_start == 0 and n_keys == n_new:
            return None, True  # a fresh prefill: the plain triangle
    q = torch.arange(q_start, q_start + n_new, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return visible(q, k, window), False  # (T, S) broadcasts over batch and heads


def visible(q: torch.Tensor, k: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether queries at positions q see keys at positions k (broadcast against each
    other): k <= q, and within the model's attention window W, q - k < W."""
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


@dataclass(slots=True)
class KVView:
    """Where some of the model's layers keep their K/V for one step: `store` (layers, 2,
    blocks, kv_heads, block_size, head_dim), row b's position s in block
    tables[b][slot // block_size], slot = s, or s % ring in a ring of `ring` slots (a
    windowed group's ring, kvlm.cache.hybrid), whose layers attend within `window` (the
    kind's; 0: none); `layers`: the model's layers the store holds, in its order (None:
    all of them). A contiguous cache is a pool of one block per row holding every slot.
    Made afresh for each call (kv_views), so its maker may still fill a field in."""

    store: Store
    tables: Sequence[Sequence[int]]
    block_size: int
    ring: int = 0
    layers: tuple[int, ...] | None = None
    window: int = 0


@dataclass(slots=True)
class ConvView:
    """Where some of the model's conv layers keep their rows for one step (kvlm.cache.conv):
    `rows` fp32, a sequence's last `keep` input rows of the convolution, either ConvRows'
    (ring 0: (layers, sequences, keep, H), positions end - keep .. end - 1 in order) or
    ConvSlots' (`ring` = keep: (layers, slots * ring + 1, H), slot s's position p at row
    s * ring + p % ring, the last row zeros for every position before 0); the step's row i
    feeds sequence (slot) seqs[i], whose rows end at position ends[i] (rows of one
    sequence consecutive at consecutive positions: a draft's); `layers`: the model's
    layers the rows hold, in their order. Made afresh for each call (kv_views)."""

    rows: torch.Tensor
    seqs: Sequence[int]
    ends: Sequence[int]
    layers: tuple[int, ...] | None = None
    ring: int = 0


@dataclass(slots=True)
class Taps:
    """What a causal convolution's L taps read in one step (ConvStep.taps, a pool step's
    `taps`), without copying them out: output n's tap k is row index[k, n] of `rows`
    (R, C), the rows held before the step and the step's own; `shape` the outputs' (B, T,
    C). kvlm.model.conv.depthwise sums them (in C, kvlm_depthwise); `taps[k]` is tap k as
    a tensor of `shape`."""

    rows: torch.Tensor
    index: torch.Tensor  # (L, N) int64
    shape: tuple[int, ...]

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.rows.index_select(0, self.index[k]).view(self.shape)

    def __len__(self) -> int:
        return self.index.shape[0]


@dataclass(slots=True)
class StateView:
    """Where some of the model's recurrent layers keep their state for one step
    (kvlm.cache.recurrent): `conv` their convolution's rows (a ConvView of ConvRows' layout,
    ring 0, one row a sequence: row i feeds sequence conv.seqs[i]), `state` the states
    before the step (layers, sequences, *state shape) fp32, row i's at its sequence;
    `out` (layers, sequences, *state shape) fp32, where the step writes row i's state
    after it, at its sequence too: a buffer of the step's (a one-sequence cache's), or
    `state` itself, updated in place (the pool's slots); None: a declaration, no step.
    `layers`: the model's layers, in their order. A sequence's rows may be several (a
    draft's, consecutive at consecutive positions): its state after each but the last goes
    to `snaps` (layers, draft rows of the step in row order, *state shape) fp32, and every
    row's convolution input to `urows` (layers, rows, conv width) fp32 (None: no draft).
    Made afresh for each call (kv_views)."""

    conv: ConvView
    state: torch.Tensor
    out: torch.Tensor | None = None
    layers: tuple[int, ...] | None = None
    snaps: torch.Tensor | None = None
    urows: torch.Tensor | None = None
    # a gated DeltaNet's carried rows (kinds.RecurrentState.window_shape; None: a Mamba2's):
    # before the step (layers, sequences, ...) as `state`, after it as `out`, the draft
    # rows' as `snaps`
    win: torch.Tensor | None = None
    win_out: torch.Tensor | None = None
    wsnaps: torch.Tensor | None = None


@dataclass(slots=True)
class CacheSnapshot:
    """A cache's contents, detached from it: what snapshot() returns and files hold.

    `layout` says how to read `tensors`: "dense" is values [layers, 2, batch, heads, length,
    head_dim] (and for int8 "scales", [..., length, 2]: step and zero point per token),
    shared by basic, contiguous and paged;
    "window" is the ring as stored plus the position of each slot.
    """

    layout: str
    dtype: str
    length: int
    batch: int
    geometry: dict[str, int]
    tensors: dict[str, torch.Tensor]
    extra: dict[str, int] = field(default_factory=dict)


class KVCache(ABC):
    """A KV cache of one of the modes in kvlm.cache.factory.CACHE_MODES."""

    mode: ClassVar[str]
    layout: ClassVar[str] = "dense"
    drafts: ClassVar[bool] = True  # begin(n, draft=True) applies (all modes but off)
    # What the roads that take a cache read of its mode (kvlm.cache.factory's lists of
    # modes are made from these): the fused C decode step reads and writes its store in
    # place (kvlm.model.fused); and the mode of the engine's pool that computes its
    # attention bit for bit, through which LLM.generate batches its prompts (None: they
    # run one after another on the cache)
    fused_step: ClassVar[bool] = False
    pool_mode: ClassVar[str | None] = None

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self._length = 0
        self.batch = spec.batch

    # ------------------------------------------------------------------ the forward

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V this cache holds (per sequence)."""
        return self._length

    @property
    def capacity(self) -> int:
        """The most tokens one sequence may hold, counting the new ones of a step."""
        return self.spec.max_tokens

    def would_overflow(self, n_new: int) -> bool:
        return self.num_tokens + n_new > self.capacity

    def begin(self, n_new: int, draft: bool = False) -> CacheStep:
        """Plan a forward of `n_new` tokens per sequence. Raises before anything is written.
        `draft`: one sequence's n_new tokens as n_new rows of one token at consecutive
        positions (a speculative draft's check, kvlm.engine.runner), each row computing
        what decoding its token alone would; refused by the modes that have no such step."""
        if draft and (self.batch != 1 or not self.drafts):
            raise InvalidRequestError(
                f"a draft is checked on a contiguous, paged, basic or window cache of one "
                f"sequence, not {self.mode} ({self.batch} rows)"
            )
        if n_new <= 0:
            raise InvalidRequestError(f"a forward needs at least one token, got {n_new}")
        if self.would_overflow(n_new):
            raise CacheOverflowError(self._overflow_message(n_new))
        step = self._begin(n_new, draft)
        step.kinds = self.spec.layer_kinds
        return step

    def _overflow_message(self, n_new: int) -> str:
        return (
            f"{self.num_tokens} cached + {n_new} new tokens exceed the cache capacity of "
            f"{self.capacity} tokens (raise --max-context, up to the model's limit)"
        )

    def commit(self, step: CacheStep) -> None:
        """The forward succeeded: the cache now holds the step's tokens."""
        if step.start != self._length:
            raise RuntimeError("commit of a stale cache step")  # a bug, not a user error
        self._commit(step)
        self._length = step.start + step.n_new

    # ------------------------------------------------------------------ lifetime

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens (speculation rejected, a chat turn diverged)."""
        if not 0 <= n <= self._length:
            raise InvalidRequestError(f"cannot roll back {n} of {self._length} cached tokens")
        self._check_rollback(n)
        self._length -= n
        self._truncate(self._length)

    def hold_rollback(self, n: int) -> None:
        """Keep what a rollback of up to `n` tokens over steps of their own needs (a draft
        model's cache, its drafts one token a step): a DeltaNet state the state each step
        ends at (kvlm.cache.recurrent); K/V rows and rings keep it anyway."""
        return None

    def checkpoint(self, position: int) -> None:
        """Keep what a rollback to `position` needs once a step passes it (a DeltaNet
        state: the state there, kvlm.cache.recurrent; K/V rows keep it anyway)."""
        return None

    def rollback_point(self, keep: int) -> int:
        """The furthest position at most `keep` a rollback can go back to (0: none, the
        caller starts over)."""
        return keep if self.can_roll_back(self.num_tokens - keep) else 0

    def can_roll_back(self, n: int) -> bool:
        """Whether rollback(n) keeps what the next query reads (a ring may have let it go)."""
        if not 0 <= n <= self._length:
            return False
        try:
            self._check_rollback(n)
        except InvalidRequestError:
            return False
        return True

    def reset(self) -> None:
        """Empty, keeping the batch and whatever storage the cache owns."""
        self._length = 0
        self._truncate(0)

    def free(self) -> None:
        """Empty and give storage back (blocks to their pool); back to the initial batch."""
        self.reset()
        self._release()
        self.batch = self.spec.batch

    def fork(self, n: int) -> None:
        """Turn each sequence into n that share its prefix (n samples of one prompt).
        Sequence i becomes rows i*n .. i*n + n-1."""
        if n < 1:
            raise InvalidRequestError(f"fork needs n >= 1, got {n}")
        if n > 1:
            self._fork(n)
            self.batch *= n

    # ------------------------------------------------------------------ state

    def snapshot(self) -> CacheSnapshot:
        """A copy of the contents that outlives later writes (restore() brings it back)."""
        return CacheSnapshot(
            layout=self.layout,
            dtype=self.spec.kv_format,
            length=self._length,
            batch=self.batch,
            geometry=self.spec.geometry(),
            tensors={k: t.clone() for k, t in self._export().items()},
            extra=self._layout_extra(),
        )

    def restore(self, snap: CacheSnapshot) -> None:
        self._check_compatible(snap, "the snapshot")
        self._replace(snap)

    def _replace(self, snap: CacheSnapshot) -> None:
        """Swap the contents for a checked snapshot's."""
        self.free()
        self.batch = snap.batch
        try:
            self._import(snap.tensors, snap.length)
        except CacheOverflowError:  # a block pool without room for the rows: nothing taken
            self.free()
            raise
        self._length = snap.length

    def _check_compatible(self, snap: CacheSnapshot, source: str) -> None:
        if snap.layout != self.layout:
            raise CacheFileError(
                f"{source}: a {snap.layout} cache cannot be restored into --kv {self.mode}"
            )
        if snap.dtype != self.spec.kv_format:
            raise CacheFileError(
                f"{source} holds {snap.dtype} values but this cache stores "
                f"{self.spec.kv_format} (use the same --kv-dtype, or --k-dtype/--v-dtype; "
                f"{V_ROTATED}: V stored Hadamard-rotated)"
            )
        if snap.geometry != self.spec.geometry():
            raise CacheFileError(
                f"{source}: cache shape {snap.geometry} does not match this model's "
                f"{self.spec.geometry()}"
            )
        if snap.extra != self._layout_extra():
            raise CacheFileError(
                f"{source}: cache layout {brief(snap.extra, 80)} does not match this cache's "
                f"{self._layout_extra()}"
            )
        if snap.length > self.capacity:
            raise CacheFileError(
                f"{source} holds {snap.length} tokens, more than this cache's capacity of "
                f"{self.capacity} (raise --max-context)"
            )

    # ------------------------------------------------------------------ accounting

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of K/V storage this cache holds right now (allocated, not just used)."""

    @classmethod
    @abstractmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        """Bytes this mode allocates for `batch` sequences of `tokens` tokens each."""

    # ------------------------------------------------------------------ per-mode hooks

    @abstractmethod
    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        """The step of begin(n_new, draft), its checks passed."""

    @abstractmethod
    def _export(self) -> dict[str, torch.Tensor]:
        """The held contents as raw tensors (views are fine: snapshot() clones)."""

    @abstractmethod
    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Load contents of `length` tokens for `self.batch` rows into an empty cache."""

    @abstractmethod
    def _fork(self, n: int) -> None: ...

    def _commit(self, step: CacheStep) -> None:  # noqa: B027 - most modes write in update()
        pass

    def _truncate(self, length: int) -> None:  # noqa: B027 - a counter move is enough for most
        pass

    def _release(self) -> None:  # noqa: B027 - only pools and growable caches give memory back
        pass

    def _check_rollback(self, n: int) -> None:  # noqa: B027 - every token is kept by most
        pass

    def _layout_extra(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ views

    def kv_views(
        self, rows: Sequence[int], step: CacheStep | None = None
    ) -> list[KVView | ConvView | StateView] | None:
        """This cache's K/V for a caller that reads and writes them itself (the fused
        decode step), token i through row rows[i]: a KVView per layer group of attention,
        a ConvView per group of conv layers, a StateView per group of recurrent layers
        (its `out` the `step`'s, staged by written_in_place; None without a step); None
        where the layout is none a view describes (basic, off, window)."""
        return None

    def written_in_place(self, step: CacheStep) -> None:  # noqa: B027 - most write in place
        """The caller wrote `step`'s K/V (and conv rows) through kv_views() itself: a cache
        that stages a step's writes for commit() (a ring, conv rows) then only records the
        positions."""

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.batch}x{self.num_tokens}/{self.capacity} tokens, "
            f"{self.nbytes} B>"
        )


def brief(value: object, limit: int = 40) -> str:
    """A value from a file as one short line (repr escapes newlines)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
