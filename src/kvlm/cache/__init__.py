from kvlm.cache.base import CacheSpec, CacheStep, KVCache
from kvlm.cache.factory import CACHE_MODES, create_cache

__all__ = ["CACHE_MODES", "CacheSpec", "CacheStep", "KVCache", "create_cache"]
