"""The engine's tier glue with a controllable in-memory store: parking, partial loads, faults.

The real stores are tested in test_kv_tiers*.py; here a store that can be slowed, broken or
made to lie shows that the engine never waits for another request's loads, never takes a
block it was not given, and never fails a request because a tier misbehaved.
"""

from __future__ import annotations

import threading

import pytest
import torch
from support import ids

from ragkv.cache_engine import Engine, SamplingParams, offload

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
LONG = 120  # + 4 generated tokens: 8 blocks


class MemoryTiers:
    """A dict posing as :class:`KVTiers` (one tier, "host"), with hooks to misbehave."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[bytes, torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.load_limit: int | None = None  # loads after this many return None
        self.offer_error: Exception | None = None
        self.loads = 0
        self.closed = False

    def offer(self, block_hash, hash_input, payload, *, salted):
        if self.offer_error is not None:
            raise self.offer_error
        with self.lock:
            self.entries[block_hash] = (hash_input, payload.clone())

    def lookup(self, hashes):
        present = []
        with self.lock:
            for block_hash in hashes:
                if block_hash not in self.entries:
                    break
                present.append("host")
        return present

    def load(self, block_hash, hash_input):
        assert self.gate.wait(timeout=30)
        with self.lock:
            self.loads += 1
            if self.load_limit is not None and self.loads > self.load_limit:
                return None
            entry = self.entries.get(block_hash)
        if entry is None or entry[0] != hash_input:
            return None
        return entry[1].clone(), "host"

    def flush(self, timeout_s=None):
        pass

    def stats(self):
        return {}

    def close(self):
        self.closed = True


@pytest.fixture
def tiers(monkeypatch):
    store = MemoryTiers()
    monkeypatch.setattr(offload, "open_tiers", lambda config, runner: store)
    return store


def tiered(path, **kwargs) -> Engine:
    # A pool of 7 blocks: a 100-token prompt (+4 generated: 7 blocks) evicts the previous one.
    kwargs.setdefault("kv_cache_tokens", 7 * BLOCK)
    return Engine.from_pretrained(path, device="cpu", host_cache_bytes=1 << 20, **kwargs)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy tokens and logits of prompts 0..3 (100 tokens) and of prompt 2 at ``LONG``
    tokens, from an engine without any cache."""
    with Engine.from_pretrained(
        llama_dir, device="cpu", kv_cache_tokens=2048, enable_prefix_caching=False
    ) as eng:
        prompts = [ids(i, 100) for i in range(4)] + [ids(2, LONG)]
        return [eng.generate(p, GREEDY, return_logits=True) for p in prompts]


def assert_same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    start = out.logits_start
    torch.testing.assert_close(out.logits, ref.logits[start:], rtol=0, atol=1e-4)


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_tier_exactly(
    llama_dir, tiers, reference
):
    with tiered(llama_dir) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        out = eng.generate(ids(0, 100), GREEDY, return_logits=True)
        stats = eng.stats()
    assert out.usage.cached_tokens == 96
    assert out.usage.cached_tokens_by_tier == {"pool": 0, "host": 96}
    assert_same(out, reference[0])
    assert stats.tier_hit_tokens["host"] == 96 and stats.tier_loaded_blocks == {"host": 6}
    assert stats.prefill_tokens_reused == sum(stats.tier_hit_tokens.values())
    assert tiers.closed


def while_parked(eng, tiers, parked: int, other: int, other_len: int = 100):
    """Prompt ``parked`` waits at the tier's gate while prompt ``other`` (``other_len``
    tokens) runs start to end.

    Returns both outputs; asserts the parked one had not finished when the other had.
    """
    tiers.gate.clear()  # loads block until the other request has finished
    done = threading.Event()
    result = {}

    def run_parked():
        result["out"] = eng.generate(ids(parked, 100), GREEDY, return_logits=True)
        done.set()

    thread = threading.Thread(target=run_parked)
    thread.start()
    while not eng.scheduler.waiting_for_kv:  # waiting for K/V, its loads waiting at the gate
        threading.Event().wait(0.01)
    out = eng.generate(ids(other, other_len), GREEDY, return_logits=True)
    assert not done.is_set()  # still parked while the other one ran start to end
    tiers.gate.set()
    thread.join(timeout=30)
    return result["out"], out


def test_a_request_waiting_for_its_loads_does_not_hold_up_another(llama_dir, tiers, reference):
    with tiered(llama_dir, kv_cache_tokens=14 * BLOCK) as eng:
        for i in (0, 1, 2):  # prompt 0 ends up in the tier only
            eng.generate(ids(i, 100), GREEDY)
        parked, other = while_parked(eng, tiers, 0, 3)
    assert_same(other, reference[3])
    assert_same(parked, reference[0])
    assert parked.usage.cached_tokens_by_tier["host"] == 96


def test_a_load_that_fails_midway_ends_the_reused_prefix_there(llama_dir, tiers, reference):
    with tiered(llama_dir) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        tiers.load_limit = tiers.loads + 2  # two blocks load, the third is a miss
        out = eng.generate(ids(0, 100), GREEDY, return_logits=True)
        assert eng.stats().tier_load_misses == 1
    assert out.usage.cached_tokens == 32
    assert_same(out, reference[0])


