"""The paged KV engine with automatic prefix caching.

Pure-Python bookkeeping (block hashes, block pool, KV cache manager) decides which KV
blocks a request can reuse; the model runner computes only the uncached suffix.

The engine-side names (``Engine``, ``SamplingParams``, ``Output``, ...) load lazily, so the
pure-Python cache core imports without torch.
"""

from typing import TYPE_CHECKING

from ragkv._lazy import lazy_attributes
from ragkv.cache_engine.block_hash import BlockHasher, block_hashes
from ragkv.cache_engine.block_pool import BlockPool
from ragkv.cache_engine.cache_stats import CacheStats
from ragkv.cache_engine.config import EngineConfig
from ragkv.cache_engine.default_model import default_model_path
from ragkv.cache_engine.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from ragkv.cache_engine.engine import Engine
    from ragkv.cache_engine.outputs import (
        EngineHealth,
        EngineStats,
        Output,
        StreamDelta,
        Timings,
        Usage,
    )
    from ragkv.cache_engine.sampling_params import SamplingParams

__getattr__ = lazy_attributes(
    __name__,
    {
        "Engine": "ragkv.cache_engine.engine",
        "EngineHealth": "ragkv.cache_engine.outputs",
        "EngineStats": "ragkv.cache_engine.outputs",
        "Output": "ragkv.cache_engine.outputs",
        "StreamDelta": "ragkv.cache_engine.outputs",
        "Timings": "ragkv.cache_engine.outputs",
        "Usage": "ragkv.cache_engine.outputs",
        "SamplingParams": "ragkv.cache_engine.sampling_params",
    },
)


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineHealth",
    "EngineStats",
    "Output",
    "SamplingParams",
    "StreamDelta",
    "Timings",
    "Usage",
    "BlockHasher",
    "BlockPool",
    "CacheStats",
    "KVCacheManager",
    "block_hashes",
    "default_model_path",
]
