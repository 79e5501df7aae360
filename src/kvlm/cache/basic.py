"""`basic`: per-layer K and V grown by concatenation.

The simplest correct cache, and a teaching baseline: every decode step allocates a new
(S+1)-long tensor per layer and copies the old S rows into it, so its cost per token grows
with the sequence, gently, where `contiguous` writes one row in place. It is also the
reference the other modes are checked against (tests/test_cache_properties.py).
"""

from __future__ import annotations

import torch

from kvlm.cache.base import CacheSpec, CacheStep, DenseStep, DraftRows, KVCache, KVPair
from kvlm.dtypes import Q4
from kvlm.errors import InvalidRequestError


class _BasicStep(DenseStep):
    def __init__(self, cache: BasicCache, n_new: int) -> None:
        super().__init__(cache, n_new)
        self.cache = cache
        # Staged per layer; swapped in by commit, so a forward that raises changes nothing.
        self.staged: list[torch.Tensor | None] = [None] * len(cache.kv)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVPair:
        new = torch.stack([k, v]).to(self.cache.spec.dtype)  # (2, B, Hkv, T, D)
        old = self.cache.kv[layer]
        kv = self.staged[layer] = new if old is None else torch.cat([old, new], dim=3)
        return kv[0].to(k.dtype), kv[1].to(v.dtype)


class BasicDraftRowsStep(DraftRows, _BasicStep):
    """A draft's check on a basic cache (kvlm.cache.base.DraftRows): the rows' K/V
    appended, staged for the commit as a one-sequence step's are."""


class BasicCache(KVCache):
    mode = "basic"

    def __init__(self, spec: CacheSpec) -> None:
        if spec.dtype in (torch.int8, Q4) or spec.v_dtype not in (None, spec.dtype):
            raise InvalidRequestError(
                f"--kv basic stores K and V as floats of one dtype; {spec.kv_name} needs "
                "--kv contiguous, paged or window"
            )
        super().__init__(spec)
        self.kv: list[torch.Tensor | None] = [None] * spec.num_layers  # (2, B, Hkv, S, D) each

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv if t is not None)

    @classmethod
    def planned_nbytes(cls, spec: CacheSpec, tokens: int, batch: int) -> int:
        return batch * tokens * spec.bytes_per_token

    def _begin(self, n_new: int, draft: bool) -> CacheStep:
        return (BasicDraftRowsStep if draft else _BasicStep)(self, n_new)

    def _commit(self, step: CacheStep) -> None:
        assert isinstance(step, _BasicStep)
        self.kv = [old if kv is None else kv for old, kv in zip(self.kv, step.staged, strict=True)]

    def _truncate(self, length: int) -> None:
        # clone: a slice would pin the old, longer storage
        self.kv = [
            None if length == 0 or kv is None else kv[:, :, :, :length].clone() for kv in self.kv
        ]

    def _fork(self, n: int) -> None:
        self.kv = [None if kv is None else kv.repeat_interleave(n, dim=1) for kv in self.kv]

    def _export(self) -> dict[str, torch.Tensor]:
        if self.num_tokens == 0:
            s = self.spec
            shape = (s.num_layers, 2, self.batch, s.num_kv_heads, 0, s.head_dim)
            return {"values": torch.zeros(shape, dtype=s.dtype, device=s.device)}
        return {"values": torch.stack(self.kv)}  # (L, 2, B, Hkv, n, D)

    def _import(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        if length == 0:
            return
        self.kv = [layer.clone() for layer in tensors["values"].to(self.spec.dtype)]
