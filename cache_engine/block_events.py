"""The prefix cache's blocks told as KV events (:mod:`~ragkv.cache_engine.kv_events`).

Everything here is decoded from what a block keeps: its hash and its hash input (parent ‖
tokens as little-endian int32 ‖ extra keys, and a salted first block's salt digest last,
see :mod:`~ragkv.cache_engine.block_hash`). So the pool's snapshot, the events of newly
registered blocks and the KV tiers' entries (in any medium) are described one way.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

from ragkv.cache_engine.block_pool import BlockPool
from ragkv.cache_engine.kv_events import (
    POOL_MEDIUM,
    SALT_DIGEST_KEY,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    wire_hash,
)


class BlockEvents:
    """Encodes the blocks of one block size, root hash and extra keys as ``BlockStored``
    events. Holds only what is fixed at construction: any thread may use it."""

    def __init__(self, block_size: int, root: bytes, extra: bytes) -> None:
        self.block_size = block_size
        self._root = root  # a first block's parent in its hash input
        self._extra_len = len(extra)
        self._unpack = struct.Struct(f"<{block_size}i").unpack_from

    def snapshot(self, pool: BlockPool) -> list[KVEvent]:
        """``AllBlocksCleared``, then one ``BlockStored`` per cached block of ``pool`` a
        prefix can reach (its chain registered back to a prompt's first block), parents
        first. Call it where the pool cannot change (the stepping thread, or under the
        engine's lock)."""
        children: dict[bytes, list[bytes]] = {}
        for block_hash, block_id in pool.cached.items():
            hash_input = pool.hash_input[block_id]
            assert hash_input is not None  # set with the hash
            children.setdefault(hash_input[: len(block_hash)], []).append(block_hash)
        events: list[KVEvent] = [AllBlocksCleared()]
        todo = list(children.get(self._root, ()))
        while todo:  # depth first: a block is emitted before its children are pushed
            block_hash = todo.pop()
            data = pool.hash_input[pool.cached[block_hash]]
            assert data is not None
            events.append(self.decode(block_hash, data, POOL_MEDIUM))
            todo.extend(children.get(block_hash, ()))
        return events

    def stored(self, blocks: Sequence[tuple[bytes, bytes]], medium: str) -> list[KVEvent]:
        """One ``BlockStored`` in ``medium`` per ``(hash, hash input)`` of an exact block,
        parents before their children among them."""
        known = dict(blocks)
        children: dict[bytes, list[bytes]] = {}
        todo: list[bytes] = []
        for block_hash, data in known.items():
            parent = data[: len(block_hash)]
            if parent in known:
                children.setdefault(parent, []).append(block_hash)
            else:
                todo.append(block_hash)  # a first block, or its parent is held elsewhere
        events: list[KVEvent] = []
        while todo:
            block_hash = todo.pop()
            events.append(self.decode(block_hash, known[block_hash], medium))
            todo.extend(children.get(block_hash, ()))
        return events

    def decode(self, block_hash: bytes, data: bytes, medium: str) -> BlockStored:
        """A block's ``BlockStored`` read from its hash input."""
        bs, size = self.block_size, len(block_hash)
        parent = data[:size]
        first = parent == self._root
        extra: list[object] = [None]
        if first and len(data) > size + 4 * bs + self._extra_len:  # salted
            extra = [[SALT_DIGEST_KEY, data[-32:]]]
        return BlockStored(
            block_hashes=[wire_hash(block_hash)],
            parent_block_hash=None if first else wire_hash(parent),
            token_ids=list(self._unpack(data, size)),
            block_size=bs,
            medium=medium,
            extra_keys=extra,
        )

    def registered(
        self,
        token_ids: list[int],
        salt_digest: bytes | None,
        hashes: list[bytes],
        first: int,
        new: list[bool],
    ) -> list[BlockStored]:
        """One ``BlockStored`` per run of newly registered blocks ``first + i`` of a
        request (``new[i]``), chained to the block before the run; a salted prompt's
        block 0 carries the salt's digest in its extra keys."""
        bs, i = self.block_size, 0
        events: list[BlockStored] = []
        for is_new, run in itertools.groupby(new):  # one pass over the runs
            size = len(list(run))
            i += size
            if not is_new:
                continue
            start, stop = first + i - size, first + i
            extra: list[object] = [None] * (stop - start)
            if start == 0 and salt_digest is not None:
                extra[0] = [SALT_DIGEST_KEY, salt_digest]
            events.append(
                BlockStored(
                    block_hashes=[wire_hash(h) for h in hashes[start:stop]],
                    parent_block_hash=wire_hash(hashes[start - 1]) if start else None,
                    token_ids=token_ids[start * bs : stop * bs],
                    block_size=bs,
                    extra_keys=extra,
                )
            )
        return events
