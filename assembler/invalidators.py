"""Silent-invalidator detection: "static" content whose bytes change on every request.

A timestamp or request id inside the system prompt makes every prompt unique from its first
block on, so nothing after it can ever be reused from the prefix cache. The detector watches
each static/stable slot (``"system"``, ``"few_shot[0]"``, ...) through the registry's
statistics: when the slot's content hash has been brand new (registry count 1) for
``after`` requests in a row, the slot is flagged. It is unflagged as soon as its content
repeats. Each slot is warned about once per detector.

The fix is to move the changing part after the stable content (or out of the prompt); the
assembler does that automatically with ``demote_invalidators=True``.
"""

from __future__ import annotations

import logging

from ragkv.dedup import ChunkRegistry
from ragkv.errors import ConfigError

logger = logging.getLogger(__name__)

_MAX_SLOTS = 256


class InvalidatorDetector:
    """Flags static slots whose content is new on every request."""

    def __init__(self, registry: ChunkRegistry, after: int = 3) -> None:
        if after < 2:
            raise ConfigError("Invalidator detection needs after >= 2 requests.")
        self.registry = registry
        self.after = after
        self._streaks: dict[str, int] = {}
        self._warned: set[str] = set()

    def check(self, slot: str, key: bytes) -> bool:
        """Update ``slot`` with this request's content ``key`` (already observed); flagged?"""
        stats = self.registry.stats(key)
        novel = stats is None or stats.count <= 1
        streak = self._streaks.get(slot, 0) + 1 if novel else 0
        if slot in self._streaks or len(self._streaks) < _MAX_SLOTS:
            self._streaks[slot] = streak
        flagged = streak >= self.after
        if flagged and slot not in self._warned:
            self._warned.add(slot)
            logger.warning(
                "The %s segment is marked static but its bytes changed on each of the last %d "
                "requests (a timestamp or request id?). It invalidates the prefix cache for "
                "everything after it: move the changing part after the retrieved chunks, "
                "or keep demote_invalidators=True to let the assembler do it.",
                slot,
                streak,
            )
        return flagged
