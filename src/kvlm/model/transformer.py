"""One transformer for every family, built from the ModelConfig's description of its block
(kvlm.config: each layer's mixer, attention or a short convolution; the activation, the
norm layout, the embedding scale, soft-caps, q/k norms, each layer's window and RoPE
base) and the weights by the model's tensor names (kvlm.model.weights.WeightSource: a
family's quirks already folded into them).

The same `forward` serves prefill, decode and chunked prefill: what differs is how many
tokens are fed, at which positions, and which cache step they attend through (and for
conv layers, which ConvStep holds their rows: kvlm.model.conv).
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from kvlm.cache.kinds import ConvWindow, recurrent_state
from kvlm.cache.memory import available_memory
from kvlm.cache.recurrent import DeltaRows, DeltaStep
from kvlm.config import ModelConfig, RopeScaling
from kvlm.errors import ModelLoadError, UnsupportedModelError
from kvlm.model import quant
from kvlm.model.attention import Attention, KVStep
from kvlm.model.conv import ConvRows, ConvStep, ShortConv
from kvlm.model.deltanet import GatedDeltaNet
from kvlm.model.experts import Experts
from kvlm.model.layers import MLP, Linear, RMSNorm, RotaryEmbedding, feeding_prompt
from kvlm.model.mamba2 import Mamba2Mixer
from kvlm.model.mla import LatentAttention
from kvlm.model.mtp import MtpHead
from kvlm.model.numerics import ModelNumerics
from kvlm.model.weights import BESIDE_NORMS, WeightSource, out_norms

VOCAB_WEIGHTS = ("lm_head.weight", "model.embed_tokens.weight")
log = logging.getLogger("kvlm.loading")
# a forward past position 0 of a model with conv layers, given no ConvStep (a cache made
# for another model's spec; the caches of this model's spec keep a conv group)
NO_CONV_ROWS = (
    "this model's short-convolution layers need their rows of the tokens before this step, "
    "which this cache does not keep: make it with the model's own cache spec (LLM.new_cache)"
)
# a forward past position 0 of a model with recurrent layers (gated DeltaNet, Mamba2), given
# no DeltaStep (a cache made for another model's spec; the caches of this model's spec keep
# a state group)
NO_DELTA_STATE = (
    "this model's recurrent layers need their state of the tokens before this step, "
    "which this cache does not keep: make it with the model's own cache spec (LLM.new_cache)"
)


class Block(nn.Module):
    """Pre-norm mixer (attention, a short convolution: `conv`, or a recurrent mixer, a
    gated DeltaNet or a Mamba2 layer: `recurrent`) and MLP, each added to the residual
    stream (times `residual_scale` where it is not None: ModelConfig's). A "sandwich"
    block (ModelConfig.norm_layout) also norms each one's output before adding it
    (`attn_out_norm`, `mlp_out_norm`); a mixture of experts beside the MLP (`beside`:
    Experts.beside_mlp) adds its output to the MLP's before that norm."""

    def __init__(
        self,
        attn: Attention | LatentAttention | None,
        mlp: MLP | Experts,
        input_norm: RMSNorm,
        post_norm: RMSNorm,
        attn_out_norm: RMSNorm | None = None,
        mlp_out_norm: RMSNorm | None = None,
        conv: ShortConv | None = None,
        recurrent: GatedDeltaNet | Mamba2Mixer | None = None,
        residual_scale: float | None = None,
        per_layer: PerLayerInput | None = None,
        scalar: torch.Tensor | None = None,
        beside: ExpertsBeside | None = None,
    ):
        super().__init__()
        self.beside = beside  # experts beside the MLP (ModelConfig.experts.beside_mlp)
        self.per_layer = per_layer  # the layer's per-layer input (ModelConfig.per_layer_input)
        self.scalar = scalar  # the output times this (ModelConfig.layer_scalars)
        self.attn = attn
        self.conv = conv
        self.recurrent = recurrent
        self.residual_scale = residual_scale
        self.mlp = mlp
        self.input_norm = input_norm
        self.post_norm = post_norm
        self.attn_out_norm = attn_out_norm
        self.mlp_out_norm = mlp_out_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVStep,
        key_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        rows: ConvStep | None = None,
        state: DeltaStep | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_norm(x)
        if self.conv is not None:
            a = self.conv(h, rows)
        elif self.recurrent is not None:
            a = self.recurrent(h, state)
        else:
            a = self.attn(h, cos, sin, kv, key_rope)
        a = a if self.attn_out_norm is None else self.attn_out_norm(a)
        x = x + (a if self.residual_scale is None else a * self.residual_scale)
        m = self.mlp(self.post_norm(x))
        m = m if self.beside is None else self.beside(x, m)
        m = m if self.mlp_out_norm is None else self.mlp_out_norm(m)
        x = x + (m if self.residual_scale is None else m * self.residual_scale)
        if self.per_layer is not None:
            x = x + self.per_layer(x, per_layer_input)
        return x if self.scalar is None else x * self.scalar


class ExpertsBeside(nn.Module):
    """A mixture of experts beside a layer's dense MLP (Experts.beside_mlp), on the
    residual stream x after the mixer:

        dense_out_norm(m) + experts_out_norm(experts(experts_in_norm(x)))

    where m is the dense MLP's output (of the block's MLP input norm of x, as ever) and
    the router reads x itself (through its own input norm: Experts' `router_norm`)."""

    def __init__(self, experts: Experts, in_norm: RMSNorm, dense_out_norm: RMSNorm,
                 out_norm: RMSNorm) -> None:  # fmt: skip
        super().__init__()
        self.experts, self.in_norm = experts, in_norm
        self.dense_out_norm, self.out_norm = dense_out_norm, out_norm

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        y = self.experts(self.in_norm(x), route_from=x)
        return self.dense_out_norm(m) + self.out_norm(y)


class PerLayerInput(nn.Module):
    """A layer's per-layer input (ModelConfig.per_layer_input), added to its output:
    norm(proj(act(gate(x)) * its input)), the activation the MLP's."""

    def __init__(self, gate: Linear, proj: Linear, norm: RMSNorm, activation: str) -> None:
        super().__init__()
        self.gate, self.proj, self.norm, self.activation = gate, proj, norm, activation

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        g = F.silu(g) if self.activation == "silu" else F.gelu(g, approximate="tanh")
        return self.norm(self.proj(g * inputs))


class Transformer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        weights: WeightSource,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        progress: bool = True,
        weight_format: str | None = None,
        numerics: ModelNumerics | None = None,
        cpu_experts: int = 0,
    ) -> None:
        """`numerics`: how the products and the prompt's attention round (fp32 without),
        handed to each layer as it is built; the runner reads them here (`numerics`).
        `weight_format` (kvlm.model.layers.Linear.convert): None keeps the projections
        in `dtype`; "bf16", "int8", "int4" convert each as it loads (int4 keeps the vocabulary
        projection at int8); "native" multiplies a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0,
        Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 blocks as stored (q|k|v and gate|up of different
        types as parts of their own kinds; other quantized types as int8, named in a warning,
        float tensors as `dtype`). The embedding table stays in `dtype` (one row per
        token). `cpu_experts`: the routed experts of the first that many expert layers
        kept in host memory and run on the CPU (`host_experts`; Experts' `host`)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.numerics = numerics or ModelNumerics()
        # the layers whose routed experts live in host memory (--cpu-experts)
        self.host_experts = frozenset(sorted(config.expert_layers)[:cpu_experts])
        loader = _WeightTaker(weights, config, dtype, self.device, progress, weight_format,
                              self.numerics, self.host_experts)  # fmt: skip
        capacity = _arena_capacity(weights) if weight_format in quant.PACKED_FORMATS else 0
        arena = quant.packing_on_huge_pages(capacity) if capacity else nullcontext()
        with loader, freed_memory_returned(), arena as packed_in:
            self.layers = nn.ModuleList(loader.block(i) for i in range(config.num_layers))
            self.norm = loader.norm("model.norm")
            self.mtp = loader.mtp_head()  # a drafter the file carries (kvlm.model.mtp)
            tied = config.tie_word_embeddings or "lm_head.weight" not in loader.available
            # --weights native: the table stays in its stored low-bit format, rows
            # dequantized on lookup (a 151,936 x 896 table is 519 MiB in fp32)
            q = self._embed_quant = loader.native_embedding("model.embed_tokens.weight")
            embed = None if q is not None else loader.take("model.embed_tokens.weight")
            # the vocabulary projection: fp32 products, its prompt rows the single rows'
            # road (Linear's `vocabulary`)
            if not tied:
                self.lm_head = loader.linear("lm_head.weight", vocabulary=True)
            elif q is not None:
                self.lm_head = Linear.from_quant(q, vocabulary=True)
            else:
                self.lm_head = loader.linear("model.embed_tokens.weight", embed, vocabulary=True)
            # Tied: read embeddings out of lm_head's weight unless it is packed.
            self._embed_table = embed if not tied or self.lm_head.rows() is None else None
            # the per-layer inputs' table, projection and norm (ModelConfig.per_layer_input)
            self.per_layer_table = self.per_layer_proj = self.per_layer_norm = None
            if config.per_layer_input:
                self.per_layer_table = loader.take("model.embed_tokens_per_layer.weight")
                self.per_layer_proj = loader.linear("model.per_layer_model_projection.weight")
                self.per_layer_norm = loader.norm("model.per_layer_projection_norm")
            freq_factors = loader.take_raw("rope_freqs.weight")
            if freq_factors is not None and not bool((freq_factors.float() > 0).all()):
                raise ModelLoadError("rope_freqs.weight holds a factor that is not a positive "
                                     "number (RoPE frequencies are divided by them)")  # fmt: skip
            weights.release()  # the vocabulary table's pages
        # each RoPE turns heads of its layers' size (ModelConfig.layer_head_dims)
        full_dim, window_dim = _rope_head_dims(config)
        self.rope = RotaryEmbedding(replace(config, head_dim=full_dim), self.device, freq_factors)
        # the layers with a window turn at their own base where they have one, unscaled
        self.local_rope = None
        if config.rope_local_theta is not None:
            local = replace(config, rope_theta=config.rope_local_theta, rope_scaling=RopeScaling(),
                            head_dim=window_dim)  # fmt: skip
            self.local_rope = RotaryEmbedding(local, self.device)
        # each layer's index in the cache (the layers that keep K/V: a layer that reads an
        # earlier one's is at that one's), and the layers whose K/V a later layer reads
        at = {i: n for n, i in enumerate(config.cache_layers)}
        self._cache_index = [at[config.kv_source(i)] for i in range(config.num_layers)]
        self._kv_keepers = [b.attn for b in self.layers
                            if isinstance(b.attn, Attention) and b.attn.keeps_kv]  # fmt: skip
        # each layer's RoPE: 0 self.rope, 1 self.local_rope (a layer with a window)
        two = self.local_rope is not None
        self._rope_of = [int(two and w is not None) for w in config.layer_windows]
        self._rope_of = self._rope_of or [0] * config.num_layers
        for i, b in enumerate(self.layers):  # a K = V layer makes its keys at their positions
            if isinstance(b.attn, Attention) and b.attn.k_eq_v:
                b.attn.key_rope = self.local_rope if self._rope_of[i] else self.rope
        # what each conv layer keeps of a sequence: its last kernel - 1 input rows
        self.conv_window = None
        if config.conv_layers:
            self.conv_window = ConvWindow(config.conv_kernel - 1, config.hidden_size)
        # embeddings times embed_scale, rounded to fp32 first as transformers does
        scale = config.embed_scale
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        # low-bit weights on huge pages, in the order a decode step reads them: packed
        # there as they loaded; any that did not fit moved there now, each old copy freed
        # as soon as it has moved
        owners: dict[int, list[Linear]] = {}
        packed: list[quant.QuantWeight] = []
        for m in self.modules():
            if isinstance(m, Linear) and m.quant is not None:
                inside = packed_in is not None and packed_in.holds(m.quant.data)
                if id(m.quant) not in owners and not inside and not m.quant.in_place:
                    packed.append(m.quant)
                owners.setdefault(id(m.quant), []).append(m)

        def moved(w: quant.QuantWeight) -> None:
            for m in owners[id(w)]:
                m.weight = w.data

        with freed_memory_returned():
            if packed:
                quant.move_to_huge_pages(packed, moved)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids (any shape) -> (*ids.shape, H) in the model dtype."""
        if self._embed_quant is not None:
            x = self._embed_quant.rows(ids.cpu()).to(self.device, self.dtype)
        else:
            table = self._embed_table
            x = (self.lm_head.rows() if table is None else table)[ids]
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def new_conv_rows(self, batch: int = 1, slack: int = 0) -> ConvRows:
        """Empty rows of this model's conv layers for `batch` sequences (`slack`: rows
        kept for a rollback of up to that many tokens)."""
        layers = len(self.config.conv_layers)
        return ConvRows(self.conv_window, layers, batch, self.dtype, self.device, slack)

    def new_delta_rows(self, batch: int = 1) -> DeltaRows:
        """Zero state of this model's recurrent layers (gated DeltaNet or Mamba2) for
        `batch` sequences."""
        layers = len(self.config.recurrent_layers)
        return DeltaRows(recurrent_state(self.config), layers, batch, self.dtype, self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVStep,
        last_only: bool = True,
        prompt: bool | None = None,
        conv: ConvStep | None = None,
        recurrent: DeltaStep | None = None,
        hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: (B, T) -> fp32 logits (B, 1 or T, V) (fp64 for an fp64
        model: the reference keeps its precision to the end). With `hidden`, (the logits,
        every position's final-normed state (B, T, H): what an MTP head drafts from).

        `last_only` skips the vocabulary projection for all but the last position: a
        512-token prefill would otherwise build a 512 x 49152 logits matrix to use one row.
        `prompt`: the tokens are a prompt's (True) or decoded ones (False), which picks the
        low-bit products' numerics (kvlm.model.layers.feeding_prompt); None: T > 1.
        `conv`: the conv layers' rows before the step (kvlm.model.conv; the caller commits
        them); None: the cache step's (`kv.conv`, a cache that keeps a conv group), else
        rows of zeros, right for a step from position 0 only. `recurrent`: the gated
        DeltaNet layers' rows and states before the step (kvlm.model.deltanet; the caller
        commits them); None: the cache step's (`kv.recurrent`, a cache that keeps a state
        group, kvlm.cache.recurrent), else a zero state, right for a step from position 0
        only.
        """
        if prompt is None:
            prompt = input_ids.shape[-1] > 1
        if conv is None:
            conv = getattr(kv, "conv", None)
        if conv is None and self.conv_window is not None:
            conv = self._fresh_rows(input_ids, positions)
        elif conv is not None and positions.numel() and int(positions[0, 0]) != conv.start:
            raise ValueError(f"the conv rows are at position {conv.start}, the step at "
                             f"{int(positions[0, 0])}")  # fmt: skip
        if recurrent is None:
            recurrent = getattr(kv, "recurrent", None)
        if recurrent is None and self.config.recurrent_layers:
            if positions.numel() and int(positions[..., 0].max()) != 0:
                raise UnsupportedModelError(NO_DELTA_STATE)
            recurrent = self.new_delta_rows(input_ids.shape[0]).begin(input_ids.shape[-1])
        elif (
            recurrent is not None
            and positions.numel()
            and (int(positions[0, 0]) != recurrent.start)
        ):
            raise ValueError(f"the recurrent state is at position {recurrent.start}, the step "
                             f"at {int(positions[0, 0])}")  # fmt: skip
        with feeding_prompt(prompt):
            x = self.embed(input_ids)  # (B, T, H)
            # A cache that keeps K before RoPE (the window cache, positions inside the
            # cache) names every key's position; cos/sin for them once per step, for all
            # layers (of each RoPE base).
            ropes = [self._ropes(r, positions, kv.key_rope_positions, x.dtype)
                     for r in (self.rope, self.local_rope) if r is not None]  # fmt: skip
            inputs = None if self.per_layer_table is None else self._per_layer(input_ids, x)
            try:
                for i, layer in enumerate(self.layers):
                    cos, sin, key_rope = ropes[self._rope_of[i]]
                    x = layer(x, cos, sin, kv.for_layer(self._cache_index[i]), key_rope, conv,
                              recurrent, None if inputs is None else inputs[:, :, i])  # fmt: skip
            finally:
                for attn in self._kv_keepers:  # the K/V later layers read: this step's
                    attn.kept = None
            normed = self.norm(x) if hidden else None  # a row's norm is its own: same bits
            rows = x if normed is None else normed
            if kv.logit_rows is not None:  # a ragged step: each sequence's rows it asks for
                rows = rows[:, kv.logit_rows]
            elif last_only:
                rows = rows[:, -1:]
            logits = self._logits(self.norm(rows) if normed is None else rows.contiguous())
        return logits if normed is None else (logits, normed)

    def _per_layer(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every layer's per-layer input (B, T, layers, width) (ModelConfig.per_layer_input):
        (norm(projection(embeddings) / sqrt(hidden)) + table[ids] * sqrt(width)) / sqrt(2),
        the table's scale rounded to fp32 first as the embeddings' is."""
        c = self.config
        n, width = c.num_layers, c.per_layer_input
        proj = self.per_layer_proj(x) * c.hidden_size**-0.5
        proj = self.per_layer_norm(proj.reshape(*x.shape[:-1], n, width))
        scale = torch.tensor(width**0.5, dtype=torch.float32).to(x.dtype)
        table = self.per_layer_table[ids.to(self.per_layer_table.device)] * scale
        return (proj + table.reshape(*ids.shape, n, width)) * 2.0**-0.5

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection of final-normed rows, soft-capped and scaled as the
        config says: fp32 (fp64 for an fp64 model)."""
        logits = self.lm_head(normed)
        if self.config.final_softcap is not None:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        if self.config.logit_scale is not None:
            logits = logits / self.config.logit_scale
        return logits if logits.dtype == torch.float64 else logits.float()

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv: KVStep,
        step: int = 0,
        last_only: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head (`self.mtp`) at `positions` (B, T): `next_ids` (B, T) the tokens
        after each position, `hidden` (B, T, H) the states it drafts from, `kv` the head's
        cache step -> (fp32 logits (B, 1, V) of the token after the last position, or with
        `last_only` False every position's (B, T, V); the head's normed states (B, T, H):
        the next draft's `hidden`). Products as the model's: prompt rows where T > 1."""
        if self.mtp is None:
            raise UnsupportedModelError("this model file carries no multi-token-prediction head")
        # the drafter's ids and positions are made on the host: the head runs where the
        # model does (a GPU's)
        next_ids, positions = next_ids.to(self.device), positions.to(self.device)
        with feeding_prompt(next_ids.shape[-1] > 1):
            cos, sin, _ = self._ropes(self.rope, positions, None, hidden.dtype)
            normed = self.mtp(self.embed(next_ids), hidden, cos, sin, kv, step)
            rows = normed[:, -1:] if last_only else normed
            return self._logits(rows.contiguous()), normed

    def _fresh_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> ConvStep:
        """Zero rows for a step from position 0 (the `off` cache's every forward, a first
        prefill); past it, the rows of the tokens before are needed and not here."""
        if positions.numel() and int(positions[..., 0].max()) != 0:
            raise UnsupportedModelError(NO_CONV_ROWS)
        return self.new_conv_rows(input_ids.shape[0]).begin(input_ids.shape[-1])

    @staticmethod
    def _ropes(
        rope: RotaryEmbedding, positions: torch.Tensor, keys_at: torch.Tensor | None, dtype
    ) -> tuple:
        """(cos, sin, the keys' cos/sin or None) of one RoPE base for a step."""
        cos, sin = rope(positions, dtype)
        return cos, sin, None if keys_at is None else rope.for_keys(keys_at, dtype)


