"""The host-memory KV tier: an LRU of CPU tensors bounded in bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from ragkv.cache_engine.kv_tiers.block_store import TierListener
from ragkv.cache_engine.kv_tiers.payload import check_payload, checksum, cpu_copy
from ragkv.cache_engine.kv_tiers.tier_stats import TierStats
from ragkv.errors import ConfigError


@dataclass(slots=True, frozen=True)
class HostEntry:
    """One stored block. ``payload`` is never written after it is stored."""

    block_hash: bytes
    hash_input: bytes
    payload: torch.Tensor
    checksum: int
    nbytes: int  # what the entry counts against capacity: payload + hash input
    salted: bool


class HostStore:
    """Host-memory tier: blocks in an LRU bounded by ``capacity_bytes``.

    ``put`` copies the payload (into pinned memory when ``pin_memory``, so the engine can
    load it back to the GPU with a non-blocking copy) and checksums it; ``get`` verifies the
    hash input and the checksum before returning the stored tensor, without copying it.
    An entry counts its payload plus its hash input against capacity.
    """

    name = "host"

    def __init__(self, capacity_bytes: int, *, pin_memory: bool = False) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigError(
                f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}",
                param="capacity_bytes",
            )
        if capacity_bytes < 0:
            raise ConfigError(
                f"capacity_bytes must be >= 0, got {capacity_bytes}", param="capacity_bytes"
            )
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory=True needs CUDA; pass pin_memory=False on a CPU-only machine",
                param="pin_memory",
            )
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._stats = TierStats(name=self.name, capacity_bytes=capacity_bytes)
        self._listener: TierListener | None = None

    def contains(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` is stored (unverified; a dict lookup)."""
        return block_hash in self._entries

    def get(self, block_hash: bytes, hash_input: bytes) -> torch.Tensor | None:
        """The verified stored payload (not a copy: never write to it), or ``None``."""
        start = time.perf_counter()
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(block_hash)
        # Verified outside the lock: a stored payload is immutable, and the checksum of a
        # large block should not hold up the writer.
        intact = entry.hash_input == hash_input and checksum(entry.payload) == entry.checksum
        with self._lock:
            if not intact:
                self._stats.corrupt += 1
                self._stats.misses += 1
                if self._entries.get(block_hash) is entry:
                    self._remove(block_hash)
                return None
            self._stats.hits += 1
            self._stats.loaded_bytes += entry.payload.nbytes
            self._stats.load_seconds += time.perf_counter() - start
        return entry.payload

    def put(self, block_hash: bytes, hash_input: bytes, payload: torch.Tensor) -> bool:
        """Store a copy of ``payload``, evicting least recently used blocks to make room."""
        return self.put_and_evict(block_hash, hash_input, payload)[0]

    def put_and_evict(
        self, block_hash: bytes, hash_input: bytes, payload: torch.Tensor, *, salted: bool = False
    ) -> tuple[bool, list[HostEntry]]:
        """``put``, also returning the entries it evicted (write-back sends them to disk).

        ``salted`` is kept with the entry so an evicted salted block can be kept off disk.
        An entry already stored with the same hash input is only refreshed (moved to the
        LRU tail), not copied again.
        """
        check_payload(payload)
        nbytes = payload.nbytes + len(hash_input)
        with self._lock:
            old = self._entries.get(block_hash)
            if old is not None and old.hash_input == hash_input:
                self._entries.move_to_end(block_hash)
                return True, []
            if nbytes > self.capacity_bytes:
                self._stats.write_errors += 1
                return False, []
        copy = cpu_copy(payload, pin_memory=self.pin_memory)
        entry = HostEntry(block_hash, bytes(hash_input), copy, checksum(copy), nbytes, salted)
        evicted: list[HostEntry] = []
        with self._lock:
            if block_hash in self._entries:
                self._remove(block_hash)
            while self._stats.bytes_used + nbytes > self.capacity_bytes:
                _, victim = self._entries.popitem(last=False)
                self._stats.bytes_used -= victim.nbytes
                self._stats.evictions += 1
                evicted.append(victim)
            self._entries[block_hash] = entry
            self._stats.bytes_used += nbytes
            self._stats.puts += 1
            self._stats.stored_bytes += copy.nbytes
            if self._listener is not None:
                if evicted:
                    self._listener.removed([victim.block_hash for victim in evicted])
                self._listener.stored([(block_hash, entry.hash_input)])
        return True, evicted

    def peek(self, block_hash: bytes) -> HostEntry | None:
        """The stored entry, unverified and without touching LRU order (for write-through)."""
        return self._entries.get(block_hash)

    def snapshot(self) -> list[HostEntry]:
        """Every stored entry, least recently used first (unverified; for a shutdown write)."""
        with self._lock:
            return list(self._entries.values())

    def discard(self, block_hash: bytes) -> None:
        """Drop ``block_hash`` if stored."""
        with self._lock:
            if block_hash in self._entries:
                self._remove(block_hash)

    def set_listener(self, listener: TierListener | None) -> None:
        """Tell ``listener`` the entries stored now (``stored``), then every change; None
        stops. Both under the lock, so no change falls between the two."""
        with self._lock:
            if listener is not None and self._entries:
                listener.stored([(e.block_hash, e.hash_input) for e in self._entries.values()])
            self._listener = listener

    def stats(self) -> TierStats:
        """A snapshot of the counters and the contents now."""
        with self._lock:
            return replace(self._stats, entries=len(self._entries))

    def close(self) -> None:
        """Drop every entry (frees the host memory); idempotent."""
        with self._lock:
            if self._listener is not None and self._entries:
                self._listener.removed(list(self._entries))
            self._entries.clear()
            self._stats.bytes_used = 0

    def _remove(self, block_hash: bytes) -> None:
        entry = self._entries.pop(block_hash)
        self._stats.bytes_used -= entry.nbytes
        if self._listener is not None:
            self._listener.removed([block_hash])
