"""A queued request's cached prefix is evicted last (``BlockPool`` demand).

Requests scheduled ahead of a queued one take other free blocks first, so the prefix it was
routed or assembled to reuse is still there when it is admitted; a demand never keeps a block
from being handed out when nothing else is free, except that a head the scheduler may pass
while others run is passed rather than take one.
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


def test_a_request_s_withdrawal_spares_a_demand_on_the_blocks_new_contents():
    # The queued request's prefix block is handed out (nothing else free) and cached anew;
    # another request demands the new contents. The first one leaving must not withdraw it.
    kv = KVCacheManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=1))
    _run_alone(scheduler, _req("p", [1, 2, 3, 4, 5]))
    waiting = _req("waiting", [1, 2, 3, 4, 9])
    scheduler.add(waiting)
    (block,) = [b for b, d in enumerate(kv.pool.demand) if d]
    new = kv.pool.allocate(2)
    assert block in new and kv.pool.demand[block] == 0
    kv.pool.cache(block, b"new", b"new")
    kv.pool.free(new)
    kv.pool.add_demand([block])  # someone demands the new contents
    scheduler.finish(waiting, "abort")
    assert kv.pool.demand[block] == 1


def test_discarding_a_request_withdraws_its_demand():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=1))
    _run_alone(scheduler, _req("p", [*range(100, 116), 1]))
    waiting = _req("waiting", [*range(100, 116), 9])
    scheduler.add(waiting)
    assert sum(kv.pool.demand) == 4
    kv.discard(waiting, 0)  # a request failing mid-step is discarded
    assert not any(kv.pool.demand) and kv.num_free_blocks == 8


def test_a_preempted_request_demands_its_prefix_again():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=2))
    a = Request("a", list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    b = Request("b", list(range(100, 108)), SamplingParams(max_tokens=8, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(6):  # decode until the pool runs out and the youngest is preempted
        out = scheduler.schedule()
        if out.preempted:
            break
        for s in out.slices:
            s.request.num_computed_tokens = s.end
        scheduler.update(out, [7] * sum(1 for s in out.slices if s.end >= s.request.num_tokens))
    assert out.preempted == [b]
    assert sum(kv.pool.demand) >= 1  # its cached prefix is kept for its return


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
    assert pool.recorded[:2] == [0, 0] and pool.free_block_ids()[-2:] == [0, 1]


def test_an_entry_whose_blocks_moved_on_withdraws_only_what_it_still_demands():
    from ragkv.cache_engine.chunk_reuse.index import ChunkIndex

    pool = registered_pool(4, cached=[0, 1])
    index = ChunkIndex(pool=pool)
    index.record(None, [5] * 8, 0, [0, 1], 4, pool.generation)
    pool.add_demand([1])  # a queued request's demand on block 1 as well
    pool.forget(0)  # block 0's K/V is gone: its demands with it
    assert index.lookup(None, [5] * 8, pool.generation) is None  # stale: dropped
    assert pool.demand == [0, 1, 0, 0]  # the queued request's demand stays
    assert pool.recorded == [0, 0, 0, 0]
    index.record(None, [6] * 4, 0, [1], 4, pool.generation)
    index.clear()
    assert pool.demand == [0, 1, 0, 0] and pool.recorded == [0, 0, 0, 0]


def test_a_stale_entry_never_withdraws_a_demand_made_on_the_blocks_new_contents():
    from ragkv.cache_engine.chunk_reuse.index import ChunkIndex

    pool = registered_pool(4, cached=[0])
    index = ChunkIndex(pool=pool)
    index.record(None, [5] * 4, 0, [0], 4, pool.generation)
    pool.forget(0)  # the entry's generation is gone
    pool.cache(0, b"new", b"new")
    index.record(None, [6] * 4, 0, [0], 4, pool.generation)  # the new contents, recorded
    assert index.lookup(None, [5] * 4, pool.generation) is None  # the stale entry drops
    assert pool.recorded[0] == 1  # the new entry's demand is untouched


def test_queued_requests_demands_outlast_the_chunk_index_s():
    from ragkv.cache_engine.chunk_reuse.index import ChunkIndex

    pool = registered_pool(6, cached=[0, 1, 2, 3])
    ChunkIndex(pool=pool).record(None, [5] * 8, 0, [0, 1], 4, pool.generation)
    pool.add_demand([3, 2])  # a queued request's prefix, demanded after the chunk
    assert pool.free_block_ids() == [4, 5, 1, 0, 3, 2]
    assert pool.allocate(4) == [4, 5, 1, 0]
    assert pool.demand[2:4] == [1, 1] and pool.recorded[:2] == [0, 0]


def _head_and_demander(*, running: bool) -> tuple[Scheduler, Request, Request]:
    """12 blocks of 4: P's 4 full blocks cached; with ``running``, R (4 blocks) runs. Then B
    (5 new blocks) is queued ahead of C, which starts with P (4 cached blocks, 1 new)."""
    kv = KVCacheManager(num_blocks=12 if running else 8, block_size=4)
    scheduler = Scheduler(kv, DEFAULTS.replace(max_num_seqs=4))
    prefix = list(range(100, 116))
    _run_alone(scheduler, _req("p", [*prefix, 1]))
    if running:
        r = Request("r", list(range(500, 515)), SamplingParams(max_tokens=8, ignore_eos=True))
        scheduler.add(r)
        out = scheduler.schedule()
        r.num_computed_tokens = out.slices[0].end
        scheduler.update(out, [7])
    b = _req("b", list(range(300, 320)))
    c = _req("c", [*prefix, 7, 8])
    scheduler.add(b)
    scheduler.add(c)
    return scheduler, b, c


def test_a_head_is_passed_rather_than_evict_the_prefix_a_queued_request_demands():
    # 4 blocks are free beside C's demanded prefix, B needs 5: admitting B would take one of
    # P's. R will free its blocks, so B is passed; C goes first and finds all of P.
    scheduler, b, c = _head_and_demander(running=True)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.slices] == ["r", "c"]
    assert c.num_cached_tokens == 16 and b.num_skipped == 1
    assert list(scheduler.waiting) == [b]
    r = next(q for q in scheduler.running if q.request_id == "r")
    scheduler.finish(r, "stop")  # R finishes: B fits
    assert b in [s.request for s in scheduler.schedule().slices]


def test_a_head_takes_demanded_blocks_when_nothing_runs_or_once_passed_too_often():
    from ragkv.cache_engine.scheduler import MAX_TIMES_SKIPPED

    # Nothing runs: no block will come free by waiting, so B is admitted as before.
    scheduler, b, c = _head_and_demander(running=False)
    assert [s.request for s in scheduler.schedule().slices] == [b]
    assert kv_holds(scheduler, c) == 3  # one of P's blocks went to B
    # Passed its bounded number of times, the head takes them even while others run.
    scheduler, b, c = _head_and_demander(running=True)
    b.num_skipped = MAX_TIMES_SKIPPED
    assert [s.request.request_id for s in scheduler.schedule().slices] == ["r", "b"]
    assert kv_holds(scheduler, c) == 3


def kv_holds(scheduler: Scheduler, request: Request) -> int:
    """Blocks of the request's prefix the pool still holds."""
    return len(scheduler.kv.get_computed_blocks(request, record=False)[0])
