"""ReplicaRouter on KV events: the exact index, gaps and replay, salts, media, real vLLM frames.

``PoolReplica`` is an EngineLike over a real :class:`KVCacheManager` (no model): it admits a
prompt, reports ``cached_tokens`` as the pool reused it, frees it, and publishes its
manager's events through ``kv_events()`` as an :class:`~ragkv.cache_engine.Engine` does.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from pathlib import Path

import pytest

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.kv_cache_manager import KVCacheManager
from ragkv.cache_engine.kv_events import (
    SALT_DIGEST_KEY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventBuffer,
    wire_hash,
)
from ragkv.cache_engine.outputs import Output, Timings, Usage
from ragkv.integrations.routing import ReplicaRouter
from ragkv.integrations.routing.event_index import EventIndex
from ragkv.integrations.routing.replica_events import ReplicaEvents

BS = 4
REAL_FILE = (
    Path(__file__).resolve().parents[3] / "shared/data/vllm-kv-events/vllm-0.32-cpu-events.json"
)


class _Req:
    def __init__(self, rid, token_ids, salt):
        self.request_id = rid
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.salt_digest = None if salt is None else digest_salt(salt)
        self.block_hasher = None


class PoolReplica:
    """An EngineLike whose cache is a real KV cache manager of ``pool_blocks`` blocks."""

    tokenizer = None
    block_size = BS
    knows_residency = False
    model_name = "pool"

    def __init__(self, pool_blocks: int = 64) -> None:
        self.kv = KVCacheManager(pool_blocks, BS)
        self.buffer: KVEventBuffer | None = None
        self._lock = threading.Lock()
        self._ids = 0

    def kv_events(self) -> KVEventBuffer:
        if self.buffer is None:  # as Engine.kv_events does
            self.buffer = KVEventBuffer()
            for event in self.kv.snapshot_events():
                self.buffer.put(event)
            self.kv.set_event_sink(self.buffer.put)
        return self.buffer

    def generate(self, prompt, params=None, *, cache_salt=None):
        with self._lock:
            self._ids += 1
            req = _Req(self._ids, prompt, cache_salt)
            blocks, hit = self.kv.get_computed_blocks(req)
            assert self.kv.allocate_slots(req, len(prompt) - hit, blocks) is not None
            self.kv.free(req)
        usage = Usage(len(prompt), 1, hit)
        return Output("r", list(prompt), [1], "ok", "stop", usage, Timings(0, 0, 0))


def settle(router: ReplicaRouter, timeout_s: float = 5.0) -> None:
    """Wait until every replica's follower applied every event its engine published."""
    deadline = time.monotonic() + timeout_s
    for replica in router._replicas:
        buffer = replica.engine.buffer
        while replica.events.applied < buffer.accepted:
            assert time.monotonic() < deadline, "events not applied in time"
            time.sleep(0.005)


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    return rng.choice(prefixes) + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]


def test_events_make_predicted_cached_tokens_exact():
    rng = random.Random(3)
    prefixes = [[rng.randrange(1000) for _ in range(6 * BS)] for _ in range(12)]
    replicas = [PoolReplica(pool_blocks=40) for _ in range(3)]
    with ReplicaRouter(replicas, kv_events=True, index_blocks=40) as router:
        for _ in range(300):
            router.generate(_prompt(rng, prefixes))
            settle(router)
        stats = router.stats().replicas
    assert all(s.events == "synced" and s.event_gaps == 0 for s in stats)
    assert sum(s.predicted_cached_tokens for s in stats) > 0
    for s in stats:  # sequential requests, events applied: the index is the pool
        assert s.predicted_cached_tokens == s.reported_cached_tokens


def test_index_mirrors_the_pool_through_evictions_resets_and_salts():
    rng = random.Random(5)
    replica = PoolReplica(pool_blocks=24)
    index = EventIndex(BS)
    buffer = replica.kv_events()
    prefixes = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(6)]
    for step in range(400):
        salt = rng.choice([None, None, "a", "b"])
        replica.generate(_prompt(rng, prefixes), cache_salt=salt)
        if step % 97 == 96:
            assert replica.kv.reset_prefix_cache()
        for event in buffer.take(0)[0]:
            index.apply(event)
        pool_keys = set(replica.kv.pool.cached)  # no extra keys: ragkv's keys are the router's
        held = {k for k in pool_keys if k in index}
        assert held <= pool_keys and len(index) == len(held)
        assert len(pool_keys) - len(held) <= index.orphans


def _stored(tokens, *, parent=None, salt_item=None, medium="GPU", first_hash=100):
    n = len(tokens) // BS
    extra = [salt_item] + [None] * (n - 1)
    return BlockStored(
        list(range(first_hash, first_hash + n)),
        parent,
        list(tokens),
        BS,
        medium=medium,
        extra_keys=extra,
    )


