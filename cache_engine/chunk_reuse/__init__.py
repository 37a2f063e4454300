"""Opt-in position-independent chunk reuse (approximate; Invariant 8).

A chunk's exact K/V, recorded wherever it was computed (:class:`ChunkIndex`), is copied to
the chunk's position in a later prompt with keys re-rotated (:mod:`.placement`); the
strategy (:class:`BlendConfig`) says which reused tokens are recomputed (:mod:`.planner`).
"""

from ragkv.cache_engine.chunk_reuse.config import STRATEGIES, BlendConfig, check_chunk_spans
from ragkv.cache_engine.chunk_reuse.index import ChunkIndex, ChunkLocation
from ragkv.cache_engine.chunk_reuse.planner import BlendPlan, plan_blend

__all__ = [
    "STRATEGIES",
    "BlendConfig",
    "BlendPlan",
    "ChunkIndex",
    "ChunkLocation",
    "check_chunk_spans",
    "plan_blend",
]
