"""The memory planner behind `kvlm memory`: what a cache costs, before allocating it.

The figures come from each mode's own planned_nbytes(), the same accounting its nbytes
reports once allocated (tests/test_cache.py and tests/test_memory.py check the two agree),
generalising Akunu's table: any model config, any mode, any storage dtype.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from kvlm.cache.base import CacheSpec
from kvlm.cache.factory import mode_spec, planned_nbytes, planned_parts, refused
from kvlm.cache.groups import layer_groups as spec_groups
from kvlm.cache.kinds import FullAttention, RecurrentState, shown
from kvlm.config import ModelConfig
from kvlm.dtypes import Q4
from kvlm.errors import InvalidRequestError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 1000, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}  # fmt: skip


@dataclass(slots=True)
class MemoryPlan:
    mode: str
    kv_dtype: str
    context: int
    batch: int
    bytes_per_token: int  # per sequence, all layers, K and V, int8 parameters included
    bytes_per_sequence: int  # what one sequence of `context` tokens allocates in this mode
    total_bytes: int  # `batch` such sequences
    weight_bytes: int  # the model's weights at the compute dtype
    budget_bytes: int | None
    sequences_in_budget: int | None  # how many sequences of `context` tokens fit the budget
    # the layers by what they keep (layer_groups): one group unless a hybrid model's cache
    layer_groups: list[dict]

    def to_dict(self) -> dict:
        return asdict(self)


def parse_size(text: str) -> int:
    """'8GiB', '512MB', '1.5g', '2e9' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise InvalidRequestError(f"cannot read the size {text!r} (examples: 8GiB, 512MB, 2e9)")
    return int(value * _UNITS[unit])


def parameter_count(config: ModelConfig, active: bool = False) -> int:
    """The model's parameters, from its shapes: embeddings (and an untied output), the
    attention and gated MLP products (a mixture of experts' layers: the router and every
    expert, or with `active` the experts one token runs, top_k of them), the norms (the
    q/k norms where it has them, and the norms on attention's and the MLP's outputs in
    the "sandwich" layout; a shared expert and its gate; a router's input norm and its
    experts' scales; experts beside the dense MLP and their three norms; latent
    attention's products and norms in place of q/k/v/o; layers of their own head
    geometry, MLP width, K = V or reading an earlier layer's K/V; per-layer inputs and
    layer scalars)."""
    c = config
    q = c.num_heads * c.head_dim
    kv = c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    norms = 4 if c.norm_layout == "sandwich" else 2
    per_layer += norms * c.hidden_size + (sum(c.qk_norm_sizes) if c.qk_norm else 0)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    total = c.num_layers * per_layer + embeddings + c.hidden_size
    for i in range(c.num_layers if c.layer_intermediate_sizes else 0):  # a layer's own MLP
        total += 3 * c.hidden_size * (c.intermediate_of(i) - c.intermediate_size)
    if c.layer_head_dims or c.layer_kv_heads or c.kv_sources or any(c.layer_k_eq_v):
        same = c.hidden_size * (2 * q + 2 * kv) + (sum(c.qk_norm_sizes) if c.qk_norm else 0)
        total += sum(_own_attention(c, i) - same for i in range(c.num_layers))
    if c.per_layer_input:  # the table, the projection and its norm; each layer's gate,
        w, n, h = c.per_layer_input, c.num_layers, c.hidden_size  # projection and norm
        total += c.per_layer_vocab * n * w + n * w * h + w + n * (2 * h * w + h)
    total += c.num_layers if c.layer_scalars else 0
    x = c.experts
    if x is not None and c.expert_layers:  # experts in place of those layers' MLP (or
        used = x.top_k if active else x.count  # beside it, with three norms of their own)
        moe = x.count * c.hidden_size + used * 3 * c.hidden_size * x.intermediate
        moe += 3 * c.hidden_size * x.shared + (c.hidden_size if x.shared_gate else 0)
        moe += (c.hidden_size if x.router_norm else 0) + (x.count if x.expert_scale else 0)
        dense = 3 * c.hidden_size * c.intermediate_size
        moe += 3 * c.hidden_size if x.beside_mlp else -dense
        total += len(c.expert_layers) * moe
    m = c.latent
    if m is not None and c.latent_layers:  # latent attention in place of q/k/v/o
        h, heads = c.hidden_size, c.num_heads
        queries = h * heads * m.qk_dim
        if m.q_rank:  # a compressed query: q_a, its norm, q_b
            queries = h * m.q_rank + m.q_rank + m.q_rank * heads * m.qk_dim
        keys = h * m.row + m.kv_rank + m.kv_rank * heads * (m.nope_dim + m.v_dim)
        latent = queries + keys + heads * m.v_dim * h
        total += len(c.latent_layers) * (latent - h * (2 * q + 2 * kv))
    return total