def test_salted_blocks_are_never_shared_across_salts_in_the_index():
    tokens = list(range(3 * BS))
    index = EventIndex(BS)
    index.apply(_stored(tokens, salt_item=["tenant-x"], first_hash=100))  # vLLM: the raw salt
    index.apply(
        _stored(tokens, salt_item=[SALT_DIGEST_KEY, digest_salt("tenant-y")], first_hash=200)
    )  # ragkv: the digest
    for salt in ("tenant-x", "tenant-y"):
        hashes = BlockHasher(BS, salt=salt).extend(tokens)
        assert index.match(hashes)[0] == 3
    assert index.match(BlockHasher(BS).extend(tokens))[0] == 0
    assert index.match(BlockHasher(BS, salt="tenant-z").extend(tokens))[0] == 0
    # A salted chain's next block continues its own salt's chain only.
    index.apply(_stored(list(range(3 * BS, 4 * BS)), parent=102, first_hash=300))
    assert index.match(BlockHasher(BS, salt="tenant-x").extend(list(range(4 * BS))))[0] == 4
    assert index.match(BlockHasher(BS, salt="tenant-y").extend(list(range(4 * BS))))[0] == 3


def test_removals_by_engine_hash_per_medium_and_tier_scores():
    tokens = list(range(2 * BS))
    hashes = BlockHasher(BS).extend(tokens)
    index = EventIndex(BS)
    index.apply(_stored(tokens, first_hash=1))
    index.apply(_stored(tokens, medium="CPU", first_hash=1))
    assert index.match(hashes) == (2, 2.0)
    index.apply(BlockRemoved([1, 2], medium="GPU"))
    blocks, score = index.match(hashes)
    assert blocks == 2 and score < 2.0  # in host memory only: worth less than the pool
    index.apply(BlockRemoved([2], medium="CPU"))
    assert index.match(hashes)[0] == 1
    index.apply(AllBlocksCleared())
    assert index.match(hashes)[0] == 0 and len(index) == 0


def test_blocks_no_plain_prompt_can_hit_are_left_out():
    tokens = list(range(2 * BS))
    index = EventIndex(BS)
    lora = _stored(tokens)
    lora.lora_id = 1
    other_size = BlockStored([1], None, list(range(8)), 8)
    multimodal = _stored(tokens, salt_item=[["mm-hash", 0]])
    for event in (lora, other_size, multimodal):
        index.apply(event)
    assert len(index) == 0 and index.skipped == 5
    index.apply(_stored(list(range(BS)), parent=999))  # a parent it never saw
    assert len(index) == 0 and index.orphans == 1


class ScriptedFeed:
    """A feed whose replay buffer the test fills; messages go to ``receive`` by hand."""

    def __init__(self, buffered: dict[int, KVEventBatch] | None) -> None:
        self.buffered = buffered

    def next(self, timeout_s):
        return None

    def replay(self, start_seq):
        if self.buffered is None:
            return None
        return [(s, b) for s, b in sorted(self.buffered.items()) if s >= start_seq]

    def close(self):
        pass


def _batches(n: int) -> list[KVEventBatch]:
    """Batch 0 clears, batch i stores one prompt's first block (tokens i..i+BS)."""
    out = [KVEventBatch(0.0, [AllBlocksCleared()])]
    for i in range(1, n):
        out.append(KVEventBatch(0.0, [_stored(list(range(i, i + BS)), first_hash=i)]))
    return out


def _held(events: ReplicaEvents, i: int) -> bool:
    return events.index.match(BlockHasher(BS).extend(list(range(i, i + BS))))[0] == 1


def test_a_gap_is_replayed_in_order():
    batches = _batches(6)
    feed = ScriptedFeed(dict(enumerate(batches)))
    events = ReplicaEvents(feed, BS, threading.Lock())
    events.receive(0, batches[0])
    events.receive(1, batches[1])
    events.receive(4, batches[4])  # 2 and 3 lost on the way
    assert events.synced and events.replayed == 2 and events.gaps == 0
    assert all(_held(events, i) for i in (1, 2, 3, 4))
    events.receive(5, batches[5])
    assert _held(events, 5) and events.batches == 6


def test_a_late_subscriber_replays_from_the_start():
    batches = _batches(4)
    events = ReplicaEvents(ScriptedFeed(dict(enumerate(batches))), BS, threading.Lock())
    events.receive(3, batches[3])  # joined late: 0..2 published before it subscribed
    assert events.synced and all(_held(events, i) for i in (1, 2, 3))


def test_a_gap_replay_cannot_fill_clears_and_falls_back_to_prediction():
    batches = _batches(8)
    buffered = {s: b for s, b in enumerate(batches) if s != 2}  # the publisher lost 2 too
    events = ReplicaEvents(ScriptedFeed(buffered), BS, threading.Lock())
    events.receive(0, batches[0])
    events.receive(1, batches[1])
    events.receive(4, batches[4])
    assert not events.synced and events.gaps == 1
    assert not _held(events, 1) and _held(events, 4)  # cleared, then kept applying
    events.receive(5, KVEventBatch(0.0, [AllBlocksCleared(), *batches[5].events]))
    assert events.synced and _held(events, 5) and not _held(events, 4)
    events.receive(6, None)  # an undecodable payload is a hole too
    assert not events.synced and events.undecodable == 1


