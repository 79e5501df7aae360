"""Hybrid caches: each kind of layer keeps what it attends to, and no more.

A hybrid model's layers come in kinds (kvlm.cache.kinds): local ones see only the last W
tokens (a sliding window, e.g. five of every six with W = 512 or 1,024), global ones the
whole context. A cache that keeps every layer's K/V for the whole context holds ~5x what
such a model reads at 32k tokens. So a hybrid model's cache is a cache per layer group
(kvlm.cache.groups) in lockstep (`HybridCache`):

    layers   0  1  2  3  4  5 | 6  7  8  9 10 11 | ...
    window   W  W  W  W  W  - | W  W  W  W  W  - |
    part     ring ........... whole .............

- the layers that see everything in a cache of the mode asked for (contiguous, basic),
  over those layers only;
- the layers of each window W in a ring of their last W + RING_SLACK tokens: the window
  cache's ring (kvlm.cache.window) with no sinks and positions as in the text, the model's
  window W in its masks, so a chunk longer than the window still sees what its early
  queries need, a rollback of up to RING_SLACK tokens (or a draft's rejected rows) finds
  what the next query reads, and its memory is W + RING_SLACK tokens however long the
  context.

A step is a step of each part (`HybridStep`); `for_layer(i)` hands layer i its part's
step, with the layer's index inside that part. The model never knows. A longer rollback
is refused, as the window cache refuses it (`can_roll_back`: the caller starts over).
Cache files hold every part (`layout` "groups", kvlm.cache.files): group n's tensors as
its part exports them, prefixed `g{n}_` (a ring's with its `slot_pos`, checked as a
ring is).

The split is kvlm.cache.groups': its `layer_groups` (the layers by kind, each group's
spec, which layer sits where, the file's layout) serve this cache and the pool's block
tables alike. This is the basic and contiguous modes' storage of the groups
(factory.RING_MODES); the paged and int8 modes keep each group on a block table of its
own (kvlm.cache.paged); their files hold the same layout, so either reads the other's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import torch

from kvlm.cache.base import (
    CacheSpec,
    CacheStep,
    ConvView,
    KVCache,
    KVPair,
    KVView,
    StateView,
)
from kvlm.cache.conv import ConvCache
from kvlm.cache.groups import LayerGroup, layer_at, layer_groups, layout_extra
from kvlm.cache.kinds import ConvWindow, RecurrentState
from kvlm.cache.recurrent import StateCache
from kvlm.cache.window import WindowCache


def group_prefix(g: int) -> str:
    """The prefix of layer group g's tensors in a snapshot of the `groups` layout."""
    return f"g{g}_"


def group_tensors(tensors: dict[str, torch.Tensor], g: int) -> dict[str, torch.Tensor]:
    """Layer group g's tensors of a `groups` snapshot, their prefix taken off."""
    prefix = group_prefix(g)
    return {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}


def ring_spec(spec: CacheSpec, group: LayerGroup) -> CacheSpec:
    """The ring a windowed group of `spec` is kept in: W + RING_SLACK slots, no sinks,
    positions as in the text, the model's window W in the masks."""
    keep, window = group.kind.keep, group.kind.window
    return replace(group.spec(spec), sinks=0, window=keep, window_positions="absolute",
                   sliding_window=window)  # fmt: skip


def part_cache(mode_cls: type[KVCache], spec: CacheSpec, group: LayerGroup) -> KVCache:
    """The cache a `mode_cls` cache keeps `group` of `spec`'s layers in: the mode's own for
    the whole layers, a ring for a window, a ConvCache for conv layers' rows, a
    StateCache for gated DeltaNet layers' state."""
    if isinstance(group.kind, ConvWindow):
        return ConvCache(group.spec(spec), group.kind)
    if isinstance(group.kind, RecurrentState):
        return StateCache(group.spec(spec), group.kind)
    if group.kind.keep is None:
        return mode_cls(group.spec(spec))
    return WindowCache(ring_spec(spec, group))


class _PartStep:
    """A part's step as one layer sees it: update() takes the model's layer index."""

    def __init__(self, step: CacheStep, index: dict[int, int]) -> None:
        self._step, self._index = step, index

    def __getattr__(self, name: str):
        return getattr(self._step, name)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        return self._step.update(self._index[layer], k, v)


class HybridStep(CacheStep):
    """One forward through both parts: the whole part's step is the step's face (positions,
    masks), each layer gets its part's (`for_layer`)."""

    def __init__(self, parts: list[CacheStep], cache: HybridCache) -> None:
        self.__dict__.update(parts[0].__dict__)  # positions, masks, rows: the whole part's
        self.parts = tuple(parts)
        self._views = {}
        self.conv = next((p.conv for p in parts if p.conv is not None), None)
        self.recurrent = next((p.recurrent for p in parts if p.recurrent is not None), None)
        self._layers = cache.layers

    def for_layer(self, layer: int) -> _PartStep:
        view = self._views.get(layer)
        if view is None:
            part, index = self._layers[layer]
            view = self._views[layer] = _PartStep(self.parts[part], index)
        return view

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        return self.for_layer(layer).update(layer, k, v)


