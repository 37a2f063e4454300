"""Prefix-cache counters reported by :meth:`KVCacheManager.stats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    """A snapshot of the prefix cache: lookups since start, and the pool right now."""

    queries: int = 0  # recorded lookups (admissions; probes and rankings are not counted)
    query_tokens: int = 0  # tokens of the looked-up sequences
    hit_tokens: int = 0  # tokens served from cache
    hit_blocks: int = 0
    evictions: int = 0  # cached blocks whose hash was dropped when they were reused
    collisions: int = 0  # equal hash, different bytes: degraded to a miss
    num_blocks: int = 0
    num_free_blocks: int = 0
    usage: float = 0.0  # fraction of blocks referenced by requests, 0..1

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0 before the first query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
