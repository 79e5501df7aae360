"""`window`: the first S tokens (attention sinks) plus a ring of the last W, in constant memory.

StreamingLLM's observation (Xiao et al. 2023): a model keeps attending to its first few
tokens whatever they say, so dropping them breaks it, while keeping them plus a recent
window lets generation run on indefinitely, *if* RoPE positions are counted inside the
cache rather than in the text. With absolute positions (mlx-lm's RotatingKVCache, and this
cache's `window_positions="absolute"`), the query at position p meets the sinks at distance
p - i, which grows past the model's trained context (the paper shows perplexity exploding there)
and fp32 angles p * theta lose their low bits.

So by default (`window_positions="cache"`) K is stored *before* RoPE, and each step rotates
every key it returns at its position inside the cache; the queries take the positions that
follow. The model never sees a distance above S + W + n_new, however long the stream:

    slots:   [ s0 s1 s2 s3 | r0 r1 r2 ... rW-1 ]   S = 4 sinks, then a ring of W
    token at position p >= S lives in ring slot (p - S) % W; slot_pos records who is where.

    a decode step at absolute position t >= S + W (the ring has wrapped), keys by position:

    absolute  0  1  2  3   t-W  t-W+1 ... t-1 | t        sinks at distance t - i: unbounded
    visible   y  y  y  y    n     y   ...  y  | y        (t - (t-W) = W: out of the window)
    in cache  0  1  2  3    .     4   ... W+2 | W+3      = absolute - shift for the ring
                                                          shift = start - W + 1 - S

    i.e. the visible keys (sinks, then ring tokens in order, then the new tokens) sit at
    0, 1, 2, ...: exactly where a from-scratch forward over the kept tokens would put them
    (StreamingLLM's definition). Distances among ring and new tokens are the absolute ones;
    only the sinks move, to sit right before the oldest visible ring token.

A step attends over every stored slot plus its own new tokens, masked by absolute position:
query q sees key p iff p <= q and (p < S or q - p < W). So a long prefill chunk is exact in
what it sees: its early queries still see tokens its later tokens will evict. One shift
serves the whole step, computed from the chunk's first query (the keys visible to some
query of the step are sinks, then positions start-W+1 .. start+n-1, contiguous), so a chunk's
later queries meet the sinks a little farther away than a one-token step would place them;
positions stay below S + W + n_new. Before the ring first wraps (start < S + W) the shift is
0 and both modes use the same positions. The model's own sliding window (Mistral), if any,
applies to the distances the model sees. After the step only the sinks and the last W
tokens are kept. Memory never grows past S + W slots.

Storage dtypes: fp32/bf16/fp16 store pre-RoPE K as they store anything. int8 stores K in
the Hadamard-rotated basis k R (kvlm.cache.storage); RoPE does not commute with R, so in
cache mode a step turns the dequantized keys back with R^T (R orthonormal) and returns them
in the plain basis with `key_rotation` None: one (S+W) x D x D product per layer and step.
The absolute mode keeps the old contract (keys rotated at write, q R at read).

The model-facing contract: `step.positions` are the queries' positions (also the new keys'
positions); `step.key_rope_positions` (S+W+n_new,) is None in absolute mode, else the
position of every key update() returns, which update() returns *before* RoPE (the model
computes cos/sin for them once per step, kvlm.model.transformer).

Rollback is exact only while nothing the next query needs has been evicted (before the ring
first wraps, or by one token after it); otherwise it is refused. Cache files record the
position mode (layout_extra "cache_positions": 1; absolute files carry no such key, as
files written before the mode existed), so a file is only restored into its own mode.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from kvlm.cache.base import CacheSpec, CacheStep, KVPair, KVView
from kvlm.cache.rows import RowCache
from kvlm.errors import InvalidRequestError

ALL = slice(None)


def within(
    visible: torch.Tensor, q_at: torch.Tensor, k_at: torch.Tensor, window: int | None
) -> torch.Tensor:
    """`visible` (WindowCache.sees) within a model attention window, on the distances RoPE
    sees (q_at - k_at < window)."""
    if window is None:
        return visible
    return visible & (q_at[:, None] - k_at[None, :] < window)


class _WindowStep(CacheStep):
    def __init__(self, cache: WindowCache, n_new: int) -> None:
        spec, start = cache.spec, cache.num_tokens
        q = torch.arange(start, start + n_new, device=spec.device)  # absolute positions
        k, *self._seen = cache.sees(start, q, cache.slot_pos)
        q_at, k_at = self._seen[1:]
        super().__init__(start, n_new, cache.batch, spec.device, None, False)
        self.use_window(spec.sliding_window)
        self.positions = q_at.expand(cache.batch, n_new)  # (B, T) where RoPE puts the queries
        self.key_positions = k  # the absolute position each returned key holds (-1: empty)
        # (S + W + n_new,) where RoPE puts each returned key; None: keys come back rotated.
        self.key_rope_positions = k_at if cache.cache_positions else None
        self._keys_over(cache)

    def use_window(self, window: int | None) -> None:
        self.mask = within(*self._seen, window)

    def _keys_over(self, cache: WindowCache) -> None:
        """The step reads and writes the cache's ring; int8 K is stored as k R, which in
        cache mode update() turns back to the plain basis for RoPE."""
        self._over(cache.store)
        self._basis = self.key_rotation
        if cache.cache_positions:
            self.key_rotation = None
        self.staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cache.spec.num_layers
        self.in_place = False  # the K/V written into the ring by the caller (written_in_place)
        self.undo: tuple | None = None  # a draft's undo record, taken before those writes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        if self._basis is not None:
            k = k @ self._basis.to(k.dtype)
        v = self._values_in(v)  # V has no RoPE: kept and returned in its stored basis
        self.staged[layer] = self._stage(k, v)  # written by commit, after every layer has read
        k_all, v_all = self._read(layer, 0, k), self._read(layer, 1, v)
        if self._basis is not None and self.key_rotation is None:
            k_all = k_all @ self._basis.T.to(k_all.dtype)  # (k R) R^T = k, ready for RoPE
        return k_all, v_all  # (B, Hkv, S + W + n_new, D)

    def _stage(self, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        return k, v

    def _read(self, layer: int, kv: int, x: torch.Tensor) -> torch.Tensor:
        """The ring's K or V, then the new tokens' as they will be read back later (rounded
        to the storage dtype), so a result never depends on how a prompt was split."""
        return torch.cat([self.store.get((layer, kv), x.dtype), self.store.roundtrip(x, kv)], dim=2)


class WindowDraftRowsStep(_WindowStep):
    """One sequence fed n tokens as n rows of one token (a speculative draft's check): row
    i computes exactly what a one-token step at position start + i computes after rows
    0..i-1 were fed one at a time. Each row gets its own copy of the cache's slots with
    rows 0..i-1 written in (rounded as the store would keep them), then its own token,
    its own visibility mask and, with positions inside the cache, its own RoPE positions
    (the per-step shift of a one-token step at its position). The commit keeps an undo
    record of the slots it overwrites, so rolling the rejected rows back restores the
    ring exactly (WindowCache._truncate)."""

    def __init__(self, cache: WindowCache, n_new: int) -> None:
        spec, start = cache.spec, cache.num_tokens
        if n_new > spec.window:
            raise ValueError("a draft longer than the window")
        dev = spec.device
        CacheStep.__init__(self, start, n_new, 1, dev, None, False)
        self._keys_over(cache)
        pos = torch.arange(start, start + n_new, device=dev)
        self.new_slots = cache._slot(pos)  # where row i's token goes
        seen = []  # (mask (1, S + W + 1), query position, key positions) per row
        slot_pos = cache.slot_pos.clone()
        for i in range(n_new):  # as the one-token step at start + i builds its own
            seen.append(cache.sees(start + i, pos[i : i + 1], slot_pos)[1:])
            slot_pos[self.new_slots[i]] = start + i  # row i's token, in the ring for row i+1
        self._seen_rows = seen
        _, q_ats, k_ats = zip(*seen, strict=True)
        self.positions = torch.stack(q_ats)  # (rows, 1)
        self.key_rope_positions = torch.stack(k_ats) if cache.cache_positions else None
        self.use_window(spec.sliding_window)

    def use_window(self, window: int | None) -> None:
        masks = [within(*seen, window) for seen in self._seen_rows]
        self.rows = [(m.shape[-1], m, False) for m in masks]

    def _stage(self, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        """k, v (rows, Hkv, 1, D) -> the one sequence's (1, Hkv, rows, D)."""
        return k[:, :, 0].transpose(0, 1)[None], v[:, :, 0].transpose(0, 1)[None]

    def _read(self, layer: int, kv: int, x: torch.Tensor) -> torch.Tensor:
        """Per row (rows, Hkv, S + W + 1, D): the slots as row i's one-token step would
        read them, then its own token."""
        stored = self.store.get((layer, kv), x.dtype)  # (1, Hkv, slots, D)
        kept = self.store.roundtrip(x, kv)  # (rows, Hkv, 1, D), as the store reads them back
        ring = stored.clone()  # rows before i: in the ring, as one-token steps left them
        rows = []
        for i in range(x.shape[0]):
            rows.append(torch.cat([ring, kept[i : i + 1]], dim=2))
            ring[0, :, self.new_slots[i]] = kept[i, :, 0]  # row i's token, for rows after i
        return torch.cat(rows)


class WindowCache(RowCache):
    mode = "window"
    layout = "window"

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec, slots=spec.sinks + spec.window)
        self.cache_positions = spec.window_positions == "cache"
        self.slot_pos = torch.full((self.slots,), -1, dtype=torch.long, device=spec.device)
        # (start, n, slots, raw values, slot_pos) a draft check's commit overwrote
        self._undo: tuple | None = None

    @property
    def capacity(self) -> int:
        return sys.maxsize  # endless: old tokens leave the ring

    def rope_positions(self, start: int, q: torch.Tensor, k: torch.Tensor) -> KVPair:
        """Where RoPE puts a step's queries and keys, from their absolute positions.

        Cache positions: the ring tokens no query of the step can see (S .. start-W) are
        skipped, so the sinks keep 0..S-1 and the oldest visible ring token sits at S. Keys
        no query sees (an empty slot, the stale ring slot) get a harmless position >= 0."""
        if not self.cache_positions:
            return q, k
        s = self.spec
        shift = max(0, start - s.window + 1 - s.sinks)
        return q - shift, torch.where(k < s.sinks, k, k - shift).clamp_min(0)

    def sees(self, start: int, q: torch.Tensor, slot_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A step from `start` of queries at absolute positions q over slots holding
        slot_pos, then its own tokens: (each key's absolute position k, the (T, S) mask of
        what each query sees, where RoPE puts the queries, and the keys). Query q sees key
        p iff p <= q and (p < S or q - p < W); `within` adds the model's own window."""
        s = self.spec
        k = torch.cat([slot_pos, q])  # stored slots, then this step's tokens
        visible = (k[None, :] >= 0) & (k[None, :] <= q[:, None])
        visible &= (k[None, :] < s.sinks) | (q[:, None] - k[None, :] < s.window)
        q_at, k_at = self.rope_positions(start, q, k)
        return k, visible, q_at, k_at

    def _slot(self, pos: torch.Tensor) -> torch.Tensor:
        s = self.spec
        return torch.where(pos < s.sinks, pos, s.sinks + (pos - s.sinks) % s.window)

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return (WindowDraftRowsStep if draft else _WindowStep)(self, n_new)

    def _kept(self, step: _WindowStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's positions, which of them the ring keeps, and their slots."""
        s = self.spec
        pos = torch.arange(step.start, step.start + step.n_new, device=s.device)
        keep = (pos < s.sinks) | (pos >= step.start + step.n_new - s.window)
        return pos, keep, self._slot(pos[keep])  # distinct slots: at most W ring tokens kept

    def _undo_of(self, step: _WindowStep, slots: torch.Tensor) -> tuple | None:
        """A draft check's record of what its commit overwrites, for a rollback."""
        if not isinstance(step, WindowDraftRowsStep):
            return None
        raw = {key: t.clone() for key, t in self.store.raw((ALL, ALL, ALL, ALL, slots)).items()}
        return (step.start, step.n_new, slots, raw, self.slot_pos[slots].clone())

    def ring_views(self, rows: Sequence[int]) -> list[KVView] | None:
        """The ring as a view (kv_views), row b's block b of `slots` slots, position p in
        slot p % slots, where its masks are a model window on positions as in the text
        with no sinks (a windowed layer group's ring, kvlm.cache.hybrid); else None."""
        s = self.spec
        if s.sinks or self.cache_positions or s.sliding_window is None:
            return None
        return [KVView(self.store, [[r] for r in rows], self.slots, self.slots,
                       window=s.sliding_window)]  # fmt: skip

    def written_in_place(self, step: CacheStep) -> None:
        """The caller writes the step's K/V into the ring itself, every token at its slot
        (the fused decode step, kvlm.model.fused, over a ring with positions as in the
        text): a draft's undo record is taken now, before anything is overwritten, and
        commit() then only records the positions."""
        assert isinstance(step, _WindowStep) and not self.cache_positions
        step.undo = self._undo_of(step, self._kept(step)[2])
        step.in_place = True

    def _commit(self, step: CacheStep) -> None:
        assert isinstance(step, _WindowStep)
        pos, keep, slots = self._kept(step)
        self._undo = step.undo if step.in_place else self._undo_of(step, slots)
        for layer, (k, v) in enumerate([] if step.in_place else step.staged):
            self.store.put((layer, 0, ALL, ALL, slots), k[:, :, keep])
            self.store.put((layer, 1, ALL, ALL, slots), v[:, :, keep])
        self.slot_pos[slots] = pos[keep]

    def _undoes(self, n: int) -> bool:
        """Whether rolling back n tokens stays within the last draft check's own tokens,
        whose overwritten slots it recorded."""
        undo = getattr(self, "_undo", None)
        return undo is not None and undo[0] + undo[1] == self.num_tokens and n <= undo[1]

    def _check_rollback(self, n: int) -> None:
        """Allowed iff every position the next query will attend to is still held (or is
        restored: a draft check's rejected rows)."""
        if self._undoes(n):
            return
        s, new_len = self.spec, self.num_tokens - n
        reads = min(
            s.window, s.sliding_window or s.window
        )  # the model's window too (a hybrid ring's)
        needed = set(range(max(s.sinks, new_len - reads + 1), new_len))
        missing = needed - set(self.slot_pos.tolist())
        if missing:
            raise InvalidRequestError(
                f"cannot roll back {n} tokens: the window has evicted position {min(missing)}, "
                "which the next query would need"
            )

    def _truncate(self, length: int) -> None:
        undo, self._undo = getattr(self, "_undo", None), None
        if undo is not None and undo[0] <= length <= undo[0] + undo[1]:
            _, _, slots, raw, old_pos = undo
            gone = self.slot_pos[slots] >= length  # slots the rolled-back rows wrote
            index = (ALL, ALL, ALL, ALL, slots[gone])
            self.store.put_raw(index, {key: t[..., gone, :] if t.dim() == 6 else t[..., gone]
                                       for key, t in raw.items()})  # fmt: skip
            self.slot_pos[slots[gone]] = old_pos[gone]
            return
        self.slot_pos[self.slot_pos >= length] = -1

    def _export(self) -> dict[str, torch.Tensor]:
        return {**self.store.raw(()), "slot_pos": self.slot_pos}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        self._import_rows({k: t for k, t in tensors.items() if k != "slot_pos"}, ())
        self.slot_pos.copy_(tensors["slot_pos"])

    def _layout_extra(self) -> dict[str, int]:
        extra = {"sinks": self.spec.sinks, "window": self.spec.window}
        if self.cache_positions:  # K before RoPE: unusable by an absolute-position cache
            extra["cache_positions"] = 1
        return extra

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return batch * (spec.sinks + spec.window) * spec.bytes_per_token
