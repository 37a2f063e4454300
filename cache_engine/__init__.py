"""The paged KV engine with automatic prefix caching.

Pure-Python bookkeeping (block hashes, block pool, KV cache manager) decides which KV
blocks a request can reuse; the model runner computes only the uncached suffix.
"""

from ragkv.cache_engine.default_model import default_model_path

__all__ = ["default_model_path"]
