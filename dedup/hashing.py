"""Content hashing: the byte-exact identity of a chunk.

blake3 is the default because dedup has no second check: two chunks with equal digests
are treated as equal, so the hash must be collision resistant. xxh3_128 is several times
faster and fine when a 128-bit non-cryptographic hash is acceptable for your data.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash
from blake3 import blake3

from ragkv.errors import ConfigError, InvalidInputError

HASH_ALGOS: tuple[str, ...] = ("blake3", "xxh3_128")


def _blake3_digest(data: bytes) -> bytes:
    return blake3(data).digest()


_HASHERS: dict[str, Callable[[bytes], bytes]] = {
    "blake3": _blake3_digest,
    "xxh3_128": xxhash.xxh3_128_digest,
}


def hasher(algo: str) -> Callable[[bytes], bytes]:
    """Return the raw ``bytes -> digest`` function for ``algo`` (no input checks: hot path)."""
    fn = _HASHERS.get(algo)
    if fn is None:
        raise ConfigError(f"unknown hash {algo!r}; choose one of {', '.join(HASH_ALGOS)}")
    return fn


def content_hash(data: bytes, algo: str = "blake3") -> bytes:
    """Digest of ``data``: 32 bytes for ``"blake3"``, 16 bytes for ``"xxh3_128"``.

    Raises :class:`ConfigError` for an unknown ``algo`` and :class:`InvalidInputError`
    for ``str`` input (encode it first, or hash ``Chunk(text).data``).
    """
    fn = hasher(algo)
    if isinstance(data, str):
        raise InvalidInputError("content_hash takes bytes; use Chunk(text).data for text")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInputError(f"content_hash takes bytes, got {type(data).__name__}")
    return fn(data)
