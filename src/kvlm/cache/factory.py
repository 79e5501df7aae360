"""Cache modes by name: the one place a mode string becomes a cache."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvlm.cache.base import CacheSpec, KVCache
from kvlm.cache.basic import BasicCache
from kvlm.cache.contiguous import ContiguousCache
from kvlm.cache.groups import LayerGroup, layer_groups
from kvlm.cache.hybrid import HybridCache, ring_spec
from kvlm.cache.kinds import STATE_KINDS
from kvlm.cache.off import OffCache
from kvlm.cache.paged import Int8PagedCache, PagedCache
from kvlm.cache.window import WindowCache
from kvlm.errors import InvalidRequestError, UnsupportedModelError

CACHE_MODES: dict[str, type[KVCache]] = {
    "off": OffCache,
    "basic": BasicCache,
    "contiguous": ContiguousCache,
    "paged": PagedCache,
    "int8": Int8PagedCache,
    "window": WindowCache,
}
# Modes whose caches keep a hybrid model's layers (layers with a window and layers without)
# apart, in the `groups` layout: basic and contiguous as a HybridCache, a cache of the mode
# for the whole layers and a ring for each window's (RING_MODES, kvlm.cache.hybrid); paged and
# int8 on a pool with a block table per layer group (kvlm.cache.paged)
HYBRID_MODES = ("basic", "contiguous", "paged", "int8")
RING_MODES = ("basic", "contiguous")
# Modes whose caches keep one head geometry (one ring) for all layers: a model whose
# layers have heads of their own sizes (LayerKind.heads, head_dim) is refused
OWN_GEOMETRY_REFUSED = ("window",)
ONE_GEOMETRY = ("keeps one head geometry for every layer, and this model's layers have heads "
                "of their own sizes (use contiguous, basic, paged or int8)")  # fmt: skip
# Modes whose attention equals full attention over the whole sequence, bit for bit in the
# stored dtype (int8 quantizes; window drops what falls out of it).
EXACT_MODES = ("off", "basic", "contiguous", "paged")
# What the caches declare (KVCache.fused_step, pool_mode): the modes the fused C decode
# step reads (kvlm.model.fused), and those whose prompts LLM.generate batches through the
# engine's pool (the same attention, exactly: window, basic and off keep state the pool
# cannot, a ring, a per-step rebuild, nothing)
FUSED_MODES = tuple(mode for mode, cls in CACHE_MODES.items() if cls.fused_step)
BATCH_MODES = tuple(mode for mode, cls in CACHE_MODES.items() if cls.pool_mode is not None)


def check_mode(mode: str) -> type[KVCache]:
    cls = CACHE_MODES.get(mode)
    if cls is None:
        raise InvalidRequestError(
            f"unknown cache mode {mode!r}; valid modes: {', '.join(CACHE_MODES)}"
        )
    return cls


def pool_mode(mode: str) -> str:
    """The mode of the engine's pool for an LLM of `mode`: its cache's own pool mode
    (int8 stores int8 whatever --kv-dtype says), else paged."""
    return check_mode(mode).pool_mode or "paged"


def mode_spec(mode: str, spec: CacheSpec) -> CacheSpec:
    """The spec a mode really runs with (`int8` always stores int8)."""
    return replace(spec, dtype=torch.int8, v_dtype=None) if mode == "int8" else spec


def create_cache(mode: str, spec: CacheSpec) -> KVCache:
    """A cache of `mode`; for a model whose layers have different windows, in a mode that
    keeps a sequence's rows (RING_MODES), a HybridCache of that mode (kvlm.cache.hybrid);
    paged and int8 keep them apart on their own (a block table per layer group)."""
    cls, spec = check_mode(mode), mode_spec(mode, spec)
    groups = layer_groups(spec)
    reason = refused(mode, spec)
    if reason is not None:
        raise UnsupportedModelError(reason)
    if len(groups) > 1 and (mode in RING_MODES or (mode != "off" and state_group(groups))):
        return HybridCache(cls, spec)
    return cls(spec)


def refused(mode: str, spec: CacheSpec) -> str | None:
    """Why a cache of `mode` (its spec as mode_spec makes it) cannot keep `spec`'s layers,
    or None: a mode or K dtype of one head geometry for every layer (OWN_GEOMETRY_REFUSED,
    int8/q4 K: one K rotation) where layers have heads of their own sizes."""
    # attention rows of their own geometry (a state kind's `heads` are its state's, and
    # every mode keeps a state group beside the mode's own cache)
    own = any(g.kind.head_dim or g.kind.heads for g in layer_groups(spec)
              if not isinstance(g.kind, STATE_KINDS))  # fmt: skip
    if own and mode in OWN_GEOMETRY_REFUSED:
        return f"the {mode} cache {ONE_GEOMETRY}"
    return None


def state_group(groups: tuple[LayerGroup, ...]) -> LayerGroup | None:
    """The first group of a state kind (kinds.STATE_KINDS: conv layers' rows, a gated
    DeltaNet's state), if any: every mode but off keeps it as a HybridCache's part
    (kvlm.cache.conv.ConvCache, kvlm.cache.recurrent.StateCache) beside the mode's cache of
    the others."""
    return next((g for g in groups if isinstance(g.kind, STATE_KINDS)), None)


def without(spec: CacheSpec, group: LayerGroup) -> CacheSpec:
    """`spec` less `group`'s layers (the layers the mode's own cache keeps)."""
    kinds = [k for i, k in enumerate(spec.layer_kinds) if i not in group.layers]
    return replace(spec, num_layers=len(kinds),
                   layer_kinds=tuple(kinds) if len(set(kinds)) > 1 else ())  # fmt: skip


def planned_nbytes(mode: str, spec: CacheSpec, tokens: int, batch: int) -> int:
    """What a cache of this mode allocates for `batch` sequences of `tokens` tokens."""
    return sum(n for _, n, _ in planned_parts(mode, spec, tokens, batch))


def planned_parts(
    mode: str, spec: CacheSpec, tokens: int, batch: int
) -> list[tuple[CacheSpec, int, int]]:
    """(spec, bytes it allocates, tokens each sequence keeps) of each part of a `mode`
    cache for `batch` sequences of `tokens` tokens: the cache itself; a HybridCache's
    whole part and ring; a paged or int8 cache's layer groups (PagedCache.planned_groups:
    a windowed group holds at most kvlm.cache.paged.window_blocks(W + RING_SLACK, ...)
    blocks between steps)."""
    cls, spec = check_mode(mode), mode_spec(mode, spec)
    state = state_group(layer_groups(spec))
    if state is not None and mode != "off":  # the mode's cache of the others, the state
        rest = planned_parts(mode, without(spec, state), tokens, batch)
        return [*rest, (state.spec(spec), batch * state.sequence_bytes(spec), 0)]
    if issubclass(cls, PagedCache):
        return cls.planned_groups(spec, tokens, batch)
    groups = layer_groups(spec)
    if mode not in RING_MODES or len(groups) == 1:
        return [(spec, cls.planned_nbytes(spec, tokens, batch), tokens)]
    parts = []
    for group in groups:  # as kvlm.cache.hybrid.part_cache keeps each group
        if group.kind.keep is None:
            whole = group.spec(spec)
            parts.append((whole, cls.planned_nbytes(whole, tokens, batch), tokens))
        else:
            ring = ring_spec(spec, group)
            parts.append((ring, WindowCache.planned_nbytes(ring, tokens, batch), ring.window))
    return parts
