from kvlm.cache.base import CacheFileError, CacheSnapshot, CacheSpec, CacheStep, KVCache
from kvlm.cache.factory import CACHE_MODES, EXACT_MODES, create_cache, planned_nbytes
from kvlm.cache.files import load_cache, save_cache

__all__ = [
    "CACHE_MODES",
    "EXACT_MODES",
    "CacheFileError",
    "CacheSnapshot",
    "CacheSpec",
    "CacheStep",
    "KVCache",
    "create_cache",
    "load_cache",
    "planned_nbytes",
    "save_cache",
]
