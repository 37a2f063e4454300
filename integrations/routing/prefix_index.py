"""``PrefixIndex``: what the router believes one replica's prefix cache holds.

A bounded LRU set of chained block hashes (the router's own, from
:class:`~ragkv.cache_engine.block_hash.BlockHasher`: the salt digest enters the first block,
so two salts never share an entry and one tenant's prefixes never steer another's routing).
Chained hashes make a prefix match a walk from the first block: ``hash_i`` stands for block
``i`` *and everything before it*.

Entries are **tentative** when the router inserted them as it sent a request (so a burst of
requests on one prefix follows the first one before it has answered) and **confirmed** once a
replica answered a request whose prompt contained them (it computed or reused them, so it
held them at that moment). Only a confirmed entry that the replica then failed to reuse is
evidence of eviction: see :meth:`PrefixIndex.correct`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ragkv.errors import ConfigError


class PrefixIndex:
    """Block hashes one replica is believed to hold, least recently used first.

    ``capacity`` approximates the replica's KV pool in blocks; inserting past it forgets the
    least recently used entries, as the replica's own LRU pool would.
    """

    __slots__ = ("capacity", "_entries")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"index capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, bool] = OrderedDict()  # hash -> confirmed

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the replica is believed to hold."""
        n = 0
        for h in hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[bytes], *, confirmed: bool) -> None:
        """Record ``hashes`` as held (most recently used); a confirmed entry stays confirmed."""
        entries = self._entries
        # Reversed, so the first block ends up most recently used: a replica's pool evicts a
        # prompt's tail blocks first, and so does this index.
        for h in reversed(hashes):
            entries[h] = confirmed or entries.get(h, False)
            entries.move_to_end(h)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def correct(self, hashes: Sequence[bytes], reported: int, predicted: int) -> int:
        """The replica reused ``reported`` leading blocks where ``predicted`` were expected.

        Blocks ``reported..predicted-1`` were wrongly assumed. A tentative one is a race (the
        request that would compute it had not answered yet) and stays. A confirmed one was
        evicted; in an LRU pool everything used less recently than it went first, so those
        entries are dropped too. Returns the number of entries dropped.
        """
        wrong = [h for h in hashes[reported:predicted] if self._entries.get(h)]
        if not wrong:
            return 0
        wrong_set = set(wrong)
        dropped = 0
        # Walk from the least recently used end up to the newest wrongly assumed entry.
        for h in list(self._entries):
            if not wrong_set:
                break
            del self._entries[h]
            dropped += 1
            wrong_set.discard(h)
        return dropped

    def clear(self) -> None:
        """Forget everything (the replica failed: it may come back empty)."""
        self._entries.clear()


__all__ = ["PrefixIndex"]
