"""KV tiers: the host store and KVTiers' write queue and policies (disk: test_kv_tiers_disk.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from support import TIER_BLOCK_SHAPE, race, same_bits
from support import tier_block as block

from ragkv.cache_engine.kv_tiers import HostStore, KVTiers, TierStats
from ragkv.errors import ConfigError, InvalidInputError

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPE = TIER_BLOCK_SHAPE


def entry_bytes(i: int) -> int:
    _, hash_input, payload = block(i)
    return payload.nbytes + len(hash_input)


class Gate:
    """A ``ready`` object that holds the worker until released (stalls the queue)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def synchronize(self) -> None:
        assert self.event.wait(30)


# -- HostStore ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_round_trip_is_bit_identical_and_a_copy(dtype):
    store = HostStore(1 << 20)
    h, hash_input, payload = block(1, dtype)
    original = payload.clone()
    assert store.put(h, hash_input, payload)
    payload.zero_()  # the caller's tensor is reused: the store kept its own copy
    got = store.get(h, hash_input)
    assert got is not None and same_bits(got, original)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.entries) == (1, 0, 1, 1)
    assert stats.loaded_bytes == stats.stored_bytes == original.nbytes


def test_host_hash_input_mismatch_is_a_counted_miss_and_drops_the_entry():
    store = HostStore(1 << 20)
    h, hash_input, payload = block(1)
    store.put(h, hash_input, payload)
    assert store.get(h, hash_input[:-1] + b"X") is None
    assert not store.contains(h)  # dropped: the next lookup does not find it
    assert store.get(h, hash_input) is None
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.hits, stats.entries, stats.bytes_used) == (
        1,
        2,
        0,
        0,
        0,
    )


def test_host_payload_corrupted_in_memory_is_never_served():
    store = HostStore(1 << 20)
    h, hash_input, payload = block(1)
    store.put(h, hash_input, payload)
    store.peek(h).payload.view(-1)[5] += 1.0  # a bit flip in host memory
    assert store.get(h, hash_input) is None
    assert store.stats().corrupt == 1 and not store.contains(h)


def test_host_stays_within_capacity_and_evicts_least_recently_used():
    capacity = 5 * entry_bytes(0)
    store = HostStore(capacity)
    for i in range(5):
        assert store.put(*block(i))
    store.get(*block(0)[:2])  # 0 is now the most recently used
    for i in range(5, 40):
        assert store.put(*block(i))
        assert store.stats().bytes_used <= capacity
    stats = store.stats()
    assert stats.entries == 5 and stats.evictions == 35
    assert not store.contains(block(0)[0])
    assert [store.contains(block(i)[0]) for i in range(35, 40)] == [True] * 5


def test_host_lru_order_follows_gets():
    store = HostStore(3 * entry_bytes(0))
    for i in range(3):
        store.put(*block(i))
    store.get(*block(0)[:2])
    store.put(*block(3))  # evicts 1, the least recently used
    assert [store.contains(block(i)[0]) for i in range(4)] == [True, False, True, True]


def test_host_refuses_a_block_larger_than_its_capacity():
    store = HostStore(entry_bytes(0) - 1)
    assert store.put(*block(0)) is False
    stats = store.stats()
    assert stats.write_errors == 1 and stats.entries == 0 and stats.bytes_used == 0


def test_host_put_of_a_stored_block_refreshes_without_a_second_copy():
    store = HostStore(1 << 20)
    store.put(*block(0))
    first = store.peek(block(0)[0]).payload
    assert store.put(*block(0))
    assert store.peek(block(0)[0]).payload is first
    assert store.stats().puts == 1


def test_host_discard_and_close_free_the_bytes():
    store = HostStore(1 << 20)
    store.put(*block(0))
    store.put(*block(1))
    store.discard(block(0)[0])
    store.discard(b"absent")
    assert not store.contains(block(0)[0]) and store.stats().bytes_used == entry_bytes(1)
    store.close()
    store.close()
    assert store.stats().entries == 0 and store.stats().bytes_used == 0


def test_host_store_checks_its_arguments():
    with pytest.raises(ConfigError) as err:
        HostStore(-1)
    assert err.value.param == "capacity_bytes"
    with pytest.raises(ConfigError):
        HostStore(1.5)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as err:
            HostStore(1024, pin_memory=True)
        assert err.value.param == "pin_memory"
    store = HostStore(1024)
    with pytest.raises(InvalidInputError):
        store.put(b"h", b"in", [1, 2, 3])
    with pytest.raises(InvalidInputError):
        store.put(b"h", b"in", torch.zeros(2, dtype=torch.complex64))


# -- KVTiers (host tier; a second HostStore named "disk" stands in for disk here) -------------


def fake_disk(capacity: int = 1 << 20) -> HostStore:
    store = HostStore(capacity)
    store.name = "disk"
    return store


def test_offered_blocks_reach_host_and_load_back_verified():
    tiers = KVTiers(HostStore(1 << 20), None)
    for i in range(3):
        tiers.offer(*block(i), salted=False)
    assert tiers.flush(10)
    assert tiers.lookup([block(i)[0] for i in (0, 1, 2)]) == ["host"] * 3
    assert tiers.lookup([block(0)[0], b"absent", block(1)[0]]) == ["host"]  # stops at a gap
    payload, tier = tiers.load(*block(1)[:2])
    assert tier == "host" and same_bits(payload, block(1)[2])
    assert tiers.load(block(1)[0], b"other input") is None  # verified, counted, dropped
    assert tiers.lookup([block(1)[0]]) == []
    stats = tiers.stats()
    assert set(stats) == {"host", "offers"}
    assert stats["host"].corrupt == 1 and stats["offers"].offered == 3
    tiers.close()


