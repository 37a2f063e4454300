"""Chained block hashes: the identity of a full KV block (Invariant 2).

``hash_i = H(hash_{i-1} ‖ tokens_i as little-endian int32 ‖ extras_i)`` with a fixed root
seed as ``hash_{-1}``. ``extras_i`` are the manager's extra keys (e.g. the model identity),
domain-tagged and length-prefixed; a cache salt is appended to the first block's extras only,
so it changes every hash of the chain. The salt enters as its 32-byte blake3 digest
(:func:`digest_salt`), never raw: the stored hash input of a block is the same size whatever
the salt, and a tenant's salt is not kept in memory.

Python overhead per block is the cost that matters: token ids are packed to bytes in one
call, numpy splits them into per-block records (extras appended) in one more, and the
sequential chain is left with one concatenation and one digest per block.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import xxhash
from blake3 import blake3

from ragkv.errors import ConfigError, InvalidInputError

HashFn = Callable[[bytes], bytes]
ExtraKeys = Sequence[tuple[str, bytes | str]]

_ROOT_LABEL = b"ragkv/block_hash/root/v1"
_SALT_LABEL = b"ragkv/cache_salt/v1\0"
# Keys of blocks holding approximate K/V (chunk reuse) start their hash input with this, so
# no exact block's input (which starts with its parent's digest) can equal one.
APPROXIMATE_LABEL = b"ragkv/block_hash/approximate/v1\0"
# A salt names a tenant or a user; 256 bytes is room for any id or token and keeps hashing
# a salt, done in the caller's thread, trivially cheap.
MAX_SALT_BYTES = 256


def _blake3_digest() -> HashFn:
    """A blake3 ``bytes -> digest`` function that reuses one hasher object.

    For a ~100-byte block input, reset + update is ~35 % cheaper than building a new hasher
    (~2 KB of state) per call. Not thread-safe, so each :class:`BlockHasher` gets its own.
    """
    hasher = blake3()

    def digest(data: bytes) -> bytes:
        hasher.reset()
        hasher.update(data)
        return hasher.digest()

    return digest


# Name -> factory of a fresh digest function (stateless ones are shared as they are).
_ALGOS: dict[str, Callable[[], HashFn]] = {
    "xxh3_128": lambda: xxhash.xxh3_128_digest,
    "blake3": _blake3_digest,
}


def digest_salt(salt: str | bytes) -> bytes:
    """The fixed-size key a ``cache_salt`` adds to the first block's hash input.

    blake3 (a cryptographic hash: salts isolate tenants, so two salts must never be made to
    collide) of the salt's UTF-8 bytes, domain-tagged. Raises
    :class:`~ragkv.errors.InvalidInputError` (``param="cache_salt"``) for a non-string, a
    string with no UTF-8 form (lone surrogates) or one over ``MAX_SALT_BYTES`` bytes.
    """
    if isinstance(salt, str):
        try:
            data = salt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(
                f"cache_salt is not valid Unicode ({exc.reason} at index {exc.start}); "
                "use UTF-8 text without lone surrogates",
                param="cache_salt",
            ) from None
    elif isinstance(salt, bytes | bytearray):
        data = bytes(salt)
    else:
        raise InvalidInputError(
            f"cache_salt must be a string, got {type(salt).__name__}", param="cache_salt"
        )
    if len(data) > MAX_SALT_BYTES:
        raise InvalidInputError(
            f"cache_salt is {len(data)} UTF-8 bytes; the limit is {MAX_SALT_BYTES}. Use a "
            "tenant or user id (or a hash of a longer secret) as the salt",
            param="cache_salt",
        )
    return blake3(_SALT_LABEL + data).digest()


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


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.size and (token_ids.min() < -(2**31) or token_ids.max() >= 2**31):
            raise InvalidInputError("token ids must fit in int32")
        return token_ids.astype("<i4", copy=False).tobytes()
    try:
        # A Struct for the exact count packs a list of Python ints ~2x faster than
        # array('i'), numpy or the module-level struct.pack(fmt, *args).
        return struct.Struct(f"<{len(token_ids)}i").pack(*token_ids)
    except struct.error as exc:
        raise InvalidInputError(f"token ids must be int32 integers: {exc}") from None


def _split(
    data: bytes, block_bytes: int, n: int, suffix: bytes = b"", offset: int = 0
) -> list[bytes]:
    """``n`` blocks of ``data`` from ``offset``, each followed by ``suffix``, as bytes objects.

    One numpy call instead of a Python slice (and concatenation) per block; void items
    come back from ``tolist`` as bytes.
    """
    rows = np.frombuffer(data, np.uint8, n * block_bytes, offset).reshape(n, block_bytes)
    if suffix:
        tail = np.broadcast_to(np.frombuffer(suffix, dtype=np.uint8), (n, len(suffix)))
        rows = np.concatenate([rows, tail], axis=1)
    record = np.dtype((np.void, rows.shape[1]))
    return cast("list[bytes]", np.ascontiguousarray(rows).view(record).ravel().tolist())


def _chained_digests(
    parent: bytes, blocks: list[bytes], one: HashFn
) -> tuple[list[bytes], list[bytes]]:
    """``(hashes, inputs)`` with ``inputs[i] = hashes[i-1] ‖ blocks[i]`` (``parent`` first).

    A plain loop: on CPython 3.11 it is as fast as chaining through C iterators, and the
    chain is inherently sequential. The digest call is most of the per-block cost.
    """
    hashes, inputs = [], []
    for block in blocks:
        data = parent + block
        parent = one(data)
        inputs.append(data)
        hashes.append(parent)
    return hashes, inputs


class BlockHasher:
    """Incremental chained hashes of one token sequence.

    ``extend`` takes the *new* tokens and hashes only blocks that became full; the partial
    tail waits for the next call. ``hashes[i]`` identifies block ``i`` and everything before.
    Pass a cache salt as ``salt`` (digested here) or, already digested by
    :func:`digest_salt` in the caller's thread, as ``salt_digest``. ``parent`` continues a
    chain from a known block's hash (its first block is then not a prompt's first, so it
    takes no salt): what a KV event consumer does with a block stored after its parent.
    """

    __slots__ = (
        "block_size",
        "hashes",
        "num_tokens",
        "_root",
        "_extra",
        "_first_extra",
        "_one",
        "_algo",
        "inputs",
        "_tail",
    )

    def __init__(
        self,
        block_size: int,
        *,
        extra: ExtraKeys | bytes = (),
        salt: str | bytes | None = None,
        salt_digest: bytes | None = None,
        algo: str | HashFn = "xxh3_128",
        parent: bytes | None = None,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        if parent is not None and (salt is not None or salt_digest is not None):
            raise ConfigError("a salt enters a chain's first block; pass it or parent, not both")
        if salt is not None:
            if salt_digest is not None:
                raise ConfigError("pass salt or salt_digest, not both")
            salt_digest = digest_salt(salt)
        self._one = resolve_algo(algo)
        self._algo = algo
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self.num_tokens = 0
        self._extra = extra if isinstance(extra, bytes) else encode_extra_keys(extra)
        self._first_extra = self._extra
        if salt_digest is not None:
            self._first_extra += _encode_key("salt", salt_digest)
        self._root = self._one(_ROOT_LABEL) if parent is None else parent
        self.inputs: list[bytes] = []  # inputs[i]: the exact bytes hashed into hashes[i]
        self._tail: list[int] = []

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Append tokens; return the hashes of the blocks they completed."""
        self.num_tokens += len(token_ids)
        tokens = self._tail + list(token_ids) if self._tail else token_ids
        num_blocks = len(tokens) // self.block_size
        self._tail = list(tokens[num_blocks * self.block_size :])
        if not num_blocks:
            return []
        # The partial tail is packed too (cheaper than copying the list); _split skips it.
        data = tokens_to_bytes(tokens)
        size = self.block_size * 4
        first: tuple[list[bytes], list[bytes]] = ([], [])
        offset = 0
        if not self.hashes and self._first_extra != self._extra:
            first = _chained_digests(self._root, [data[:size] + self._first_extra], self._one)
            offset, num_blocks = size, num_blocks - 1
        parent = (first[0] or self.hashes or [self._root])[-1]
        blocks = _split(data, size, num_blocks, self._extra, offset)
        hashes, inputs = _chained_digests(parent, blocks, self._one)
        self.inputs += first[1] + inputs
        new = first[0] + hashes
        self.hashes += new
        return new

    def prefix(self, num_blocks: int) -> BlockHasher:
        """A new hasher that has hashed this one's first ``num_blocks`` full blocks and nothing
        else: another sequence sharing those blocks extends it from there, and the shared
        blocks are hashed once. It gets its own digest function (a stateful one is never
        shared between threads), unless a custom function was given."""
        if not 0 <= num_blocks <= len(self.hashes):
            raise InvalidInputError(
                f"num_blocks must be in [0, {len(self.hashes)}], got {num_blocks}"
            )
        fork = BlockHasher.__new__(BlockHasher)
        fork._one, fork._algo = resolve_algo(self._algo), self._algo
        fork.block_size, fork._root = self.block_size, self._root
        fork._extra, fork._first_extra = self._extra, self._first_extra
        fork.hashes, fork.inputs = self.hashes[:num_blocks], self.inputs[:num_blocks]
        fork.num_tokens, fork._tail = num_blocks * self.block_size, []
        return fork


def approximate_keys(
    inputs: Sequence[bytes], scope: bytes, one: HashFn
) -> tuple[list[bytes], list[bytes]]:
    """``(hashes, inputs)`` naming blocks of approximate K/V: block ``i`` under ``scope`` (the
    reuse settings that made it), for the exact block input ``inputs[i]`` (its parent's hash,
    its tokens and extras: the whole prefix and the salt). An exact lookup never makes one."""
    keyed = [APPROXIMATE_LABEL + scope + b"\0" + data for data in inputs]
    return [one(data) for data in keyed], keyed


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


def root_hash(algo: str | HashFn = "xxh3_128") -> bytes:
    """The fixed seed every chain starts from: the parent in a prompt's first block's input."""
    return resolve_algo(algo)(_ROOT_LABEL)


def resolve_algo(algo: str | HashFn) -> HashFn:
    """A fresh ``bytes -> digest`` function for an algorithm name, or a custom one as is.

    A named algorithm's function may keep state between calls: give it one owner.
    """
    if callable(algo):
        return algo
    try:
        return _ALGOS[algo]()
    except KeyError:
        raise ConfigError(
            f"unknown block hash algo {algo!r}; use one of {sorted(_ALGOS)}"
        ) from None
