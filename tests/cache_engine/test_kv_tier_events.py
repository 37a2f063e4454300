"""KV events from the KV tiers: host memory is ``"CPU"``, disk ``"DISK"``, in vLLM's schema.

The stores tell what their index gains and loses; the engine's event buffer gets one
``BlockStored`` per stored block (token ids, parent and salt decoded from its hash input) and
a ``BlockRemoved`` per drop, so a router scores a block a replica would load back from a tier.
"""

from __future__ import annotations

import threading

import pytest
from support import TIER_BLOCK_SHAPE, ids, save_tiny_checkpoint
from support import tier_block as block

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.kv_cache_manager import KVCacheManager
from ragkv.cache_engine.kv_events import (
    SALT_DIGEST_KEY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBuffer,
    wire_hash,
)
from ragkv.cache_engine.kv_tiers import DiskStore, HostStore, KVTiers, StoreNamespace
from ragkv.integrations.routing.event_index import DISK, HOST, MEDIUM_WEIGHTS, POOL, EventIndex

BS = TIER_BLOCK_SHAPE[2]  # the stores' test payloads hold 4-token blocks
ENTRY = 1500  # more than one entry's bytes (payload 1 KiB + hash input), less than two
NS = StoreNamespace("model:tiny", "f" * 32, "float32", BS, "xxh3_128", "LKVBHD:2x2x4x2x8")


