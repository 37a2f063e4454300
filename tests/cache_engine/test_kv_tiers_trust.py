"""The disk tier is a trust boundary: private files, authenticated entries, nothing followed."""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch
from support import TIER_BLOCK_SHAPE
from support import tier_block as block

from ragkv.cache_engine.kv_tiers import DiskStore, StoreNamespace
from ragkv.cache_engine.kv_tiers.entry_file import encode_head, write_entry
from ragkv.errors import ConfigError

NS = StoreNamespace("model:tiny", "f" * 32, "float32", 4, "xxh3_128", "LKVBHD:2x2x4x2x8")


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_store_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = DiskStore(tmp_path / "store", 1 << 20, NS)
        assert store.put(*block(1))
    finally:
        os.umask(old)
    root = tmp_path / "store"
    assert _mode(root) == 0o700
    assert _mode(store.directory) == 0o700 and _mode(store.blocks) == 0o700
    files = [root / "secret", store.directory / "namespace.json", store.directory / "lock"]
    files += list(store.blocks.iterdir())
    assert len(files) == 4 and all(_mode(f) == 0o600 for f in files), [oct(_mode(f)) for f in files]


def test_a_root_others_could_change_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        DiskStore(shared, 1 << 20, NS)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir()
    with pytest.raises(ConfigError, match="symbolic link"):
        DiskStore(link, 1 << 20, NS)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another uid")
def test_a_root_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match="belongs to uid 12345"):
        DiskStore(theirs, 1 << 20, NS)


def test_an_entry_with_valid_checksums_but_no_secret_is_refused(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    h, hash_input, payload = block(2)
    assert store.put(h, hash_input, payload)
    # A forger who can write the directory but not read the secret: checksums are public.
    forged = torch.zeros(TIER_BLOCK_SHAPE)
    with open(store._path(h), "wb") as file:
        write_entry(file, h, hash_input, forged, key=b"\0" * 32)
    assert store.get(h, hash_input) is None
    assert store.stats().corrupt == 1 and not store._path(h).exists()


def test_entries_of_another_store_are_not_accepted(tmp_path):
    a, b = DiskStore(tmp_path / "a", 1 << 20, NS), DiskStore(tmp_path / "b", 1 << 20, NS)
    h, hash_input, payload = block(3)
    assert a.put(h, hash_input, payload)
    os.replace(a._path(h), b._path(h))  # copied into another deployment's store
    reopened = DiskStore(tmp_path / "b", 1 << 20, NS)
    assert reopened.contains(h) and reopened.get(h, hash_input) is None


def test_a_link_planted_in_the_store_is_never_followed(tmp_path):
    store = DiskStore(tmp_path / "s", 1 << 20, NS)
    h, hash_input, payload = block(4)
    assert store.put(h, hash_input, payload)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.replace(store._path(h), tmp_path / "moved.kv")
    os.symlink(tmp_path / "moved.kv", store._path(h))  # a valid entry, but behind a link
    assert store.get(h, hash_input) is None
    h2, input2, payload2 = block(5)
    for n in range(64):  # whatever name the next write picks is a planted link
        os.symlink(victim, store.blocks / f"{h2.hex()}.{os.getpid()}.{n}.tmp")
    assert not store.put(h2, input2, payload2)  # refused, never written through
    assert victim.read_text() == "keep me"


def test_a_fifo_in_the_store_cannot_hang_a_load(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    h, hash_input, payload = block(6)
    assert store.put(h, hash_input, payload)
    os.unlink(store._path(h))
    os.mkfifo(store._path(h))
    result = []
    worker = threading.Thread(target=lambda: result.append(store.get(h, hash_input)))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and result == [None]


def test_an_entry_of_another_layout_is_refused_before_allocating(tmp_path, monkeypatch):
    from ragkv.cache_engine.kv_tiers import disk_store

    def never(*args, **kwargs):
        raise AssertionError("the payload was read: the header alone should have refused it")

    monkeypatch.setattr(disk_store, "read_payload", never)  # proves nothing is allocated
    store = DiskStore(tmp_path, 1 << 20, NS)
    h, hash_input, payload = block(7)
    assert store.put(h, hash_input, payload)
    with open(store._path(h), "wb") as file:  # the store's own key, another shape
        write_entry(file, h, hash_input, torch.zeros(3), key=store._key)
    assert store.get(h, hash_input) is None
    assert store.put(h, hash_input, payload)
    # A header claiming 3 GiB over a sparse file: refused from the header alone.
    claimed = torch.empty((3 << 28,), dtype=torch.float32, device="meta")
    head = encode_head(h, hash_input, claimed, 0)
    with open(store._path(h), "wb") as file:
        file.write(head)
    os.truncate(store._path(h), len(head) + claimed.nbytes + 32)
    assert store.get(h, hash_input) is None


def test_only_names_the_store_makes_are_ever_removed(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, NS)
    notes = store.blocks / "notes.tmp"
    notes.write_text("mine")
    stale = store.blocks / "ab.999999.1.tmp"  # a dead writer's temporary file
    stale.write_text("")
    os.utime(stale, (0, 0))
    (tmp_path / "ns-not-a-digest").mkdir()
    DiskStore(tmp_path, 1 << 20, NS)
    assert notes.exists() and not stale.exists() and (tmp_path / "ns-not-a-digest").exists()