def test_a_tier_that_cannot_store_costs_hits_not_requests(llama_dir, tiers, reference):
    tiers.offer_error = OSError(28, "No space left on device")
    with tiered(llama_dir) as eng:
        outs = [eng.generate(ids(i, 100), GREEDY, return_logits=True) for i in (0, 1, 0)]
        assert eng.stats().tier_offered_blocks == 0
        assert eng.stats().tier_save_errors > 0  # counted, and now reported
        assert eng.health().ok
    for out, ref in zip(outs, [reference[0], reference[1], reference[0]], strict=True):
        assert_same(out, ref)
    assert outs[2].usage.cached_tokens == 0


def test_a_payload_of_the_wrong_shape_is_a_miss(llama_dir, tiers, reference):
    with tiered(llama_dir) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        for key, (hash_input, payload) in list(tiers.entries.items()):
            tiers.entries[key] = (hash_input, payload[:, :, :8])
        out = eng.generate(ids(0, 100), GREEDY, return_logits=True)
    assert out.usage.cached_tokens == 0
    assert_same(out, reference[0])


def test_aborting_a_parked_request_frees_its_staging(llama_dir, tiers, reference):
    with tiered(llama_dir) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        tiers.gate.clear()
        stream = eng.stream(ids(0, 100), GREEDY)
        thread = threading.Thread(target=lambda: list(stream))
        thread.start()
        while (
            not eng.scheduler.waiting_for_kv
        ):  # waiting for K/V, its first load waiting at the gate
            threading.Event().wait(0.01)
        [(request, _)] = eng.scheduler.waiting_for_kv.values()
        eng.abort(request.request_id)
        tiers.gate.set()
        thread.join(timeout=30)
        assert not eng.scheduler.waiting_for_kv and not eng.core.offload.loader._ready
        assert eng.core.offload.loader.staged_blocks == 0
        assert_same(eng.generate(ids(1, 100), GREEDY, return_logits=True), reference[1])


def test_a_staged_run_gone_stale_while_parked_is_looked_up_again(llama_dir, tiers, reference):
    # Pool of 10 blocks: after prompt 1, prompt 0 keeps its first 3 blocks in the pool and
    # the rest only in the tier. Its arrival makes those 3 the most recently used, so while
    # it waits for the loads, a prompt of 8 blocks takes prompt 1's 7 and the last of them:
    # the staged run no longer continues the pool prefix. The request must look the tier up
    # again from there (that block went to the tier when it was written), not compute it.
    with tiered(llama_dir, kv_cache_tokens=10 * BLOCK) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        parked, other = while_parked(eng, tiers, 0, 2, other_len=LONG)
        stats = eng.stats()
    assert stats.tier_stale_loads == 1
    assert parked.usage.cached_tokens_by_tier == {"pool": 32, "host": 64}
    assert_same(parked, reference[0])
    assert_same(other, reference[4])


def test_a_load_stuck_in_one_read_times_out_and_the_request_computes(llama_dir, tiers, reference):
    # A read that never returns (a hung mount): before the deadline, the request waited for
    # good and health said ok. Now it computes after kv_load_timeout_s, health shows the
    # stalled loader, and the next request is not parked behind it.
    with tiered(llama_dir, kv_load_timeout_s=0.3) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        tiers.gate.clear()
        try:
            out = eng.generate(ids(0, 100), GREEDY, return_logits=True)
            health = eng.health()
            eng.generate(ids(1, 100), GREEDY)  # prompt 0 leaves the pool again
            again = eng.generate(ids(0, 100), GREEDY, return_logits=True)
            stats = eng.stats()
        finally:
            tiers.gate.set()
    assert out.usage.cached_tokens == 0
    assert_same(out, reference[0])
    assert health.ok and health.kv_loader["stalled"]
    assert health.kv_loader["load_timeouts"] == 1 and health.kv_loader["jobs_waiting"] == 0
    assert again.usage.cached_tokens == 0  # the tiers were skipped, not waited for
    assert_same(again, reference[0])
    assert stats.tier_load_timeouts == 1 and stats.tier_stalled_skips >= 1


def test_a_load_timed_out_midway_keeps_the_blocks_loaded_by_then(llama_dir, tiers, reference):
    fast = tiers.load
    stuck = threading.Event()

    def load(block_hash, hash_input):
        if tiers.loads >= 2:  # the third read hangs until the test ends
            stuck.wait(timeout=30)
        return fast(block_hash, hash_input)

    tiers.load = load
    with tiered(llama_dir, kv_load_timeout_s=2.0) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        try:
            out = eng.generate(ids(0, 100), GREEDY, return_logits=True)
        finally:
            stuck.set()
    assert out.usage.cached_tokens_by_tier == {"pool": 0, "host": 32}
    assert_same(out, reference[0])


def test_finished_loads_wake_the_stepping_thread_without_waiting_for_its_poll(
    llama_dir, tiers, reference, monkeypatch
):
    # The engine polls only to time parked requests out; a finished load must wake it. With
    # the wake lost (the loader kept its no-op default), this took the whole poll interval.
    import time

    from ragkv.cache_engine import engine_core

    monkeypatch.setattr(engine_core, "LOAD_POLL_S", 60.0)
    with tiered(llama_dir) as eng:
        for i in (0, 1):
            eng.generate(ids(i, 100), GREEDY)
        started = time.monotonic()
        out = eng.generate(ids(0, 100), GREEDY, return_logits=True)
        elapsed = time.monotonic() - started
    assert out.usage.cached_tokens_by_tier == {"pool": 0, "host": 96}
    assert elapsed < 30  # far below the 60 s poll: the loader woke the engine
    assert_same(out, reference[0])
