"""ModelConfig: the few numbers the transformer and the cache need, and the block's
composition as plain data, whichever format and family a model came from.

A family file of kvlm.arch reads a Hugging Face `config.json` or GGUF metadata into one
(with `Fields` and `value`, which check every untrusted value); nothing downstream knows
the format or the family: the transformer, the loaders, the fused step and the caches
read the fields (its activation, norm layout, embedding scale, soft-caps, q/k norms,
each layer's window and RoPE base), never a family's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvlm.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# What a user may ask RoPE to be scaled by for a context (--rope-scaling, LLM(rope_scaling=)):
# none, as the file gives it; linear or YaRN in place of the file's (for_context)
ROPE_SCALINGS = ("none", "linear", "yarn")
# The range of each size, past any real model's and short of what a buffer sized from it
# could not hold: a file outside one is refused before anything is sized from it (the
# tensors' shapes are then held to the sizes: kvlm.loading.shapes).
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1 << 12),
    "num_heads": (1, 1 << 12),
    "num_kv_heads": (1, 1 << 12),
    "head_dim": (2, 1 << 12),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
}
REQUIRED = object()  # a Fields call without a default: the key must be there
# The gated MLP's activation: SiLU (SwiGLU) or tanh's GELU (GeGLU)
ACTIVATIONS = ("silu", "gelu_tanh")
# Where a block's RMSNorms are: "pre" one before attention and one before the MLP; "sandwich"
# also one on each one's output before it is added to the residual stream
NORM_LAYOUTS = ("pre", "sandwich")
# What the q and k RMSNorms before RoPE (`qk_norm`) each norm: "head" every head on its own
# (a weight of head_dim), "projection" the whole q and the whole k projection before they
# are split into heads (a weight of num_heads x head_dim and of num_kv_heads x head_dim)
QK_NORM_EXTENTS = ("head", "projection")
# A block's mixer, what mixes positions before its MLP: "attention" (over the whole context
# or a window), "conv" a gated short convolution over the last `conv_kernel` positions
# (kvlm.model.conv), "deltanet" a gated DeltaNet: a causal convolution, then the gated delta
# rule's recurrent state (kvlm.model.deltanet), "mamba2" a Mamba2 layer: a causal convolution,
# then a selective state space's recurrent state (kvlm.model.mamba2), "latent" latent
# attention: K and V made from one compressed latent a token, which is what the cache keeps
# (kvlm.model.mla; its sizes `latent`)
MIXERS = ("attention", "conv", "deltanet", "mamba2", "latent")
# the mixers that keep a recurrent state a sequence (kvlm.cache.recurrent); a model has
# layers of one of them at most
RECURRENT_MIXERS = ("deltanet", "mamba2")
# a short convolution's kernel: 2 positions or more (it keeps kernel - 1 rows a sequence)
CONV_KERNEL = (2, 64)
# A block's FFN: "mlp" the gated MLP, "experts" a mixture of gated MLPs a router picks from
# for each token (kvlm.model.experts)
FFNS = ("mlp", "experts")
# how a router scores experts: "softmax" over every expert's logit, then the top k;
# "sigmoid" of each logit, the top k by those scores plus a selection bias where the layer
# has one (the bias chooses, the un-biased scores weigh); "topk_softmax" the top k of the
# logits, then a softmax over those k alone
ROUTERS = ("softmax", "sigmoid", "topk_softmax")
# how a group of experts scores where routing is group-limited (Experts.groups): "top2" the
# sum of its two highest selection scores (a sigmoid router's with its selection bias),
# "max" its highest (a softmax router's)
GROUP_SCORES = ("top2", "max")
# an expert's activation other than the model's (Experts.activation): "clamped_swiglu"
# gate clamped to at most `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha
# gate) (kvlm.model.layers.MLP)
EXPERT_ACTIVATIONS = ("clamped_swiglu",)
EXPERTS = (1, 1 << 12)  # experts in a layer


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling, with the numbers of transformers' ROPE_INIT_FUNCTIONS
    (kvlm.model.layers.rope_inv_freq computes them): `default` plain `theta ** (-2i/d)`
    frequencies; `linear` each divided by `factor`; `llama3` Llama 3.1's stretch by band
    (`low_freq_factor`, `high_freq_factor`); `yarn` (YaRN, Peng et al. 2023) the fast
    dimensions kept, those turning fewer than `beta_slow` times over
    `original_max_position_embeddings` divided by `factor`, a ramp between (from
    `beta_fast` turns), and cos/sin times `attention_scaling`; `proportional` the first
    `proportion` x D/2 frequencies of a head of D (exponents over D), the others 0 (those
    dimensions not turned), each divided by `factor`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # YaRN's scale of cos/sin; None: from `factor` (and mscale / mscale_all_dim where the
    # config names both: DeepSeek's), as transformers infers it
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # YaRN's ramp ends rounded to whole dimensions
    # proportional RoPE's share of a head's frequency pairs that turn (partial_rotary_factor)
    proportion: float = 1.0

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: 1 but for YaRN (0.1 ln(factor) + 1)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(slots=True, frozen=True)
class DeltaNet:
    """The sizes of a gated DeltaNet layer (kvlm.model.deltanet): `key_heads` q/k heads of
    `key_dim`, `value_heads` v heads of `value_dim` (each q/k head serves value_heads /
    key_heads consecutive v heads), the causal convolution over q|k|v of `conv_kernel`
    positions."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_width(self) -> int:
        """The convolution's channels: q|k|v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def check(self, where: str) -> None:
        for name in ("key_heads", "value_heads"):
            value(getattr(self, name), f"deltanet {name}", int, *LIMITS["num_heads"], where=where)
        for name in ("key_dim", "value_dim"):
            value(getattr(self, name), f"deltanet {name}", int, *LIMITS["head_dim"], where=where)
        value(self.conv_kernel, "deltanet conv_kernel", int, *CONV_KERNEL, where=where)
        if self.value_heads % self.key_heads:
            raise UnsupportedModelError(f"deltanet value_heads={self.value_heads} is not a "
                                        f"multiple of key_heads={self.key_heads}")  # fmt: skip


@dataclass(slots=True, frozen=True)
class Mamba2:
    """The sizes of a Mamba2 layer (kvlm.model.mamba2): `heads` heads of `head_dim`
    channels, each with a (head_dim, state_size) state; B and C in `groups` groups of
    `state_size`, each serving heads / groups consecutive heads; the causal convolution
    over x|B|C of `conv_kernel` positions (with a bias where the file has one)."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int

    @property
    def inner(self) -> int:
        """x's channels (and z's, the gate's): every head's."""
        return self.heads * self.head_dim

    @property
    def conv_width(self) -> int:
        """The convolution's channels: x|B|C."""
        return self.inner + 2 * self.groups * self.state_size

    def check(self, where: str) -> None:
        for name in ("heads", "groups"):
            value(getattr(self, name), f"mamba2 {name}", int, *LIMITS["num_heads"], where=where)
        for name in ("head_dim", "state_size"):
            value(getattr(self, name), f"mamba2 {name}", int, *LIMITS["head_dim"], where=where)
        value(self.conv_kernel, "mamba2 conv_kernel", int, *CONV_KERNEL, where=where)
        if self.heads % self.groups:
            raise UnsupportedModelError(f"mamba2 heads={self.heads} is not a multiple of "
                                        f"groups={self.groups}")  # fmt: skip


