"""Layer kinds: what each kind of layer keeps for a sequence, and a model's layers grouped
by it (vLLM's KVCacheSpec and its KV cache groups).

A model is a stack of blocks; each block's mixer keeps something per sequence so that the
next token is computed without the text before it again. What it keeps is its kind's spec:

    kind          keeps, per sequence                   spec               kept(T)   first_read(T)
    attention     K/V rows of every token               FullAttention()    T         0
    window        K/V rows of the last W + RING_SLACK   SlidingWindow(W)   <= W+32   T - W + 1
    (next) conv   the last L - 1 input rows             a window of rows
    (next) state  one fixed matrix                      a state, no rows

`layer_groups(spec)` groups a model's layers by spec, the layers that see everything
first. Every cache keeps one part per group, its storage chosen by the mode and the
group's kind, and asks the group's spec, never the model, what the group needs:

    group 0  FullAttention     layers 5 11 17 ...   basic/contiguous: the mode's own cache
                                                    paged/int8, the pool: a block table
    group 1  SlidingWindow(W)  layers 0-4 6-10 ...  basic/contiguous: a ring of W + slack
                                                    paged/int8, the pool: a block table
                                                    whose blocks slide out behind `keep`

- the group's cache shape (`LayerGroup.spec`: the model's geometry over its layers);
- which layer is where (`layer_at`: layer i -> (group, index inside the group's store));
- how many positions a sequence keeps (`kept`: a plan's bytes, `kvlm memory`, the pool's
  windowed blocks), how far back it keeps them (`keep`), and the first position the next
  query reads (`first_read`: what a rollback must not let go of);
- how a file names the layout (`layout_extra`: the hybrid layout's window and local
  layers, kvlm.cache.files).

Today a layer's kind follows from its attention window (CacheSpec.layer_windows:
`kind_of`); a model holds at most two groups, the whole layers and one window (the
`hybrid` file layout has room for one ring).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

from kvlm.cache.base import CacheSpec
from kvlm.errors import UnsupportedModelError

# Tokens a windowed group keeps past its window: what a rollback may take back (a chat's
# last token, a draft's rows beyond its own undo); a longer one is refused (the caller
# recomputes the prefix)
RING_SLACK = 32


@dataclass(frozen=True, slots=True)
class LayerKind:
    """What a layer of this kind keeps for a sequence (a spec: equal specs, one group)."""

    name: ClassVar[str]

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


@dataclass(frozen=True, slots=True)
class FullAttention(LayerKind):
    """Attention over the whole context: K/V rows of every token."""

    name: ClassVar[str] = "attention"


@dataclass(frozen=True, slots=True)
class SlidingWindow(LayerKind):
    """Attention over the last `size` tokens: K/V rows of the last size + RING_SLACK."""

    name: ClassVar[str] = "window"
    size: int

    @property
    def window(self) -> int:
        return self.size

    @property
    def keep(self) -> int:
        return self.size + RING_SLACK

    def first_read(self, length: int) -> int:
        return max(0, length - self.size + 1)


def kind_of(window: int | None) -> LayerKind:
    """What an attention layer with model window `window` keeps (None: the whole context)."""
    return FullAttention() if window is None else SlidingWindow(window)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers of one kind: `layers`, the model's layer indices in their store's order."""

    kind: LayerKind
    layers: tuple[int, ...]

    def spec(self, spec: CacheSpec) -> CacheSpec:
        """The cache shape of this group of `spec`'s layers: its layers, one window."""
        if spec.layer_windows == () or len(self.layers) == spec.num_layers:
            return spec
        window = spec.sliding_window if self.kind.window is None else self.kind.window
        return replace(spec, num_layers=len(self.layers), layer_windows=(), sliding_window=window)

    @property
    def described(self) -> dict:
        """The group as `kvlm memory`, /v1/kv and the dashboard show it."""
        return {"kind": self.kind.name, "layers": list(self.layers), "window": self.kind.window}


@functools.cache
def layer_groups(spec: CacheSpec) -> tuple[LayerGroup, ...]:
    """`spec`'s layers grouped by kind, the ones that see the whole context first, then
    each window's. One group where every layer is alike (a model window applied to every
    layer, Mistral's, is the masks' business: the cache keeps every row)."""
    windows = spec.layer_windows
    if len(set(windows)) < 2:
        return (LayerGroup(FullAttention(), tuple(range(spec.num_layers))),)
    local = set(windows) - {None}
    if len(local) != 1 or None not in windows:
        raise UnsupportedModelError(
            f"layers with windows {sorted(local)}: one window and whole layers only"
        )
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return tuple(LayerGroup(kind_of(w), tuple(i for i, v in enumerate(windows) if v == w))
                 for w in order)  # fmt: skip


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