class HybridCache(KVCache):
    """A cache per layer group of `spec` (kvlm.cache.groups) in lockstep: the layers that
    see everything in a cache of `mode_cls`, each window's in a ring."""

    layout: ClassVar[str] = "groups"

    def __init__(self, mode_cls: type[KVCache], spec: CacheSpec) -> None:
        super().__init__(spec)
        self.groups = layer_groups(spec)
        self.caches = [part_cache(mode_cls, spec, group) for group in self.groups]
        self.mode = mode_cls.mode
        # a draft step on every part, or none
        self.drafts = all(part.drafts for part in self.caches)
        # layer -> (part, {layer: index inside the part} of that part)
        indexes = [{i: n for n, i in enumerate(g.layers)} for g in self.groups]
        self.layers = [(g, indexes[g]) for g, _ in layer_at(self.groups)]

    @property
    def parts(self) -> tuple[KVCache, ...]:
        return tuple(self.caches)

    @property
    def capacity(self) -> int:
        return min(part.capacity for part in self.parts)

    def would_overflow(self, n_new: int) -> bool:
        return any(part.would_overflow(n_new) for part in self.parts)

    def _overflow_message(self, n_new: int) -> str:
        part = next(p for p in self.parts if p.would_overflow(n_new))
        return part._overflow_message(n_new)

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return HybridStep([part.begin(n_new, draft) for part in self.parts], self)

    def _commit(self, step: CacheStep) -> None:
        assert isinstance(step, HybridStep)
        for part, sub in zip(self.parts, step.parts, strict=True):
            part.commit(sub)

    def _check_rollback(self, n: int) -> None:
        for part in self.parts:
            part._check_rollback(n)

    def _truncate(self, length: int) -> None:
        for part in self.parts:
            if length == 0:
                part.reset()
            else:
                part.rollback(part.num_tokens - length)

    def _release(self) -> None:
        for part in self.parts:
            part.free()

    def hold_rollback(self, n: int) -> None:
        for part in self.parts:
            part.hold_rollback(n)

    def checkpoint(self, position: int) -> None:
        for part in self.parts:
            part.checkpoint(position)

    def rollback_point(self, keep: int) -> int:
        """The furthest position at most `keep` every part can go back to."""
        while keep > 0:
            point = min(part.rollback_point(keep) for part in self.parts)
            if point == keep:
                return keep
            keep = point
        return 0

    def _fork(self, n: int) -> None:
        for part in self.parts:
            part.fork(n)

    def _export(self) -> dict[str, torch.Tensor]:
        parts = enumerate(self.parts)
        return {group_prefix(g) + k: t for g, part in parts for k, t in part._export().items()}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        for g, part in enumerate(self.parts):
            part.free()
            part.batch = self.batch
            part._import(group_tensors(tensors, g), length)
            part._length = length

    def _layout_extra(self) -> dict[str, int]:
        """The groups' keys (groups.layout_extra); --kv window's group 0 is a sinks + ring,
        whose keys (sinks, window: WindowCache's) the file carries beside them."""
        extra = layout_extra(self.groups)
        if self.mode == "window":
            extra.update(self.parts[0]._layout_extra())
        return extra

    def kv_views(
        self, rows: Sequence[int], step: CacheStep | None = None
    ) -> list[KVView | ConvView | StateView] | None:
        """Each part's views, its group's layers in its store's order: the mode's own
        cache's (kv_views), a ring's (WindowCache.ring_views), the conv rows'
        (ConvCache.kv_views), the states' (StateCache.kv_views, with its part of `step`);
        None if a part has none."""
        views: list[KVView | ConvView | StateView] = []
        subs = step.parts if isinstance(step, HybridStep) else [None] * len(self.parts)
        for group, part, sub in zip(self.groups, self.parts, subs, strict=True):
            whole = group.kind.keep is None or isinstance(part, (ConvCache, StateCache))
            mine = part.kv_views(rows, sub) if whole else part.ring_views(rows)
            if mine is None:
                return None
            for view in mine:  # fresh ones: the part's layers are this group's
                view.layers = group.layers
            views += mine
        return views

    def written_in_place(self, step: CacheStep) -> None:
        assert isinstance(step, HybridStep)
        for part, sub in zip(self.parts, step.parts, strict=True):
            part.written_in_place(sub)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        raise TypeError("a hybrid cache's plan depends on its mode: kvlm.cache.factory")

    def __repr__(self) -> str:
        return f"<HybridCache {' + '.join(repr(p) for p in self.parts)}>"
