"""Cache modes by name: the one place a mode string becomes a cache."""

from __future__ import annotations

from kvlm.cache.base import CacheSpec, KVCache
from kvlm.cache.basic import BasicCache
from kvlm.cache.contiguous import ContiguousCache
from kvlm.cache.off import OffCache
from kvlm.errors import InvalidRequestError

CACHE_MODES: dict[str, type[KVCache]] = {
    "off": OffCache,
    "basic": BasicCache,
    "contiguous": ContiguousCache,
}


def check_mode(mode: str) -> type[KVCache]:
    cls = CACHE_MODES.get(mode)
    if cls is None:
        raise InvalidRequestError(
            f"unknown cache mode {mode!r}; valid modes: {', '.join(CACHE_MODES)}"
        )
    return cls


def create_cache(mode: str, spec: CacheSpec) -> KVCache:
    return check_mode(mode)(spec)
