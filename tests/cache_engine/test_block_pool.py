"""The block pool's ref counts never go negative: a second free of a block is a bug, refused."""

from __future__ import annotations

import pytest

from ragkv.cache_engine.block_pool import BlockPool


def test_freeing_an_unreferenced_block_is_refused_and_the_free_queue_is_unchanged():
    pool = BlockPool(4)
    block_ids = pool.allocate(2)
    pool.free(block_ids)
    queue = pool.free_block_ids()
    with pytest.raises(RuntimeError, match=r"block 0 .* no reference"):
        pool.free([0])
    assert pool.ref_counts == [0, 0, 0, 0]
    assert pool.free_block_ids() == queue
    assert pool.allocate(4) is not None  # every block can still be handed out exactly once


def test_a_shared_block_is_freed_once_per_reference():
    pool = BlockPool(2)
    [block_id] = pool.allocate(1)
    pool.touch([block_id])
    pool.free([block_id])
    assert pool.ref_counts[block_id] == 1 and block_id not in pool.free_block_ids()
    pool.free([block_id])
    assert pool.free_block_ids()[-1] == block_id
    with pytest.raises(RuntimeError):
        pool.free([block_id])
