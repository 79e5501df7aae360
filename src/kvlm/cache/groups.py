"""Layer groups: a model's layers grouped by kind (kvlm.cache.kinds; vLLM's KV cache
groups), the one place the split is made.

`layer_groups(spec)` groups a CacheSpec's layers by their kinds (CacheSpec.layer_kinds):
group 0 is the one kind that keeps every position (its blocks chain a pool's prefix
cache and carry a sequence's admission, kvlm.cache.prefix), then every other kind's
layers, in the order of their first layer. Every cache keeps one part per group, its
storage chosen by the mode and the group's kind, and asks the group, never the model,
what the group needs:

    group 0  FullAttention     layers 5 11 17 ...   basic/contiguous: the mode's own cache
                                                    paged/int8, the pool: a block table
    group 1  SlidingWindow(W)  layers 0-4 6-10 ...  basic/contiguous: a ring of W + slack
                                                    paged/int8, the pool: a block table
                                                    whose blocks slide out behind `keep`
    group 2  SlidingWindow(V)  ...                  (as many as the model has kinds)

- the group's cache shape (`LayerGroup.spec`: its kind's geometry over its layers) and
  bytes (`token_bytes`, `sequence_bytes`, `end_bytes`, `planned_bytes`);
- which layer is where (`layer_at`: layer i -> (group, index inside the group's store));
- how many positions a sequence keeps, how far back, and what the next query reads (the
  group's kind: `keep`, `kept`, `first_read`);
- how a file names the layout (`layout_extra`, `from_layout`: the `groups` layout,
  kvlm.cache.files).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from kvlm.cache.base import CacheSpec
from kvlm.cache.kinds import FullAttention, LayerKind, kind_from
from kvlm.errors import KvlmError, UnsupportedModelError


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

    def snapshot_bytes(self, spec: CacheSpec) -> int:
        """Bytes a snapshot of one sequence's state takes in this group's layers (a
        recurrent kind's: RecurrentState.snapshot_bytes at the spec's block size)."""
        return len(self.layers) * self.kind.snapshot_bytes(spec, spec.block_size)  # type: ignore[attr-defined]

    def end_bytes(self, spec: CacheSpec) -> int:
        """Bytes a prefix-caching pool keeps at each full block's end in this group's
        layers (LayerKind.end_bytes: a conv group's rows before it)."""
        return len(self.layers) * self.kind.end_bytes(spec)

    def planned_bytes(self, spec: CacheSpec, positions: int) -> int:
        """Bytes one sequence holding `positions` positions' rows takes in this group."""
        return positions * self.token_bytes(spec) + self.sequence_bytes(spec)

    @property
    def described(self) -> dict:
        """The group as `kvlm memory`, /v1/kv and the dashboard show it."""
        return {"kind": self.kind.name, "layers": list(self.layers), "window": self.kind.window}


@functools.cache
def layer_groups(spec: CacheSpec) -> tuple[LayerGroup, ...]:
    """`spec`'s layers grouped by kind: the one kind that keeps every position first, then
    the others by their first layer. One group where every layer is alike
    (CacheSpec.layer_kinds empty)."""
    kinds = spec.layer_kinds
    if not kinds:
        return (LayerGroup(FullAttention(), tuple(range(spec.num_layers))),)
    whole = {k for k in kinds if k.keep is None}
    if len(whole) != 1:
        names = sorted({repr(k) for k in kinds})
        raise UnsupportedModelError(
            f"layers of kinds {', '.join(names)}: kvlm keeps one kind of layers that see the "
            f"whole context (group 0, whose blocks chain the prefix cache) beside any others"
        )
    order = sorted(set(kinds), key=lambda k: (k.keep is not None, kinds.index(k)))
    return tuple(LayerGroup(k, tuple(i for i, v in enumerate(kinds) if v == k)) for k in order)


def layer_at(groups: tuple[LayerGroup, ...]) -> list[tuple[int, int]]:
    """Layer i -> (its group, its index inside the group's store)."""
    where = {i: (g, n) for g, group in enumerate(groups) for n, i in enumerate(group.layers)}
    return [where[i] for i in range(len(where))]


def layer_kinds(groups: tuple[LayerGroup, ...]) -> tuple[LayerKind, ...]:
    """Each layer's kind (CacheSpec.layer_kinds) from its group."""
    kinds = {i: group.kind for group in groups for i in group.layers}
    return tuple(kinds[i] for i in range(len(kinds)))


def layout_extra(groups: tuple[LayerGroup, ...]) -> dict[str, int]:
    """How a file names a grouped cache's layout (the `groups` layout, kvlm.cache.files):
    how many groups, and per group n its kind (`g{n}_kind`, its code in kinds.KINDS), its
    layers (`g{n}_layers`, a bit per model layer) and the kind's fields (`g{n}_size`,
    ...: LayerKind.fields); {} for one group."""
    if len(groups) == 1:
        return {}
    extra = {"groups": len(groups)}
    for n, group in enumerate(groups):
        extra[f"g{n}_kind"] = group.kind.code
        extra[f"g{n}_layers"] = sum(1 << i for i in group.layers)
        extra.update({f"g{n}_{name}": v for name, v in group.kind.fields.items()})
    return extra


def from_layout(extra: dict[str, int], num_layers: int) -> tuple[LayerGroup, ...]:
    """The groups a file's `groups` layout names (layout_extra's inverse), checked: known
    kinds with their fields, every layer in one group, the groups as layer_groups orders
    them. ValueError with the reason."""
    n = extra.get("groups")
    if type(n) is not int or not 2 <= n <= num_layers:
        raise ValueError(f"groups {n!r} is not a count of 2 .. {num_layers} groups")
    kinds: list[LayerKind | None] = [None] * num_layers
    for g in range(n):
        code, mask = extra.get(f"g{g}_kind"), extra.get(f"g{g}_layers")
        if type(code) is not int or type(mask) is not int or not 0 < mask < 1 << num_layers:
            raise ValueError(f"group {g} has no kind, or its layers {mask!r} are not a set of "
                             f"some of {num_layers} layers")  # fmt: skip
        prefix = f"g{g}_"
        fields = {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}
        kind = kind_from(code, {k: v for k, v in fields.items() if k not in ("kind", "layers")})
        for i in range(num_layers):
            if mask >> i & 1:
                if kinds[i] is not None:
                    raise ValueError(f"layer {i} is in two groups")
                kinds[i] = kind
    if None in kinds:
        raise ValueError(f"layer {kinds.index(None)} is in no group")
    try:
        spec = CacheSpec(num_layers, 1, 2, 1, layer_kinds=tuple(kinds))  # type: ignore[arg-type]
        groups = layer_groups(spec)
    except KvlmError as exc:  # two groups of one kind; no group that keeps every position
        raise ValueError(str(exc)) from None
    if layout_extra(groups) != extra:
        raise ValueError(f"groups {extra} are not as kvlm writes them ({layout_extra(groups)})")
    return groups
