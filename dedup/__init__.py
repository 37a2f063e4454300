"""Byte-exact dedup of retrieved chunks, before a prompt exists.

- :class:`Chunk`: a retrieved passage (``str`` or ``bytes``) with source id, score, metadata.
- :func:`content_hash`: its identity (blake3 by default, xxh3_128 opt-in).
- :class:`ChunkRegistry`: a bounded, thread-safe cross-request store of each chunk's
  token ids and request statistics, keyed by content hash.

This stage imports nothing from other ragkv stages (only :mod:`ragkv.errors`).
"""

from ragkv.dedup.chunk import Chunk
from ragkv.dedup.hashing import HASH_ALGOS, content_hash
from ragkv.dedup.registry import ChunkRegistry, ChunkStats

__all__ = ["HASH_ALGOS", "Chunk", "ChunkRegistry", "ChunkStats", "content_hash"]
