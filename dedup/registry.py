"""ChunkRegistry: a bounded cross-request memory of chunks, keyed by content hash.

It holds what later stages want to compute once per distinct chunk: its token ids (per
tokenizer) and how often / how recently requests contained it (the assembler's
"stable first" ordering reads these). Nothing here stores the chunk text itself.
"""

from __future__ import annotations

import operator
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ragkv.dedup.chunk import Chunk
from ragkv.dedup.hashing import hasher
from ragkv.errors import ConfigError, InvalidInputError


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
    # int32 arrays: 4 bytes a token. A tuple of ints costs 8 bytes a pointer plus a 28-byte
    # int object per id above 256 (a tokenizer returns fresh ones): 36 bytes a token.
    token_ids: dict[str, array] = field(default_factory=dict)
    cost: int = 0  # bytes charged to total_bytes, see _entry_cost


# What an entry costs besides its key and token ids, measured on CPython 3.11: the _Entry
# object, its slot in the OrderedDict (hash-table entry plus linked-list node, 75 to 105
# bytes depending on the table's fill) and the int objects of its statistics.
_ENTRY_FIXED_BYTES = sys.getsizeof(_Entry()) + 96 + 3 * sys.getsizeof(2**20)


def _entry_cost(key: bytes, entry: _Entry) -> int:
    """The bytes an entry keeps alive (within ~20 % of tracemalloc, see the tests)."""
    token_ids = entry.token_ids
    return (
        _ENTRY_FIXED_BYTES
        + sys.getsizeof(key)
        + sys.getsizeof(token_ids)
        + sum(map(sys.getsizeof, token_ids.values()))
    )


class ChunkRegistry:
    """Thread-safe LRU (bounded by bytes) of per-chunk token ids and request statistics.

    ``total_bytes`` counts the Python objects the entries keep alive (entry, key, token id
    arrays, table slot); the chunk text is not stored, so not counted. When the total
    passes ``max_bytes`` the least recently used entries (token ids and stats together)
    are dropped. ``hash`` must match the digest other components use as key.
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
        self._tokenizer_keys: dict[str, str] = {}  # one shared str per tokenizer key
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
        Ids are kept as an int32 array and handed out as a new tuple (one C-level copy,
        far cheaper than tokenizing; a kept tuple would cost 9x the memory).
        """
        key = self.key(chunk)
        slot = (key, tokenizer_key)
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and tokenizer_key in entry.token_ids:
                    self._entries.move_to_end(key)
                    return tuple(entry.token_ids[tokenizer_key])
                waiter = self._pending.get(slot)
                if waiter is None:
                    self._pending[slot] = threading.Event()
                    break
            waiter.wait()  # someone else is tokenizing this chunk; then look again
        try:
            ids = _as_token_ids(tokenize(chunk.text))
            with self._lock:
                entry = self._touch(key, len(chunk.data))
                shared_key = self._tokenizer_keys.setdefault(tokenizer_key, tokenizer_key)
                entry.token_ids[shared_key] = ids
                self._recharge(key, entry)
                self._evict()
            return tuple(ids)
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
        """Bytes the entries now held keep alive (never above ``max_bytes`` between calls)."""
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
            self._recharge(key, entry)
        else:
            self._entries.move_to_end(key)
        entry.num_bytes = max(entry.num_bytes, num_bytes)
        return entry

    def _recharge(self, key: bytes, entry: _Entry) -> None:
        cost = _entry_cost(key, entry)
        self._total += cost - entry.cost
        entry.cost = cost

    def _evict(self) -> None:
        entries = self._entries
        while self._total > self.max_bytes and entries:
            _, entry = entries.popitem(last=False)
            self._total -= entry.cost


def _as_token_ids(ids: Sequence[int]) -> array:
    try:
        return array("i", map(operator.index, ids))
    except OverflowError as exc:
        raise InvalidInputError(f"token ids must fit in int32: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"tokenize() must return a sequence of ints, got {type(ids).__name__}: {exc}"
        ) from exc
