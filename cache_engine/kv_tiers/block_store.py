"""The contract both KV tiers implement (host memory and disk)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ragkv.cache_engine.kv_tiers.tier_stats import TierStats


class TierListener(Protocol):
    """Told what a store's index gains and loses (KV events, :mod:`.tier_events`).

    A store calls it with its lock held, so the calls come in the order of the changes; it
    must not block nor call back into the store.
    """

    def stored(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        """``(block hash, hash input)`` of entries now findable."""
        ...

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        """Hashes no longer findable (evicted, found damaged, discarded)."""
        ...


@runtime_checkable
class BlockStore(Protocol):
    """A bounded store of KV blocks keyed by chained block hash, verified on every load.

    Thread-safe: a worker thread writes while the engine's step thread reads. An entry keeps
    the block's full hash input (parent hash, token ids, extra keys incl. model identity and
    salt digest) and a checksum of its payload; ``get`` verifies both, so a tier is a cache
    and never a source of truth (Invariant 7, docs/invariants.md).
    """

    name: str  # "host" | "disk"
    capacity_bytes: int  # the bound on what it holds

    def contains(self, block_hash: bytes) -> bool:
        """Whether an entry is stored under ``block_hash`` (cheap, unverified)."""
        ...

    def get(self, block_hash: bytes, hash_input: bytes) -> torch.Tensor | None:
        """The verified payload (CPU tensor, dtype and shape as put), or ``None``.

        A stored hash input different from ``hash_input``, a checksum mismatch or a torn,
        truncated or unreadable entry is counted (``corrupt``), dropped, and returns ``None``.
        Never raises for I/O errors or corrupt data. The returned tensor may be the stored one:
        read it, never write to it.
        """
        ...

    def put(self, block_hash: bytes, hash_input: bytes, payload: torch.Tensor) -> bool:
        """Store a copy of ``payload``; ``False`` (counted ``write_errors``) if it cannot.

        Too big for the whole capacity, or an I/O error: never raises for I/O.
        """
        ...

    def discard(self, block_hash: bytes) -> None:
        """Drop the entry stored under ``block_hash``, if any."""
        ...

    def set_listener(self, listener: TierListener | None) -> None:
        """Tell ``listener`` what the index gains and loses from now on (a store may first
        tell what it holds); None stops."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of this tier's counters and contents."""
        ...

    def close(self) -> None:
        """Release the tier's resources; idempotent."""
        ...
