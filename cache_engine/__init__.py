"""The paged KV engine with automatic prefix caching.

Pure-Python bookkeeping (block hashes, block pool, KV cache manager) decides which KV
blocks a request can reuse; the model runner computes only the uncached suffix.
"""

from ragkv.cache_engine.block_hash import BlockHasher, block_hashes
from ragkv.cache_engine.block_pool import BlockPool
from ragkv.cache_engine.cache_stats import CacheStats
from ragkv.cache_engine.default_model import default_model_path
from ragkv.cache_engine.kv_cache_manager import KVCacheManager

__all__ = [
    "BlockHasher",
    "BlockPool",
    "CacheStats",
    "KVCacheManager",
    "block_hashes",
    "default_model_path",
]
