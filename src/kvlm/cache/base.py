"""The cache protocol: what every KV cache mode answers, and the per-step view the model sees.

One forward pass goes through a cache like this:

    step = cache.begin(n_new)        # capacity checked here: overflow raises, nothing written
    logits = model(ids, step.positions, step)
        # each layer:  k_all, v_all = step.update(layer, k_new, v_new)
        #              attention(q, k_all, v_all, step.mask, step.is_causal)
    cache.commit(step)               # only now does the cache hold n_new more tokens

If the forward raises, `commit` never runs and the cache still holds exactly what it held
before (a contiguous cache may have scribbled past its counter; nothing reads there).

Positions are owned by the cache, never inferred from tensor contents: the new tokens sit
at `num_tokens .. num_tokens + n_new - 1`. That one rule makes prefill, decode, chunked
prefill and a chat turn that resumes a conversation the same code path. A cache that
stores nothing (`off`) always reports 0 tokens, so its caller re-feeds the whole sequence.

Later modes fit the same shape: a paged cache's step gathers the sequence's blocks, an
int8 cache's step dequantizes, a window cache's step builds its mask from the positions
its ring slots hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlm.config import ModelConfig
from kvlm.errors import CacheOverflowError, InvalidRequestError


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """The shape of one cache: the model's K/V geometry and how many tokens it may hold."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int
    batch: int = 1
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable
    # The model's own attention window (Mistral), applied in the mask; not the window cache.
    sliding_window: int | None = None

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
    ) -> CacheSpec:
        if max_tokens <= 0:
            raise InvalidRequestError(f"cache length must be positive, got {max_tokens}")
        return cls(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_tokens=max_tokens,
            batch=batch,
            dtype=dtype,
            device=torch.device(device),
            sliding_window=config.sliding_window,
        )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, for one sequence."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class CacheStep(ABC):
    """One forward's view of a cache: where the new tokens go and what they attend to."""

    def __init__(self, spec: CacheSpec, start: int, n_new: int, n_keys: int) -> None:
        self.start = start
        self.n_new = n_new
        pos = torch.arange(start, start + n_new, device=spec.device)
        self.positions = pos.expand(spec.batch, n_new)  # (B, T) int64
        self.mask, self.is_causal = causal_mask(
            start, n_new, n_keys, spec.sliding_window, spec.device
        )

    @abstractmethod
    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, Hkv, T, D) for `layer`; return all visible (B, Hkv, S, D)."""


def causal_mask(
    q_start: int, n_new: int, n_keys: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """Mask for queries at positions q_start.. over keys at positions 0..n_keys-1.

    Returns (mask, is_causal) for scaled_dot_product_attention, taking the cheap forms when
    they are exact. A chunk that continues a prefix needs the explicit form, because SDPA's
    is_causal aligns the triangle top-left:

                 k0 k1 k2 k3 | k4 k5 k6        (k0..k3 cached, k4..k6 this chunk)
            q4 [  1  1  1  1 |  1  0  0 ]
            q5 [  1  1  1  1 |  1  1  0 ]
            q6 [  1  1  1  1 |  1  1  1 ]

    With a model attention window W, key j is visible to query i only if i - j < W.
    """
    if window is None or n_keys <= window:
        if n_new == 1:
            return None, False  # one query sees every key
        if q_start == 0 and n_keys == n_new:
            return None, True  # a fresh prefill: the plain triangle
    q = torch.arange(q_start, q_start + n_new, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed, False  # (T, S) broadcasts over batch and heads


class KVCache(ABC):
    """A KV cache of one of the modes in kvlm.cache.factory.CACHE_MODES."""

    mode: ClassVar[str]

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self._length = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V this cache holds (per sequence)."""
        return self._length

    @property
    def capacity(self) -> int:
        """The most tokens one forward may see: its stored prefix plus the new tokens."""
        return self.spec.max_tokens

    def would_overflow(self, n_new: int) -> bool:
        return self.num_tokens + n_new > self.capacity

    def begin(self, n_new: int) -> CacheStep:
        """Plan a forward of `n_new` tokens. Raises before anything is written."""
        if n_new <= 0:
            raise InvalidRequestError(f"a forward needs at least one token, got {n_new}")
        if self.would_overflow(n_new):
            raise CacheOverflowError(
                f"{self.num_tokens} cached + {n_new} new tokens exceed the cache capacity of "
                f"{self.capacity} tokens (raise --max-context, up to the model's limit)"
            )
        return self._begin(n_new)

    def commit(self, step: CacheStep) -> None:
        """The forward succeeded: the cache now holds the step's tokens."""
        if step.start != self._length:
            raise RuntimeError("commit of a stale cache step")  # a bug, not a user error
        self._commit(step)
        self._length = step.start + step.n_new

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens (speculation rejected, a chat turn diverged)."""
        if not 0 <= n <= self._length:
            raise InvalidRequestError(f"cannot roll back {n} of {self._length} cached tokens")
        self._length -= n
        self._truncate(self._length)

    def reset(self) -> None:
        self._length = 0
        self._truncate(0)

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of K/V storage this cache holds right now (allocated, not just used)."""

    @abstractmethod
    def _begin(self, n_new: int) -> CacheStep: ...

    def _commit(self, step: CacheStep) -> None:  # noqa: B027 - most modes write in update()
        pass

    def _truncate(self, length: int) -> None:  # noqa: B027 - a counter move is enough for most
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.num_tokens}/{self.capacity} tokens, {self.nbytes} B>"