@dataclass(slots=True, frozen=True)
class Latent:
    """The sizes of a latent attention layer (kvlm.model.mla): each token's hidden state
    compressed to a latent of `kv_rank` (RMSNormed) and one shared key part of `rope_dim`
    that RoPE rotates; each head's key is kv_b's `nope_dim` rows of the latent and the shared
    rotated part, its value kv_b's `v_dim` rows. The queries: `q_rank` a compressed query
    (q_a, its RMSNorm, q_b) or 0 for one projection, `nope_dim` + `rope_dim` a head. The
    cache keeps a token's latent and rotated key part alone: kv_rank + rope_dim a layer.
    `norm_eps`: the latent's and the compressed query's RMSNorms' epsilon."""

    kv_rank: int
    q_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    # the epsilon of the latent's and the compressed query's RMSNorms
    norm_eps: float = 1e-6

    @property
    def qk_dim(self) -> int:
        """A query's and a key's dimensions a head."""
        return self.nope_dim + self.rope_dim

    @property
    def row(self) -> int:
        """What the cache keeps a token and layer: the latent and the rotated key part."""
        return self.kv_rank + self.rope_dim

    def check(self, where: str) -> None:
        for name in ("kv_rank", "nope_dim", "rope_dim", "v_dim"):
            value(getattr(self, name), f"latent {name}", int, 1, 1 << 14, where=where)
        value(self.q_rank, "latent q_rank", int, 0, 1 << 16, where=where)
        if self.rope_dim % 2:
            raise UnsupportedModelError(f"latent rope_dim={self.rope_dim} must be even for RoPE")


