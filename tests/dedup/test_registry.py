"""ChunkRegistry: LRU bound by bytes, tokenize once, stats, thread safety."""

import gc
import random
import threading
import tracemalloc

import pytest

from ragkv.dedup import Chunk, ChunkRegistry, content_hash
from ragkv.errors import ConfigError, InvalidInputError


def _tokenize(calls: list[str]):
    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    return tokenize


def test_each_chunk_is_tokenized_once_per_tokenizer():
    reg, calls = ChunkRegistry(), []
    tok = _tokenize(calls)
    a1, a2 = Chunk("hello"), Chunk(b"hello")
    assert reg.token_ids(a1, "t1", tok) == (104, 101, 108, 108, 111)
    assert reg.token_ids(a2, "t1", tok) == (104, 101, 108, 108, 111)
    assert calls == ["hello"]
    reg.token_ids(a1, "t2", tok)
    assert calls == ["hello", "hello"]


def test_key_is_the_content_hash_under_the_registry_algorithm():
    assert ChunkRegistry().key(Chunk("x")) == content_hash(b"x")
    assert ChunkRegistry(hash="xxh3_128").key(Chunk("x")) == content_hash(b"x", "xxh3_128")


def test_observe_counts_requests_and_recency():
    reg = ChunkRegistry()
    a, b = Chunk("a"), Chunk("bb")
    assert reg.observe([a, b, a]) == 0
    assert reg.observe([reg.key(a)]) == 1
    s = reg.stats(reg.key(a))
    assert (s.count, s.first_seen, s.last_seen, s.num_bytes) == (2, 0, 1, 1)
    assert reg.stats(reg.key(b)).count == 1
    assert reg.stats(b"unknown") is None
    with pytest.raises(InvalidInputError):
        reg.observe(["not a key"])


def test_least_recently_used_entry_is_evicted_with_its_stats():
    a, b, c, d = (Chunk(ch * 100) for ch in "abcd")
    probe = ChunkRegistry()
    probe.observe([Chunk("z" * 100)])
    reg = ChunkRegistry(max_bytes=3 * probe.total_bytes)  # room for three observed chunks
    reg.observe([a])
    reg.observe([b])
    reg.observe([c])
    reg.observe([a])  # a is now more recent than b
    reg.observe([d])
    assert [x in reg for x in map(reg.key, (a, b, c, d))] == [True, False, True, True]
    assert reg.stats(reg.key(b)) is None
    assert reg.total_bytes <= reg.max_bytes


def test_total_bytes_never_exceed_the_bound():
    reg = ChunkRegistry(max_bytes=2_000)
    tok = _tokenize([])
    chunks = [Chunk(f"{i:03d}" * 40) for i in range(10)]  # 120 bytes + 960 token bytes
    for c in chunks:
        reg.token_ids(c, "t", tok)
        reg.observe([c])
        assert reg.total_bytes <= 2_000
    assert 1 <= len(reg) < len(chunks)


def test_an_entry_larger_than_the_bound_is_returned_but_not_kept():
    reg = ChunkRegistry(max_bytes=100)
    ids = reg.token_ids(Chunk("x" * 500), "t", lambda s: [1] * len(s))
    assert len(ids) == 500
    assert len(reg) == 0 and reg.total_bytes == 0


def test_clear_forgets_entries():
    reg = ChunkRegistry()
    reg.observe([Chunk("a")])
    reg.clear()
    assert len(reg) == 0 and reg.total_bytes == 0


@pytest.mark.parametrize("kwargs", [{"max_bytes": 0}, {"max_bytes": 1.5}, {"hash": "sha1"}])
def test_bad_configuration_raises(kwargs):
    with pytest.raises(ConfigError):
        ChunkRegistry(**kwargs)


def test_tokenizer_returning_non_ints_is_reported():
    with pytest.raises(InvalidInputError, match="sequence of ints"):
        ChunkRegistry().token_ids(Chunk("a"), "t", lambda s: ["x"])


def test_failed_tokenization_does_not_block_later_calls():
    reg = ChunkRegistry()

    def boom(text: str) -> list[int]:
        raise RuntimeError("tokenizer down")

    with pytest.raises(RuntimeError):
        reg.token_ids(Chunk("a"), "t", boom)
    assert reg.token_ids(Chunk("a"), "t", lambda s: [1]) == (1,)


def test_threads_hammering_the_registry_keep_it_consistent():
    reg = ChunkRegistry(max_bytes=40_000)
    calls: list[str] = []
    lock = threading.Lock()
    gate = threading.Event()

    def tokenize(text: str) -> list[int]:
        with lock:
            calls.append(text)
        return [len(text)] * 8

    chunks = [Chunk(f"chunk-{i}" * 5) for i in range(50)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        gate.wait()
        try:
            for step in range(300):
                c = chunks[(seed * 7 + step) % len(chunks)]
                assert reg.token_ids(c, "t", tokenize) == (len(c.text),) * 8
                reg.observe([c, chunks[step % 3]])
                reg.stats(reg.key(c))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert not errors
    assert reg.num_requests == 8 * 300
    assert len(calls) == len(chunks)  # the bound is large enough: never tokenized twice
    assert reg.total_bytes <= 40_000
    expected = sum(
        e.cost
        for e in reg._entries.values()  # noqa: SLF001 - accounting invariant
    )
    assert reg.total_bytes == expected
    hot = reg.stats(reg.key(chunks[0]))
    assert hot is not None and hot.last_seen < reg.num_requests


def test_concurrent_misses_on_one_chunk_tokenize_once():
    reg = ChunkRegistry()
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow(text: str) -> list[int]:
        calls.append(text)
        started.set()
        release.wait(5)
        return [1, 2]

    results = []
    first = threading.Thread(target=lambda: results.append(reg.token_ids(Chunk("z"), "t", slow)))
    first.start()
    started.wait(5)
    others = [
        threading.Thread(target=lambda: results.append(reg.token_ids(Chunk("z"), "t", slow)))
        for _ in range(4)
    ]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join()
    assert calls == ["z"]
    assert results == [(1, 2)] * 5


def test_total_bytes_is_the_memory_the_registry_really_holds():
    rng = random.Random(0)
    reg = ChunkRegistry(max_bytes=2**40)

    def tokenize(text: str) -> list[int]:  # fresh int objects, as a real tokenizer returns
        return [rng.randrange(0, 50_000) for _ in range(len(text) // 4)]

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3_000):
            chunk = Chunk(f"chunk number {i} " + "x" * rng.randrange(50, 400))
            reg.token_ids(chunk, "tok", tokenize)
            reg.observe([chunk])
            reg.token_ids(chunk, "tok", tokenize)  # a hit allocates nothing that stays
        del chunk
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 * held <= reg.total_bytes <= 1.2 * held


def test_token_ids_are_stored_compactly_and_returned_as_a_tuple():
    reg = ChunkRegistry()
    ids = reg.token_ids(Chunk("abc"), "t", lambda s: [70_000, 1, 2**31 - 1])
    assert ids == (70_000, 1, 2**31 - 1) and isinstance(ids, tuple)
    with pytest.raises(InvalidInputError, match="int32"):
        reg.token_ids(Chunk("big"), "t", lambda s: [2**31])
