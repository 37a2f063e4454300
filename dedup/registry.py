"""ChunkRegistry: a bounded cross-request memory of chunks, keyed by content hash.

It holds what later stages want to compute once per distinct chunk: its token ids (per
tokenizer) and how often / how recently requests contained it (the assembler's
"stable first" ordering reads these). Nothing here stores the chunk text itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ragkv.dedup.chunk import Chunk
from ragkv.dedup.hashing import hasher
from ragkv.errors import ConfigError, InvalidInputError

# Rough CPython cost of a cached tuple of small ints: one pointer per id plus the header.
_TOKEN_ID_BYTES = 8
_ENTRY_OVERHEAD = 128


@dataclass(slots=True)
class ChunkStats:
    """How often and how recently requests contained one chunk."""

    count: int  # number of requests that contained the chunk
    first_seen: int  # request sequence number (registry-wide counter) when first observed
    last_seen: int
    num_bytes: int


@dataclass(slots=True)
class _Entry:
    num_bytes: int = 0
    count: int = 0
    first_seen: int = -1
    last_seen: int = -1
    token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cost: int = _ENTRY_OVERHEAD


class ChunkRegistry:
    """Thread-safe LRU (bounded by bytes) of per-chunk token ids and request statistics.

    An entry costs its chunk's byte length plus an estimate of its cached token ids; when
    the total passes ``max_bytes`` the least recently used entries (token ids and stats
    together) are dropped. ``hash`` must match the digest other components use as key.
    """

    def __init__(self, max_bytes: int = 256 * 2**20, hash: str = "blake3") -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"max_bytes must be a positive int, got {max_bytes!r}")
        hasher(hash)  # validates the name
        self.max_bytes = max_bytes
        self.hash = hash
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[tuple[bytes, str], threading.Event] = {}
        self._total = 0
        self._seq = 0

    def key(self, chunk: Chunk) -> bytes:
        """Content hash of ``chunk`` under this registry's algorithm."""
        return chunk.digest(self.hash)

    def token_ids(
        self, chunk: Chunk, tokenizer_key: str, tokenize: Callable[[str], Sequence[int]]
    ) -> tuple[int, ...]:
        """Token ids of ``chunk`` under ``tokenizer_key``; ``tokenize(chunk.text)`` runs only on a miss.

        Concurrent misses for the same chunk wait for the first caller instead of
        tokenizing again. ``tokenizer_key`` must change whenever the tokenizer does.
        """
        key = self.key(chunk)
        slot = (key, tokenizer_key)
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and tokenizer_key in entry.token_ids:
                    self._entries.move_to_end(key)
                    return entry.token_ids[tokenizer_key]
                waiter = self._pending.get(slot)
                if waiter is None:
                    self._pending[slot] = threading.Event()
                    break
            waiter.wait()  # someone else is tokenizing this chunk; then look again
        try:
            ids = _as_token_ids(tokenize(chunk.text))
            with self._lock:
                entry = self._touch(key, len(chunk.data))
                entry.token_ids[tokenizer_key] = ids
                self._charge(entry, _TOKEN_ID_BYTES * len(ids))
                self._evict()
            return ids
        finally:
            with self._lock:
                self._pending.pop(slot).set()

    def observe(self, keys: Iterable[bytes | Chunk]) -> int:
        """Record one request containing these chunks; returns that request's sequence number.

        Pass chunks (or their keys): a chunk also records its byte size. A chunk listed
        twice in one request counts once.
        """
        items: dict[bytes, int] = {}
        for item in keys:
            if isinstance(item, Chunk):
                items[self.key(item)] = len(item.data)
            elif isinstance(item, bytes):
                items.setdefault(item, 0)
            else:
                raise InvalidInputError(
                    f"observe() takes chunk keys (bytes) or Chunks, got {type(item).__name__}"
                )
        with self._lock:
            seq = self._seq
            self._seq += 1
            for key, num_bytes in items.items():
                entry = self._touch(key, num_bytes)
                if entry.count == 0:
                    entry.first_seen = seq
                entry.count += 1
                entry.last_seen = seq
            self._evict()
        return seq

    def stats(self, key: bytes) -> ChunkStats | None:
        """Statistics of the chunk with this key, or None if no request observed it (or evicted)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.count == 0:
                return None
            return ChunkStats(entry.count, entry.first_seen, entry.last_seen, entry.num_bytes)

    @property
    def total_bytes(self) -> int:
        """Bytes charged to the entries now held (never above ``max_bytes`` between calls)."""
        return self._total

    @property
    def num_requests(self) -> int:
        """How many requests :meth:`observe` has recorded (the next sequence number)."""
        return self._seq

    def clear(self) -> None:
        """Forget every entry (the request counter keeps counting)."""
        with self._lock:
            self._entries.clear()
            self._total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # -- under the lock ---------------------------------------------------------------

    def _touch(self, key: bytes, num_bytes: int) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            self._total += entry.cost
        else:
            self._entries.move_to_end(key)
        if num_bytes > entry.num_bytes:
            self._charge(entry, num_bytes - entry.num_bytes)
            entry.num_bytes = num_bytes
        return entry

    def _charge(self, entry: _Entry, num_bytes: int) -> None:
        entry.cost += num_bytes
        self._total += num_bytes

    def _evict(self) -> None:
        entries = self._entries
        while self._total > self.max_bytes and entries:
            _, entry = entries.popitem(last=False)
            self._total -= entry.cost


def _as_token_ids(ids: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(map(int, ids))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"tokenize() must return a sequence of ints, got {type(ids).__name__}: {exc}"
        ) from exc
