"""Counters of one KV tier (host memory or disk), as reported by ``stats()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierStats:
    """A snapshot of one tier: lookups and writes since it opened, and its contents now.

    ``misses`` counts every ``get`` that returned nothing, so it includes ``corrupt`` (a
    stored entry that failed verification: different hash input, payload checksum mismatch,
    torn / truncated / unreadable file). ``KVTiers.stats()`` adds an ``"offers"`` record for
    its queue: ``offered`` accepted, ``dropped`` refused because the queue was full or
    closed, ``entries`` still queued, ``capacity_bytes`` unused (0).
    """

    name: str
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    write_errors: int = 0
    entries: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    loaded_bytes: int = 0  # payload bytes returned by verified hits
    stored_bytes: int = 0  # payload bytes accepted by put
    load_seconds: float = 0.0  # wall time of verified hits (lookup + read + verify), summed
    puts: int = 0  # entries stored (a put of an entry already present only refreshes it)
    offered: int = 0  # "offers" record only
    dropped: int = 0  # "offers" record only

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)`` (0 before the first get)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
