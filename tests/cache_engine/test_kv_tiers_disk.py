"""The disk KV tier: verified files that survive restarts, damage and ``kill -9`` (Invariant 7)."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support import TIER_BLOCK_SHAPE, race, same_bits
from support import tier_block as block

from ragkv.cache_engine.kv_tiers import (
    DiskStore,
    HostStore,
    KVTiers,
    StoreNamespace,
    weights_fingerprint,
)
from ragkv.cache_engine.kv_tiers import disk_store as disk_store_module
from ragkv.errors import ConfigError, InvalidInputError

SHAPE = TIER_BLOCK_SHAPE
NS = StoreNamespace("model:tiny", "f" * 32, "float32", 4, "xxh3_128", "LKVBHD:2x2x4x2x8")


def file_size(store: DiskStore, i: int = 0) -> int:
    return store._path(block(i)[0]).stat().st_size


def entry_files(store: DiskStore) -> list:
    return sorted(store.blocks.glob("*.kv"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_disk_round_trip_is_bit_identical_and_survives_a_reopen(tmp_path, dtype):
    ns = dataclasses.replace(NS, dtype=str(dtype).removeprefix("torch."))
    store = DiskStore(tmp_path, 1 << 20, ns)
    h, hash_input, payload = block(1, dtype)
    assert store.put(h, hash_input, payload)
    got = store.get(h, hash_input)
    assert got is not None and same_bits(got, payload)
    reopened = DiskStore(tmp_path, 1 << 20, ns)
    assert reopened.contains(h)
    got = reopened.get(h, hash_input)
    assert got is not None and same_bits(got, payload)
    stats = reopened.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 0, 1)
    assert stats.bytes_used == file_size(reopened, 1) and stats.load_seconds > 0


def test_another_namespace_never_sees_the_entries(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    store.put(*block(0))
    for field, value in (
        ("weights_fingerprint", "0" * 32),
        ("dtype", "float16"),
        ("block_size", 8),
    ):
        other = DiskStore(tmp_path, 1 << 20, _replace(NS, **{field: value}))
        assert not other.contains(block(0)[0]) and other.get(*block(0)[:2]) is None
    assert DiskStore(tmp_path, 1 << 20, NS).contains(block(0)[0])


def _replace(namespace: StoreNamespace, **changes) -> StoreNamespace:
    from dataclasses import replace

    return replace(namespace, **changes)


def test_a_hash_input_mismatch_is_a_counted_miss_and_removes_the_file(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    h, hash_input, payload = block(2)
    store.put(h, hash_input, payload)
    assert store.get(h, b"another salt's input") is None
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.entries, stats.bytes_used) == (1, 1, 0, 0)
    assert entry_files(store) == []


def _damage_every_way(path, size):
    """(name, damage) pairs: flipped bytes in each region of the file, and truncations."""
    for name, offset in (
        ("magic", 0),
        ("header field", 20),
        ("header checksum", 40),
        ("shape", 48),
        ("block hash", 48 + 4 * len(SHAPE)),
        ("hash input", 48 + 4 * len(SHAPE) + 20),
        ("payload start", size - 512),
        ("payload end", size - 1),
    ):
        yield name, lambda data, o=offset: data[:o] + bytes([data[o] ^ 0x01]) + data[o + 1 :]
    yield "truncated payload", lambda data: data[:-1]
    yield "truncated header", lambda data: data[:30]
    yield "empty", lambda data: b""
    yield "appended byte", lambda data: data + b"\0"


def test_any_damaged_byte_or_length_is_detected_counted_and_dropped(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    h, hash_input, payload = block(3)
    store.put(h, hash_input, payload)
    path = store._path(h)
    good = path.read_bytes()
    damages = list(_damage_every_way(path, len(good)))
    for name, damage in damages:
        path.write_bytes(damage(good))
        reopened = DiskStore(tmp_path, 1 << 20, NS)  # the listing still names the file
        assert reopened.contains(h), name
        assert reopened.get(h, hash_input) is None, name
        assert reopened.stats().corrupt == 1 and not path.exists(), name
        path.write_bytes(good)
    final = DiskStore(tmp_path, 1 << 20, NS)
    assert same_bits(final.get(h, hash_input), payload)  # the intact file still serves
    assert len(damages) == 12


def test_a_file_renamed_to_another_blocks_name_is_never_served(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    store.put(*block(4))
    os.replace(store._path(block(4)[0]), store._path(block(5)[0]))
    reopened = DiskStore(tmp_path, 1 << 20, NS)
    assert reopened.contains(block(5)[0])
    assert reopened.get(block(5)[0], block(4)[1]) is None  # its own input, another name
    assert reopened.stats().corrupt == 1


def test_stays_within_capacity_evicting_least_recently_used_also_across_reopen(tmp_path):
    probe = DiskStore(tmp_path / "probe", 1 << 20, NS)
    probe.put(*block(0))
    size = file_size(probe)
    store = DiskStore(tmp_path / "s", 3 * size, NS)
    for i in range(3):
        assert store.put(*block(i))
        time.sleep(0.01)  # distinct modification times
    assert store.get(*block(0)[:2]) is not None  # 0 is now the most recent
    time.sleep(0.01)
    reopened = DiskStore(tmp_path / "s", 3 * size, NS)  # LRU order from the files: 1, 2, 0
    assert reopened.put(*block(3))
    assert [reopened.contains(block(i)[0]) for i in range(4)] == [True, False, True, True]
    stats = reopened.stats()
    assert stats.bytes_used <= 3 * size and stats.evictions == 1
    assert sum(p.stat().st_size for p in entry_files(reopened)) == stats.bytes_used
    smaller = DiskStore(tmp_path / "s", size, NS)  # a smaller bound trims at open
    assert smaller.stats().entries == 1 and smaller.contains(block(3)[0])
    assert len(entry_files(smaller)) == 1


def test_a_block_larger_than_the_capacity_or_a_write_error_is_counted_never_raised(
    tmp_path, monkeypatch
):
    tiny = DiskStore(tmp_path / "tiny", 100, NS)
    assert not tiny.put(*block(0)) and tiny.stats().write_errors == 1
    store = DiskStore(tmp_path / "s", 1 << 20, NS)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store_module, "write_entry", disk_full)
    assert not store.put(*block(1))
    stats = store.stats()
    assert (stats.write_errors, stats.entries, stats.bytes_used) == (1, 0, 0)
    assert list(store.blocks.iterdir()) == []  # the temporary file is gone too
    monkeypatch.undo()
    assert store.put(*block(1)) and store.get(*block(1)[:2]) is not None


def test_a_full_disk_under_kv_tiers_costs_hits_never_an_offer(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20, NS)
    monkeypatch.setattr(
        disk_store_module, "write_entry", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full"))
    )
    tiers = KVTiers(None, store)
    for i in range(3):
        tiers.offer(*block(i), salted=False)
    assert tiers.flush(10)
    assert tiers.lookup([block(0)[0]]) == [] and store.stats().write_errors == 3
    assert tiers.stats()["offers"].write_errors == 0  # handled by the store, not an exception
    tiers.close()


def test_other_namespaces_are_trimmed_to_half_the_capacity_at_open(tmp_path):
    old = DiskStore(tmp_path, 1 << 20, _replace(NS, weights_fingerprint="1" * 32))
    for i in range(3):
        old.put(*block(i))
    size = file_size(old)
    older = DiskStore(tmp_path, 1 << 20, _replace(NS, weights_fingerprint="2" * 32))
    older.put(*block(0))
    older.put(*block(1))
    old.close()  # both engines have exited: nothing holds their namespaces
    older.close()
    os.utime(older.directory / "namespace.json", (1, 1))  # opened long ago
    store = DiskStore(tmp_path, 8 * size, NS)  # others hold 5 blocks: more than half of 8
    assert not older.directory.exists()  # the least recently opened goes first ...
    assert old.contains(block(0)[0]) and old.directory.exists()  # ... and that was enough
    old_bytes = sum(p.stat().st_size for p in old.directory.rglob("*") if p.is_file())
    assert old_bytes <= 4 * size
    for i in range(10):  # the rest of the directory's bound is this namespace's
        store.put(*block(i))
    assert store.stats().bytes_used <= 8 * size - old_bytes
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 8 * size + 1024  # + the two namespace files


def test_a_namespace_an_open_store_holds_is_never_trimmed(tmp_path):
    live = DiskStore(tmp_path, 1 << 20, _replace(NS, weights_fingerprint="1" * 32))
    for i in range(3):
        live.put(*block(i))
    os.utime(live.directory / "namespace.json", (1, 1))  # the least recently opened
    DiskStore(tmp_path, 2 * file_size(live), NS)  # would trim it, were it not open
    assert all((live._path(block(i)[0])).exists() for i in range(3))
    assert live.put(*block(3)) and same_bits(live.get(*block(3)[:2]), block(3)[2])
    live.close()
    DiskStore(tmp_path, 2 * file_size(live), NS)  # closed: now it may go
    assert not live.directory.exists()


def test_a_store_whose_directory_was_removed_under_it_writes_again(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    store.put(*block(0))
    shutil.rmtree(store.directory)
    assert store.put(*block(1)) and store.stats().write_errors == 0
    assert same_bits(store.get(*block(1)[:2]), block(1)[2])
    assert store.get(*block(0)[:2]) is None and store.stats().corrupt == 0  # gone: a miss


def test_a_read_error_is_a_miss_that_keeps_the_entry(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20, NS)
    store.put(*block(0))

    def too_many_files(*args):
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patch:
        patch.setattr(disk_store_module, "read_header", too_many_files)
        assert store.get(*block(0)[:2]) is None
    stats = store.stats()
    assert (stats.misses, stats.corrupt, stats.entries) == (1, 0, 1)
    assert same_bits(store.get(*block(0)[:2]), block(0)[2])


def test_a_write_that_raises_releases_its_room_and_its_temporary_file(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 20, NS)

    def broken(*args):
        raise TypeError("not a payload")

    monkeypatch.setattr(disk_store_module, "write_entry", broken)
    with pytest.raises(TypeError):
        store.put(*block(0))
    assert store._reserved == 0 and not list(store.blocks.iterdir())


def test_no_room_for_a_write_evicts_nothing(tmp_path):
    probe_size = file_size(_one_block_store(tmp_path / "probe"))
    store = DiskStore(tmp_path / "s", 2 * probe_size, NS)
    store.put(*block(0))
    store._reserved = 2 * probe_size - 10  # writes in progress hold almost everything
    assert not store.put(*block(1))
    store._reserved = 0
    assert store.contains(block(0)[0]) and store._path(block(0)[0]).exists()
    assert store.stats().bytes_used == probe_size


def _one_block_store(path) -> DiskStore:
    store = DiskStore(path, 1 << 20, NS)
    store.put(*block(0))
    return store


def test_an_old_temporary_file_is_removed_even_under_this_process_pid(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    fresh = store.blocks / f"{'ab' * 16}.{os.getpid()}.0.tmp"
    stale = store.blocks / f"{'cd' * 16}.{os.getpid()}.1.tmp"
    for path in (fresh, stale):
        path.write_bytes(b"partial")
    old = time.time() - disk_store_module.TMP_STALE_S - 60
    os.utime(stale, (old, old))
    DiskStore(tmp_path, 1 << 20, NS)
    assert fresh.exists() and not stale.exists()


def test_an_entry_the_format_cannot_hold_is_refused_before_writing(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    h, hash_input, payload = block(0)
    with pytest.raises(InvalidInputError):
        store.put(h * 5, hash_input, payload)  # an 80-byte key: a reader would reject it
    assert not list(store.blocks.iterdir())


def test_host_memory_that_changed_never_becomes_a_disk_entry(tmp_path):
    disk = DiskStore(tmp_path, 1 << 20, NS)
    tiers = KVTiers(HostStore(1 << 20), disk)
    tiers.offer(*block(0), salted=False)
    tiers.offer(*block(1), salted=False)
    assert tiers.flush(10)
    tiers.host.peek(block(0)[0]).payload.view(-1)[0] += 1  # a bit flipped in RAM
    tiers.close()  # write-back: host memory goes to disk
    assert not disk.contains(block(0)[0]) and disk.contains(block(1)[0])
    assert tiers.stats()["offers"].corrupt == 1


def test_close_writes_only_the_most_recent_host_entries_that_fit_the_disk(tmp_path):
    size = file_size(_one_block_store(tmp_path / "probe"))
    disk = DiskStore(tmp_path / "s", 3 * size + 100, NS)
    tiers = KVTiers(HostStore(1 << 22), disk)
    for i in range(10):
        tiers.offer(*block(i), salted=False)
    assert tiers.flush(10)
    tiers.close()
    stats = disk.stats()
    assert (stats.puts, stats.evictions) == (3, 0)
    assert all(disk.contains(block(i)[0]) for i in (7, 8, 9))


def test_deleting_or_damaging_the_namespace_file_loses_nothing(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    store.put(*block(0))
    (store.directory / "namespace.json").unlink()
    assert DiskStore(tmp_path, 1 << 20, NS).get(*block(0)[:2]) is not None
    (store.directory / "namespace.json").write_bytes(b"\xff garbage")
    assert DiskStore(tmp_path, 1 << 20, NS).get(*block(0)[:2]) is not None
    assert "weights_fingerprint" in (store.directory / "namespace.json").read_text()


def test_concurrent_puts_and_gets_only_ever_return_exact_payloads(tmp_path):
    store = DiskStore(tmp_path, 8 * (SHAPE_BYTES + 256), NS)
    expected = {i: block(i) for i in range(24)}
    errors: list[int] = []

    def put(offset):
        for _ in range(3):
            for i in range(offset, 24, 2):
                store.put(*expected[i])

    def get():
        for _ in range(30):
            for i in range(0, 24, 3):
                got = store.get(*expected[i][:2])
                if got is not None and not same_bits(got, expected[i][2]):
                    errors.append(i)

    race(put, get, timeout_s=60)
    assert errors == [] and store.stats().corrupt == 0
    assert store.stats().bytes_used <= store.capacity_bytes
    assert sum(p.stat().st_size for p in entry_files(store)) == store.stats().bytes_used


SHAPE_BYTES = 2 * 2 * 4 * 2 * 8 * 4

WRITER = textwrap.dedent(
    """
    import sys, torch
    from ragkv.cache_engine.kv_tiers import DiskStore, StoreNamespace
    ns = StoreNamespace(*sys.argv[2:8])
    store = DiskStore(sys.argv[1], 1 << 34, ns)
    i = 0
    while True:
        payload = torch.full((4, 1 << 16), float(i))  # 1 MiB: a kill lands mid-write
        store.put(i.to_bytes(16, "big"), b"input-%d" % i, payload)
        i += 1
        if i == 8:
            print("ready", flush=True)
    """
)


def test_kill_9_during_writes_leaves_a_store_that_opens_and_serves_only_intact_entries(
    tmp_path,
):
    ns = StoreNamespace("model:kill", "k" * 32, "float32", "4", "xxh3_128", "flat")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), *map(str, (
            ns.model_identity, ns.weights_fingerprint, ns.dtype, ns.block_size, ns.hash_algo,
            ns.layout,
        ))],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    store = DiskStore(tmp_path, 1 << 34, ns)
    assert not list(store.blocks.glob("*.tmp"))  # its cut-short write was cleared at open
    stats = store.stats()
    assert stats.entries >= 8
    intact = 0
    for name in entry_files(store):
        i = int.from_bytes(bytes.fromhex(name.stem), "big")
        got = store.get(i.to_bytes(16, "big"), b"input-%d" % i)
        if got is not None:
            assert torch.equal(got, torch.full((4, 1 << 16), float(i)))
            intact += 1
    assert intact + store.stats().corrupt == stats.entries and intact >= 8


def test_weights_fingerprint_follows_every_byte_of_the_weights(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(bytes(4096))
    (model / "config.json").write_text("{}")
    (model / "README.md").write_text("not weights")
    first = weights_fingerprint(model)
    assert weights_fingerprint(model) == first
    (model / "README.md").write_text("edited")
    assert weights_fingerprint(model) == first
    data = bytearray(weights.read_bytes())
    data[2049] = 1
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(model) != first
    assert weights_fingerprint(weights) != weights_fingerprint(model)


def test_disk_store_checks_its_arguments(tmp_path):
    for capacity in (0, -1, True, 1.5):
        with pytest.raises(ConfigError) as err:
            DiskStore(tmp_path, capacity, NS)
        assert err.value.param == "capacity_bytes"
    with pytest.raises(ConfigError):
        DiskStore(tmp_path, 1024, "namespace")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError) as err:
        DiskStore(not_a_dir, 1024, NS)
    assert err.value.param == "kv_store_dir"
