"""KV cache events: what the engine's prefix cache stored and dropped, in vLLM's schema.

The records mirror vLLM's ``vllm.distributed.kv_events`` (field names and order), so a
router that speaks vLLM's events (llm-d, NVIDIA Dynamo, ragkv's own ``ReplicaRouter``) can
follow a ragkv engine, and ragkv's router can follow vLLM. The wire (msgpack over ZMQ) is in
:mod:`ragkv.integrations.kv_events`; this module is plain data and the engine's bounded
buffer, with no dependency.

- :class:`BlockStored`: full blocks registered under a hash, chained from
  ``parent_block_hash`` (None: the first block of a prompt), with their token ids
  (``block_size`` per hash). ``extra_keys`` has one entry per block; a salted prompt's first
  block carries ``[SALT_DIGEST_KEY, digest]`` there (ragkv keeps only the salt's digest,
  :func:`~ragkv.cache_engine.block_hash.digest_salt`; vLLM puts the raw ``cache_salt``).
- :class:`BlockRemoved`: hashes no longer findable in ``medium``.
- :class:`AllBlocksCleared`: nothing is cached any more (an engine starting, a reset).

Block hashes on the wire are ``int``: the last 8 bytes of ragkv's digest, big-endian, as
vLLM sends its own by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). A consumer never
recomputes them; they only name blocks between a ``BlockStored`` and its ``BlockRemoved``.

``medium`` says where the block lives (:data:`MEDIA`): ``"GPU"`` is the engine's KV pool
whatever its device (vLLM's name for it, also on its CPU backend), ``"CPU"`` the host-memory
tier, ``"DISK"`` the disk tier (as vLLM's offloading connector names them). The pool's events
come from the stepping thread, the tiers' from their worker thread
(:mod:`ragkv.cache_engine.kv_tiers.tier_events`); a block in a tier and the pool at once has
one ``BlockStored`` per medium and leaves each with its own ``BlockRemoved``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager

# Where a block lives: the engine's pool, the host-memory tier, the disk tier.
POOL_MEDIUM = "GPU"
HOST_MEDIUM = "CPU"
DISK_MEDIUM = "DISK"
MEDIA = (POOL_MEDIUM, HOST_MEDIUM, DISK_MEDIUM)
# The extra key that carries a salt's digest in a first block's ``extra_keys``.
SALT_DIGEST_KEY = "ragkv.salt_digest"
# Events held for a consumer before new ones are dropped (and counted). A step registers at
# most a few hundred blocks; this is minutes of traffic for a consumer that keeps up.
DEFAULT_MAX_EVENTS = 100_000

BlockId = int | bytes  # a block's hash on the wire: int (vLLM's default, ragkv's) or bytes


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockId]
    parent_block_hash: BlockId | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = POOL_MEDIUM
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockId]
    medium: str | None = POOL_MEDIUM
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """What one published message carries: the events of one drain of the buffer."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def wire_hash(block_hash: bytes) -> int:
    """A ragkv block hash as the int vLLM's events carry: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventBuffer:
    """Events from the engine's stepping thread and its KV tiers' worker, waiting for one
    consumer (a publisher, or a router in process).

    :meth:`put` is thread-safe (any number of producers: everything it touches is under one
    lock), never blocks beyond that short lock and never grows past ``max_events``: past
    it an event is dropped and counted (``dropped``), and the next :meth:`take` says so, so
    the consumer can tell its subscribers that the stream has a hole.
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.max_events = max_events
        self.accepted = 0  # events put and kept (a consumer has seen them all when it took
        self.dropped = 0  # this many)
        self._events: deque[KVEvent] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._dropped_taken = 0

    def put(self, event: KVEvent) -> None:
        with self._lock:
            if len(self._events) >= self.max_events:
                self.dropped += 1
                return
            self._events.append(event)
            self.accepted += 1
        self._ready.set()

    def take(self, timeout_s: float | None = None) -> tuple[list[KVEvent], bool]:
        """``(events, lost)``: everything buffered (waiting up to ``timeout_s`` for one), and
        whether events were dropped since the last take (they came before these)."""
        if timeout_s is None or timeout_s > 0:
            self._ready.wait(timeout_s)
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self._ready.clear()
            lost = self.dropped != self._dropped_taken
            self._dropped_taken = self.dropped
        return events, lost


__all__ = [
    "DEFAULT_MAX_EVENTS",
    "DISK_MEDIUM",
    "HOST_MEDIUM",
    "MEDIA",
    "POOL_MEDIUM",
    "SALT_DIGEST_KEY",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventBuffer",
    "wire_hash",
]


def start_events(kv: KVCacheManager, tiers: Any, max_events: int) -> KVEventBuffer:
    """A buffer of the engine's events from now on: ``AllBlocksCleared`` and the pool's
    cached blocks first (``KVCacheManager.snapshot_events``), then what the pool and the KV
    tiers (``tiers``, None when off; from their worker thread) store and drop. The snapshot
    (one event per cached block, bounded by the pool) always fits: a dropped first batch
    would leave a consumer nothing to replay from. Call with the engine's lock held."""
    snapshot = kv.snapshot_events()
    buffer = KVEventBuffer(max(max_events, len(snapshot) + max_events // 2))
    for event in snapshot:
        buffer.put(event)
    if tiers is None:
        kv.set_event_sink(buffer.put)
        return buffer
    describe = kv.stored_events  # after the pool: tier blocks chain to it

    def pool_sink(event: KVEvent) -> None:
        buffer.put(event)
        if isinstance(event, AllBlocksCleared):  # a reset of the pool only
            tiers.set_event_sink(buffer.put, describe)  # host memory tells its blocks again

    kv.set_event_sink(pool_sink)
    tiers.set_event_sink(buffer.put, describe)
    return buffer
