"""Layer groups: a model's layers grouped by kind (kvlm.cache.kinds; vLLM's KV cache
groups), the one place the split is made.

`layer_groups(spec)` groups a CacheSpec's layers by their kinds (CacheSpec.layer_kinds),
the layers that keep every position first. Every cache keeps one part per group, its
storage chosen by the mode and the group's kind, and asks the group, never the model,
what the group needs:

    group 0  FullAttention     layers 5 11 17 ...   basic/contiguous: the mode's own cache
                                                    paged/int8, the pool: a block table
    group 1  SlidingWindow(W)  layers 0-4 6-10 ...  basic/contiguous: a ring of W + slack
                                                    paged/int8, the pool: a block table
                                                    whose blocks slide out behind `keep`

- the group's cache shape (`LayerGroup.spec`: the model's geometry over its layers);
- which layer is where (`layer_at`: layer i -> (group, index inside the group's store));
- how many positions a sequence keeps, how far back, and what the next query reads (the
  group's kind: `keep`, `kept`, `first_read`);
- how a file names the layout (`layout_extra`: the hybrid layout's window and local
  layers, kvlm.cache.files).

Today a model holds at most two groups, the whole layers and one window (the `hybrid`
file layout has room for one ring).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from kvlm.cache.base import CacheSpec
from kvlm.cache.kinds import FullAttention, LayerKind
from kvlm.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers of one kind: `layers`, the model's layer indices in their store's order."""

    kind: LayerKind
    layers: tuple[int, ...]

    def spec(self, spec: CacheSpec) -> CacheSpec:
        """The cache shape of this group of `spec`'s layers: its layers, its kind's
        geometry (LayerKind.shape), one window."""
        if not spec.layer_kinds or len(self.layers) == spec.num_layers:
            return spec
        window = spec.sliding_window if self.kind.window is None else self.kind.window
        heads, head_dim = self.kind.shape(spec)
        return replace(spec, num_layers=len(self.layers), layer_kinds=(), sliding_window=window,
                       num_kv_heads=heads, head_dim=head_dim)  # fmt: skip

    def token_bytes(self, spec: CacheSpec) -> int:
        """Bytes one token's rows take in this group's layers (LayerKind.token_bytes)."""
        return len(self.layers) * self.kind.token_bytes(spec)

    def sequence_bytes(self, spec: CacheSpec) -> int:
        """Bytes one sequence keeps in this group's layers whatever its length."""
        return len(self.layers) * self.kind.sequence_bytes(spec)

    def planned_bytes(self, spec: CacheSpec, positions: int) -> int:
        """Bytes one sequence holding `positions` positions' rows takes in this group."""
        return positions * self.token_bytes(spec) + self.sequence_bytes(spec)

    @property
    def described(self) -> dict:
        """The group as `kvlm memory`, /v1/kv and the dashboard show it."""
        return {"kind": self.kind.name, "layers": list(self.layers), "window": self.kind.window}


@functools.cache
def layer_groups(spec: CacheSpec) -> tuple[LayerGroup, ...]:
    """`spec`'s layers grouped by kind, the ones that keep every position first, then each
    window's. One group where every layer is alike (CacheSpec.layer_kinds empty)."""
    kinds = spec.layer_kinds
    if not kinds:
        return (LayerGroup(FullAttention(), tuple(range(spec.num_layers))),)
    windows = {k.window for k in kinds} - {None}
    if len(windows) != 1 or all(k.keep is not None for k in kinds):
        raise UnsupportedModelError(
            f"layers with windows {sorted(windows)}: one window and whole layers only"
        )
    order = sorted(set(kinds), key=lambda k: (k.keep is not None, kinds.index(k)))
    return tuple(LayerGroup(k, tuple(i for i, v in enumerate(kinds) if v == k)) for k in order)


def layer_at(groups: tuple[LayerGroup, ...]) -> list[tuple[int, int]]:
    """Layer i -> (its group, its index inside the group's store)."""
    where = {i: (g, n) for g, group in enumerate(groups) for n, i in enumerate(group.layers)}
    return [where[i] for i in range(len(where))]


def layout_extra(groups: tuple[LayerGroup, ...]) -> dict[str, int]:
    """How a file names a grouped cache's layout (the `hybrid` layout's window and a bit
    per windowed layer); {} for one group."""
    if len(groups) == 1:
        return {}
    (ring,) = groups[1:]
    return {"window": ring.kind.window, "local_layers": sum(1 << i for i in ring.layers)}
