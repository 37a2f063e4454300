"""Where each chunk's K/V lives: the chunk index of position-independent reuse.

When a request that passed its chunk spans has computed its prompt, every chunk is
recorded under ``H(model identity ‖ salt digest ‖ chunk token ids)`` with the blocks that
hold its K/V and the position its first token had there. A lookup verifies the stored
token ids and salt (a hash collision is a miss, never wrong K/V) and the blocks' residency:
the pool bumps a block's *generation* whenever it hands the block out again (or forgets
it), so an entry whose blocks have moved on is dropped, never read. Pure Python, no torch.

An entry is *exact* (computed over exact K/V only) or *approximate*: a chunk a blended
request computed after its first copied token attended to copied K/V. An approximate entry
carries the reuse settings that made it (its *scope*) and is found only by lookups of the
same scope; it never replaces a live exact entry (one of another scope, which its
requests could not find, it does). Only opted-in requests look anything up,
so no exact request ever reads what this index points at.

Given the engine's ``pool``, the index *demands* the blocks of every entry it holds
(:meth:`~ragkv.cache_engine.block_pool.BlockPool.add_demand` with ``recorded=True``): the
pool evicts plain free blocks first (a question's, a history's), so a recorded chunk,
reusable at any position, outlives blocks only an exact prefix could reuse; a queued
request's prefix outlives both. An entry dropped withdraws its demand.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragkv.cache_engine.block_hash import HashFn, resolve_algo, tokens_to_bytes

if TYPE_CHECKING:
    from ragkv.cache_engine.block_pool import BlockPool

_KEY_LABEL = b"ragkv/chunk_index/v1\0"
DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_TOKENS = 1 << 20  # stored token ids for verification: 4 MiB at most


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """A recorded chunk: its first token sat at ``start``; ``block_ids[i]`` holds positions
    ``[first_block * block_size + i * block_size, ...)`` with ``first_block = start // block_size``."""

    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]

    def slots(self, block_size: int, offset: int, end: int) -> list[int]:
        """KV slots of the chunk's tokens ``[offset, end)`` (chunk-relative)."""
        first_block = self.start // block_size
        slots = []
        for pos in range(self.start + offset, self.start + end):
            block = self.block_ids[pos // block_size - first_block]
            slots.append(block * block_size + pos % block_size)
        return slots


@dataclass(slots=True)
class _Entry:
    salt_digest: bytes | None
    tokens: bytes
    location: ChunkLocation
    scope: bytes | None  # None: exact K/V; else the reuse settings of approximate K/V

    def is_live(self, generations: Sequence[int]) -> bool:
        """Every block still holds what was recorded (none handed out again since)."""
        location = self.location
        return all(
            generations[b] == g
            for b, g in zip(location.block_ids, location.generations, strict=True)
        )


class ChunkIndex:
    """Bounded LRU map from a chunk's identity to where its exact K/V lives."""

    def __init__(
        self,
        identity: bytes = b"",
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        algo: str | HashFn = "xxh3_128",
        pool: BlockPool | None = None,
    ) -> None:
        self._prefix = _KEY_LABEL + len(identity).to_bytes(4, "little") + identity
        self._digest = resolve_algo(algo)
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._pool = pool
        self._num_tokens = 0
        self.num_hits = 0
        self.num_stale = 0  # lookups whose blocks had been reused: dropped, not read

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self,
        salt_digest: bytes | None,
        token_ids: Sequence[int],
        start: int,
        block_table: Sequence[int],
        block_size: int,
        generations: Sequence[int],
        scope: bytes | None = None,
    ) -> None:
        """Record the chunk ``token_ids`` computed at ``start`` in ``block_table``: exactly
        (``scope`` None), or approximately under the reuse settings ``scope``, which then
        leaves a live exact entry of the same tokens, or one of the same scope, as it is."""
        if not token_ids or len(token_ids) > self.max_tokens:
            return
        tokens = tokens_to_bytes(token_ids)
        key = self._key(salt_digest, tokens)
        if scope is not None:
            held = self._entries.get(key)
            if (
                held is not None
                and held.tokens == tokens
                and held.scope in (None, scope)
                and held.is_live(generations)
            ):
                return
        first, last = start // block_size, (start + len(token_ids) - 1) // block_size
        block_ids = tuple(block_table[first : last + 1])
        location = ChunkLocation(
            start, len(token_ids), block_ids, tuple(generations[b] for b in block_ids)
        )
        self._drop(key)
        self._entries[key] = _Entry(salt_digest, tokens, location, scope)
        self._num_tokens += len(token_ids)
        if self._pool is not None:  # tail blocks first, as the pool frees a request's
            self._pool.add_demand(reversed(block_ids), recorded=True)
        while len(self._entries) > self.max_entries or self._num_tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def lookup(
        self,
        salt_digest: bytes | None,
        token_ids: Sequence[int],
        generations: Sequence[int],
        scope: bytes | None = None,
    ) -> ChunkLocation | None:
        """Where the chunk's K/V lives now: exact, or approximate made under ``scope``;
        None when unknown, collided, of another scope or gone."""
        tokens = tokens_to_bytes(token_ids)
        key = self._key(salt_digest, tokens)
        entry = self._entries.get(key)
        if entry is None or entry.tokens != tokens or entry.salt_digest != salt_digest:
            return None
        if entry.scope is not None and entry.scope != scope:
            return None
        if not entry.is_live(generations):
            self.num_stale += 1
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return entry.location

    @property
    def num_approximate(self) -> int:
        """Entries whose K/V a blended request computed after copied K/V."""
        return sum(entry.scope is not None for entry in self._entries.values())

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _key(self, salt_digest: bytes | None, tokens: bytes) -> bytes:
        salt = b"\0" if salt_digest is None else b"\1" + salt_digest
        return self._digest(self._prefix + salt + tokens)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            location = entry.location
            self._num_tokens -= location.num_tokens
            if self._pool is not None:
                self._pool.drop_demand(location.block_ids, location.generations, recorded=True)
