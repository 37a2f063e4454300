"""KVCacheManager: allocation order, sharing, isolation and the verified-hit rules."""

from __future__ import annotations

import pytest
from support import CacheReq as Req

from ragkv.cache_engine import KVCacheManager


def admit(manager: KVCacheManager, req: Req) -> tuple[list[int], int]:
    """Schedule a new request's whole prompt; return (computed blocks, new blocks)."""
    computed, num_computed = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, len(req.token_ids) - num_computed, computed)
    assert new is not None
    return computed, new


def decode(manager: KVCacheManager, req: Req, token: int) -> list[int] | None:
    req.token_ids.append(token)
    return manager.allocate_slots(req, 1)


def pool_snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.pool
    return (
        list(pool.ref_counts),
        pool.free_block_ids(),
        dict(pool.cached),
        list(pool.block_hash),
        manager.stats(),
    )


def test_vllm_design_doc_walkthrough_allocation_and_free_queue_order():
    # vLLM "Automatic Prefix Caching" design doc example: block size 4, 10 blocks.
    m = KVCacheManager(num_blocks=10, block_size=4)
    prompt0 = list(range(100, 115))  # 15 tokens: 3 full blocks + 3 tokens
    r0 = Req(0, list(prompt0))
    # Time 1: empty cache, 4 blocks allocated, the 3 full ones cached.
    assert admit(m, r0) == ([], [0, 1, 2, 3])
    assert sorted(m.pool.cached.values()) == [0, 1, 2]
    # Time 2-3: decoding fills block 3 (cached) and the next token needs block 4.
    assert decode(m, r0, 900) == []
    assert sorted(m.pool.cached.values()) == [0, 1, 2, 3]
    assert decode(m, r0, 901) == [4]
    assert m.block_table(r0) == [0, 1, 2, 3, 4]
    # Time 4: 14 tokens, the first 10 shared: only 2 blocks (8 tokens) hit.
    r1 = Req(1, prompt0[:10] + [200, 201, 202, 203])
    assert admit(m, r1) == ([0, 1], [5, 6])
    assert m.num_computed_tokens(r1) == 14
    # Time 5: request 0 frees 4, 3, 2 (reverse order); 0 and 1 stay with request 1.
    m.free(r0)
    assert m.pool.free_block_ids() == [7, 8, 9, 4, 3, 2]
    # Time 6: request 1 frees too.
    m.free(r1)
    assert m.pool.free_block_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    # Time 7: 29 tokens, first 12 as request 0: hits 0, 1, 2 (touched out of the queue),
    # then 7, 8, 9, 4 and 3, whose cached hash is evicted.
    r2 = Req(2, prompt0[:12] + list(range(300, 317)))
    computed, num_computed = m.get_computed_blocks(r2)
    assert (computed, num_computed) == ([0, 1, 2], 12)
    evictions = m.stats().evictions
    assert m.allocate_slots(r2, 17, computed) == [7, 8, 9, 4, 3]
    assert m.block_table(r2) == [0, 1, 2, 7, 8, 9, 4, 3]
    assert m.stats().evictions == evictions + 1  # block 3 (4 was never full)


def test_duplicated_full_block_keeps_first_registration_and_append_only_table():
    # Design doc "duplicated blocks": the same request twice, greedy, block size 4.
    m = KVCacheManager(num_blocks=10, block_size=4)
    r1 = Req(1, [1, 2, 3, 4, 5, 6])
    admit(m, r1)
    decode(m, r1, 7)
    decode(m, r1, 8)  # block 1 = [5, 6, 7, 8] full and cached
    key = m.pool.block_hash[m.block_table(r1)[1]]
    assert m.pool.cached[key] == m.block_table(r1)[1]
    r2 = Req(2, [1, 2, 3, 4, 5, 6])
    computed, new = admit(m, r2)
    assert computed == [m.block_table(r1)[0]]
    decode(m, r2, 7)
    decode(m, r2, 8)  # its own copy of [5, 6, 7, 8] is full now
    dup = m.block_table(r2)[1]
    assert dup != m.block_table(r1)[1]
    assert m.pool.cached[key] == m.block_table(r1)[1]  # the first stays registered
    assert m.pool.block_hash[dup] is None
    assert m.stats().collisions == 0
    m.free(r1)
    m.free(r2)
    assert m.pool.num_free_blocks == 10


def test_salted_requests_never_share_blocks():
    m = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(17))
    admit(m, Req(0, list(prompt)))
    admit(m, Req(1, list(prompt), cache_salt="tenant-a"))
    assert m.get_computed_blocks(Req(2, list(prompt)))[1] == 16
    assert m.get_computed_blocks(Req(3, list(prompt), cache_salt="tenant-b")) == ([], 0)
    salted, _ = m.get_computed_blocks(Req(4, list(prompt), cache_salt="tenant-a"))
    unsalted, _ = m.get_computed_blocks(Req(5, list(prompt)))
    assert len(salted) == len(unsalted) == 4
    assert not set(salted) & set(unsalted)


