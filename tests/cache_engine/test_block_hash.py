"""Chained block hashes: the documented formula, incremental = one-shot, domain separation."""

from __future__ import annotations

import struct

import pytest
import xxhash
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.cache_engine import BlockHasher, block_hashes
from ragkv.cache_engine import block_hash as bh
from ragkv.errors import ConfigError, InvalidInputError


def reference_hashes(tokens, block_size, extra=b"", salt_extra=b"", digest=xxhash.xxh3_128_digest):
    parent = digest(b"ragkv/block_hash/root/v1")
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = struct.pack(f"<{block_size}i", *block)
        parent = digest(parent + data + extra + (salt_extra if i == 0 else b""))
        out.append(parent)
    return out


def tagged(kind: bytes, value: bytes) -> bytes:
    return struct.pack("<H", len(kind)) + kind + struct.pack("<I", len(value)) + value


def test_block_hashes_follow_the_documented_chained_formula():
    tokens = list(range(1000, 1037))
    got = block_hashes(tokens, 8, extra=[("model", b"m1")], salt="s")
    salt = blake3(b"ragkv/cache_salt/v1\0s").digest()  # the salt enters as a fixed-size digest
    want = reference_hashes(tokens, 8, tagged(b"model", b"m1"), tagged(b"salt", salt))
    assert got == want
    assert len(got) == 4  # the partial tail is not hashed


def test_blake3_is_opt_in_and_follows_the_same_formula():
    tokens = list(range(40))
    got = block_hashes(tokens, 16, algo="blake3")
    assert got == reference_hashes(tokens, 16, digest=lambda d: blake3(d).digest())
    assert got != block_hashes(tokens, 16)


def test_blake3_hashers_used_in_turn_do_not_share_state():
    tokens = list(range(64))
    a, b = BlockHasher(4, algo="blake3"), BlockHasher(4, algo="blake3", salt="s")
    for start in range(0, 64, 8):
        a.extend(tokens[start : start + 8])
        b.extend(tokens[start : start + 8])
    assert a.hashes == block_hashes(tokens, 4, algo="blake3")
    assert b.hashes == block_hashes(tokens, 4, algo="blake3", salt="s")


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    salt=st.one_of(st.none(), st.text(max_size=3)),
)
def test_incremental_extend_equals_one_shot(tokens, cuts, salt):
    hasher = BlockHasher(4, extra=[("model", b"x")], salt=salt)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    for a, b in zip(bounds, bounds[1:], strict=False):
        hasher.extend(tokens[a:b])
    assert hasher.hashes == block_hashes(tokens, 4, extra=[("model", b"x")], salt=salt)
    assert hasher.num_tokens == len(tokens)
    assert hasher.hashes == [xxhash.xxh3_128_digest(data) for data in hasher.inputs]


def test_numpy_block_split_matches_slicing():
    data = bytes(range(256)) * 2
    assert bh._split(data, 16, 3, b"xy", 32) == [data[o : o + 16] + b"xy" for o in (32, 48, 64)]
    assert bh._split(data, 8, 4) == [data[o : o + 8] for o in (0, 8, 16, 24)]
    assert bh._split(data, 8, 0, b"z") == []


def test_salt_changes_every_block_and_extra_kinds_are_separated():
    tokens = list(range(16))
    plain = block_hashes(tokens, 4)
    salted = block_hashes(tokens, 4, salt="a")
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert block_hashes(tokens, 4, salt="a") == salted
    # Same concatenated bytes, different (kind, value) split: different hashes.
    assert block_hashes(tokens, 4, extra=[("model", b"ab")]) != block_hashes(
        tokens, 4, extra=[("modela", b"b")]
    )
    assert block_hashes(tokens, 4, extra=[("a", b""), ("b", b"")]) != block_hashes(
        tokens, 4, extra=[("a", b"\x01\x00b\x00\x00\x00\x00")]
    )


def test_numpy_and_list_inputs_hash_the_same():
    np = pytest.importorskip("numpy")
    tokens = list(range(64))
    assert block_hashes(np.array(tokens, dtype=np.int64), 16) == block_hashes(tokens, 16)


def test_bad_inputs_raise_ragkv_errors():
    with pytest.raises(InvalidInputError):
        block_hashes([2**31] * 4, 4)
    with pytest.raises(InvalidInputError):
        block_hashes([1] * 4, 4, extra=[("salt", b"x")])
    with pytest.raises(ConfigError):
        block_hashes([1] * 4, 4, algo="md5")
    with pytest.raises(ConfigError):
        BlockHasher(0)


def test_the_salt_enters_the_hash_input_as_a_fixed_size_digest():
    tokens = list(range(8))
    short, long = BlockHasher(4, salt="a"), BlockHasher(4, salt="b" * bh.MAX_SALT_BYTES)
    short.extend(tokens)
    long.extend(tokens)
    assert [len(x) for x in short.inputs] == [len(x) for x in long.inputs]
    assert short.hashes[0] != long.hashes[0]
    assert bh.digest_salt("a") == bh.digest_salt(b"a") != bh.digest_salt("b")


@pytest.mark.parametrize(
    "salt", ["x" * (bh.MAX_SALT_BYTES + 1), "\u00e9" * 129, "lone \ud800", 7, None]
)
def test_bad_salts_are_refused_naming_cache_salt(salt):
    with pytest.raises(InvalidInputError) as info:
        bh.digest_salt(salt)
    assert info.value.param == "cache_salt"


@settings(max_examples=60, deadline=None)
@given(
    shared=st.lists(st.integers(0, 1000), max_size=40),
    rest=st.lists(st.integers(0, 1000), max_size=40),
    salt=st.one_of(st.none(), st.text(max_size=8)),
    algo=st.sampled_from(["xxh3_128", "blake3"]),
)
def test_a_prefix_fork_extended_equals_hashing_from_scratch(shared, rest, salt, algo):
    extra = [("model", "m")]
    first = BlockHasher(4, extra=extra, salt=salt, algo=algo)
    first.extend(shared + [7] * 9)
    fork = first.prefix(len(shared) // 4)
    fork.extend(shared[len(shared) // 4 * 4 :] + rest)
    fresh = BlockHasher(4, extra=extra, salt=salt, algo=algo)
    fresh.extend(shared + rest)
    assert (fork.hashes, fork.inputs, fork.num_tokens) == (
        fresh.hashes,
        fresh.inputs,
        fresh.num_tokens,
    )
    assert first.hashes[: len(shared) // 4] == fork.hashes[: len(shared) // 4]
    with pytest.raises(InvalidInputError):
        first.prefix(len(first.hashes) + 1)