def _own_attention(c: ModelConfig, i: int) -> int:
    """Layer i's attention parameters where layers have their own head geometry, K = V
    (no v_proj) or read an earlier layer's K/V (q and o alone, and the q norm)."""
    d, h = c.head_dim_of(i), c.hidden_size
    kv_mats = 0 if c.kv_source(i) != i else 1 if c.k_eq_v(i) else 2
    norms = (1 if kv_mats == 0 else 2) * d if c.qk_norm else 0
    return h * (2 * c.num_heads * d + kv_mats * c.kv_heads_of(i) * d) + norms


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    return parameter_count(config) * dtype.itemsize


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes the OS could give this process now (Linux: MemAvailable), or None; on a GPU
    (`device` cuda) the device's free memory (cudaMemGetInfo)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan(
    config: ModelConfig,
    mode: str,
    context: int,
    batch: int,
    kv_dtype: torch.dtype | tuple[torch.dtype, torch.dtype],
    compute_dtype: torch.dtype = torch.float32,
    budget: int | None = None,
    device: torch.device | str = "cpu",
    weights: int | None = None,
    **sizes: int | None,
) -> MemoryPlan:
    """`sizes`: block_size, num_blocks, window, sinks (as CacheSpec). `budget` None: what
    `device` has free (RAM, or the GPU's memory) less the weights: `weights` bytes (None:
    every parameter dense in `compute_dtype`)."""
    if batch < 1:
        raise InvalidRequestError("batch must be >= 1")
    spec = mode_spec(mode, CacheSpec.for_model(config, context, kv_dtype, **sizes))
    per_seq = planned_nbytes(mode, spec, context, 1)
    weights = weight_bytes(config, compute_dtype) if weights is None else weights
    if budget is None:
        free = available_memory(device)
        budget = None if free is None else max(0, free - weights)
    fits = None if budget is None or per_seq == 0 else budget // per_seq
    return MemoryPlan(
        mode=mode,
        kv_dtype=spec.kv_name,
        context=context,
        batch=batch,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_sequence=per_seq,
        total_bytes=planned_nbytes(mode, spec, context, batch),
        weight_bytes=weights,
        budget_bytes=budget,
        sequences_in_budget=fits,
        layer_groups=layer_groups(mode, spec, context, batch, config),
    )


def layer_groups(
    mode: str, spec: CacheSpec, context: int, batch: int, config: ModelConfig | None = None
) -> list[dict]:
    """The layers by what a `mode` cache keeps of `batch` sequences of `context` tokens:
    {"kind" (kvlm.cache.kinds, or the mode's own: "window" for the window cache, "none"
    for off), "layers", "window" (None: the whole context), "tokens" each keeps, "bytes"},
    and for a state kind (conv) "block_end_bytes": what the engine's pool (`kvlm serve`)
    keeps besides, with its prefix cache, for each full block of block_size tokens (the
    state at its end, which a hit there restores; LayerGroup.end_bytes).
    One group, but for a hybrid model's cache of a HYBRID_MODES mode: a group per
    kvlm.cache.groups.layer_groups (a ring, or a paged pool's windowed block-table group), as
    factory.planned_parts plans them. With the model's `config`, each row also says what
    its layers keep and which later layers read their K/V (kinds.shown: "keeps",
    "shared_by")."""
    parts = planned_parts(mode, spec, context, batch)
    groups = spec_groups(spec)
    if len(parts) == len(groups):
        names = [group.kind.name for group in groups]
    else:  # one cache over every layer, of the mode's own kind
        names = [{"window": "window", "off": "none"}.get(mode, FullAttention.name)]
    rows = enumerate(zip(names, parts, strict=True))
    out = [{"kind": name, "layers": part.num_layers,
            "window": part.sliding_window if i else None, "tokens": kept, "bytes": n}
           for i, (name, (part, n, kept)) in rows]  # fmt: skip
    if len(parts) == len(groups):  # a state kind's end rows: what the engine's pool keeps
        for row, group in zip(out, groups, strict=True):  # a block for prefix hits
            if group.end_bytes(spec):
                row["block_end_bytes"] = group.end_bytes(spec)
            if isinstance(group.kind, RecurrentState):  # a sequence's snapshot
                row["snapshot_bytes"] = group.snapshot_bytes(spec)
    if config is not None:  # each row's cache layers: its group's, or every one
        every = [list(range(spec.num_layers))]
        lists = [list(g.layers) for g in groups] if len(parts) == len(groups) else every
        for row, layers in zip(out, lists, strict=True):
            row |= shown(config, layers)
    return out


def table(config: ModelConfig, context: int, batch: int, **sizes: int | None) -> list[dict]:
    """Every mode x storage dtype for one workload: the generalised Akunu table."""
    return spec_table(CacheSpec.for_model(config, context, **sizes), context, batch)


def spec_table(base: CacheSpec, context: int, batch: int) -> list[dict]:
    """table() for a K/V geometry and mode sizes without a model config (a saved cache
    file carries only those); `base`'s K/V dtypes are replaced by each row's."""
    specs = [(mode, mode_spec(mode, replace(base, dtype=k, v_dtype=None if v == k else v)))
             for mode, k, v in TABLE_ROWS]  # fmt: skip
    return [
        {
            "mode": mode,
            "kv_dtype": spec.kv_name,
            "bytes_per_token": spec.bytes_per_token if mode != "off" else 0,
            "total_bytes": planned_nbytes(mode, spec, context, batch),
        }
        for mode, spec in specs
        if refused(mode, spec) is None  # a mode that cannot keep these layers: no row
    ]


F32, BF16, I8 = torch.float32, torch.bfloat16, torch.int8
# (mode, K's dtype, V's)
TABLE_ROWS = [("off", F32, F32), ("basic", F32, F32), ("basic", BF16, BF16),
              ("contiguous", F32, F32), ("contiguous", BF16, BF16), ("contiguous", I8, I8),
              ("contiguous", Q4, Q4), ("paged", F32, F32), ("paged", BF16, BF16),
              ("paged", I8, Q4), ("paged", Q4, Q4), ("int8", I8, I8),
              ("window", F32, F32), ("window", BF16, BF16), ("window", I8, I8),
              ("window", Q4, Q4)]  # fmt: skip
