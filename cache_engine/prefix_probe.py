"""The residency probe that hands its hashes on: ``Engine.prefix_probe``.

The assembler asks how much of each candidate prompt is cached; the probe hashes each
candidate once, in the caller's thread, and the hashes of the candidate that is sent go to
the engine with it (:class:`~ragkv.cache_engine.input_processor.PromptHashes`), so the
prompt is never hashed again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from ragkv.cache_engine.block_hash import BlockHasher
from ragkv.cache_engine.input_processor import PromptHashes
from ragkv.cache_engine.kv_cache_manager import KVCacheManager

MAX_CANDIDATES = 4  # earlier candidates a probe shares hashes from


class PrefixProbe:
    """:meth:`Engine.prefix_probe` for one request. Its candidates often share their head
    (the template's frame, the system prompt): a candidate's blocks that an earlier one
    began with are taken from that one's hashes, so each block is hashed once.

    ``cached_prefix(hasher, num_tokens)`` answers how many leading blocks are cached (the
    engine core's, which takes the core's lock only for the lookup)."""

    __slots__ = ("kv", "cached_prefix", "cache_salt", "salt_digest", "_probed")

    def __init__(
        self,
        kv: KVCacheManager,
        cached_prefix: Callable[[BlockHasher, int], int],
        cache_salt: str | None,
        salt_digest: bytes | None,
    ) -> None:
        self.kv = kv
        self.cached_prefix = cached_prefix
        self.cache_salt = cache_salt
        self.salt_digest = salt_digest
        # One request's candidates (a few); bounded, so a probe kept longer (an assembler's
        # default residency) neither grows nor slows with traffic.
        self._probed: deque[tuple[list[int], BlockHasher]] = deque(maxlen=MAX_CANDIDATES)

    def __call__(self, token_ids: Sequence[int]) -> tuple[int, PromptHashes]:
        kv = self.kv
        ids = list(token_ids)  # what the hashes are checked against when a request takes them
        shared, hasher = 0, None
        for earlier, earlier_hasher in list(self._probed):
            blocks = _shared_blocks(earlier, ids, kv.block_size)
            if blocks > shared:
                shared, hasher = blocks, earlier_hasher
        # In the caller's thread, outside the engine's lock.
        hasher = kv.new_hasher(self.salt_digest) if hasher is None else hasher.prefix(shared)
        hasher.extend(ids[shared * kv.block_size :])
        self._probed.append((ids, hasher))
        hashes = PromptHashes(kv, ids, self.cache_salt, self.salt_digest, hasher)
        if len(ids) < 2:
            return 0, hashes
        return self.cached_prefix(hasher, len(ids)) * kv.block_size, hashes


def _shared_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """Leading full blocks ``a`` and ``b`` have in common."""
    blocks = min(len(a), len(b)) // block_size
    for i in range(blocks):
        start, end = i * block_size, (i + 1) * block_size
        if a[start:end] != b[start:end]:
            return i
    return blocks


def nothing_cached(token_ids: Sequence[int]) -> tuple[int, None]:
    """The residency probe of an engine without prefix caching."""
    return 0, None
