"""The fixed pool of KV blocks: ref counts, the LRU free queue and the hash → block map.

Blocks are plain integers; per-block state lives in preallocated lists indexed by block id
(no Python object per block). The free queue is an ``OrderedDict`` used as an O(1) LRU:
``popitem(last=False)`` takes the head, ``del`` removes from the middle, assignment appends.

Free blocks that something is going to reuse are *demanded* and wait in queues of their
own, drawn from only when the plain free queue is empty: first those the chunk index
records (``recorded=True``: a chunk reusable at any position outlives blocks only an exact
prefix could reuse), last those a queued request will reuse (its cached prefix when it
arrived: requests scheduled ahead of it take other blocks first, and the prefix it was
routed or assembled to reuse is still there when it is admitted). A demand is not a
reference: ``allocate`` hands a demanded block out when nothing else is free; only the
scheduler may choose to wait instead (``KVCacheManager.allocate_slots(spare_demanded=)``).

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
        # Free blocks the chunk index records, evicted after the plain ones; then free blocks
        # queued requests will reuse, evicted last (see the module docstring).
        self._recorded: OrderedDict[int, None] = OrderedDict()
        self._held: OrderedDict[int, None] = OrderedDict()
        self.demand = [0] * num_blocks  # queued requests' demands per block
        self.recorded = [0] * num_blocks  # the chunk index's demands per block
        self.num_evictions = 0
        self.num_collisions = 0
        # When a list, every hash dropped by eviction or ``forget`` is appended to it (the
        # manager turns them into KV events and clears it); None, the usual case, costs nothing.
        self.removed: list[bytes] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not): what ``allocate`` can hand out."""
        return len(self._free) + len(self._recorded) + len(self._held)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order, the next one to be reused first."""
        return [*self._free, *self._recorded, *self._held]

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are unreferenced (touching them shrinks the free queue)."""
        return list(map(self.ref_counts.__getitem__, block_ids)).count(0)

    def num_spare_blocks(self, touching: Sequence[int] = ()) -> int:
        """Free blocks no queued request demands, less those of ``touching`` among them (a
        request about to reference ``touching`` takes them out of the free queues)."""
        refs, demand = self.ref_counts, self.demand
        taken = sum(1 for b in touching if not refs[b] and not demand[b])
        return len(self._free) + len(self._recorded) - taken

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
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            queue = self._free or self._recorded or self._held
            block_id, _ = queue.popitem(last=False)
            if queue is not self._free:  # its demanders will compute it again
                self.demand[block_id] = self.recorded[block_id] = 0  # late drops: ignored
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

    def add_demand(self, block_ids: Iterable[int], *, recorded: bool = False) -> None:
        """A queued request (or, ``recorded``, the chunk index) will reuse ``block_ids``: free
        ones move to the tail of their demanded queue in the given order (among demanded
        blocks of one kind, the least recently demanded go first)."""
        refs, counts = self.ref_counts, self.recorded if recorded else self.demand
        for block_id in block_ids:
            counts[block_id] += 1
            if not refs[block_id]:
                self._requeue(block_id)

    def drop_demand(
        self,
        block_ids: Iterable[int],
        generations: Iterable[int] | None = None,
        *,
        recorded: bool = False,
    ) -> None:
        """Undo :meth:`add_demand` of the same kind (the request was admitted or left, the
        entry was dropped); a free block joins the tail of the queue its demands now say.

        ``generations``: each block's generation when it was demanded; a block handed out
        or forgotten since lost that demand then, so it is skipped (a demand on its new
        contents stays)."""
        refs, counts = self.ref_counts, self.recorded if recorded else self.demand
        if generations is not None:
            now = self.generation
            block_ids = [b for b, g in zip(block_ids, generations, strict=True) if now[b] == g]
        for block_id in block_ids:
            if not counts[block_id]:
                continue
            counts[block_id] -= 1
            if not counts[block_id] and not refs[block_id]:
                self._requeue(block_id)

    def _queue_of(self, block_id: int) -> OrderedDict[int, None]:
        """The free queue an unreferenced block waits in."""
        if self.demand[block_id]:
            return self._held
        return self._recorded if self.recorded[block_id] else self._free

    def _requeue(self, block_id: int) -> None:
        """Move an unreferenced block to the tail of the queue its demands say."""
        for queue in (self._free, self._recorded, self._held):
            queue.pop(block_id, None)
        self._queue_of(block_id)[block_id] = None

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order.

        Freeing a block that holds no reference is a double free in ragkv itself (a caller
        bookkeeping bug, not bad input): it raises ``RuntimeError``, not a ``RagkvError``, so
        the server logs it as an internal error instead of answering the request with it.
        Blocks before it in ``block_ids`` are already released; the offending one is untouched.
        """
        refs = self.ref_counts
        for block_id in block_ids:
            if not refs[block_id]:
                raise RuntimeError(
                    f"block {block_id} freed with no reference held (a double free); "
                    "the KV cache manager's bookkeeping is wrong"
                )
            refs[block_id] -= 1
            if refs[block_id] == 0:
                self._queue_of(block_id)[block_id] = None

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
        for block_id in [*self._recorded, *self._held]:
            self._undemand(block_id)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.hash_input = [None] * self.num_blocks
        self.generation = [g + 1 for g in self.generation]
        return True

    def _undemand(self, block_id: int) -> None:
        """Its content is gone: nobody can reuse it (demands of the old generation are void)."""
        if self.demand[block_id] or self.recorded[block_id]:
            self.demand[block_id] = self.recorded[block_id] = 0
            if not self.ref_counts[block_id]:
                self._requeue(block_id)

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
