"""Which chunks are stable, with hysteresis, and the order in which they became stable.

A chunk is *promoted* to stable when it has been seen in ``promote_after`` requests within a
window of ``window`` requests, and *demoted* only once it has gone unseen for
``demote_after`` requests (``demote_after > window``). The gap between the two thresholds is
the hysteresis: a hot chunk that skips a few requests keeps its place, so its position in
the canonical order does not flap from request to request.

A promotion's rank is the number of the request that promoted it; the canonical order sorts
stable chunks by rank, then content hash. Ranks never change while a chunk stays stable,
so the prefix the engine cached for them stays valid. State is bounded by ``max_tracked`` keys (least recently seen evicted first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ragkv.errors import ConfigError


@dataclass(slots=True)
class _Entry:
    sightings: list[int] = field(default_factory=list)  # last `promote_after` request numbers
    rank: int | None = None  # set while stable


class StabilityTracker:
    """Request-by-request stability of content keys (chunk hashes)."""

    def __init__(
        self,
        promote_after: int = 2,
        window: int = 64,
        demote_after: int = 256,
        max_tracked: int = 65_536,
    ) -> None:
        if promote_after < 1 or window < 1 or max_tracked < 1:
            raise ConfigError("promote_after, window and max_tracked must be >= 1.")
        if demote_after <= window:
            raise ConfigError(
                f"demote_after ({demote_after}) must exceed window ({window}) for hysteresis."
            )
        self.promote_after = promote_after
        self.window = window
        self.demote_after = demote_after
        self.max_tracked = max_tracked
        self.request = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently seen first

    def observe(self, keys: Iterable[bytes]) -> int:
        """Record one request containing ``keys``; returns its request number."""
        self.request += 1
        now = self.request
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = _Entry()
            else:
                entries.move_to_end(key)
                if entry.rank is not None and now - entry.sightings[-1] > self.demote_after:
                    entry.rank = None
            sightings = entry.sightings
            if sightings and sightings[-1] == now:
                continue  # the same key twice in one request counts once
            sightings.append(now)
            if len(sightings) > self.promote_after:
                del sightings[0]
            if (
                entry.rank is None
                and len(sightings) == self.promote_after
                and now - sightings[0] < self.window
            ):
                entry.rank = now  # chunks promoted by the same request tie (then: by hash)
        while len(entries) > self.max_tracked:
            entries.popitem(last=False)
        return now

    def rank(self, key: bytes) -> int | None:
        """The key's stable rank (lower = stable earlier), or ``None`` if it is not stable."""
        entry = self._entries.get(key)
        if entry is None or entry.rank is None:
            return None
        if self.request - entry.sightings[-1] > self.demote_after:
            return None
        return entry.rank

    def is_stable(self, key: bytes) -> bool:
        """Whether the key currently counts as stable."""
        return self.rank(key) is not None

    def __len__(self) -> int:
        return len(self._entries)
