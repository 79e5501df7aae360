"""A gated DeltaNet's state (kvlm.model.deltanet; the layer kind RecurrentState): what its
layers keep of a sequence is no row per token but a fixed state, its recurrence's
(value heads, key_dim, value_dim) and its convolution's last L - 1 input rows.
`DeltaRows` holds it for a group of DeltaNet layers and a batch of sequences in lockstep
(begin(n) -> a `DeltaStep` the model reads and stages in, commit only once the forward
succeeded; fork, snapshot/restore; no rollback: a state cannot forget tokens).
`StateCache` is the part of a cache that keeps it (kvlm.cache.hybrid: a cache of a model
with DeltaNet layers keeps a part per layer group, the DeltaNet layers' this one), a
DeltaRows of the group's layers and the cache's sequences; its step's
`recurrent` the DeltaStep the model reads (Transformer.forward), kept by commit only once
the forward succeeded.

    conv:  (DeltaNet layers, B, L - 1, conv_width)        positions length - L + 1 .. length - 1
    state: (DeltaNet layers, B, value_heads, key_dim, value_dim)   after `length` tokens

Both in kinds.state_dtype (fp32; fp64 for an fp64 cache). A state cannot forget tokens:
`can_roll_back(n)` is False for any n > 0 (a chat turn starts over; speculative decoding
is refused for such a model, kvlm.llm), rollback to 0 is a reset. fork, snapshot/restore
copy it whole. No fused C step reads it (kvlm.model.fused refuses a DeltaNet layer), no
cache file holds it yet (kvlm.cache.files refuses), nor the engine's pool (kvlm.llm).
"""

from __future__ import annotations

import sys

import torch

from kvlm.cache.base import CacheSpec, CacheStep, KVCache, KVPair
from kvlm.cache.conv import ConvRows, ConvStep
from kvlm.cache.kinds import ConvWindow, RecurrentState, state_dtype
from kvlm.config import DeltaNet
from kvlm.errors import InvalidRequestError

# Why a cache with a DeltaNet state refuses a rollback (and the callers that need one)
NO_ROLLBACK = "a gated DeltaNet's state cannot forget tokens"