def test_write_back_sends_host_evictions_to_the_lower_tier():
    disk = fake_disk()
    tiers = KVTiers(HostStore(2 * entry_bytes(0)), disk, write_policy="write-back")
    for i in range(5):
        tiers.offer(*block(i), salted=False)
    tiers.flush(10)
    assert tiers.lookup([block(i)[0] for i in range(5)]) == ["disk"] * 3 + ["host"] * 2
    payload, tier = tiers.load(*block(0)[:2])
    assert tier == "disk" and same_bits(payload, block(0)[2])
    tiers.flush(10)  # the disk hit is promoted to host
    assert tiers.host.contains(block(0)[0])
    tiers.close()


def test_write_through_admits_a_block_to_the_lower_tier_on_its_second_sighting():
    disk = fake_disk()
    tiers = KVTiers(HostStore(1 << 20), disk, write_policy="write-through", admit_after=2)
    for i in range(3):
        tiers.offer(*block(i), salted=False)
    tiers.offer(*block(0), salted=False)  # seen twice: admitted
    tiers.flush(10)
    assert [disk.contains(block(i)[0]) for i in range(3)] == [True, False, False]
    tiers.load(*block(1)[:2])  # a host hit is a sighting too
    tiers.flush(10)
    assert [disk.contains(block(i)[0]) for i in range(3)] == [True, True, False]
    tiers.close()


def test_write_through_drops_unadmitted_host_evictions():
    disk = fake_disk()
    tiers = KVTiers(HostStore(entry_bytes(0)), disk, write_policy="write-through")
    for i in range(4):
        tiers.offer(*block(i), salted=False)
    tiers.flush(10)
    assert disk.stats().entries == 0 and tiers.stats()["host"].evictions == 3
    tiers.close()


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_salted_blocks_stay_off_the_lower_tier_when_asked(policy):
    disk = fake_disk()
    tiers = KVTiers(
        HostStore(entry_bytes(0)),
        disk,
        write_policy=policy,
        admit_after=1,
        salted_to_disk=False,
    )
    for i in range(4):
        tiers.offer(*block(i), salted=i % 2 == 1)
    tiers.flush(10)
    assert [disk.contains(block(i)[0]) for i in range(4)] == [True, False, True, False]
    tiers.close()


def test_offer_never_blocks_and_drops_when_the_queue_is_full():
    tiers = KVTiers(HostStore(1 << 20), None, max_pending=4)
    gate = Gate()
    tiers.offer(*block(0), salted=False, ready=gate)  # the worker now waits on the gate
    offered = threading.Thread(
        target=lambda: [tiers.offer(*block(i), salted=False) for i in range(1, 20)]
    )
    try:
        offered.start()
        offered.join(10)
        assert not offered.is_alive()  # 19 offers returned while the worker was stalled
        stats = tiers.stats()["offers"]
        assert stats.dropped >= 19 - 4 and stats.offered + stats.dropped == 20
    finally:
        gate.event.set()
    assert tiers.flush(10)
    assert tiers.stats()["host"].entries == tiers.stats()["offers"].offered
    tiers.close()
    tiers.offer(*block(30), salted=False)  # after close: dropped, no error
    assert tiers.stats()["offers"].dropped >= 16


def test_a_failing_offer_is_counted_and_the_worker_goes_on():
    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("copy failed")

    tiers = KVTiers(HostStore(1 << 20), None)
    tiers.offer(*block(0), salted=False, ready=Broken())
    tiers.offer(*block(1), salted=False)
    tiers.flush(10)
    assert tiers.lookup([block(1)[0]]) == ["host"] and tiers.lookup([block(0)[0]]) == []
    assert tiers.stats()["offers"].write_errors == 1
    tiers.close()


def test_concurrent_offers_and_loads_only_ever_return_exact_payloads():
    tiers = KVTiers(HostStore(8 * entry_bytes(0)), fake_disk(16 * entry_bytes(0)), max_pending=8)
    expected = {i: block(i) for i in range(32)}
    errors: list[str] = []

    def offer(offset: int) -> None:
        for _ in range(3):
            for i in range(offset, 32, 2):
                tiers.offer(*expected[i], salted=False)

    def load() -> None:
        for _ in range(200):
            for i in range(0, 32, 3):
                got = tiers.load(*expected[i][:2])
                if got is not None and not same_bits(got[0], expected[i][2]):
                    errors.append(f"block {i} from {got[1]}")

    race(offer, load, timeout_s=30)
    assert tiers.flush(10)
    assert errors == []
    stats = tiers.stats()
    assert stats["host"].bytes_used <= 8 * entry_bytes(0)
    assert stats["disk"].bytes_used <= 16 * entry_bytes(0)
    assert stats["host"].corrupt == stats["disk"].corrupt == 0
    tiers.close()


def test_kv_tiers_checks_its_arguments():
    for kwargs, param in (
        ({"write_policy": "write-around"}, "write_policy"),
        ({"admit_after": 0}, "admit_after"),
        ({"max_pending": 0}, "max_pending"),
        ({"max_pending": True}, "max_pending"),
    ):
        with pytest.raises(ConfigError) as err:
            KVTiers(HostStore(1024), None, **kwargs)
        assert err.value.param == param
    tiers = KVTiers(HostStore(1024), None)
    with pytest.raises(InvalidInputError):
        tiers.offer("not bytes", b"in", torch.zeros(2), salted=False)
    tiers.close()


def test_tier_stats_hit_rate():
    assert TierStats("host").hit_rate == 0.0
    assert TierStats("host", hits=3, misses=1).hit_rate == 0.75
