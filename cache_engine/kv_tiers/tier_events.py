"""KV events from the tiers: what host memory and disk hold, in vLLM's schema.

A router that follows a replica's events (:mod:`ragkv.cache_engine.kv_events`) scores a block
the replica would load back from a tier (``medium`` ``"CPU"``: host memory, ``"DISK"``: disk),
not only what its pool holds. Each store tells a :class:`TierEvents` what its index gains and
loses, with its lock held (so events come in the order of the changes); ``TierEvents`` turns
that into ``BlockStored`` / ``BlockRemoved`` and puts them in the engine's event buffer, whose
``put`` never blocks. Without a consumer no listener is set and the stores pay one ``None``
check per change.

The tiers hold exact blocks only, so each entry's hash input (parent ‖ tokens ‖ extra keys,
a salted first block's salt digest last) gives the event's token ids, parent and salt
(``KVCacheManager.stored_events``, i.e. ``BlockEvents``, decodes it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragkv.cache_engine.kv_events import BlockRemoved, KVEvent, wire_hash

# (block hash, hash input) pairs and a medium -> their BlockStored events, parents first.
Describe = Callable[[Sequence[tuple[bytes, bytes]], str], list[KVEvent]]


class TierEvents:
    """A store's :class:`~.block_store.TierListener` that puts KV events in ``sink``."""

    __slots__ = ("describe", "medium", "sink")

    def __init__(self, sink: Callable[[KVEvent], None], medium: str, describe: Describe) -> None:
        self.sink = sink
        self.medium = medium
        self.describe = describe

    def stored(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        for event in self.describe(entries, self.medium):
            self.sink(event)

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        self.sink(BlockRemoved([wire_hash(h) for h in block_hashes], medium=self.medium))