def _rope_head_dims(config: ModelConfig) -> tuple[int, int]:
    """The head size of the layers without a window and of those with one (each RoPE's):
    head_dim, or where layers have their own (ModelConfig.layer_head_dims), theirs, one
    size a RoPE."""
    if not config.layer_head_dims:
        return config.head_dim, config.head_dim
    windows = config.layer_windows or (config.sliding_window,) * config.num_layers
    split = config.rope_local_theta is not None  # else one RoPE for every layer
    dims = []
    for windowed in (False, True):
        sizes = {d for d, w in zip(config.layer_head_dims, windows, strict=True)
                 if not split or (w is not None) == windowed}  # fmt: skip
        if len(sizes) > 1:
            raise UnsupportedModelError(f"layers of head sizes {sorted(sizes)} under one RoPE")
        dims.append(sizes.pop() if sizes else config.head_dim)
    return dims[0], dims[1]


def _arena_capacity(weights: WeightSource) -> int:
    """Address space to reserve for the packed weights: twice the model's files (a K-quant
    packs to its own size; int8 from a 2-3 bit type to up to ~3x, which then overflows to
    ordinary memory and moves after), untouched pages costing nothing; 0 where the source
    has no file to size it by."""
    size = sum(f.stat().st_size for f in weights.files())
    return 2 * size + (64 << 20) if size else 0