def chain(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> list[tuple]:
    """``(hash, hash input)`` of each full block of ``tokens`` as the engine hashes them."""
    hasher = kv.new_hasher(None if salt is None else digest_salt(salt))
    hasher.extend(tokens)
    return list(zip(hasher.hashes, hasher.inputs, strict=True))


def listening(tiers: KVTiers, kv: KVCacheManager) -> KVEventBuffer:
    buffer = KVEventBuffer()
    tiers.set_event_sink(buffer.put, kv.stored_events)
    return buffer


def offer(tiers: KVTiers, blocks, salted: bool = False) -> None:
    for i, (block_hash, hash_input) in enumerate(blocks):
        tiers.offer(block_hash, hash_input, block(i)[2], salted=salted)
    assert tiers.flush(5.0)


def test_a_block_stored_in_host_memory_is_told_in_cpu_with_its_tokens_and_parent():
    kv = KVCacheManager(8, BS, extra_keys=[("model", b"tiny")])
    tiers = KVTiers(HostStore(4 * ENTRY), None)
    try:
        buffer = listening(tiers, kv)
        tokens = list(range(100, 100 + 2 * BS))
        blocks = chain(kv, tokens)
        offer(tiers, blocks)
        events, lost = buffer.take(0)
    finally:
        tiers.close()
    assert not lost
    assert events == [
        BlockStored(
            [wire_hash(blocks[0][0])], None, tokens[:BS], BS, medium="CPU", extra_keys=[None]
        ),
        BlockStored(
            [wire_hash(blocks[1][0])],
            wire_hash(blocks[0][0]),
            tokens[BS:],
            BS,
            medium="CPU",
            extra_keys=[None],
        ),
    ]


def test_a_block_evicted_from_host_memory_is_removed_in_cpu():
    kv = KVCacheManager(8, BS)
    tiers = KVTiers(HostStore(ENTRY), None)  # one entry: the second offer evicts the first
    try:
        buffer = listening(tiers, kv)
        blocks = chain(kv, list(range(2 * BS)))
        offer(tiers, blocks)
        events, _ = buffer.take(0)
    finally:
        tiers.close()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert events[1] == BlockRemoved([wire_hash(blocks[0][0])], medium="CPU")


def test_a_salted_block_carries_its_salt_digest():
    kv = KVCacheManager(8, BS)
    tiers = KVTiers(HostStore(4 * ENTRY), None)
    try:
        buffer = listening(tiers, kv)
        offer(tiers, chain(kv, list(range(BS)), salt="tenant-a"), salted=True)
        (event,), _ = buffer.take(0)
    finally:
        tiers.close()
    assert isinstance(event, BlockStored)
    assert event.extra_keys == [[SALT_DIGEST_KEY, digest_salt("tenant-a")]]
    index = EventIndex(BS)
    index.apply(event)
    salted = BlockHasher(BS, salt_digest=digest_salt("tenant-a")).extend(list(range(BS)))
    assert index.media(salted[0]) == HOST
    assert index.match(BlockHasher(BS).extend(list(range(BS))))[0] == 0  # no salt, no hit


def test_disk_stores_and_drops_are_told_in_disk(tmp_path):
    kv = KVCacheManager(8, BS)
    tiers = KVTiers(None, DiskStore(tmp_path, 1 << 20, NS))
    try:
        buffer = listening(tiers, kv)
        blocks = chain(kv, list(range(BS)))
        offer(tiers, blocks)
        tiers.disk.discard(blocks[0][0])
        events, _ = buffer.take(0)
    finally:
        tiers.close()
    assert [(type(e).__name__, e.medium) for e in events] == [
        ("BlockStored", "DISK"),
        ("BlockRemoved", "DISK"),
    ]


def test_the_event_buffer_keeps_every_event_of_two_producer_threads():
    buffer, n = KVEventBuffer(), 20_000
    producers = [
        threading.Thread(target=lambda m=m: [buffer.put(BlockRemoved([i], m)) for i in range(n)])
        for m in ("GPU", "CPU")
    ]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join()
    events, lost = buffer.take(0)
    assert not lost and buffer.accepted == len(events) == 2 * n
    for medium in ("GPU", "CPU"):  # each producer's events in its own order
        assert [e.block_hashes[0] for e in events if e.medium == medium] == list(range(n))


def test_nothing_is_told_without_a_listener_or_after_it_stops():
    kv = KVCacheManager(8, BS)
    tiers = KVTiers(HostStore(ENTRY), None)
    try:
        buffer = listening(tiers, kv)
        tiers.set_event_sink(None, kv.stored_events)
        assert tiers.host._listener is None
        offer(tiers, chain(kv, list(range(2 * BS))))
    finally:
        tiers.close()
    assert buffer.take(0) == ([], False)


def test_a_late_listener_is_first_told_what_host_memory_holds_parents_first():
    kv = KVCacheManager(8, BS)
    tiers = KVTiers(HostStore(8 * ENTRY), None)
    try:
        blocks = chain(kv, list(range(3 * BS)))
        offer(tiers, blocks[::-1])  # LRU order: children before parents
        events, _ = listening(tiers, kv).take(0)
    finally:
        tiers.close()
    assert [e.block_hashes for e in events] == [[wire_hash(h)] for h, _ in blocks]
    index = EventIndex(BS)
    for event in events:
        index.apply(event)
    assert index.match(BlockHasher(BS).extend(list(range(3 * BS))))[0] == 3


# -- a tiered engine -----------------------------------------------------------------------

BLOCK = 16
N = 100  # 6 full blocks
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
HOST_16_BLOCKS = 16 * (2 * 2 * BLOCK * 2 * 16 * 4 + 256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama-tier-events"), "llama", seed=7)


def tiered(path) -> Engine:
    """A 7-block pool: each 100-token request evicts the previous one's blocks."""
    return Engine.from_pretrained(
        path, device="cpu", kv_cache_tokens=7 * BLOCK, host_cache_bytes=HOST_16_BLOCKS
    )


def index_of(events) -> EventIndex:
    index = EventIndex(BLOCK)
    for event in events:
        assert index.apply(event)
    assert index.orphans == 0
    return index


def test_a_block_evicted_from_the_pool_but_kept_in_host_memory_scores_as_a_host_hit(llama):
    with tiered(llama) as eng:
        buffer = eng.kv_events()
        eng.generate(ids(0, N), GREEDY)
        eng.generate(ids(1, N), GREEDY)  # evicts prompt 0's blocks from the pool
        eng.core.offload.flush()
        events, lost = buffer.take(0)
    assert not lost
    assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)
    index = index_of(events)
    keys = BlockHasher(BLOCK).extend(ids(0, N))
    assert [index.media(k) for k in keys] == [HOST] * 6
    assert index.match(keys) == (6, pytest.approx(6 * MEDIUM_WEIGHTS[HOST]))
    assert all(index.media(k) & POOL for k in BlockHasher(BLOCK).extend(ids(1, N))[:1])
    assert not any(index.media(k) & DISK for k in keys)


def test_a_late_consumer_of_a_tiered_engine_learns_the_host_tier(llama):
    with tiered(llama) as eng:
        eng.generate(ids(0, N), GREEDY)
        eng.generate(ids(1, N), GREEDY)
        eng.core.offload.flush()
        events, _ = eng.kv_events().take(0)
    assert isinstance(events[0], AllBlocksCleared)
    keys = BlockHasher(BLOCK).extend(ids(0, N))
    assert index_of(events).match(keys)[0] == 6


def test_a_tiered_engine_without_a_consumer_sets_no_listener(llama):
    with tiered(llama) as eng:
        eng.generate(ids(0, N), GREEDY)
        assert eng.core.offload.tiers.host._listener is None


def test_a_reset_of_the_pool_tells_the_host_tier_again(llama):
    with tiered(llama) as eng:
        buffer = eng.kv_events()
        eng.generate(ids(0, N), GREEDY)
        eng.generate(ids(1, N), GREEDY)
        eng.core.offload.flush()
        assert eng.reset_prefix_cache()
        events, _ = buffer.take(0)
    last_clear = max(i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared))
    index = index_of(events[last_clear:])
    assert index.match(BlockHasher(BLOCK).extend(ids(0, N))) == (
        6,
        pytest.approx(6 * MEDIUM_WEIGHTS[HOST]),
    )


def test_a_snapshot_larger_than_the_bound_still_reaches_the_consumer_whole(llama_dir):
    # The snapshot is one event per cached block; before, a pool caching more blocks than
    # max_events lost the first batch, and with it what a consumer replays from.
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as engine:
        engine.generate(ids(1, 100), SamplingParams(max_tokens=1))  # 6 cached blocks
        events, lost = engine.kv_events(max_events=2).take(timeout_s=1)
    assert not lost
    assert sum(isinstance(e, BlockStored) for e in events) == 6
