"""A queued request's cached prefix is evicted last (``BlockPool`` demand).

Requests scheduled ahead of a queued one take other free blocks first, so the prefix it was
routed or assembled to reuse is still there when it is admitted; a demand never keeps a block
from being handed out when nothing else is free.
"""

from __future__ import annotations

from ragkv.cache_engine import KVCacheManager, SamplingParams
from ragkv.cache_engine.block_pool import BlockPool
from ragkv.cache_engine.config import DEFAULTS
from ragkv.cache_engine.request import Request
from ragkv.cache_engine.scheduler import Scheduler


def registered_pool(num_blocks: int, cached: list[int]) -> BlockPool:
    """A pool whose blocks ``cached`` hold registered K/V and are free again (in that order)."""
    pool = BlockPool(num_blocks)
    ids = pool.allocate(num_blocks)
    assert ids is not None
    for block_id in cached:
        pool.cache(block_id, bytes([block_id]), bytes([block_id]))
    pool.free(ids)
    return pool


def test_demanded_blocks_are_handed_out_only_when_nothing_else_is_free():
    pool = registered_pool(6, cached=[0, 1, 2])
    pool.add_demand([0, 1])
    assert pool.num_free_blocks == 6
    assert pool.free_block_ids() == [2, 3, 4, 5, 0, 1]
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert set(pool.cached) == {bytes([0]), bytes([1])}
    assert pool.allocate(1) == [0]  # nothing else is free: a demand is not a reference
    assert pool.demand[0] == 0 and pool.num_free_blocks == 1


def test_dropping_the_last_demand_returns_a_block_to_the_plain_queue_tail():
    pool = registered_pool(4, cached=[0, 1])
    pool.add_demand([0])
    pool.add_demand([0, 1])  # two queued requests share block 0
    pool.drop_demand([0, 1])
    assert pool.free_block_ids() == [2, 3, 1, 0]  # 0 still demanded once
    pool.drop_demand([0])
    assert pool.free_block_ids() == [2, 3, 1, 0] and pool.demand == [0, 0, 0, 0]
    pool.drop_demand([0])  # more drops than demands change nothing
    assert pool.demand == [0, 0, 0, 0]


def test_a_referenced_demanded_block_goes_to_the_demanded_queue_when_freed():
    pool = registered_pool(4, cached=[0])
    pool.touch([0])
    pool.add_demand([0])
    assert 0 not in pool.free_block_ids()
    pool.free([0])
    assert pool.free_block_ids() == [1, 2, 3, 0]
    assert pool.allocate(3) == [1, 2, 3]


def test_forget_and_reset_void_demands():
    pool = registered_pool(4, cached=[0, 1])
    pool.add_demand([0, 1])
    pool.forget(0)  # its K/V cannot be trusted: nobody can reuse it
    assert pool.demand[0] == 0 and pool.free_block_ids()[:3] == [2, 3, 0]
    assert pool.reset()
    assert pool.demand == [0, 0, 0, 0] and pool.num_free_blocks == 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def _run_alone(scheduler: Scheduler, request: Request) -> None:
    scheduler.add(request)
    out = scheduler.schedule()
    assert [s.request for s in out.slices] == [request]
    scheduler.finish(request, "stop")


def test_a_queued_requests_prefix_survives_the_request_admitted_ahead_of_it():
    # 12 blocks of 4. P (4 full blocks) is cached, then Q after it: Q is the more recent.
    # B (8 blocks, nothing cached) is admitted first (one sequence at a time) while C, which
    # starts with P, waits. Plain LRU would hand B the 4 never-used blocks and P's; with C's
    # demand B takes Q's instead, and C finds all of P.
    kv = KVCacheManager(num_blocks=12, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=1))
    prefix = list(range(100, 116))
    _run_alone(scheduler, _req("p", [*prefix, 1]))
    _run_alone(scheduler, _req("q", [*range(200, 216), 1]))
    b = _req("b", list(range(300, 331)))
    c = _req("c", [*prefix, 7, 8])
    scheduler.add(b)
    scheduler.add(c)
    assert [s.request for s in scheduler.schedule().slices] == [b]
    scheduler.finish(b, "stop")
    out = scheduler.schedule()
    assert [s.request for s in out.slices] == [c]
    assert c.num_cached_tokens == 16
    scheduler.finish(c, "stop")
    assert kv.num_free_blocks == 12 and not any(kv.pool.demand)


def test_a_queued_request_that_leaves_withdraws_its_demand():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=1))
    prefix = list(range(100, 116))
    _run_alone(scheduler, _req("p", [*prefix, 1]))
    blocker = _req("blocker", list(range(300, 305)))
    waiting = _req("waiting", [*prefix, 9])
    scheduler.add(blocker)
    scheduler.add(waiting)
    assert sum(kv.pool.demand) == 4
    scheduler.finish(waiting, "abort")  # cancelled while queued
    assert not any(kv.pool.demand)
    scheduler.finish(blocker, "abort")
    assert kv.num_free_blocks == 8


def test_recorded_chunks_outlive_blocks_only_an_exact_prefix_could_reuse():
    from ragkv.cache_engine.chunk_reuse.index import ChunkIndex

    pool = registered_pool(6, cached=[0, 1, 2, 3])
    index = ChunkIndex(pool=pool, max_entries=2)
    index.record(None, [5] * 8, 0, [0, 1], 4, pool.generation)  # a chunk over blocks 0-1
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert index.lookup(None, [5] * 8, pool.generation).block_ids == (0, 1)
    # Dropped from the index (its bound), the entry withdraws its demand.
    index.record(None, [6] * 4, 0, [2], 4, pool.generation)
    index.record(None, [7] * 4, 0, [3], 4, pool.generation)
    assert index.lookup(None, [5] * 8, pool.generation) is None
    assert pool.demand[:2] == [0, 0]


def test_an_entry_whose_blocks_moved_on_withdraws_only_what_it_still_demands():
    from ragkv.cache_engine.chunk_reuse.index import ChunkIndex

    pool = registered_pool(4, cached=[0, 1])
    index = ChunkIndex(pool=pool)
    index.record(None, [5] * 8, 0, [0, 1], 4, pool.generation)
    pool.add_demand([1])  # a queued request's demand on block 1 as well
    pool.forget(0)  # block 0's K/V is gone: its demands with it
    assert index.lookup(None, [5] * 8, pool.generation) is None  # stale: dropped
    assert pool.demand == [0, 1, 0, 0]  # the queued request's demand stays
    index.record(None, [6] * 4, 0, [1], 4, pool.generation)
    index.clear()
    assert pool.demand == [0, 1, 0, 0]