class DeltaRows:
    """The DeltaNet layers' state of `batch` sequences advanced in lockstep: each layer's
    last L - 1 input rows of its convolution (`conv`, a ConvRows) and its recurrent state
    `state` (layers, batch, nv, dk, dv) in the recurrence's dtype; `length` the tokens
    they hold."""

    def __init__(
        self, shape: DeltaNet, layers: int, batch: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape = shape
        window = ConvWindow(shape.conv_kernel - 1, shape.conv_width)
        self.conv = ConvRows(window, layers, batch, dtype, device, slack=0)
        s = shape
        self.state = torch.zeros(layers, batch, s.value_heads, s.key_dim, s.value_dim,
                                 dtype=state_dtype(dtype), device=device)  # fmt: skip

    @property
    def length(self) -> int:
        return self.conv.length

    def begin(self, n_new: int) -> DeltaStep:
        """The step of `n_new` tokens after the `length` the sequences hold."""
        return DeltaStep(self, n_new)

    def commit(self, step: DeltaStep) -> None:
        """Keep the step's rows and states (only once its forward succeeded)."""
        if any(s is None for s in step.staged):
            raise ValueError("a DeltaNet step committed before it was run through")
        self.conv.commit(step.conv)
        self.state = torch.stack(step.staged)  # type: ignore[arg-type]

    def fork(self, n: int) -> None:
        """Each sequence as n (n samples decoding from one prompt)."""
        self.conv.fork(n)
        self.state = self.state.repeat_interleave(n, dim=1)

    def snapshot(self) -> tuple:
        return self.conv.snapshot(), self.state.clone()

    def restore(self, saved: tuple) -> None:
        conv, state = saved
        self.conv.restore(conv)
        self.state = state.clone()


class DeltaStep:
    """One forward's view of the DeltaNet rows: `conv` the ConvStep of their convolution
    windows, `initial(layer)` a layer's state before the step, `stage(layer, state)` its
    state after (kept by DeltaRows.commit)."""

    def __init__(self, rows: DeltaRows, n_new: int) -> None:
        self.start, self.n_new = rows.length, n_new
        self.conv: ConvStep = rows.conv.begin(n_new)
        self._state = rows.state
        self.staged: list[torch.Tensor | None] = [None] * rows.state.shape[0]

    def initial(self, layer: int) -> torch.Tensor:
        return self._state[layer]

    def stage(self, layer: int, state: torch.Tensor) -> None:
        self.staged[layer] = state


class _StateCacheStep(CacheStep):
    """A StateCache's step: no K/V (a DeltaNet layer attends to nothing); `recurrent` its
    DeltaStep."""

    def __init__(self, cache: StateCache, n_new: int) -> None:
        super().__init__(cache.num_tokens, n_new, cache.batch, cache.spec.device, None, False)
        self.recurrent = cache.rows.begin(n_new)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        raise RuntimeError("a DeltaNet layer has no K/V")  # a bug, not a user error


class StateCache(KVCache):
    """The state of a group of DeltaNet layers (`spec.num_layers` of them, kind `kind`) for
    `spec.batch` sequences: a part of a HybridCache, any mode but off."""

    mode = "state"
    drafts = False  # a draft's rejected tokens would have to leave the state

    def __init__(self, spec: CacheSpec, kind: RecurrentState) -> None:
        super().__init__(spec)
        self.kind = kind
        self.rows = self._new_rows(spec.batch)

    def _new_rows(self, batch: int) -> DeltaRows:
        dtype = state_dtype(self.spec.kv_dtypes[0])
        return DeltaRows(self.kind.sizes, self.spec.num_layers, batch, dtype, self.spec.device)

    @property
    def capacity(self) -> int:
        return sys.maxsize  # a state a sequence: any length

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return _StateCacheStep(self, n_new)

    def _commit(self, step: CacheStep) -> None:
        self.rows.commit(step.recurrent)  # type: ignore[arg-type]

    def _check_rollback(self, n: int) -> None:
        if 0 < n < self._length:  # all of them: a reset
            raise InvalidRequestError(f"{NO_ROLLBACK}: {n} of {self._length} tokens back")

    def _truncate(self, length: int) -> None:
        if length == 0:
            self.rows = self._new_rows(self.batch)
        elif length != self.rows.length:  # _check_rollback lets none through
            raise RuntimeError(f"{NO_ROLLBACK}: to {length} of {self.rows.length}")

    def _fork(self, n: int) -> None:
        self.rows.fork(n)

    def kv_views(self, rows):  # type: ignore[override]
        return None  # no fused step reads a DeltaNet layer

    def _release(self) -> None:  # back to the spec's batch
        self.rows = self._new_rows(self.spec.batch)

    def _export(self) -> dict[str, torch.Tensor]:
        """`conv` (layers, B, L - 1, conv_width) and `state` (layers, B, nv, dk, dv)."""
        return {"conv": self.rows.conv.rows, "state": self.rows.state}

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        rows = self._new_rows(self.batch)
        dtype, device = rows.state.dtype, self.spec.device
        rows.conv.rows = tensors["conv"].to(dtype=dtype, device=device, copy=True).contiguous()
        rows.conv.end = rows.conv.length = length
        rows.conv.first = length - rows.conv.keep
        rows.state = tensors["state"].to(dtype=dtype, device=device, copy=True)
        self.rows = rows

    @property
    def nbytes(self) -> int:
        conv, state = self.rows.conv.rows, self.rows.state
        return conv.numel() * conv.element_size() + state.numel() * state.element_size()

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        raise TypeError("a state part's plan is its kind's: LayerGroup.sequence_bytes")