def test_stored_hash_inputs_do_not_grow_with_the_salt():
    m = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(9))
    _, short = admit(m, Req(0, list(prompt), cache_salt="s"))
    _, long = admit(m, Req(1, list(prompt), cache_salt="t" * 256))
    assert len(m.pool.hash_input[short[0]]) == len(m.pool.hash_input[long[0]])
    assert m.pool.hash_input[short[0]] != m.pool.hash_input[long[0]]


def test_different_extra_keys_never_share_blocks():
    prompt = list(range(9))
    a = KVCacheManager(num_blocks=8, block_size=4, extra_keys=[("model", b"a")])
    b = KVCacheManager(num_blocks=8, block_size=4, extra_keys=[("model", b"b")])
    admit(a, Req(0, list(prompt)))
    admit(b, Req(0, list(prompt)))
    assert a.pool.block_hash[0] != b.pool.block_hash[0]


def test_forced_hash_collision_is_detected_counted_and_missed():
    m = KVCacheManager(num_blocks=16, block_size=4, algo=lambda data: b"\x00" * 16)
    r0 = Req(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(m, r0)
    assert m.stats().collisions == 1  # block 1's constant hash already maps to block 0
    # Different tokens under the same (constant) key: a miss, never a hit.
    assert m.get_computed_blocks(Req(1, [9, 9, 9, 9, 5])) == ([], 0)
    assert m.stats().collisions == 2
    # Same first block (a genuine hit), then a collision that ends the prefix.
    assert m.get_computed_blocks(Req(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == ([0], 4)
    assert m.stats().collisions == 3


def test_fully_cached_prompt_recomputes_its_last_token():
    m = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    admit(m, Req(0, list(prompt)))
    computed, num_computed = m.get_computed_blocks(Req(1, list(prompt)))
    assert num_computed == 8 == len(computed) * 4  # not 12: logits need the last token
    computed, num_computed = m.get_computed_blocks(Req(2, prompt + [99]))
    assert num_computed == 12


def test_failed_allocation_leaves_the_pool_unchanged():
    m = KVCacheManager(num_blocks=6, block_size=4)
    r0 = Req(0, list(range(12)))
    admit(m, r0)
    m.free(r0)  # 3 cached blocks, all free
    holder = Req(1, [50, 51, 52, 53, 54])
    admit(m, holder)  # 2 blocks, evicting cached ones from the head
    r2 = Req(2, list(range(12)) + list(range(60, 70)))
    computed, num_computed = m.get_computed_blocks(r2)
    assert computed
    before = pool_snapshot(m)
    assert m.allocate_slots(r2, len(r2.token_ids) - num_computed, computed) is None
    assert pool_snapshot(m) == before
    assert m.block_table(r2) == []


def test_allocation_beyond_pool_returns_none_then_fits_after_free():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = Req(0, list(range(9)))
    admit(m, a)
    b = Req(1, list(range(100, 109)))
    assert m.allocate_slots(b, 9) is None
    m.free(a)
    assert m.allocate_slots(b, 9) is not None


def test_slot_mapping_follows_the_block_table():
    m = KVCacheManager(num_blocks=8, block_size=4)
    filler = Req(9, [7, 7, 7, 7, 7])
    admit(m, filler)  # takes blocks 0, 1
    r = Req(0, list(range(10)))
    admit(m, r)
    table = m.block_table(r)
    expected = [table[p // 4] * 4 + p % 4 for p in range(3, 10)]
    assert m.slot_mapping(r, 3, 10) == expected
    assert m.slot_mapping(r, 5, 5) == []


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    m = KVCacheManager(num_blocks=8, block_size=4)
    r = Req(0, list(range(9)))
    admit(m, r)
    assert m.reset_prefix_cache() is False
    assert m.pool.cached
    m.free(r)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Req(1, list(range(9)))) == ([], 0)


def test_stats_report_hits_and_usage():
    m = KVCacheManager(num_blocks=10, block_size=4)
    admit(m, Req(0, list(range(9))))
    admit(m, Req(1, list(range(9))))
    s = m.stats()
    assert (s.queries, s.query_tokens, s.hit_tokens, s.hit_blocks) == (2, 18, 8, 2)
    assert s.hit_rate == pytest.approx(8 / 18)
    assert s.num_free_blocks == 10 - 4
    assert s.usage == pytest.approx(0.4)


def test_caching_disabled_never_hits():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    admit(m, Req(0, list(range(9))))
    assert m.get_computed_blocks(Req(1, list(range(9)))) == ([], 0)
    assert not m.pool.cached


def test_discarding_a_failed_request_forgets_its_unwritten_blocks():
    m = KVCacheManager(num_blocks=16, block_size=4)
    written = Req(0, list(range(9)))
    admit(m, written)
    m.free(written)  # its K/V were written: its blocks stay findable
    failed = Req(1, list(range(9)) + list(range(100, 109)))
    computed, _ = admit(m, failed)  # registers blocks 2 and 3 before any K/V exists
    assert len(computed) == 2
    m.discard(failed, num_written_tokens=8)
    probe = Req(2, list(failed.token_ids))
    assert m.get_computed_blocks(probe)[1] == 8  # the written prefix, nothing past it
    assert m.pool.num_free_blocks == 16
