"""Byte-exact dedup of retrieved chunks, before a prompt exists.

- :class:`Chunk`: a retrieved passage (``str`` or ``bytes``) with source id, score, metadata.
- :func:`content_hash`: its identity (blake3 by default, xxh3_128 opt-in).
- :class:`Deduplicator` / :class:`DedupResult`: collapse byte-identical chunks (keeping the
  first, merging metadata), optionally drop contained chunks and merge overlapping windows.
- :class:`ChunkRegistry`: a bounded, thread-safe cross-request store of each chunk's
  token ids and request statistics, keyed by content hash.

This stage imports nothing from other ragkv stages (only :mod:`ragkv.errors`).
"""

from ragkv.dedup.chunk import Chunk
from ragkv.dedup.deduplicator import Deduplicator
from ragkv.dedup.hashing import HASH_ALGOS, content_hash
from ragkv.dedup.normalize import NORMALIZE_MODES
from ragkv.dedup.registry import ChunkRegistry, ChunkStats
from ragkv.dedup.result import DedupResult, DedupStats

__all__ = [
    "HASH_ALGOS",
    "NORMALIZE_MODES",
    "Chunk",
    "ChunkRegistry",
    "ChunkStats",
    "DedupResult",
    "DedupStats",
    "Deduplicator",
    "content_hash",
]
