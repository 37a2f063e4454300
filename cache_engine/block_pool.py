"""The fixed pool of KV blocks: ref counts, the LRU free queue and the hash → block map.

Blocks are plain integers; per-block state lives in preallocated lists indexed by block id
(no Python object per block). The free queue is an ``OrderedDict`` used as an O(1) LRU:
``popitem(last=False)`` takes the head, ``del`` removes from the middle, assignment appends.

Free blocks that a queued request is going to reuse (its cached prefix, *demanded* when it
arrived) wait in a second queue, evicted only when no other free block is left: requests
scheduled ahead of it then take other blocks first, and the prefix it was routed or
assembled to reuse is still there when it is admitted. A demand is not a reference: it never
keeps a block from being handed out when nothing else is free.

A free block keeps its hash and stays findable until it is popped for reuse (lazy
eviction). There is no reserved null block: every id in ``range(num_blocks)`` holds KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from contextlib import suppress
from operator import eq
from typing import cast

from ragkv.cache_engine.block_hash import APPROXIMATE_LABEL


class BlockPool:
    """``num_blocks`` KV blocks shared by all requests of one engine."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # The key a block is registered under, and the exact bytes that were hashed for it
        # (parent ‖ tokens ‖ extras) so a hit can be verified byte for byte.
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_input: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Bumped whenever a block's K/V may change (handed out again, forgotten, reset), so
        # the chunk index can tell that a recorded location still holds what it recorded.
        self.generation = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Free blocks with a demand (queued requests that will reuse them), evicted last.
        self._held: OrderedDict[int, None] = OrderedDict()
        self.demand = [0] * num_blocks
        self.num_evictions = 0
        self.num_collisions = 0
        # When a list, every hash dropped by eviction or ``forget`` is appended to it (the
        # manager turns them into KV events and clears it); None, the usual case, costs nothing.
        self.removed: list[bytes] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not): what ``allocate`` can hand out."""
        return len(self._free) + len(self._held)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order, the next one to be reused first."""
        return [*self._free, *self._held]

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are unreferenced (touching them shrinks the free queue)."""
        return list(map(self.ref_counts.__getitem__, block_ids)).count(0)

    def find_prefix(self, hashes: Sequence[bytes], inputs: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` whose stored input matches.

        ``inputs[i]`` is the request's hash input of block ``i``. A key found with different
        stored bytes is a hash collision: counted, and the prefix ends there.
        """
        if not self.enable_caching:
            return []
        found = list(map(self.cached.get, hashes))
        with suppress(ValueError):  # no miss: every block hit
            del found[found.index(None) :]  # one scan (`None in found` first would be a second)
        hits = cast("list[int]", found)  # the cut above removed every None
        hash_input = self.hash_input
        stored = [hash_input[block_id] for block_id in hits]
        if stored != inputs[: len(hits)]:
            self.num_collisions += 1
            del hits[list(map(eq, stored, inputs)).index(False) :]
        return hits

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Pop ``num_blocks`` from the free-queue head (evicting their hashes), ref count 1."""
        if num_blocks > len(self._free) + len(self._held):
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id, _ = self._free.popitem(last=False)
            else:  # only demanded blocks are left: the queued request will compute it
                block_id, _ = self._held.popitem(last=False)
                self.demand[block_id] = 0  # its generation moves on: late drops are ignored
            block_hash = self.block_hash[block_id]
            if block_hash is not None:
                self._evict(block_id, block_hash)
            self.generation[block_id] += 1
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks, pulling unreferenced ones out of the free queue."""
        refs = self.ref_counts
        for block_id in block_ids:
            if refs[block_id]:
                refs[block_id] += 1
            else:
                self._queue_of(block_id).pop(block_id)
                refs[block_id] = 1

    def add_demand(self, block_ids: Iterable[int]) -> None:
        """A queued request will reuse ``block_ids``: free ones move to the demanded queue's
        tail in the given order (evicted last, and among those least recently demanded first)."""
        refs, demand, held = self.ref_counts, self.demand, self._held
        for block_id in block_ids:
            demand[block_id] += 1
            if not refs[block_id]:
                self._free.pop(block_id, None)
                held[block_id] = None
                held.move_to_end(block_id)

    def drop_demand(self, block_ids: Iterable[int]) -> None:
        """Undo :meth:`add_demand` (the request was admitted or left); a free block nobody
        demands any more joins the plain free queue's tail."""
        refs, demand = self.ref_counts, self.demand
        for block_id in block_ids:
            if not demand[block_id]:
                continue
            demand[block_id] -= 1
            if not demand[block_id] and not refs[block_id]:
                del self._held[block_id]
                self._free[block_id] = None

    def _queue_of(self, block_id: int) -> OrderedDict[int, None]:
        """The free queue an unreferenced block waits in."""
        return self._held if self.demand[block_id] else self._free

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order.

        Freeing a block that holds no reference is a double free in ragkv itself (a caller
        bookkeeping bug, not bad input): it raises ``RuntimeError``, not a ``RagkvError``, so
        the server logs it as an internal error instead of answering the request with it.
        Blocks before it in ``block_ids`` are already released; the offending one is untouched.
        """
        refs, demand = self.ref_counts, self.demand
        for block_id in block_ids:
            if not refs[block_id]:
                raise RuntimeError(
                    f"block {block_id} freed with no reference held (a double free); "
                    "the KV cache manager's bookkeeping is wrong"
                )
            refs[block_id] -= 1
            if refs[block_id] == 0:
                (self._held if demand[block_id] else self._free)[block_id] = None

    def cache(self, block_id: int, block_hash: bytes, hash_input: bytes) -> bool:
        """Register a full block under ``block_hash``; False if the key holds different bytes.

        When the key already maps to a block with the same bytes (two requests computed the
        same block independently), the first stays registered and ``block_id`` remains an
        unregistered private copy of its request; that is still a success.
        """
        if not self.enable_caching:
            return False
        holder = self.cached.setdefault(block_hash, block_id)
        if holder == block_id:
            self.block_hash[block_id] = block_hash
            self.hash_input[block_id] = hash_input
            return True
        if self.hash_input[holder] == hash_input:
            return True
        self.num_collisions += 1
        return False

    def forget(self, block_id: int) -> None:
        """Unregister one block's hash (its K/V cannot be trusted); it stays allocated or free."""
        self.generation[block_id] += 1
        self._undemand(block_id)
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self._tell_removed(block_id, block_hash)
            self.block_hash[block_id] = None
            self.hash_input[block_id] = None

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in list(self._held):
            self._undemand(block_id)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.hash_input = [None] * self.num_blocks
        self.generation = [g + 1 for g in self.generation]
        return True

    def _undemand(self, block_id: int) -> None:
        """Its content is gone: nobody can reuse it (demands of the old generation are void)."""
        if self.demand[block_id]:
            self.demand[block_id] = 0
            if not self.ref_counts[block_id]:
                del self._held[block_id]
                self._free[block_id] = None

    def _evict(self, block_id: int, block_hash: bytes) -> None:
        del self.cached[block_hash]
        self._tell_removed(block_id, block_hash)
        self.block_hash[block_id] = None
        self.hash_input[block_id] = None
        self.num_evictions += 1

    def _tell_removed(self, block_id: int, block_hash: bytes) -> None:
        """Note a dropped exact hash for the KV events (approximate blocks were never told)."""
        if self.removed is not None:
            hash_input = self.hash_input[block_id]
            if hash_input is None or not hash_input.startswith(APPROXIMATE_LABEL):
                self.removed.append(block_hash)
