"""``EventIndex``: what one replica's KV cache holds, exactly, as its KV events said.

Built from vLLM-schema events (:mod:`ragkv.cache_engine.kv_events`), whoever sends them
(``ragkv serve``, vLLM, an in-process :class:`~ragkv.cache_engine.Engine`). The keys are the
router's own: each stored block is re-hashed from its ``token_ids`` with ragkv's
:class:`~ragkv.cache_engine.block_hash.BlockHasher` at the router's block size, chained from
its parent's key and salted from the first block's ``extra_keys``, so a match is the same
walk over the same hashes as :class:`~.prefix_index.PrefixIndex` and never depends on the
engine's hash recipe. The engine's hashes only name blocks: ``engine hash -> key`` turns a
``BlockRemoved`` into the keys to drop.

Each key records the media that hold it (pool, host memory, disk): a block can sit in the
pool and a tier at once and leaves them separately. A match scores a block by the best
medium holding it (:data:`MEDIUM_WEIGHTS`).

What is left out, counted in ``skipped``: blocks of a LoRA adapter, of a KV cache group other
than the first (hybrid models), with extra keys other than a salt (multimodal inputs), or
of another block size: none of them can serve a plain prompt routed here. A block whose
parent the index does not know (stored after the parent was dropped, or after events were
lost) cannot be keyed: counted in ``orphans``.

Blocks the router expects a replica to store (a request was just sent there) are
*pending* until an event stores them or their deadline passes (:meth:`EventIndex.expect`),
so a burst on one prefix follows the first request before its events arrive.

Entries are bounded by ``capacity``; an index that would grow past it has lost track of its
replica (a publisher that never sends removals) and says so by returning False from
:meth:`apply`, which the router treats like lost events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.kv_events import (
    SALT_DIGEST_KEY,
    AllBlocksCleared,
    BlockId,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

POOL, HOST, DISK = 1, 2, 4  # medium bits
# How much a block found in each medium is worth to the ranking, against one in the pool.
# A host-memory hit still skips the block's prefill but costs a copy into the pool (a few
# per cent of the prefill on this project's CPU runs, docs/benchmarks.md), a disk hit a
# verified read on the loader thread while the request waits: both are worth most of a pool
# hit, and less than one, so a pool hit wins a tie.
MEDIUM_WEIGHTS = {POOL: 1.0, HOST: 0.8, DISK: 0.6}
# 16 M blocks: a pool and a disk tier of hundreds of GB; ~150 B per entry.
DEFAULT_EVENT_INDEX_BLOCKS = 1 << 24
# Expected blocks kept at most (a burst of long prompts is a few thousand).
MAX_PENDING = 1 << 16


def medium_bit(medium: str | None) -> int:
    """The bit of a ``medium`` name: None and ``GPU`` are the pool (vLLM's names), ``DISK``
    (or ``SSD``, ``NVME``) the disk, anything else (``CPU``, a connector's own name) host."""
    if medium is None:
        return POOL
    name = medium.upper()
    if name in ("GPU", "DEVICE", "HBM"):
        return POOL
    if name in ("DISK", "SSD", "NVME", "FILE"):
        return DISK
    return HOST


def _best_weight(mask: int) -> float:
    if mask & POOL:
        return MEDIUM_WEIGHTS[POOL]
    return MEDIUM_WEIGHTS[HOST] if mask & HOST else MEDIUM_WEIGHTS[DISK]


def event_salt(extra: Any, lora_name: str | None = None) -> tuple[bytes | None, bool]:
    """``(salt digest, other keys?)`` from a first block's ``extra_keys`` entry.

    ragkv sends ``[SALT_DIGEST_KEY, digest]``; vLLM the raw ``cache_salt`` string, after
    any LoRA name and multimodal keys. ``other`` is True when keys besides a salt are there.
    """
    if not extra:
        return None, False
    items = list(extra)
    if len(items) == 2 and items[0] == SALT_DIGEST_KEY and isinstance(items[1], bytes):
        return items[1], False
    strings = [i for i, item in enumerate(items) if isinstance(item, str) and item != lora_name]
    if not strings:
        return None, True
    last = strings[-1]
    return digest_salt(items[last]), len(items) > 1


class EventIndex:
    """The blocks one replica holds, keyed by the router's block hashes, with their media."""

    __slots__ = ("block_size", "capacity", "orphans", "skipped", "_keys", "_media", "_pending")

    def __init__(self, block_size: int, capacity: int = DEFAULT_EVENT_INDEX_BLOCKS) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.orphans = 0
        self.skipped = 0
        self._keys: dict[BlockId, bytes] = {}  # the engine's hash -> the router's key
        self._media: dict[bytes, int] = {}  # the router's key -> medium bits
        self._pending: dict[bytes, float] = {}  # the router's key -> until when it is expected

    def __len__(self) -> int:
        return len(self._media)

    def __contains__(self, key: bytes) -> bool:
        return key in self._media

    def media(self, key: bytes) -> int:
        return self._media.get(key, 0)

    def match(self, hashes: Sequence[bytes], now: float = 0.0) -> tuple[int, float]:
        """``(blocks, score)``: how many leading blocks of ``hashes`` the replica holds in any
        medium (or is expected to store by ``now``), and their worth (:data:`MEDIUM_WEIGHTS`;
        an expected block counts as a pool block)."""
        media, pending = self._media, self._pending
        n, score = 0, 0.0
        for h in hashes:
            mask = media.get(h)
            if mask:
                score += _best_weight(mask)
            elif pending.get(h, 0.0) > now:
                score += MEDIUM_WEIGHTS[POOL]
            else:
                break
            n += 1
        return n, score

    def expect(self, hashes: Sequence[bytes], until: float, now: float) -> None:
        """The replica was sent a prompt of ``hashes``: count the blocks it does not hold yet
        as held until ``until`` (or until an event stores them)."""
        pending, media = self._pending, self._media
        for h in hashes:
            if h not in media:
                pending[h] = until
        if len(pending) > MAX_PENDING:
            for h in [h for h, t in pending.items() if t <= now]:
                del pending[h]
            if len(pending) > MAX_PENDING:
                pending.clear()

    def settle(self, hashes: Sequence[bytes], until: float) -> None:
        """The request answered: its blocks not stored by ``until`` never will be."""
        pending = self._pending
        for h in hashes:
            if h in pending:
                pending[h] = min(pending[h], until)

    def apply(self, event: KVEvent) -> bool:
        """Update the index; False when it outgrew ``capacity`` (it is cleared then)."""
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event.block_hashes, medium_bit(event.medium))
        elif isinstance(event, AllBlocksCleared):
            self.clear()
        if len(self._keys) > self.capacity:
            self.clear()
            return False
        return True

    def clear(self) -> None:
        self._keys.clear()
        self._media.clear()
        self._pending.clear()

    def _stored(self, event: BlockStored) -> None:
        hashes = list(event.block_hashes)
        if (
            event.block_size != self.block_size
            or event.lora_id is not None
            or event.lora_name is not None
            or event.group_idx not in (None, 0)
        ):
            self.skipped += len(hashes)
            return
        extra = list(event.extra_keys or [])
        salt = parent = None
        if event.parent_block_hash is None:
            salt, other = event_salt(extra[0] if extra else None)
            if other:
                self.skipped += len(hashes)
                return
        else:
            parent = self._keys.get(event.parent_block_hash)
            if parent is None:
                self.orphans += len(hashes)
                return
        # Blocks past the first with extra keys (multimodal inputs) end what can be keyed.
        usable = min(next((i for i in range(1, len(extra)) if extra[i]), len(hashes)), len(hashes))
        if event.parent_block_hash is not None and extra and extra[0]:
            usable = 0
        self.skipped += len(hashes) - usable
        if not usable:
            return
        hasher = BlockHasher(self.block_size, salt_digest=salt, parent=parent)
        keys = hasher.extend(event.token_ids[: usable * self.block_size])
        bit = medium_bit(event.medium)
        media, pending = self._media, self._pending
        for engine_hash, key in zip(hashes, keys, strict=False):
            self._keys[engine_hash] = key
            media[key] = media.get(key, 0) | bit
            pending.pop(key, None)

    def _removed(self, hashes: Sequence[BlockId], bit: int) -> None:
        keys, media = self._keys, self._media
        for engine_hash in hashes:
            key = keys.get(engine_hash)
            if key is None:
                continue
            mask = media.get(key, 0) & ~bit
            if mask:
                media[key] = mask
            else:
                media.pop(key, None)
                del keys[engine_hash]


__all__ = ["DEFAULT_EVENT_INDEX_BLOCKS", "MEDIUM_WEIGHTS", "EventIndex", "event_salt"]