def test_a_publisher_restart_from_zero_is_a_new_cache():
    batches = _batches(4)
    events = ReplicaEvents(ScriptedFeed(None), BS, threading.Lock())
    for seq in range(4):
        events.receive(seq, batches[seq])
    events.receive(0, KVEventBatch(0.0, [_stored(list(range(9, 9 + BS)), first_hash=50)]))
    assert events.synced and _held(events, 9) and not _held(events, 1)


def test_router_falls_back_to_prediction_for_a_replica_whose_events_were_lost():
    replicas = [PoolReplica(pool_blocks=64) for _ in range(2)]
    with ReplicaRouter(replicas, kv_events=True) as router:
        prompt = list(range(5 * BS))
        router.generate(prompt)
        settle(router)
        owner = next(r for r in router._replicas if len(r.events.index))
        with router._lock:
            owner.events._lose()
        assert router.stats().replicas[owner.position].events == "predicting"
        # The prediction index still knows the prompt: the follow-up goes to its owner.
        before = replicas[owner.position].kv.stats().hit_tokens
        router.generate(prompt + [7])
        assert replicas[owner.position].kv.stats().hit_tokens > before


@pytest.mark.skipif(not REAL_FILE.exists(), reason="shared/data/vllm-kv-events not present")
def test_real_vllm_events_rebuild_ragkv_keys():
    pytest.importorskip("msgpack")
    from ragkv.integrations.kv_events.codec import decode_batch

    data = json.loads(REAL_FILE.read_text())
    index = EventIndex(32)
    stored = []
    for message in data["published"]:
        batch = decode_batch(base64.b64decode(message[2]))
        for event in batch.events:
            index.apply(event)
            stored.append(event)
    assert len(index) == sum(len(e.block_hashes) for e in stored) and index.orphans == 0
    for event in stored:
        salt = "tenant-x" if event.extra_keys[0] else None
        keys = BlockHasher(32, salt=salt).extend(event.token_ids)
        assert index.match(keys)[0] == len(keys)
        assert index.match(BlockHasher(32, salt="other").extend(event.token_ids))[0] == 0
    index.apply(BlockRemoved(stored[0].block_hashes[1:], medium="GPU"))
    assert index.match(BlockHasher(32).extend(stored[0].token_ids))[0] == 1


def test_manager_events_name_blocks_as_vllm_does():
    kv = KVCacheManager(8, BS)
    buffer = KVEventBuffer()
    kv.set_event_sink(buffer.put)
    req = _Req(1, list(range(2 * BS + 1)), "s")
    kv.allocate_slots(req, len(req.token_ids))
    (event,) = buffer.take(0)[0]
    hashes = req.block_hasher.hashes
    assert event.block_hashes == [wire_hash(h) for h in hashes[:2]]
    assert event.parent_block_hash is None and event.token_ids == list(range(2 * BS))
    assert event.extra_keys == [[SALT_DIGEST_KEY, digest_salt("s")], None]
    assert all(0 <= h < 2**64 for h in event.block_hashes)


@pytest.mark.parametrize("algo", ["xxh3_128", "blake3"])
def test_a_warm_pools_snapshot_tells_a_new_consumer_what_it_holds(algo):
    """Events started on a pool that already caches blocks: the snapshot (read back from
    the stored hash inputs, model key and salts included) keys every reachable block as the
    router hashes prompts, whatever the engine's hash recipe."""
    rng = random.Random(11)
    kv = KVCacheManager(30, BS, algo=algo, extra_keys=[("model", b"tiny")])
    prefixes = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(5)]
    prompts = []
    for i in range(60):
        salt = rng.choice([None, "a", "b"])
        prompt = _prompt(rng, prefixes)
        req = _Req(i, prompt, salt)
        blocks, hit = kv.get_computed_blocks(req)
        kv.allocate_slots(req, len(prompt) - hit, blocks)
        kv.free(req)
        prompts.append((prompt, salt))
    index = EventIndex(BS)
    events = kv.snapshot_events()
    assert events[0] == AllBlocksCleared()
    for event in events:
        index.apply(event)
    assert index.orphans == 0
    total = 0
    for prompt, salt in prompts:
        salt_digest = None if salt is None else digest_salt(salt)
        held = kv.cached_prefix(_hasher(kv, prompt, salt_digest), len(prompt))
        routed = index.match(BlockHasher(BS, salt=salt).extend(prompt))[0]
        assert min(routed, (len(prompt) - 1) // BS) == held
        total += held
    assert total > 0


def _hasher(kv, prompt, salt_digest):
    hasher = kv.new_hasher(salt_digest)
    hasher.extend(prompt)
    return hasher
