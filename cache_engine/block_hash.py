"""Chained block hashes: the identity of a full KV block (Invariant 2).

``hash_i = H(hash_{i-1} ‖ tokens_i as little-endian int32 ‖ extras_i)`` with a fixed root
seed as ``hash_{-1}``. ``extras_i`` are the manager's extra keys (e.g. the model identity),
domain-tagged and length-prefixed; a cache salt is appended to the first block's extras only,
so it changes every hash of the chain.

Python overhead per block is the cost that matters: token ids are converted to bytes once,
split into blocks by numpy in one call, and the chain itself runs inside C iterators.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import chain, repeat
from operator import add, methodcaller

import numpy as np
import xxhash
from blake3 import blake3

from ragkv.errors import ConfigError, InvalidInputError

HashFn = Callable[[bytes], bytes]
ExtraKeys = Sequence[tuple[str, bytes | str]]

_ROOT_LABEL = b"ragkv/block_hash/root/v1"


def _blake3_many(inputs: Iterable[bytes]) -> Iterator[bytes]:
    return map(methodcaller("digest"), map(blake3, inputs))


_ALGOS: dict[str, tuple[HashFn, Callable[[Iterable[bytes]], Iterator[bytes]]]] = {
    "xxh3_128": (xxhash.xxh3_128_digest, partial(map, xxhash.xxh3_128_digest)),
    "blake3": (lambda data: blake3(data).digest(), _blake3_many),
}


def encode_extra_keys(extra: ExtraKeys) -> bytes:
    """Encode ``(kind, value)`` pairs as ``len(kind) kind len(value) value`` (little-endian).

    Both the kind (the domain tag, e.g. ``"model"``) and the value are length-prefixed, so no
    two different key lists encode to the same bytes. ``"salt"`` is reserved for ``salt=``.
    """
    for kind, _ in extra:
        if kind == "salt":
            raise InvalidInputError("extra key kind 'salt' is reserved; pass salt=... instead")
    return b"".join(_encode_key(kind, value) for kind, value in extra)


def _encode_key(kind: str, value: bytes | str) -> bytes:
    tag = kind.encode()
    data = value.encode() if isinstance(value, str) else bytes(value)
    return struct.pack("<H", len(tag)) + tag + struct.pack("<I", len(data)) + data


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Token ids as little-endian int32 bytes (bytes input is taken as already encoded)."""
    if isinstance(token_ids, bytes | bytearray | memoryview):
        return bytes(token_ids)
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < -(2**31) or token_ids.max() >= 2**31):
            raise InvalidInputError("token ids must fit in int32")
        return token_ids.astype("<i4", copy=False).tobytes()
    try:
        # struct.pack is ~2x faster than array('i')/numpy for a list of Python ints.
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise InvalidInputError(f"token ids must be int32 integers: {exc}") from None


def _split(data: bytes, block_bytes: int) -> list[bytes]:
    n = len(data) // block_bytes
    # One numpy call instead of a Python slice per block; void items come back as bytes.
    return np.frombuffer(data, dtype=np.dtype((np.void, block_bytes)), count=n).tolist()


def _chained_digests(parent: bytes, blocks: list[bytes], extra: bytes, many) -> list[bytes]:
    """Chained digests of ``blocks`` starting from ``parent``, without a Python loop.

    ``out`` feeds itself: ``map(add, out, blocks)`` reads ``out[i]`` right after
    ``list.extend`` appended it, so each input is ``hash_{i-1} ‖ block_i ‖ extra``.
    CPython's list.extend grows the list one item at a time; should an interpreter
    not, the length check falls back to the plain loop.
    """
    out = [parent]
    inputs = map(add, out, blocks)
    if extra:
        inputs = map(add, inputs, repeat(extra))
    out.extend(many(inputs))
    if len(out) == len(blocks) + 1:
        del out[0]
        return out
    return _chained_digests_loop(parent, blocks, extra, many)


def _chained_digests_loop(parent: bytes, blocks: list[bytes], extra: bytes, many) -> list[bytes]:
    out = []
    for block in blocks:
        (parent,) = many((parent + block + extra,))
        out.append(parent)
    return out


class BlockHasher:
    """Incremental chained hashes of one token sequence.

    ``extend`` takes the *new* tokens and hashes only blocks that became full; the partial
    tail waits for the next call. ``hashes[i]`` identifies block ``i`` and everything before.
    """

    __slots__ = (
        "block_size",
        "hashes",
        "num_tokens",
        "_root",
        "_extra",
        "_first_extra",
        "_one",
        "_many",
        "_blocks",
        "_tail",
    )

    def __init__(
        self,
        block_size: int,
        *,
        extra: ExtraKeys | bytes = (),
        salt: str | bytes | None = None,
        algo: str | HashFn = "xxh3_128",
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self._one, self._many = resolve_algo(algo)
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self.num_tokens = 0
        self._extra = extra if isinstance(extra, bytes) else encode_extra_keys(extra)
        self._first_extra = self._extra
        if salt is not None:
            self._first_extra += _encode_key("salt", salt)
        self._root = self._one(_ROOT_LABEL)
        self._blocks: list[bytes] = []  # token bytes of every full block hashed so far
        self._tail: list[int] = []

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Append tokens; return the hashes of the blocks they completed."""
        self.num_tokens += len(token_ids)
        tokens = self._tail + list(token_ids) if self._tail else token_ids
        num_full = len(tokens) // self.block_size * self.block_size
        self._tail = list(tokens[num_full:])
        if not num_full:
            return []
        blocks = _split(tokens_to_bytes(tokens[:num_full]), self.block_size * 4)
        self._blocks += blocks
        new = []
        if not self.hashes and self._first_extra != self._extra:
            new = _chained_digests(self._root, blocks[:1], self._first_extra, self._many)
            blocks = blocks[1:]
        parent = new[-1] if new else (self.hashes[-1] if self.hashes else self._root)
        new += _chained_digests(parent, blocks, self._extra, self._many)
        self.hashes += new
        return new

    def hash_input(self, i: int) -> bytes:
        """The exact bytes hashed for block ``i`` (stored with a cached block to verify hits)."""
        if i == 0:
            return self._root + self._blocks[0] + self._first_extra
        return self.hashes[i - 1] + self._blocks[i] + self._extra

    def hash_inputs(self, n: int) -> Iterator[bytes]:
        """``hash_input(i)`` for ``i < n``, built inside C iterators."""
        if n == 0:
            return iter(())
        rest = map(add, self.hashes[: n - 1], self._blocks[1:n])
        if self._extra:
            rest = map(add, rest, repeat(self._extra))
        return chain((self.hash_input(0),), rest)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra: ExtraKeys = (),
    salt: str | bytes | None = None,
    algo: str | HashFn = "xxh3_128",
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids`` (the partial tail is ignored)."""
    return BlockHasher(block_size, extra=extra, salt=salt, algo=algo).extend(token_ids)


def resolve_algo(algo: str | HashFn) -> tuple[HashFn, Callable[[Iterable[bytes]], Iterator[bytes]]]:
    """``(digest_one, digest_many)`` for an algorithm name or a custom ``bytes -> bytes``."""
    if callable(algo):
        return algo, partial(map, algo)
    try:
        return _ALGOS[algo]
    except KeyError:
        raise ConfigError(
            f"unknown block hash algo {algo!r}; use one of {sorted(_ALGOS)}"
        ) from None
