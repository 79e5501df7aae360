"""Layer kinds: what each kind of layer keeps for a sequence (vLLM's KVCacheSpec).

A model is a stack of blocks; each block's mixer keeps something per sequence so that the
next token is computed without the text before it again. What it keeps is its kind's spec:

    kind          keeps, per sequence                   spec               kept(T)   first_read(T)
    attention     K/V rows of every token               FullAttention()    T         0
    window        K/V rows of the last W + RING_SLACK   SlidingWindow(W)   <= W+32   T - W + 1
    conv          the last L - 1 input rows (+ slack)   ConvWindow(L-1, H) 0 (state) T - L + 1
    state         a recurrent state + its L - 1 rows    RecurrentState(..) 0 (state) T
    latent        a latent + rotated key part a token   LatentAttention(.) T         0

A spec is a frozen value (equal specs: one group of layers, kvlm.cache.groups). It answers
the window its masks use (`window`), how many positions a sequence keeps behind its end
(`keep`, `kept`), the first position the next query reads (`first_read`: what a rollback
must not let go of), and its geometry and bytes (vLLM's page_size_bytes): the KV heads and
head_dim of its rows (`shape`: its own where it says, e.g. global layers with wider
heads, else the model's), what one token's rows cost in one layer (`token_bytes`),
what one sequence keeps whatever its length (`sequence_bytes`: a state kind's; 0 for
rows) and what the engine's pool keeps at each full block's end for a prefix hit there
(`end_bytes`: a state kind's state at that point). A plan's bytes for a layer of the kind
at T tokens: kept(T) * token_bytes + sequence_bytes.

Which kind a layer is comes from its mixer (`layer_kinds`): an attention layer's is its
window's (`kind_of`: the whole context, or a sliding window). A new mixer adds its kind
here and its line in `layer_kinds`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from kvlm.cache.storage import itemsize
from kvlm.config import ModelConfig

# A gated DeltaNet's rule runs in chunks of this many positions, at multiples of it from
# 0 (kernels/abi.h's DELTA_CHUNK, which tests/test_kernel_abi.py holds it to)
DELTA_CHUNK = 16

# Tokens a windowed group keeps past its window: what a rollback may take back (a chat's
# last token, a draft's rows beyond its own undo); a longer one is refused (the caller
# recomputes the prefix)
RING_SLACK = 32
# The dtype a ConvWindow's rows are kept in
CONV_ROW_DTYPE = torch.float32


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a RecurrentState is kept in for a cache storing `dtype`: fp32 (the
    recurrence's, kvlm.model.deltanet.work_dtype), fp64 for an fp64 cache (an fp64 model's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Geometry(Protocol):
    """What a kind reads of a cache's spec (kvlm.cache.base.CacheSpec): the model's K/V
    geometry and storage."""

    num_kv_heads: int
    head_dim: int

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, torch.dtype]: ...


@dataclass(frozen=True, slots=True)
class LayerKind:
    """What a layer of this kind keeps for a sequence (a spec: equal specs, one group).
    `heads`, `head_dim`: its rows' own geometry (None: the model's)."""

    name: ClassVar[str]
    code: ClassVar[int]  # its number in a file's `groups` layout (KINDS)
    heads: int | None = field(default=None, kw_only=True)
    head_dim: int | None = field(default=None, kw_only=True)

    @property
    def window(self) -> int | None:
        """The attention window in this kind's masks (None: none of its own)."""
        return None

    @property
    def keep(self) -> int | None:
        """Positions a sequence keeps behind its end between steps (None: every one)."""
        return None

    def kept(self, tokens: int) -> int:
        """Positions a sequence of `tokens` tokens keeps."""
        return tokens if self.keep is None else min(tokens, self.keep)

    def first_read(self, length: int) -> int:
        """The first position the next query of a sequence `length` tokens long reads."""
        return 0

    @property
    def fields(self) -> dict[str, int]:
        """Its parameters as a file's layout names them: every field that is set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}  # fmt: skip

    def shape(self, spec: Geometry) -> tuple[int, int]:
        """(KV heads, head_dim) of this kind's rows: its own, else the model's (`spec`'s)."""
        return self.heads or spec.num_kv_heads, self.head_dim or spec.head_dim

    def token_bytes(self, spec: Geometry) -> int:
        """Bytes one token's rows take in one layer of this kind: K and V of every KV head
        in `spec`'s dtypes, int8 and q4 parameters included."""
        heads, dim = self.shape(spec)
        return heads * sum(round(dim * itemsize(t, dim)) for t in spec.kv_dtypes)

    def sequence_bytes(self, spec: Geometry) -> int:
        """Bytes one sequence keeps in one layer of this kind whatever its length (a state
        kind's; rows cost token_bytes each)."""
        return 0

    def end_bytes(self, spec: Geometry) -> int:
        """Bytes a pool with a prefix cache keeps in one layer of this kind for each full
        block, what a hit at the block's end needs besides the blocks (a state kind's
        state there; 0 for rows, which the blocks hold)."""
        return 0


@dataclass(frozen=True, slots=True)
class FullAttention(LayerKind):
    """Attention over the whole context: K/V rows of every token."""

    name: ClassVar[str] = "attention"
    code: ClassVar[int] = 0


@dataclass(frozen=True, slots=True)
class SlidingWindow(LayerKind):
    """Attention over the last `size` tokens: K/V rows of the last size + RING_SLACK."""

    name: ClassVar[str] = "window"
    code: ClassVar[int] = 1
    size: int

    @property
    def window(self) -> int:
        return self.size

    @property
    def keep(self) -> int:
        return self.size + RING_SLACK

    def first_read(self, length: int) -> int:
        return max(0, length - self.size + 1)


@dataclass(frozen=True, slots=True)
class ConvWindow(LayerKind):
    """A short convolution's (kvlm.model.conv): its input rows at the last `rows`
    positions (the kernel less one), each `width` wide (the model's hidden size), and
    RING_SLACK rows more, so a rollback of up to RING_SLACK tokens still finds the rows
    before its new end. A state kind: no row per token (token_bytes 0), a fixed window a
    sequence (sequence_bytes), kept in fp32 whatever the K/V dtype (a bf16 or fp16 row
    goes there and back exactly), held by kvlm.cache.conv."""

    name: ClassVar[str] = "conv"
    code: ClassVar[int] = 2
    rows: int
    width: int

    @property
    def keep(self) -> int:
        return self.rows + RING_SLACK

    def kept(self, tokens: int) -> int:
        return 0  # no rows per token: the window is sequence_bytes

    def first_read(self, length: int) -> int:
        return max(0, length - self.rows)

    def token_bytes(self, spec: Geometry) -> int:
        return 0

    def sequence_bytes(self, spec: Geometry) -> int:
        return self.keep * self.width * CONV_ROW_DTYPE.itemsize

    def end_bytes(self, spec: Geometry) -> int:
        return self.rows * self.width * CONV_ROW_DTYPE.itemsize  # the rows before the end


@dataclass(frozen=True, slots=True)
class RecurrentState(LayerKind):
    """A recurrent mixer's (a gated DeltaNet's, kvlm.model.deltanet: `heads` value heads
    of a (key_dim, value_dim) state, its convolution over q|k|v; a Mamba2 layer's,
    kvlm.model.mamba2: heads of (head_dim, state_size), over x|B|C): a state of `heads`
    matrices (`rows`, `cols`) and its causal convolution's last `conv_kernel` - 1 input
    rows of `conv_width` channels, both fixed a sequence, kept in state_dtype (fp32; fp64
    for an fp64 cache) by kvlm.cache.recurrent: the cache's shapes, not the mixer's
    arithmetic (`recurrent_state` maps a mixer's sizes to them). The rows are part of this
    kind, not a ConvWindow group of their own: they and the state move together (one
    begin/commit a step, the same layers).
    No row per token (token_bytes 0); the next query reads no position before it (the
    state holds them all). A state cannot forget tokens: a rollback (a rejected draft's
    rows) goes back to a state kept for it with its rows, no slack (the one-sequence
    caches: after each draft row, kvlm.cache.recurrent.DeltaRows; the pool: a draft step's
    until its sequence's next step, StateSlots); sequence_bytes is a slot's, without them."""

    name: ClassVar[str] = "state"
    code: ClassVar[int] = 3
    heads: int
    rows: int
    cols: int
    conv_kernel: int
    conv_width: int
    # a gated DeltaNet's rule runs in chunks of this many positions (kernels/deltanet.c):
    # its state is the one at the chunk start of a sequence's length, beside the chunk's
    # rows since (`window_shape`); None: no chunks, the state after every token (Mamba2:
    # a field that is not set, so a Mamba2 cache file's layout is as it was)
    chunk: int | None = None

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One layer's state of one sequence: (heads, rows, cols)."""
        return self.heads, self.rows, self.cols

    @property
    def window_shape(self) -> tuple[int, int, int]:
        """One layer's carried rows of one sequence: (heads, chunk - 1, rows + cols + 2),
        a row each position of the current chunk before the length: its k (rows), u
        (cols), g and the chunk's cumulative g (empty without chunks)."""
        return self.heads, (self.chunk or 1) - 1, self.rows + self.cols + 2

    @property
    def keep(self) -> int:
        return 0  # no positions: the state

    def kept(self, tokens: int) -> int:
        return 0

    def first_read(self, length: int) -> int:
        return length

    def token_bytes(self, spec: Geometry) -> int:
        return 0

    def sequence_bytes(self, spec: Geometry) -> int:
        rows = (self.conv_kernel - 1) * self.conv_width
        values = self.heads * self.rows * self.cols + rows + math.prod(self.window_shape)
        return values * state_dtype(spec.kv_dtypes[0]).itemsize

    def end_bytes(self, spec: Geometry) -> int:
        return 0  # no state kept at block ends yet (kvlm.cache.recurrent.StateSlots)

    def carries_at(self, block_size: int) -> bool:
        """Whether the state at a block end carries rows (a chunk that does not end there:
        a block size not a multiple of the chunk); a snapshot then keeps them too."""
        return bool(self.chunk) and block_size % self.chunk != 0  # type: ignore[operator]

    def snapshot_bytes(self, spec: Geometry, block_size: int) -> int:
        """A snapshot's bytes: the state and conv rows, and the carried rows where a block
        end carries some (`carries_at`)."""
        window = 0 if self.carries_at(block_size) else math.prod(self.window_shape)
        return self.sequence_bytes(spec) - window * state_dtype(spec.kv_dtypes[0]).itemsize


@dataclass(frozen=True, slots=True)
class LatentAttention(LayerKind):
    """Latent attention's (kvlm.model.mla): every token's compressed latent (`rank`, after
    its RMSNorm) and its rotated key part (`rope`, one shared head), nothing per head; the
    heads' K and V are made from them at attention time. Kept as the rows of one KV head
    of half the row each (`shape`): the latent and key part side by side, the first half
    in K's place and the rest in V's (a zero past an odd length), so every cache mode, the
    pool, its files and its plans keep and price it as they keep rows:
    2 x ceil((rank + rope) / 2) values a token and layer."""

    name: ClassVar[str] = "latent"
    code: ClassVar[int] = 4
    rank: int
    rope: int

    @property
    def half(self) -> int:
        """The width of each of the two rows a token: half the latent row, rounded up."""
        return (self.rank + self.rope + 1) // 2

    def shape(self, spec: Geometry) -> tuple[int, int]:
        return 1, self.half


# Every kind by its code (a file's `groups` layout): a new kind takes the next number
KINDS: dict[int, type[LayerKind]] = {
    k.code: k for k in (FullAttention, SlidingWindow, ConvWindow, RecurrentState, LatentAttention)
}
# The kinds that keep a fixed state a sequence, no rows per token (a cache's part of their
# own beside the mode's cache of the others: kvlm.cache.hybrid)
STATE_KINDS = (ConvWindow, RecurrentState)


def recurrent_state(config: ModelConfig) -> RecurrentState | None:
    """What each of `config`'s recurrent layers keeps (ModelConfig.recurrent_layers; None:
    it has none): a gated DeltaNet's v heads of (key_dim, value_dim) and its q|k|v rows, a
    Mamba2 layer's heads of (head_dim, state_size) and its x|B|C rows."""
    d, m = config.deltanet, config.mamba2
    if d is not None and config.deltanet_layers:
        return RecurrentState(
            d.value_heads, d.key_dim, d.value_dim, d.conv_kernel, d.conv_width, DELTA_CHUNK
        )
    if m is not None and config.mamba2_layers:
        return RecurrentState(m.heads, m.head_dim, m.state_size, m.conv_kernel, m.conv_width)
    return None


def kind_from(code: int, fields: dict[str, int]) -> LayerKind:
    """The kind a file's layout names: KINDS[code] with `fields` (ints >= 1). ValueError
    for a code kvlm does not know, or fields the kind does not have or lacks."""
    cls = KINDS.get(code)
    if cls is None:
        raise ValueError(f"kind {code} is not one of {sorted(KINDS)}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    needed = {n for n, f in known.items() if f.default is dataclasses.MISSING}
    if not needed <= set(fields) <= set(known):
        raise ValueError(f"kind {cls.name!r} takes {sorted(needed)} (and may take "
                         f"{sorted(set(known) - needed)}), not {sorted(fields)}")  # fmt: skip
    bad = [n for n, v in fields.items() if type(v) is not int or v < 1]
    if bad:
        raise ValueError(f"kind {cls.name!r}: {bad[0]} {fields[bad[0]]!r} is not an integer >= 1")
    return cls(**fields)


def latent_kind(config: ModelConfig) -> LatentAttention | None:
    """What each of `config`'s latent attention layers keeps (None: it has none)."""
    x = config.latent
    return None if x is None or not config.latent_layers else LatentAttention(x.kv_rank, x.rope_dim)


def cache_geometry(config: ModelConfig) -> tuple[int, int]:
    """(KV heads, head_dim) of `config`'s cache rows: its attention's, or where every layer
    is latent attention (ModelConfig.latent: all layers or none), the latent kind's
    (one head of half a latent row)."""
    latent = latent_kind(config)
    if latent is not None:
        return latent.shape(None)  # type: ignore[arg-type]
    # rows of their own (ModelConfig.kv_row_dim, kv_heads_of) the same in every layer
    # that keeps K/V: the spec's geometry
    rows = {(config.kv_heads_of(i), config.kv_row_dim(i)) for i in config.cache_layers}
    return rows.pop() if len(rows) == 1 else (config.num_kv_heads, config.head_dim)


def kind_of(window: int | None) -> LayerKind:
    """What an attention layer with model window `window` keeps (None: the whole context)."""
    return FullAttention() if window is None else SlidingWindow(window)


def layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    """What each of `config`'s layers keeps, from its mixer: an attention layer's is
    kind_of(its window, ModelConfig.layer_windows). () where every layer keeps the same:
    every row of every token (a window every layer shares, Mistral's, is the masks'
    business: CacheSpec.for_model makes it the spec's sliding_window). A conv layer's
    (ModelConfig.layer_mixers "conv") is ConvWindow(kernel - 1, hidden). Latent attention
    is every layer's of its model or none's (ModelConfig.latent): () too, the spec's
    geometry then the LatentAttention kind's (`cache_geometry`). A layer of its own head
    geometry (ModelConfig.layer_head_dims, layer_kv_heads) keeps its kind with it. Only
    the layers that keep K/V have a kind (ModelConfig.cache_layers: a layer that reads an
    earlier layer's K/V keeps nothing), so the kinds index a cache's layers; a K = V
    layer's rows are half its head (ModelConfig.kv_row_dim: one tensor a token)."""
    windows = config.layer_windows or (config.sliding_window,) * config.num_layers
    kinds = [kind_of(w) for w in windows]
    if len(set(config.layer_windows)) < 2:
        kinds = [FullAttention()] * config.num_layers  # a shared window: the masks'
    for i in range(config.num_layers):  # a layer's own row geometry: its kind's rows
        heads, dim = config.kv_heads_of(i), config.kv_row_dim(i)
        if (heads, dim) != cache_geometry(config):
            kinds[i] = dataclasses.replace(kinds[i], heads=heads, head_dim=dim)
    if config.conv_layers:
        conv = ConvWindow(config.conv_kernel - 1, config.hidden_size)  # type: ignore[operator]
        for i in config.conv_layers:
            kinds[i] = conv
    state = recurrent_state(config)
    if state is not None:
        for i in config.recurrent_layers:
            kinds[i] = state
    # the layers that read an earlier layer's K/V keep none: the cache's layers are the
    # others (ModelConfig.cache_layers), in order
    kinds = [kinds[i] for i in config.cache_layers]
    return tuple(kinds) if len(set(kinds)) > 1 else ()


def keeps(config: ModelConfig, layer: int) -> str:
    """What `config`'s layer `layer` keeps a token, as `kvlm memory`, `kvlm inspect`,
    /v1/kv and the dashboard name it: "K/V" (a K row and a V row of its own), "K = V" (one
    row that is its K and its V), "latent" (latent attention's latent and rotated key
    part), "shared" (nothing: it reads an earlier layer's K/V), or a state kind's name
    ("conv" rows, a recurrent "state")."""
    if layer in config.latent_layers:
        return "latent"
    if config.kv_source(layer) != layer:
        return "shared"
    if layer in config.conv_layers:
        return ConvWindow.name
    if layer in config.recurrent_layers:
        return RecurrentState.name
    return "K = V" if config.k_eq_v(layer) else "K/V"


def shown(config: ModelConfig, layers: list[int]) -> dict:
    """A group of `config`'s cache layers (`layers`: indices of ModelConfig.cache_layers)
    as it is shown: what they keep ("keeps": `keeps` of each, the forms joined by " and "),
    and where later layers read their K/V instead of keeping their own, those layers
    ("shared_by", model layer indices; absent where none do)."""
    own = [config.cache_layers[i] for i in layers]
    forms = dict.fromkeys(keeps(config, i) for i in own)
    out: dict = {"keeps": " and ".join(forms)}
    readers = [j for j in range(config.num_layers) if j not in own and config.kv_source(j) in own]
    if readers:
        out["shared_by"] = readers
    return out
