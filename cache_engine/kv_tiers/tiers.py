"""``KVTiers``: host memory then disk below the KV pool, fed by a background worker.

The engine hands over copies of newly cached blocks with :meth:`KVTiers.offer`, which only
appends to a bounded queue; a worker thread checksums and stores them. Where a block goes
depends on the write policy:

- ``write-back``: every offer goes to host; blocks the host LRU evicts go to disk, and so
  does what host memory still holds at :meth:`close`. Without a host tier, offers go
  straight to disk.
- ``write-through``: every offer goes to host, and also to disk once its hash was offered or
  hit in host ``admit_after`` times (counts kept for a bounded number of recent hashes), so
  one-off blocks never cost a disk write.

``salted_to_disk=False`` keeps blocks of salted requests in host memory only.
:meth:`load` reads host first, then disk; a disk hit is queued for promotion to host.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ragkv.cache_engine.kv_events import DISK_MEDIUM, HOST_MEDIUM, KVEvent
from ragkv.cache_engine.kv_tiers.block_store import BlockStore
from ragkv.cache_engine.kv_tiers.host_store import HostEntry, HostStore
from ragkv.cache_engine.kv_tiers.payload import check_payload
from ragkv.cache_engine.kv_tiers.payload import checksum as payload_checksum
from ragkv.cache_engine.kv_tiers.tier_events import Describe, TierEvents
from ragkv.cache_engine.kv_tiers.tier_stats import TierStats
from ragkv.errors import ConfigError, InvalidInputError

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write-back", "write-through")
DEFAULT_WRITE_POLICY = "write-back"
# Admission counts are kept for this many recent hashes (~100 bytes each: a few MB at most).
MAX_SEEN_HASHES = 1 << 16


class Ready(Protocol):
    """Anything the worker can wait on before reading a payload (e.g. a ``torch.cuda.Event``
    recorded after an asynchronous device-to-host copy)."""

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class _Task:
    kind: str  # "offer": from the engine; "promote": a disk hit; "persist": admitted to disk
    block_hash: bytes
    hash_input: bytes
    payload: torch.Tensor
    salted: bool
    ready: Ready | None = None
    checksum: int | None = None  # a host entry's, verified again before it reaches disk


class KVTiers:
    """The tiers below one engine's KV pool: an optional host store and an optional disk store.

    Thread-safe: :meth:`offer`, :meth:`lookup` and :meth:`load` are called from the engine's
    threads while the worker writes. Nothing here blocks on I/O except :meth:`load` (reading
    the one block asked for), :meth:`flush` and :meth:`close`.
    """

    def __init__(
        self,
        host: HostStore | None,
        disk: BlockStore | None,
        *,
        write_policy: str = DEFAULT_WRITE_POLICY,
        admit_after: int = 2,
        salted_to_disk: bool = True,
        max_pending: int = 256,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}",
                param="write_policy",
            )
        for param, value in (("admit_after", admit_after), ("max_pending", max_pending)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{param} must be an int >= 1, got {value!r}", param=param)
        self.host = host
        self.disk = disk
        self.write_policy = write_policy
        self.admit_after = admit_after
        self.salted_to_disk = salted_to_disk
        self.max_pending = max_pending
        self._tasks: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._closed = False
        self._offers = TierStats(name="offers")
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="ragkv-kv-tiers", daemon=True)
        self._worker.start()

    # -- caller side -------------------------------------------------------------------------

    def offer(
        self,
        block_hash: bytes,
        hash_input: bytes,
        payload: torch.Tensor,
        *,
        salted: bool,
        ready: Ready | None = None,
    ) -> None:
        """Queue a CPU copy of a block for the tiers; never blocks.

        ``payload`` must not be written afterwards (the engine hands over its own copy). If it
        is filled by an asynchronous copy, pass ``ready`` (e.g. a CUDA event recorded after
        the copy): the worker waits on it before reading. A full queue or a closed tiers
        object drops the offer (counted in ``stats()["offers"].dropped``).
        """
        if not isinstance(block_hash, bytes) or not isinstance(hash_input, bytes):
            raise InvalidInputError("block_hash and hash_input must be bytes", param="block_hash")
        check_payload(payload)
        self._enqueue(_Task("offer", block_hash, hash_input, payload, bool(salted), ready))

    def lookup(self, hashes: Sequence[bytes]) -> list[str]:
        """Tier names (``"host"`` / ``"disk"``) of the leading run of ``hashes`` stored here.

        Stops at the first hash in neither tier. Cheap and unverified: :meth:`load` verifies.
        """
        found: list[str] = []
        for block_hash in hashes:
            if self.host is not None and self.host.contains(block_hash):
                found.append("host")
            elif self.disk is not None and self.disk.contains(block_hash):
                found.append("disk")
            else:
                break
        return found

    def load(self, block_hash: bytes, hash_input: bytes) -> tuple[torch.Tensor, str] | None:
        """The verified payload and the tier it came from (host first, then disk), or ``None``.

        The tensor may be a tier's own copy: read it, never write to it. A disk hit is queued
        for promotion to host (skipped if the queue is full).
        """
        if self.host is not None:
            payload = self.host.get(block_hash, hash_input)
            if payload is not None:
                if self.write_policy == "write-through":
                    self._admit_from_host(block_hash)
                return payload, "host"
        if self.disk is not None:
            payload = self.disk.get(block_hash, hash_input)
            if payload is not None:
                if self.host is not None:
                    self._enqueue(_Task("promote", block_hash, hash_input, payload, False))
                return payload, "disk"
        return None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued offer is stored; ``False`` if ``timeout_s`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._tasks and not self._busy, timeout_s)

    def stats(self) -> dict[str, TierStats]:
        """``"host"`` and ``"disk"`` (the tiers present) and ``"offers"`` (the queue)."""
        out: dict[str, TierStats] = {}
        for store in (self.host, self.disk):
            if store is not None:
                out[store.name] = store.stats()
        with self._cond:
            offers = TierStats(
                name="offers",
                offered=self._offers.offered,
                dropped=self._offers.dropped,
                write_errors=self._offers.write_errors,
                corrupt=self._offers.corrupt,  # host entries that changed before reaching disk
                entries=len(self._tasks),
            )
        out["offers"] = offers
        return out

    def set_event_sink(self, sink: Callable[[KVEvent], None] | None, describe: Describe) -> None:
        """Put a KV event in ``sink`` for every block a tier stores (``BlockStored``, medium
        ``"CPU"`` for host memory, ``"DISK"`` for disk) or drops (``BlockRemoved``), from
        whichever thread changed it (the worker, or a load that found an entry damaged), so
        ``sink`` must be thread-safe and never block (``KVEventBuffer.put``). ``describe``
        turns entries into ``BlockStored`` events (``KVCacheManager.stored_events``). The
        host tier first tells what it holds now; the disk tier tells changes from now on.
        None stops."""
        for store, medium in ((self.host, HOST_MEDIUM), (self.disk, DISK_MEDIUM)):
            if store is not None:
                events = None if sink is None else TierEvents(sink, medium, describe)
                store.set_listener(events)

    def close(self) -> None:
        """Store what is queued, stop the worker and close both stores; idempotent.

        Under write-back, what host memory holds and disk does not is written to disk first
        (least recently used first, so the most recent blocks survive a smaller disk tier):
        a clean shutdown keeps every cached block for the next engine on the same store.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True  # later offers are dropped
        self.flush()
        if self.write_policy == "write-back" and self.host is not None and self.disk is not None:
            for entry in self._snapshot_that_fits():
                self._to_disk(
                    entry.block_hash, entry.hash_input, entry.payload, entry.salted, entry.checksum
                )
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._worker.join()
        for store in (self.host, self.disk):
            if store is not None:
                store.close()

    # -- worker side -------------------------------------------------------------------------

    def _enqueue(self, task: _Task) -> None:
        """Queue ``task`` unless the queue is full or closed (offers are counted either way)."""
        is_offer = task.kind == "offer"
        with self._cond:
            if self._closed or len(self._tasks) >= self.max_pending:
                self._offers.dropped += is_offer
                return
            self._tasks.append(task)
            self._offers.offered += is_offer
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._tasks or self._stopping)
                if not self._tasks:
                    return
                task = self._tasks.popleft()
                self._busy = True
            try:
                self._handle(task)
            except Exception:  # one bad block must not stop the tiers
                logger.exception("KV tiers: storing block %s failed", task.block_hash.hex())
                with self._cond:
                    self._offers.write_errors += 1
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _handle(self, task: _Task) -> None:
        if task.ready is not None:
            task.ready.synchronize()
        if task.kind == "persist":
            self._to_disk(
                task.block_hash, task.hash_input, task.payload, task.salted, task.checksum
            )
            return
        admitted = task.kind == "offer" and self._admitted(task.block_hash)
        if self.host is None:
            if self.write_policy == "write-back" or admitted:
                self._to_disk(task.block_hash, task.hash_input, task.payload, task.salted)
            return
        stored, evicted = self.host.put_and_evict(
            task.block_hash, task.hash_input, task.payload, salted=task.salted
        )
        if self.write_policy == "write-back":
            if not stored and task.kind == "offer":  # too big for host: disk may still hold it
                self._to_disk(task.block_hash, task.hash_input, task.payload, task.salted)
            for entry in evicted:
                self._to_disk(
                    entry.block_hash, entry.hash_input, entry.payload, entry.salted, entry.checksum
                )
        elif admitted:
            self._to_disk(task.block_hash, task.hash_input, task.payload, task.salted)

    def _to_disk(
        self,
        block_hash: bytes,
        hash_input: bytes,
        payload: torch.Tensor,
        salted: bool,
        checksum: int | None = None,
    ) -> None:
        if self.disk is None or (salted and not self.salted_to_disk):
            return
        if self.disk.contains(block_hash):
            return
        if checksum is not None and payload_checksum(payload) != checksum:
            # host memory changed under the entry: never let it become a disk entry that
            # verifies (the disk checksum is computed from the bytes as written)
            logger.warning("KV tiers: block %s changed in host memory", block_hash.hex())
            with self._cond:
                self._offers.corrupt += 1
            return
        self.disk.put(block_hash, hash_input, payload)

    def _snapshot_that_fits(self) -> list[HostEntry]:
        """Host entries not on disk yet, the most recently used that fit the disk's bound,
        least recently used first (so the most recent are written last and kept)."""
        host, disk = self.host, self.disk
        assert host is not None and disk is not None  # write-back with both tiers (close)
        budget = disk.capacity_bytes
        chosen: list[HostEntry] = []
        for entry in reversed(host.snapshot()):
            if disk.contains(entry.block_hash) or (entry.salted and not self.salted_to_disk):
                continue
            if entry.nbytes > budget:
                break
            budget -= entry.nbytes
            chosen.append(entry)
        return chosen[::-1]

    def _admitted(self, block_hash: bytes) -> bool:
        """Count one more sighting; under write-through, whether the block now earns disk."""
        if self.write_policy != "write-through" or self.disk is None:
            return False
        with self._seen_lock:
            count = self._seen.pop(block_hash, 0) + 1
            self._seen[block_hash] = count
            if len(self._seen) > MAX_SEEN_HASHES:
                self._seen.popitem(last=False)
        return count >= self.admit_after

    def _admit_from_host(self, block_hash: bytes) -> None:
        host, disk = self.host, self.disk  # a host hit; without disk nothing is admitted
        if host is None or disk is None or not self._admitted(block_hash):
            return
        if disk.contains(block_hash):
            return
        entry: HostEntry | None = host.peek(block_hash)
        if entry is not None:
            self._enqueue(
                _Task(
                    "persist",
                    block_hash,
                    entry.hash_input,
                    entry.payload,
                    entry.salted,
                    checksum=entry.checksum,
                )
            )