@dataclass(slots=True, frozen=True)
class Experts:
    """A mixture-of-experts FFN (kvlm.model.experts): `count` gated MLPs of `intermediate`
    each, `top_k` of them a token, scored by `router` (ROUTERS), their weights divided by
    their sum where `normalize` (transformers' norm_topk_prob; plus `norm_eps` where the
    family adds one to the sum), then times `scale` (routed_scaling_factor); a per-expert
    selection bias (`selection_bias`: the tensor `mlp.expert_bias` of each expert layer)
    added to the scores for choosing alone; group-limited routing where `groups_used` <
    `groups` (the experts in `groups` equal runs, each scored by `group_score`; a row's top
    k chosen among its top `groups_used` groups' experts alone); a shared expert of
    `shared` beside them (0: none), gated by sigmoid(a product) where `shared_gate`."""

    count: int
    top_k: int
    intermediate: int
    normalize: bool = True
    router: str = "softmax"
    # the chosen scores' sum plus norm_eps divides them (where `normalize`), then times scale
    norm_eps: float = 0.0
    scale: float = 1.0
    # a bias per expert added to the scores to choose the top k, not to weigh them
    selection_bias: bool = False
    # the experts in `groups` equal runs (0..E/G-1 the first), a row choosing among the
    # experts of its `groups_used` best groups by `group_score` (GROUP_SCORES); both 1 (or
    # equal): every expert
    groups: int = 1
    groups_used: int = 1
    group_score: str = "top2"
    # a shared expert every token runs beside the routed ones (its intermediate size; 0:
    # none), its output times sigmoid(a gate's product) where `shared_gate`
    shared: int = 0
    shared_gate: bool = False
    # the experts' activation where it is not the model's ("": the model's), and the
    # clamped SwiGLU's alpha and limit (EXPERT_ACTIVATIONS)
    activation: str = ""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # the router's input RMSNormed by a weight of its own first (`mlp.router_norm`); each
    # chosen expert's weight times that expert's own scale last (`mlp.expert_scale`,
    # after the renormalisation and `scale`)
    router_norm: bool = False
    expert_scale: bool = False
    # the experts beside the layer's dense MLP rather than in its place: the router reads
    # the residual stream, the experts their own norm of it (`experts_in_norm`), the MLP
    # and the experts each an output norm (`dense_out_norm`, `experts_out_norm`), summed
    # before the block's MLP output norm (kvlm.model.transformer.ExpertsBeside)
    beside_mlp: bool = False

    def check(self, where: str) -> None:
        value(self.count, "experts count", int, *EXPERTS, where=where)
        value(self.top_k, "experts used per token", int, 1, self.count, where=where)
        value(self.intermediate, "an expert's intermediate size", int,
              *LIMITS["intermediate_size"], where=where)  # fmt: skip
        check_supported("expert router", self.router, ROUTERS)
        value(self.norm_eps, "the experts' renormalisation epsilon", float, 0.0, 1.0, where=where)
        value(self.scale, "the experts' weight scale", float, 0.0, 1e6, where=where,
              open_low=True)  # fmt: skip
        value(self.shared, "the shared expert's intermediate size", int, 0,
              LIMITS["intermediate_size"][1], where=where)  # fmt: skip
        self._check_groups(where)
        if self.shared_gate and not self.shared:
            raise UnsupportedModelError("a shared expert's gate without a shared expert")
        if self.activation:
            check_supported("expert activation", self.activation, EXPERT_ACTIVATIONS)
            value(self.swiglu_alpha, "swiglu alpha", float, 0.0, where=where, open_low=True)
            value(self.swiglu_limit, "swiglu limit", float, 0.0, where=where, open_low=True)

    @property
    def group_limited(self) -> bool:
        """Whether a row chooses among some groups' experts only."""
        return self.groups_used < self.groups

    def _check_groups(self, where: str) -> None:
        """The groups divide the experts, `groups_used` is 1 to `groups`, a "top2" group
        has two experts or more, and the chosen groups hold top_k experts at least (else
        transformers' top k would take masked ones: refused)."""
        value(self.groups, "expert groups", int, 1, self.count, where=where)
        value(self.groups_used, "expert groups used", int, 1, self.groups, where=where)
        check_supported("expert group score", self.group_score, GROUP_SCORES)
        size = self.count // self.groups
        if self.count % self.groups:
            raise UnsupportedModelError(f"{where}: {self.count} experts do not divide into "
                                        f"{self.groups} groups")  # fmt: skip
        if not self.group_limited:
            return
        if self.group_score == "top2" and size < 2:
            raise UnsupportedModelError(f"{where}: groups of {size} expert: a group's score "
                                        "is its two best experts' sum")  # fmt: skip
        if self.top_k > self.groups_used * size:
            raise UnsupportedModelError(f"{where}: {self.top_k} experts a token from "
                                        f"{self.groups_used} groups of {size}")  # fmt: skip


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    # what each of those norms spans (QK_NORM_EXTENTS): a head, or the whole projection
    qk_norm_extent: str = field(default="head", metadata={"fingerprint": False})
    # the attention window of every layer (Mistral); with `layer_windows`, of none
    sliding_window: int | None = None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Per layer: its attention window, None for a layer that sees the whole context (local
    # and global layers). Empty: every layer has `sliding_window`.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE base of the layers with a window, where it is not rope_theta (e.g. 10,000 locally,
    # 1,000,000 globally; the global layers alone take `rope_scaling`)
    rope_local_theta: float | None = None
    # attention sinks: a learned logit a query head (`self_attn.sinks`, (num_heads,)) that
    # joins each row's softmax denominator (kvlm.model.attention.attend_explicit)
    attn_sinks: bool = field(default=False, metadata={"fingerprint": False})
    # attention's score scale, where it is not head_dim ** -0.5 (query_pre_attn_scalar)
    query_scale: float | None = None
    # tanh soft-capping of the final logits (cap * tanh(logits / cap)) and of the attention
    # scores
    final_softcap: float | None = None
    attn_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # The block's composition beyond the sizes, as its family sets it from the architecture
    # and the sizes (both hashed into the weights' fingerprint already, so these are not:
    # a cache file saved before they were fields reads as the same model's). The defaults
    # are the Llama block's. `activation`: the gated MLP's (ACTIVATIONS); `norm_layout`:
    # where its norms are (NORM_LAYOUTS); `embed_scale`: what the embeddings are multiplied
    # by (rounded to fp32 first, as transformers does), None for 1.
    activation: str = field(default="silu", metadata={"fingerprint": False})
    norm_layout: str = field(default="pre", metadata={"fingerprint": False})
    embed_scale: float | None = field(default=None, metadata={"fingerprint": False})
    # Per layer: its mixer (MIXERS). Empty: every layer attends. A "conv" layer has no
    # attention (its K/V slots of a cache go unused) and its kernel is `conv_kernel`.
    layer_mixers: tuple[str, ...] = ()
    conv_kernel: int | None = None
    # A "deltanet" layer's sizes (None: no such layer)
    deltanet: DeltaNet | None = None
    # The dimensions of each q/k head RoPE rotates, the first ones (a partial rotary
    # factor); None: all head_dim
    rope_dim: int | None = None
    # attention's output times sigmoid(a gate): q_proj's rows are the queries, then the
    # gate (H x head_dim each), the gate taken per element of the heads' output before
    # o_proj
    attn_output_gate: bool = field(default=False, metadata={"fingerprint": False})
    # A "mamba2" layer's sizes (None: no such layer)
    mamba2: Mamba2 | None = None
    # whether attention rotates q and k (False: no position encoding at all, NoPE: RoPE's
    # frequencies are zeros, so cos 1 and sin 0 leave q and k as they are, bit for bit)
    rope: bool = True
    # each mixer's and MLP's output times this before it joins the residual stream
    # (None: 1); the logits divided by `logit_scale` (None: 1)
    residual_scale: float | None = None
    logit_scale: float | None = None
    # the blocks of a multi-token-prediction head the file carries (kvlm.model.mtp: an
    # attention block each, after the model's; a drafter, never part of the model's own
    # tokens, so not in the fingerprint); 0: none
    mtp_layers: int = field(default=0, metadata={"fingerprint": False})
    # Per layer: its FFN (FFNS). Empty: every layer's is the gated MLP. An "experts" layer's
    # sizes are `experts`.
    layer_ffns: tuple[str, ...] = ()
    experts: Experts | None = None
    # A "latent" layer's sizes (None: no such layer; head_dim is then its rotated part's,
    # rope_dim, as transformers' config has it: RoPE's dimensions)
    latent: Latent | None = None
    # Per layer: its attention's head size and KV heads where a layer's are its own (empty:
    # every layer's head_dim and num_kv_heads); its q/k norms and RoPE are of that size
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # Per layer: whether its K = V (one projection, k_proj: V is it normed without a weight,
    # K that times the k norm's weight, rotated; the cache keeps V alone, kv_row_dim)
    layer_k_eq_v: tuple[bool, ...] = ()
    # V RMSNormed (without a weight) before the cache, as K is by its k norm
    v_norm: bool = False
    # Per layer: the layer whose K/V it attends over (itself: its own). A layer that reads
    # an earlier layer's keeps no K/V (no projection, no rows in any cache); it reads what
    # that layer's step stored and returned, with that layer's window
    kv_sources: tuple[int, ...] = ()
    # Per-layer inputs: each layer's output gets a (per_layer_input)-wide input of its own,
    # from a table of `per_layer_vocab` rows and a projection of the embeddings (0: none)
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    # each layer's output times its own scalar (the tensor `layer_scalar` of the layer)
    layer_scalars: bool = False
    # Per layer: its gated MLP's intermediate size (empty: every layer's intermediate_size)
    layer_intermediate_sizes: tuple[int, ...] = ()

    def intermediate_of(self, layer: int) -> int:
        """Layer `layer`'s gated MLP's intermediate size."""
        sizes = self.layer_intermediate_sizes
        return sizes[layer] if sizes else self.intermediate_size

    def head_dim_of(self, layer: int) -> int:
        """Layer `layer`'s attention head size."""
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """Layer `layer`'s KV heads."""
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def k_eq_v(self, layer: int) -> bool:
        """Whether layer `layer`'s K = V."""
        return bool(self.layer_k_eq_v) and self.layer_k_eq_v[layer]

    def kv_row_dim(self, layer: int) -> int:
        """The width of layer `layer`'s K and V rows in a cache: its head size, or for a
        K = V layer half of it (one tensor a token, its first half kept in K's row and the
        rest in V's; the attention makes K from it)."""
        d = self.head_dim_of(layer)
        return (d + 1) // 2 if self.k_eq_v(layer) else d

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V layer `layer` attends over (itself where it keeps its own)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V of their own, in order: a cache's layers."""
        return tuple(i for i in range(self.num_layers) if self.kv_source(i) == i)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is a short convolution, in order."""
        return tuple(i for i, m in enumerate(self.layer_mixers) if m == "conv")

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is a gated DeltaNet, in order."""
        return tuple(i for i, m in enumerate(self.layer_mixers) if m == "deltanet")

    @property
    def mamba2_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is a Mamba2 layer, in order."""
        return tuple(i for i, m in enumerate(self.layer_mixers) if m == "mamba2")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state (RECURRENT_MIXERS), in order: the state
        group of a cache (kvlm.cache.kinds.recurrent_state)."""
        return tuple(i for i, m in enumerate(self.layer_mixers) if m in RECURRENT_MIXERS)

    @property
    def latent_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is latent attention, in order."""
        return tuple(i for i, m in enumerate(self.layer_mixers) if m == "latent")

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The layers whose FFN is a mixture of experts, in order."""
        return tuple(i for i, f in enumerate(self.layer_ffns) if f == "experts")

    @property
    def qk_norm_sizes(self) -> tuple[int, int]:
        """The q norm's and the k norm's weights' lengths (qk_norm_extent): head_dim each,
        or the q and the k projections' widths."""
        if self.qk_norm_extent == "projection":
            return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.head_dim, self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (the first ones)."""
        return self.head_dim if self.rope_dim is None else self.rope_dim

    def __post_init__(self) -> None:
        value(self.architecture, "architecture", str, where=self.name)
        for name, (lo, hi) in LIMITS.items():
            n = getattr(self, name)
            if not (n is None and name == "sliding_window"):
                value(n, name, int, lo, hi, where=self.name)
        floats = [("rms_norm_eps", self.rms_norm_eps, 1.0), ("rope_theta", self.rope_theta, None),
                  ("rope_local_theta", self.rope_local_theta, None),
                  ("query_scale", self.query_scale, None),
                  ("embed_scale", self.embed_scale, None),
                  ("residual_scale", self.residual_scale, None),
                  ("logit_scale", self.logit_scale, None),
                  ("RoPE scaling factor", self.rope_scaling.factor, None)]  # fmt: skip
        for name, x, hi in floats:
            if x is not None:
                value(x, name, float, 0.0, hi, where=self.name, open_low=True)
        ids = [("bos_token_id", self.bos_token_id)] + [
            ("eos_token_id", t) for t in self.eos_token_ids
        ]
        for key, t in ids:
            if t is not None:
                value(t, key, int, 0, self.vocab_size - 1, where=self.name)
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
        check_supported("RoPE scaling", self.rope_scaling.rope_type, SUPPORTED_ROPE_TYPES)
        check_supported("activation", self.activation, ACTIVATIONS)
        check_supported("norm layout", self.norm_layout, NORM_LAYOUTS)
        check_supported("q/k norm extent", self.qk_norm_extent, QK_NORM_EXTENTS)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.layer_windows)} layer types for {self.num_layers} layers"
            )
        self._check_mixers()
        self._check_layer_attention()
        for name in ("final_softcap", "attn_softcap"):
            cap = getattr(self, name)
            if cap is not None and not 0 < cap < math.inf:  # cap * tanh(x / cap)
                raise UnsupportedModelError(f"{name} {cap!r}: a soft-cap must be positive")

    def _check_mixers(self) -> None:
        if self.layer_mixers and len(self.layer_mixers) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.layer_mixers)} layer mixers for {self.num_layers} layers"
            )
        for mixer in self.layer_mixers:
            check_supported("layer mixer", mixer, MIXERS)
        if self.conv_layers or self.conv_kernel is not None:
            value(self.conv_kernel, "conv_kernel", int, *CONV_KERNEL, where=self.name)
        if self.deltanet_layers and self.deltanet is None:
            raise UnsupportedModelError("deltanet layers without their sizes")
        if self.deltanet is not None:
            self.deltanet.check(self.name)
        if self.mamba2_layers and self.mamba2 is None:
            raise UnsupportedModelError("mamba2 layers without their sizes")
        if self.mamba2 is not None:
            self.mamba2.check(self.name)
        if self.deltanet_layers and self.mamba2_layers:
            raise UnsupportedModelError("gated DeltaNet and Mamba2 layers in one model (one "
                                        "kind of recurrent state a model)")  # fmt: skip
        if self.latent_layers and self.latent is None:
            raise UnsupportedModelError("latent attention layers without their sizes")
        if self.latent is not None:
            self.latent.check(self.name)
            if len(self.latent_layers) != self.num_layers:  # one cache geometry a model
                raise UnsupportedModelError(
                    "latent attention in some layers and not in others (all or none)"
                )
        if self.layer_ffns and len(self.layer_ffns) != self.num_layers:
            raise UnsupportedModelError(f"{len(self.layer_ffns)} layer FFNs for "
                                        f"{self.num_layers} layers")  # fmt: skip
        for ffn in self.layer_ffns:
            check_supported("layer FFN", ffn, FFNS)
        if self.expert_layers and self.experts is None:
            raise UnsupportedModelError("expert layers without their sizes")
        if self.experts is not None:
            self.experts.check(self.name)
        if self.rope_dim is not None:
            value(self.rope_dim, "rope_dim", int, 2, self.head_dim, where=self.name)
            if self.rope_dim % 2:
                raise UnsupportedModelError(f"rope_dim={self.rope_dim} must be even for RoPE")

    def _check_layer_attention(self) -> None:
        """Each layer's own head size, KV heads, K = V and K/V source."""
        for name in ("layer_head_dims", "layer_kv_heads", "layer_k_eq_v", "kv_sources",
                     "layer_intermediate_sizes"):  # fmt: skip
            n = len(getattr(self, name))
            if n and n != self.num_layers:
                raise UnsupportedModelError(f"{n} {name} for {self.num_layers} layers")
        for i in range(self.num_layers if self.layer_head_dims else 0):
            value(self.layer_head_dims[i], "a layer's head_dim", int, *LIMITS["head_dim"],
                  where=self.name)  # fmt: skip
            if self.layer_head_dims[i] % 2:
                raise UnsupportedModelError(f"layer {i}'s head_dim must be even for RoPE")
        for i in range(self.num_layers if self.layer_kv_heads else 0):
            heads = value(self.layer_kv_heads[i], "a layer's num_kv_heads", int,
                          *LIMITS["num_kv_heads"], where=self.name)  # fmt: skip
            if self.num_heads % heads:
                raise UnsupportedModelError(f"num_heads={self.num_heads} is not a multiple "
                                            f"of layer {i}'s {heads} KV heads")  # fmt: skip
        for size in self.layer_intermediate_sizes:
            value(size, "a layer's intermediate_size", int, *LIMITS["intermediate_size"],
                  where=self.name)  # fmt: skip
        windows = self.layer_windows or (self.sliding_window,) * self.num_layers
        for i in range(self.num_layers if self.kv_sources else 0):
            j = self.kv_sources[i]
            if type(j) is not int or not 0 <= j <= i or self.kv_source(j) != j:
                raise UnsupportedModelError(f"layer {i} reads the K/V of layer {j!r}: not an "
                                            "earlier layer that keeps its own")  # fmt: skip
            same = (windows[j], self.head_dim_of(j), self.kv_heads_of(j)) == (
                windows[i],
                self.head_dim_of(i),
                self.kv_heads_of(i),
            )
            if j != i and not same:
                raise UnsupportedModelError(f"layer {i} reads the K/V of layer {j}, whose "
                                            "window or head geometry is not its own")  # fmt: skip
        if self.per_layer_input:
            value(self.per_layer_input, "per_layer_input", int, 1, 1 << 14, where=self.name)
            value(self.per_layer_vocab, "per_layer_vocab", int, self.vocab_size,
                  LIMITS["vocab_size"][1], where=self.name)  # fmt: skip
        if self.rope_scaling.rope_type == "proportional":
            value(self.rope_scaling.proportion, "RoPE's partial_rotary_factor", float, 0.0, 1.0,
                  where=self.name)  # fmt: skip

    @property
    def hybrid(self) -> bool:
        """Layers with a window and layers without."""
        return len(set(self.layer_windows)) > 1

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies across all layers (times itemsize = bytes):
        a latent attention layer's its latent and rotated key part (kvlm.cache.kinds)."""
        if self.latent is not None:
            return self.num_layers * 2 * ((self.latent.row + 1) // 2)
        # the layers that keep K/V (cache_layers), each its own geometry
        return 2 * sum(self.kv_heads_of(i) * self.kv_row_dim(i) for i in self.cache_layers)


def for_context(
    config: ModelConfig, max_context: int, scaling: str | None = None,
    factor: float | None = None, bounded: bool = False,
) -> tuple[ModelConfig, str | None]:  # fmt: skip
    """The config whose RoPE serves `max_context` tokens a sequence, and the warning for a
    context past the trained one (None within it).

    `scaling` None: the file's own RoPE; past the trained length, for a file that scales
    none, YaRN by max_context / trained. (llama.cpp keeps RoPE as trained there and warns:
    the slow dimensions then turn to angles the model never saw. YaRN keeps the fast ones,
    those of short distances, as trained and interpolates only the slow ones.) "none": the
    file's RoPE whatever the context, as llama.cpp runs it. "linear", "yarn": that scaling
    by `factor` (default: max_context / the original length, at least 1), over the trained
    length (a YaRN file's original one), in place of the file's: only where the file scales
    none or by YaRN (llama3's and linear frequencies are the ones its model learned).
    `bounded`: the cache keeps RoPE positions within the trained length itself (the window
    cache counting them inside it): nothing to scale, nothing to say."""
    trained, own = config.max_position_embeddings, config.rope_scaling
    if scaling is not None and scaling not in ROPE_SCALINGS:
        raise InvalidRequestError(
            f"unknown RoPE scaling {scaling!r}; valid: {', '.join(ROPE_SCALINGS)}",
            param="rope_scaling",
        )
    if factor is not None:
        if scaling not in ("linear", "yarn"):
            raise InvalidRequestError("a RoPE scale needs the RoPE scaling linear or yarn",
                                      param="rope_scale")  # fmt: skip
        if not isinstance(factor, int | float) or not 1 <= factor < math.inf:
            raise InvalidRequestError(f"the RoPE scale must be a number >= 1, got {factor!r}",
                                      param="rope_scale")  # fmt: skip
    if scaling in ("linear", "yarn"):
        if own.rope_type not in ("default", "yarn"):
            raise InvalidRequestError(
                f"the model's file scales RoPE by {own.rope_type} (factor {own.factor:g}), "
                "the frequencies it was trained on: linear or YaRN would replace them",
                param="rope_scaling",
            )
        original = own.original_max_position_embeddings if own.rope_type == "yarn" else trained
        chosen = RopeScaling(scaling, float(factor or max(1.0, max_context / original)),
                             original_max_position_embeddings=original)  # fmt: skip
        config = replace(config, rope_scaling=chosen)
    elif scaling is None and max_context > trained and own.rope_type == "default" and not bounded:
        chosen = RopeScaling("yarn", max_context / trained,
                             original_max_position_embeddings=trained)  # fmt: skip
        config = replace(config, rope_scaling=chosen)
    if max_context <= trained or bounded:
        return config, None
    auto = scaling is None and own.rope_type == "default"
    return config, _past_trained(config, max_context, trained, auto)


def _past_trained(config: ModelConfig, n: int, trained: int, chosen_for_you: bool) -> str:
    """The one line a context past the trained one is said in (`chosen_for_you`: the YaRN
    for_context picked)."""
    s = config.rope_scaling
    said = f"--max-context {n} is past the model's trained context of {trained} tokens: "
    if s.rope_type not in ("linear", "yarn"):
        kept = "unscaled" if s.rope_type == "default" else f"as the file scales it ({s.rope_type})"
        return said + (f"RoPE {kept}, at positions the model never saw (--rope-scaling yarn "
                       "interpolates them)")  # fmt: skip
    name = "YaRN" if s.rope_type == "yarn" else "linear interpolation"
    said += f"RoPE scaled by {name}, factor {s.factor:g}"
    covered = math.floor(s.original_max_position_embeddings * s.factor)
    if covered < n:
        said += f", which stretches it to {covered} tokens"
    if chosen_for_you:
        said += " (--rope-scaling none: unscaled, as llama.cpp runs it)"
    return said


def value(
    x: Any, key: str, kind: type, lo: float | None = None, hi: float | None = None,
    where: str = "", open_low: bool = False,
) -> Any:  # fmt: skip
    """`x` if it is a `kind` (int: an integer, not a bool; float: a finite number, an
    integer too, given as a float; str; bool) within [lo, hi] (lo excluded with
    `open_low`), else a ModelLoadError naming `where` (the file), the key, what it holds
    and what was expected."""
    ok = isinstance(x, kind) and not (kind is int and isinstance(x, bool))
    if kind is float and isinstance(x, int) and not isinstance(x, bool):
        x, ok = float(x), True
    if ok and kind is float and not math.isfinite(x):
        ok = False
    if ok and kind in (int, float):
        ok = (lo is None or (x > lo if open_low else x >= lo)) and (hi is None or x <= hi)
    if ok:
        return x
    what = {int: "an integer", float: "a finite number", str: "a string", bool: "a boolean"}
    expected = what[kind]
    if kind in (int, float) and (lo is not None or hi is not None):
        low = "" if lo is None else f"{'above' if open_low else 'at least'} {lo:g}"
        high = "" if hi is None else f"at most {hi:g}"
        expected += " " + " and ".join(p for p in (low, high) if p)
    prefix = f"{where}: " if where else ""
    raise ModelLoadError(f"{prefix}{key} is {shown(x)}; expected {expected}")


def limits(field_name: str) -> dict[str, int]:
    """A field's LIMITS as a reader's lo= and hi=."""
    lo, hi = LIMITS[field_name]
    return {"lo": lo, "hi": hi}


def shown(x: Any) -> str:
    """A value as an error message shows it: its type where that is the fault, short."""
    if isinstance(x, list):
        return f"an array of {len(x)}"
    if isinstance(x, str):
        return f"a string {x[:40]!r}" + ("..." if len(x) > 40 else "")
    if isinstance(x, bool):
        return f"a boolean {x}"
    if isinstance(x, dict):
        return "an object"
    return repr(x)


class Fields:
    """Typed values of a mapping (GGUF metadata, a config.json), each checked by `value`:
    `fields(key, kind, default, lo=, hi=)` (no default: the key must be there; an int is
    0 or more unless `lo` says otherwise; a float's `lo` is excluded); `where` names the
    file in errors."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data, self.where = data, where

    def __call__(
        self, key: str, kind: type, default: Any = REQUIRED, lo: float | None = None,
        hi: float | None = None,
    ) -> Any:  # fmt: skip
        x = self.data.get(key)
        if x is None:
            if default is REQUIRED:
                raise UnsupportedModelError(f"{self.where} lacks {key}")
            return default
        if kind is int and lo is None:
            lo = 0
        return value(x, key, kind, lo, hi, self.where, open_low=kind is float and lo is not None)


def check_supported(
    what: str, value: str, supported: tuple[str, ...], shown: Any = None, among: str = ""
) -> None:
    """UnsupportedModelError naming `shown` (else `value`) unless `value` is `supported`."""
    if value not in supported:
        shown = value if shown is None else shown
        raise UnsupportedModelError(
            f"unsupported {what} {shown!r} (supported{among and ' ' + among}: "
            f"{', '.join(supported)})"
        )
