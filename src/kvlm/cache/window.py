"""`window`: the first S tokens (attention sinks) plus a ring of the last W, in constant memory.

StreamingLLM's observation: a model keeps attending to its first few tokens whatever they
say, so dropping them breaks it, while keeping them plus a recent window lets generation
run on indefinitely. mlx-lm's RotatingKVCache does the same with absolute positions, as
here: keys keep the RoPE rotation of their true position (no re-rotation), and the model's
attention is restricted to sinks + window.

    slots: [ s0 s1 s2 s3 | r0 r1 r2 ... rW-1 ]     S = 4 sinks, then a ring of W
    token at position p >= S lives in ring slot (p - S) % W; slot_pos records who is where.

A step attends over every stored slot plus its own new tokens, masked by position: query
q sees key p iff p <= q and (p < S or q - p < W). So a long prefill chunk is exact: its
early queries still see tokens its later tokens will evict. After the step only the sinks
and the last W tokens are kept. Memory never grows past S + W slots.

Rollback is exact only while nothing the next query needs has been evicted (before the ring
first wraps, or by one token after it); otherwise it is refused.
"""

from __future__ import annotations

import sys

import torch

from kvlm.cache.base import CacheSpec, CacheStep
from kvlm.cache.rows import RowCache
from kvlm.errors import InvalidRequestError

ALL = slice(None)


class _WindowStep(CacheStep):
    def __init__(self, cache: WindowCache, n_new: int) -> None:
        spec, start = cache.spec, cache.num_tokens
        q = torch.arange(start, start + n_new, device=spec.device)
        k = torch.cat([cache.slot_pos, q])  # stored slots, then this step's tokens
        visible = (k[None, :] >= 0) & (k[None, :] <= q[:, None])
        visible &= (k[None, :] < spec.sinks) | (q[:, None] - k[None, :] < spec.window)
        if spec.sliding_window is not None:
            visible &= q[:, None] - k[None, :] < spec.sliding_window
        super().__init__(start, n_new, cache.batch, spec.device, visible, False)
        self.key_positions = k  # the position each returned key holds (-1: empty slot)
        self.store = cache.store
        self._over(self.store)
        self.staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * spec.num_layers

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._keys_in(k)
        self.staged[layer] = (k, v)  # written by commit, after every layer has read the ring
        # The new tokens are seen as they will be read back later (rounded to the storage
        # dtype), so a result never depends on how a prompt was split into steps.
        k_all = torch.cat([self.store.get((layer, 0), k.dtype), self.store.roundtrip(k)], dim=2)
        v_all = torch.cat([self.store.get((layer, 1), v.dtype), self.store.roundtrip(v)], dim=2)
        return k_all, v_all


class WindowCache(RowCache):
    mode = "window"
    layout = "window"

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec, slots=spec.sinks + spec.window)
        self.slot_pos = torch.full((self.slots,), -1, dtype=torch.long, device=spec.device)

    @property
    def capacity(self) -> int:
        return sys.maxsize  # endless: old tokens leave the ring

    def _slot(self, pos: torch.Tensor) -> torch.Tensor:
        s = self.spec
        return torch.where(pos < s.sinks, pos, s.sinks + (pos - s.sinks) % s.window)

    def _begin(self, n_new: int) -> CacheStep:
        return _WindowStep(self, n_new)

    def _commit(self, step: CacheStep) -> None:
        assert isinstance(step, _WindowStep)
        s = self.spec
        pos = torch.arange(step.start, step.start + step.n_new, device=s.device)
        keep = (pos < s.sinks) | (pos >= step.start + step.n_new - s.window)
        slots = self._slot(pos[keep])  # distinct: at most W ring tokens kept
        for layer, (k, v) in enumerate(step.staged):
            self.store.put((layer, 0, ALL, ALL, slots), k[:, :, keep])
            self.store.put((layer, 1, ALL, ALL, slots), v[:, :, keep])
        self.slot_pos[slots] = pos[keep]

    def _check_rollback(self, n: int) -> None:
        """Allowed iff every position the next query will attend to is still held."""
        s, new_len = self.spec, self.num_tokens - n
        needed = set(range(max(s.sinks, new_len - s.window + 1), new_len))
        missing = needed - set(self.slot_pos.tolist())
        if missing:
            raise InvalidRequestError(
                f"cannot roll back {n} tokens: the window has evicted position {min(missing)}, "
                "which the next query would need"
            )

    def _truncate(self, length: int) -> None:
        self.slot_pos[self.slot_pos >= length] = -1

    def _export(self) -> dict[str, torch.Tensor]:
        return {**self.store.raw(()), "slot_pos": self.slot_pos}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        self._import_rows({k: t for k, t in tensors.items() if k != "slot_pos"}, ())
        self.slot_pos.copy_(tensors["slot_pos"])

    def _layout_extra(self) -> dict[str, int]:
        return {"sinks": self.spec.sinks, "window": self.spec.window}

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return batch * (spec.sinks + spec.window) * spec.bytes_per_token