@contextmanager
def freed_memory_returned() -> Iterator[None]:
    """While loading, glibc hands every block of 1 MiB or more back to the OS when it is
    freed (mallopt M_MMAP_THRESHOLD), and trims its heap at the end: packing makes many
    temporaries of a few MiB, which its default (a threshold that rises to 32 MiB after
    the first big free) kept in the heap, so the process held ~1.1 GiB of freed memory
    after loading a 1B model. Afterwards the thresholds are where glibc's dynamic rule
    takes them, fixed: mmap 32 MiB, and trim twice that. (Setting one turns the rule off
    for both: the trim threshold stayed at 128 KiB, the heap was cut back after every
    forward and the next one faulted its buffers in again: a 512-token prompt on a 0.5B
    model took 740 ms instead of 500.) A no-op off glibc."""
    libc = _glibc()
    if libc is None:
        yield
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 64 << 20)
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc, not musl under that name
    except (OSError, AttributeError):
        return None
    return libc


# Q8_0 expert stacks are read in place where the model's files pass this share of the
# memory available at load (_WeightTaker._experts_in_place)
IN_PLACE_SHARE = 1.0


@dataclass
class _WeightTaker:
    """Pulls named tensors from a WeightSource, converting each at once (one in flight)."""

    weights: WeightSource
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    progress: bool
    weight_format: str | None = None
    numerics: ModelNumerics = field(default_factory=ModelNumerics)  # a block's products
    host_experts: frozenset[int] = frozenset()  # layers whose routed experts stay on the host

    def __post_init__(self) -> None:
        self.available = set(self.weights.names())
        # layer -> its Attention, for the later layers that read its K/V (kv_sources)
        self.kv_sources: dict[int, Attention] = {}
        self._in_place: bool | None = None  # _experts_in_place, decided once a load
        # --weights native: what had no kernel, (file name pattern, type) -> (outcome, count)
        self.requantized: dict[tuple[str, str], tuple[str, int]] = {}
        self.bar = tqdm(
            total=len(self.available),
            desc="loading weights",
            unit="tensor",
            disable=not self.progress,
            file=sys.stderr,
            leave=False,
        )

    def __enter__(self) -> _WeightTaker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
        for (pattern, qtype), (outcome, count) in self.requantized.items():
            many = f" ({count} tensors)" if count > 1 else ""
            log.warning("%s: %s has no kvlm kernel; %s%s", pattern, qtype, outcome, many)

    def _note(self, names: list[str], outcome: str) -> None:
        """Remember (for one warning per kind of tensor and type) what `names` became."""
        for name in names:
            file_name, qtype = self.weights.stored_as(name)
            pattern = re.sub(r"^(blk|model\.layers)\.\d+\.", r"\1.*.", file_name)
            _, count = self.requantized.get((pattern, qtype), (outcome, 0))
            self.requantized[pattern, qtype] = (outcome, count + 1)

    def take_raw(self, name: str) -> torch.Tensor | None:
        if name not in self.available:
            return None
        self.bar.update(1)
        return self.weights.get(name)

    def take(self, name: str) -> torch.Tensor:
        tensor = self.take_raw(name)
        if tensor is None:
            raise ModelLoadError(f"the model file has no tensor {name}")
        return tensor.to(device=self.device, dtype=self.dtype)

    def fused_linear(self, prefix: str, parts: tuple[str, ...]) -> Linear:
        """Concatenate projections that read the same input (q|k|v, gate|up) into one."""
        names = [f"{prefix}.{p}.weight" for p in parts]
        biases = [self.take_raw(f"{prefix}.{p}.bias") for p in parts]
        bias = None
        if any(b is not None for b in biases):  # zeros for the parts that have none
            filled = [
                torch.zeros(self._rows(n)) if b is None else b.float()
                for n, b in zip(names, biases, strict=True)
            ]
            bias = torch.cat(filled).to(device=self.device, dtype=self.dtype)
        native = [self._native(n, packed=False) for n in names]
        if any(q is not None for q in native):  # packed into one buffer (quant.concat)
            self.bar.update(sum(q is not None for q in native))
            pairs = zip(names, native, strict=True)
            parts = [self._as_int8(n) if q is None else q for n, q in pairs]
            return Linear.from_quant(quant.concat(parts), bias, self.numerics)
        return self._make(torch.cat([self.take(n) for n in names], dim=0), bias, names)

    def _as_int8(self, name: str) -> quant.QuantWeight:
        """A part of a native fused projection that has no kernel of its own: int8, as
        `_make` would store it (its width, that of the native parts, is in groups of 32)."""
        self._note([name], "re-quantized to int8")
        with quant.outside_arena():  # a part, copied into the fused weight's own buffer
            return quant.quantize(self.take(name), "q8")

    def linear(
        self,
        name: str,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        vocabulary: bool = False,
    ) -> Linear:
        """One projection (`weight`: already taken, e.g. the tied embedding; `vocabulary`:
        the vocabulary projection, Linear's)."""
        native = self._native(name)
        if native is not None:
            if weight is None:
                self.bar.update(1)
            return Linear.from_quant(native, bias, self.numerics, vocabulary)
        weight = self.take(name) if weight is None else weight
        return self._make(weight, bias, [name], vocabulary)

    def _rows(self, name: str) -> int:
        """Output rows of a projection, from the config (reading the tensor would decode
        it whole)."""
        c = self.config
        part = name.split(".")[-2]
        found = re.match(r"model\.layers\.(\d+)\.mlp\.", name)  # a layer's own MLP width
        if found and part in ("gate_proj", "up_proj"):
            return c.intermediate_of(int(found.group(1)))
        q_rows = c.num_heads * c.head_dim * (2 if c.attn_output_gate else 1)  # q|gate
        known = {"q_proj": q_rows, "k_proj": c.num_kv_heads * c.head_dim,
                 "v_proj": c.num_kv_heads * c.head_dim, "gate_proj": c.intermediate_size,
                 "up_proj": c.intermediate_size}  # fmt: skip
        return known[part] if part in known else self.weights.get(name).shape[0]

    def native_embedding(self, name: str) -> quant.QuantWeight | None:
        """The embedding table's own low-bit blocks (--weights native), one kind (not a
        mixed weight); None otherwise."""
        q = self._native(name)
        if q is None or q.kind == quant.MIXED:
            return None
        self.bar.update(1)
        return q

    def _native(self, name: str, packed: bool = True) -> quant.QuantWeight | quant.Blocks | None:
        """The file's own low-bit blocks for `name`, when --weights native can use them:
        packed, or (`packed=False`) as stored, for quant.concat to pack with others."""
        if self.weight_format != "native":
            return None
        return self.weights.get_quant(name, packed=packed)

    def _make(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        names: list[str],
        vocabulary: bool = False,
    ) -> Linear:
        """A Linear in the requested weight format (kvlm.model.layers.Linear.convert)."""
        fmt = self.weight_format
        if fmt == "native":  # no kernel for the stored type: int8 if it was quantized at all
            fmt = "int8" if any(self.weights.is_quantized(n) for n in names) else None
            if fmt == "int8":
                can = quant.can_quantize(weight)
                self._note(names, "re-quantized to int8" if can else f"dequantized to {self.dtype}")
        if fmt == "int4" and names[0] in VOCAB_WEIGHTS:
            # the vocabulary projection at 8 bits, as llama.cpp's Q4 files keep it: at 4 bits
            # greedy agreement with fp32 fell from 97% to 91% (benchmarks/bench_weights.py)
            fmt = "int8"
        if fmt in ("int8", "int4") and quant.can_quantize(weight):
            q = quant.quantize(weight, quant.FORMATS[fmt])
            return Linear.from_quant(q, bias, self.numerics, vocabulary)
        return Linear(weight, bias, fmt == "bf16", self.numerics, vocabulary)

    def block(self, i: int) -> Block:
        c = self.config
        p = f"model.layers.{i}"
        if c.layer_mixers and c.layer_mixers[i] == "conv":
            return self.conv_block(i)
        if c.layer_mixers and c.layer_mixers[i] == "deltanet":
            return self.deltanet_block(i)
        if c.layer_mixers and c.layer_mixers[i] == "mamba2":
            return self.mamba2_block(i)
        if c.layer_mixers and c.layer_mixers[i] == "latent":
            return self.latent_block(i, p)
        return self.attention_block(i, p)

    def latent_block(self, i: int, p: str) -> Block:
        """A latent attention block (kvlm.model.mla): its queries from `self_attn.q_proj`,
        or with a compressed query `q_a_proj`, `q_a_layernorm` and `q_b_proj`; the latent
        and key part from `kv_a_proj_with_mqa`, the latent's `kv_a_layernorm`, the heads'
        K/V rows `kv_b_proj` (kept dense in the model's dtype: both roads read its rows by
        head), `o_proj`. Scores scaled by query_scale, else the q/k head's size ** -0.5."""
        c, x = self.config, self.config.latent
        a = f"{p}.self_attn"
        q_a = q_norm = None
        if x.q_rank:
            q_a = self._with_bias(f"{a}.q_a_proj")
            q_norm = RMSNorm(self.take(f"{a}.q_a_layernorm.weight"), x.norm_eps)
            q = self.linear(f"{a}.q_b_proj.weight")
        else:
            q = self.linear(f"{a}.q_proj.weight")
        scale = c.query_scale if c.query_scale is not None else x.qk_dim**-0.5
        attn = LatentAttention(
            i, c.num_heads, x, q, self._with_bias(f"{a}.kv_a_proj_with_mqa"),
            RMSNorm(self.take(f"{a}.kv_a_layernorm.weight"), x.norm_eps),
            self._latent_kv_b(a),
            self._with_bias(f"{a}.o_proj"), scale, q_a, q_norm, self.numerics,
        )  # fmt: skip
        return self._block(i, p, attn=attn)

    def attention_block(self, i: int, p: str) -> Block:
        """The attention block of tensors `p`.* (a layer's, or an MTP head's block), its
        K/V at layer i of its cache."""
        c = self.config
        layer = p.startswith("model.")  # not an MTP head's block: the layer's own geometry
        d = c.head_dim_of(i) if layer else c.head_dim
        hkv = c.kv_heads_of(i) if layer else c.num_kv_heads
        source = c.kv_source(i) if layer else i  # another layer's K/V: no K/V of its own
        reads = source != i
        q_norm = k_norm = None
        if c.qk_norm:  # q and k normed before RoPE (each head, or each whole projection)
            q_norm = self.norm(f"{p}.self_attn.q_norm")
            k_norm = None if reads else self.norm(f"{p}.self_attn.k_norm")
        # another score scale than head_dim ** -0.5: the queries scaled by the ratio, in
        # their norm where they have one (RoPE is linear); exactly 1 where the two agree
        ratio = 1.0 if c.query_scale is None else c.query_scale / d**-0.5
        if q_norm is not None:
            q_norm.weight *= ratio
        parts = ("q_proj",) if reads else ("q_proj", "k_proj") if c.k_eq_v(i) and layer else (
            "q_proj", "k_proj", "v_proj")  # fmt: skip
        qkv = self.fused_linear(f"{p}.self_attn", parts)
        o_proj = self._with_bias(f"{p}.self_attn.o_proj")
        at = c.cache_layers.index(source) if layer else i  # its cache's layer
        attn = Attention(at, c.num_heads, hkv, d, qkv, o_proj, q_norm, k_norm,
                         self.numerics)  # fmt: skip
        attn.k_eq_v = len(parts) == 2
        if c.v_norm and not reads:  # V normed without a weight (ones: the same values)
            attn.v_norm = RMSNorm(torch.ones(d, dtype=self.dtype, device=self.device),
                                  c.rms_norm_eps)  # fmt: skip
        if reads:
            self.kv_sources[source].keeps_kv = True
            attn.kv_from = (self.kv_sources[source],)
        elif layer:
            self.kv_sources[i] = attn
        attn.q_scale = None if q_norm is not None or ratio == 1.0 else ratio
        attn.norm_projections = c.qk_norm_extent == "projection"
        attn.softcap = c.attn_softcap
        attn.gated = c.attn_output_gate
        if c.attn_sinks:  # a logit a query head in each row's softmax (attend_explicit)
            attn.sinks = self.take(f"{p}.self_attn.sinks").reshape(c.num_heads)
        return self._block(i, p, attn=attn)

    def _latent_kv_b(self, a: str) -> torch.Tensor:
        """A latent attention's kv_b (H x (nope + v), kv_rank): `a`.kv_b_proj, or where a
        file keeps it split per head, `k_b_proj` (H, kv_rank, nope: each head's K rows
        transposed) and `v_b_proj` (H, v, kv_rank) joined back."""
        if f"{a}.kv_b_proj.weight" in self.available:
            return self.take(f"{a}.kv_b_proj.weight")
        k_b, v_b = self.take(f"{a}.k_b_proj.weight"), self.take(f"{a}.v_b_proj.weight")
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])

    def mtp_head(self) -> MtpHead | None:
        """The file's multi-token-prediction head (`mtp.*`), or None where it has none (a
        config may name one whose tensors a save left out: the model runs without it)."""
        if not self.config.mtp_layers or "mtp.fc.weight" not in self.available:
            return None
        n = self.config.mtp_layers
        blocks = [self.attention_block(j, f"mtp.layers.{j}") for j in range(n)]
        norms = [self.norm(f"mtp.{k}") for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")]
        return MtpHead(self.linear("mtp.fc.weight"), *norms, blocks, self.norm("mtp.norm"))

    def _block(self, i: int, p: str | None = None, **mixer) -> Block:
        """Layer i around its mixer (Block's `attn`, `conv` or `recurrent`): the gated MLP
        (its gate|up one product: `mlp.gate_up_proj` where the file stores them as one,
        else gate_proj and up_proj joined), the attention's and the MLP's input norms (the
        MLP's: Llama's HF name), then their output norms where the block has them. `p`:
        the tensors' prefix, layer i's by default."""
        c, p = self.config, p or f"model.layers.{i}"
        # a multi-token-prediction head's block takes the model's FFN kind (a mixture of
        # experts' model: its head's block routes through experts too)
        layer = p.startswith("model.")
        routed = i in c.expert_layers if layer else bool(c.expert_layers)
        host = layer and i in self.host_experts
        beside = None
        if routed and c.experts.beside_mlp:  # the dense MLP, and the experts beside it
            beside = ExpertsBeside(self.experts(p, host),
                                   *(self.norm(f"{p}.{n}") for n in BESIDE_NORMS))  # fmt: skip
            routed = False
        mlp = self.experts(p, host) if routed else self._gated_mlp(f"{p}.mlp")
        names = ["input_layernorm", "post_attention_layernorm", *out_norms(c)]
        per_layer = scalar = None
        if layer and c.per_layer_input:  # the layer's per-layer input
            per_layer = PerLayerInput(self.linear(f"{p}.per_layer_input_gate.weight"),
                                      self.linear(f"{p}.per_layer_projection.weight"),
                                      self.norm(f"{p}.post_per_layer_input_norm"),
                                      c.activation)  # fmt: skip
        if layer and c.layer_scalars:
            scalar = self.take(f"{p}.layer_scalar").reshape(1)
        block = Block(mixer.pop("attn", None), mlp, *(self.norm(f"{p}.{n}") for n in names),
                      residual_scale=c.residual_scale, per_layer=per_layer, scalar=scalar,
                      beside=beside, **mixer)  # fmt: skip
        # the file's pages read so far are the model's own copies now: given back, so the
        # file and the packed model are never both resident (a layer at a time)
        self.weights.release()
        return block

    def experts(self, p: str, host: bool = False) -> Experts:
        """A mixture of experts (kvlm.model.experts) of tensors `p`.mlp.*: the router, its
        weights and products fp32 (fp64 in an fp64 model) whatever the weights' format,
        as llama.cpp's quantizer leaves ffn_gate_inp (its logits pick the experts), and
        the selection bias where the config has one (`mlp.expert_bias`, likewise),
        and each expert's gate|up and down, from one tensor an expert or from every
        expert's stacked (llama.cpp's `ffn_*_exps`: each expert's rows of its blocks).
        `host`: the routed experts in host memory as the CPU road loads them (`_on_host`),
        the router and the shared expert where the rest of the model is."""
        x = self.config.experts
        router, w = self._fp32_linear(f"{p}.mlp.gate.weight")
        norm = scale = None
        if x.router_norm:  # the router's input norm, in the router's dtype
            norm = RMSNorm(self._router_vector(f"{p}.mlp.router_norm.weight", w),
                           self.config.rms_norm_eps)  # fmt: skip
        if x.expert_scale:  # each expert's weight scale (count,)
            scale = self._router_vector(f"{p}.mlp.expert_scale", w)
        shared = gate = g = None
        if x.shared:  # the shared expert, and its gate's (1, hidden) product in fp32
            shared = self._shared_expert(p)
        if x.shared_gate:
            gate, g = self._fp32_linear(f"{p}.mlp.shared_expert_gate.weight")
            g = g.reshape(-1).contiguous()
        bias = None
        if x.selection_bias:  # the selection bias (count,), in the router's dtype
            bias = self._router_vector(f"{p}.mlp.expert_bias", w)
        with self._on_host() if host else nullcontext():
            mlps = self._routed_experts(p)
        return Experts(
            x,
            router,
            mlps,
            w,
            shared,
            gate,
            g,
            host=host,
            bias=bias,
            router_norm=norm,
            expert_scale=scale,
        )

    def _router_vector(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """A router's vector `name` (a selection bias, an input norm's weight, the experts'
        scales) flat in the router weight `w`'s dtype and device, never the model's dtype
        first."""
        raw = self.take_raw(name)
        if raw is None:
            raise ModelLoadError(f"the model file has no tensor {name}")
        return raw.to(device=w.device, dtype=w.dtype).reshape(-1).contiguous()

    @contextmanager
    def _on_host(self) -> Iterator[None]:
        """What loads inside is loaded as the CPU road loads it (--cpu-experts): on the
        CPU, the file's own blocks where the kernels multiply them (quant.Blocks, any
        --weights), else fp32, products in fp32; never on the model's device."""
        saved = self.device, self.dtype, self.weight_format, self.numerics
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.weight_format, self.numerics = "native", ModelNumerics()
        try:
            yield
        finally:
            self.device, self.dtype, self.weight_format, self.numerics = saved

    def _routed_experts(self, p: str) -> list[MLP]:
        """Each routed expert's gated MLP of `p`.mlp.experts."""
        c, x = self.config, self.config.experts
        stacks = (f"{p}.mlp.experts.{n}.weight" for n in ("gate_proj", "gate_up_proj"))
        if not any(n in self.available for n in stacks):  # one tensor an expert
            return [self._gated_mlp(f"{p}.mlp.experts.{e}") for e in range(x.count)]
        names = [f"{p}.mlp.experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        fused = f"{p}.mlp.experts.gate_up_proj.weight"  # every expert's gate|up one stack
        if fused in self.available:
            gate_up = [[part] for part in self._each_expert(fused, x.count)]
        else:
            gate_, up = (self._each_expert(n, x.count) for n in names[:2])
            gate_up = [[a, b] for a, b in zip(gate_, up, strict=True)]
        down = self._each_expert(names[2], x.count)
        gate_up_bias, down_bias = self._expert_biases(p)
        act = x.activation or c.activation
        return [MLP(self._expert_linear(gate_up[e], names[0], gate_up_bias[e]),
                    self._expert_linear([down[e]], names[2], down_bias[e]), act,
                    (x.swiglu_alpha, x.swiglu_limit))
                for e in range(x.count)]  # fmt: skip

    def _expert_biases(self, p: str) -> tuple[list, list]:
        """Each routed expert's gate|up bias and down bias (E, rows) stacked, where the file
        has them (a list of None where it has not): gate|up one stack (E, 2 I), or gate's
        and up's (llama.cpp's `ffn_gate_exps.bias`, `ffn_up_exps.bias`)."""
        count, e = self.config.experts.count, f"{p}.mlp.experts"
        parts = [self._bias(f"{e}.gate_up_proj")]
        if parts[0] is None:
            parts = [self._bias(f"{e}.{n}") for n in ("gate_proj", "up_proj")]
            if parts.count(None) == 1:
                raise ModelLoadError(f"{e}: a bias of gate_proj or up_proj without the other")
        gate_up = [None] * count if parts[0] is None else list(torch.cat(parts, dim=1).unbind(0))
        down = self._bias(f"{e}.down_proj")
        return gate_up, [None] * count if down is None else list(down.unbind(0))

    def _shared_expert(self, p: str) -> MLP:
        """A mixture's shared expert: `mlp.shared_expert.*`, or where the file names none,
        the layer's MLP (a family that keeps its shared MLP under the dense MLP's names)."""
        q = f"{p}.mlp.shared_expert"
        return self._gated_mlp(q if f"{q}.down_proj.weight" in self.available else f"{p}.mlp")

    def _gated_mlp(self, q: str) -> MLP:
        """The gated MLP of tensors `q`.*: its gate|up one product (`gate_up_proj` where
        the file stores them as one, else gate_proj and up_proj joined), down with its
        bias where the file has one."""
        fused = f"{q}.gate_up_proj.weight"
        if fused in self.available:
            gate_up = self.linear(fused)
        else:
            gate_up = self.fused_linear(q, ("gate_proj", "up_proj"))
        return MLP(gate_up, self._with_bias(f"{q}.down_proj"), self.config.activation)

    def _fp32_linear(self, name: str) -> tuple[Linear, torch.Tensor]:
        """`name`'s weight in fp32 (an fp64 model's in fp64) whatever the weights' format,
        never rounded to low bits, and a Linear of it on the vocabulary projection's road
        (fp32 products, each row's its own): a router's or a shared expert's gate, with its
        bias where the file has one (in the weight's dtype)."""
        w = self.take(name)
        w = w if w.dtype == torch.float64 else w.float()
        bias = self.take_raw(name.removesuffix(".weight") + ".bias")
        bias = None if bias is None else bias.to(w.device, w.dtype)
        return Linear(w, bias, numerics=self.numerics, vocabulary=True), w

    def _each_expert(self, name: str, count: int) -> list[quant.Blocks] | list[torch.Tensor]:
        """Each expert's matrix of the stacked tensor `name`: its blocks as stored
        (--weights native, a view of the file's; Q8_0's multiplied there, quant.ROWS_KIND,
        never copied), else its values."""
        native = self._native(name, packed=False)
        if native is None:
            stack = self.take(name)
            return list(stack.unbind(0))
        self.bar.update(1)
        raw, rows = native.raw, native.out_features // count
        kind = native.kind
        if kind == "q8" and native.order is None and self._experts_in_place():
            kind = quant.ROWS_KIND  # the map's own rows
        return [quant.Blocks(kind, raw[e * rows : (e + 1) * rows]) for e in range(count)]

    def _experts_in_place(self) -> bool:
        """Whether Q8_0 expert stacks are multiplied where they lie in the file's map
        (quant.ROWS_KIND) rather than packed: where the model's files are larger than the
        memory available at load, so a packed copy would not fit beside them (llama.cpp
        maps every such file; a mapped model larger than memory still runs, its pages read
        again as they are needed). Else packed: its products run ~1.4x the in-place ones'
        (docs/NOTES-moe.md item 2), at the copy's load time and memory."""
        if self._in_place is None:
            size = sum(f.stat().st_size for f in self.weights.files())
            free = available_memory("cpu")
            self._in_place = free is not None and size > free * IN_PLACE_SHARE
        return self._in_place

    def _expert_linear(self, parts: list, name: str, bias: torch.Tensor | None = None) -> Linear:
        """One expert's projection of `parts` (gate and up joined, or down), with `bias`."""
        if bias is not None:
            bias = bias.contiguous()
        if isinstance(parts[0], quant.Blocks):
            return Linear.from_quant(quant.concat(parts), bias, self.numerics)
        return self._make(torch.cat(parts, dim=0), bias, [name])

    def conv_block(self, i: int) -> Block:
        """Layer i, whose mixer is a short convolution (kvlm.model.conv)."""
        c, p = self.config, f"model.layers.{i}"
        kernel = self.take(f"{p}.conv.conv.weight").reshape(c.hidden_size, c.conv_kernel)
        conv = ShortConv(c.conv_layers.index(i), self._with_bias(f"{p}.conv.in_proj"), kernel,
                         self._bias(f"{p}.conv.conv"),
                         self._with_bias(f"{p}.conv.out_proj"))  # fmt: skip
        return self._block(i, conv=conv)

    def deltanet_block(self, i: int) -> Block:
        """Layer i, whose mixer is a gated DeltaNet (kvlm.model.deltanet)."""
        c, p = self.config, f"model.layers.{i}"
        d, a = c.deltanet, f"{p}.linear_attn"
        in_proj = self.fused_linear(a, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        kernel = self.take(f"{a}.conv1d.weight").reshape(d.conv_width, d.conv_kernel)
        delta = GatedDeltaNet(
            c.recurrent_layers.index(i), d, in_proj, kernel, self.take(f"{a}.A_log"),
            self.take(f"{a}.dt_bias"), self.take(f"{a}.norm.weight"), c.rms_norm_eps,
            self._with_bias(f"{a}.out_proj"),
        )  # fmt: skip
        return self._block(i, recurrent=delta)

    def mamba2_block(self, i: int) -> Block:
        """Layer i, whose mixer is a Mamba2 layer (kvlm.model.mamba2); its vectors as
        (heads,) and (inner,) whichever shape the file keeps them in (kvlm.loading.shapes)."""
        c, p = self.config, f"model.layers.{i}"
        m, a = c.mamba2, f"{p}.mamba"
        kernel = self.take(f"{a}.conv1d.weight").reshape(m.conv_width, m.conv_kernel)
        heads = [self.take(f"{a}.{n}").reshape(m.heads) for n in ("A_log", "dt_bias", "D")]
        mixer = Mamba2Mixer(
            c.recurrent_layers.index(i), m, self._with_bias(f"{a}.in_proj"), kernel,
            self._bias(f"{a}.conv1d"), *heads, self.take(f"{a}.norm.weight").reshape(m.inner),
            c.rms_norm_eps, self._with_bias(f"{a}.out_proj"),
        )  # fmt: skip
        return self._block(i, recurrent=mixer)

    def norm(self, prefix: str) -> RMSNorm:
        """The RMSNorm of `prefix`.weight (what it multiplies by: a family's 1 + w is
        folded into the weight by its loader)."""
        return RMSNorm(self.take(f"{prefix}.weight"), self.config.rms_norm_eps)

    def _bias(self, prefix: str) -> torch.Tensor | None:
        """`prefix`.bias in the model's dtype, where the file has one."""
        bias = self.take_raw(f"{prefix}.bias")
        return None if bias is None else bias.to(self.device, self.dtype)

    def _with_bias(self, prefix: str) -> Linear:
        """The projection `prefix`.weight, with `prefix`.bias where the file has one."""
        return self.linear(f"{prefix}.weight", bias=self._bias(prefix))
