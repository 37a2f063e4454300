"""Random add / decode / finish / fill / reset sequences keep the pool and every hit exact.

A shadow KV memory records, for every slot the "engine" wrote, which (salt, token prefix)
produced it. Whatever the manager hands out, each computed position of a running request
must read back exactly its own (salt, prefix): that is what a wrong cache hit would break.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import CacheReq as Req

from ragkv.cache_engine import KVCacheManager

BLOCK = 4
NUM_BLOCKS = 12
# Shared stems + a tiny vocabulary: most requests share a prefix with an earlier one.
STEMS = ((), (0, 1, 2, 0, 1, 2, 0, 1), (2, 2, 1, 1, 0))
tokens_st = st.builds(
    lambda stem, tail: [*stem, *tail],
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 2), min_size=1, max_size=9),
)
salt_st = st.sampled_from([None, "a"])


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK, extra_keys=[("model", b"toy")])
        self.running: dict[int, Req] = {}
        self.queued: dict[int, Req] = {}  # arrived, demanding their cached prefix
        self.shadow: dict[int, tuple] = {}  # slot -> (salt, token prefix ending at that slot)
        self.next_id = 0

    def write(self, req: Req, start: int, end: int) -> None:
        for pos, slot in zip(range(start, end), self.m.slot_mapping(req, start, end), strict=True):
            self.shadow[slot] = (req.cache_salt, tuple(req.token_ids[: pos + 1]))

    def admit(self, tokens: list[int], salt: str | None, req: Req | None = None) -> bool:
        if req is None:
            req = Req(self.next_id, list(tokens), salt)
            self.next_id += 1
        computed, num_computed = self.m.get_computed_blocks(req)
        assert num_computed <= len(tokens) - 1
        before = self.snapshot()
        if self.m.allocate_slots(req, len(tokens) - num_computed, computed) is None:
            assert self.snapshot() == before
            self.m.free(req)
            return False
        self.write(req, num_computed, len(tokens))
        self.running[req.request_id] = req
        return True

    def snapshot(self) -> tuple:
        pool = self.m.pool
        return list(pool.ref_counts), pool.free_block_ids(), dict(pool.cached)

    @rule(tokens=tokens_st, salt=salt_st)
    def add_request(self, tokens, salt):
        self.admit(tokens, salt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_token(self, data, token):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        req.token_ids.append(token)
        num_computed = self.m.num_computed_tokens(req)
        before = self.snapshot()
        if self.m.allocate_slots(req, 1) is None:
            assert self.snapshot() == before
            self.m.free(req)  # preempted
            del self.running[req.request_id]
            return
        self.write(req, num_computed, num_computed + 1)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.m.free(req)

    @rule(tokens=tokens_st, salt=salt_st)
    def queue(self, tokens, salt):
        req = Req(self.next_id, list(tokens), salt)
        self.next_id += 1
        self.m.note_demand(req)
        self.queued[req.request_id] = req

    @precondition(lambda self: self.queued)
    @rule(data=st.data(), leave=st.booleans())
    def dequeue(self, data, leave):
        req = self.queued.pop(data.draw(st.sampled_from(sorted(self.queued))))
        if leave:  # cancelled while queued
            self.m.free(req)
        else:
            self.admit(req.token_ids, req.cache_salt, req)

    @rule(tokens=tokens_st, salt=salt_st)
    def allocate_until_full(self, tokens, salt):
        for i in range(NUM_BLOCKS + 1):
            if not self.admit([*tokens, i % 3], salt):
                break
        else:
            raise AssertionError("a pool of NUM_BLOCKS blocks admitted NUM_BLOCKS + 1 requests")

    @rule(tokens=st.lists(st.integers(3, 9), min_size=9, max_size=30))
    def evict_with_fresh_tokens(self, tokens):
        pool = self.m.pool
        evictions = self.m.stats().evictions
        cached_before = {b: key for key, b in pool.cached.items()}
        req = Req(self.next_id, tokens)
        self.next_id += 1
        new = self.m.allocate_slots(req, len(tokens))
        if new is None:
            self.m.free(req)
            return
        was_cached = [b for b in new if b in cached_before]
        assert self.m.stats().evictions == evictions + len(was_cached)
        # An evicted block's old key no longer names it, unless the fresh tokens hash to that
        # very key again (same parent, same tokens): then it is re-registered for them.
        assert all(
            pool.cached.get(cached_before[b]) != b or pool.block_hash[b] == cached_before[b]
            for b in was_cached
        )
        self.write(req, 0, len(tokens))
        self.running[req.request_id] = req

    @rule()
    def reset(self):
        ok = self.m.reset_prefix_cache()  # queued requests hold no blocks
        assert ok == (not self.running)
        if ok:
            assert not self.m.pool.cached

    @invariant()
    def pool_is_consistent(self):
        pool = self.m.pool
        refs = pool.ref_counts
        assert len(refs) == NUM_BLOCKS
        assert all(r >= 0 for r in refs)
        free = pool.free_block_ids()
        assert len(set(free)) == len(free)
        assert all(refs[b] == 0 for b in free)  # never both free and referenced
        assert len(free) + sum(1 for r in refs if r) == NUM_BLOCKS  # nothing lost
        # Demands: exactly the queued requests' on blocks still holding what they demanded.
        demanded = [0] * NUM_BLOCKS
        for req in self.queued.values():
            for b, generation in self.m._requests[req.request_id].demanded:
                demanded[b] += generation == pool.generation[b]
        assert demanded == pool.demand
        held = [b for b in free if pool.demand[b]]
        assert free[len(free) - len(held) :] == held  # demanded free blocks are evicted last
        holders = [0] * NUM_BLOCKS
        for req in self.running.values():
            for b in self.m.block_table(req):
                holders[b] += 1
        assert holders == refs
        for key, b in pool.cached.items():
            assert pool.block_hash[b] == key
        assert sum(h is not None for h in pool.block_hash) == len(pool.cached)

    @invariant()
    def every_computed_token_reads_its_own_kv(self):
        for req in self.running.values():
            n = self.m.num_computed_tokens(req)
            for pos, slot in zip(range(n), self.m.slot_mapping(req, 0, n), strict=True):
                assert self.shadow.get(slot) == (req.cache_salt, tuple(req.token_ids[: pos + 1]))

    @invariant()
    def cached_blocks_hold_the_tokens_they_claim(self):
        pool = self.m.pool
        for b in pool.cached.values():
            salt, prefix = self.shadow[b * BLOCK + BLOCK - 1]
            assert len(prefix) % BLOCK == 0
            for off in range(BLOCK):
                assert self.shadow[b * BLOCK + off] == (
                    salt,
                    prefix[: len(prefix) - BLOCK + off + 1],
                )


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
