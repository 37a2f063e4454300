"""The disk tier's file format: one self-describing, self-checking file per block.

::

    header (48 bytes, little-endian)
      magic        8s   b"RAGKVBLK"
      version      u16  FORMAT_VERSION
      dtype        u8   payload.DTYPE_CODES
      ndim         u8   <= MAX_NDIM
      key_len      u32  length of the block hash
      input_len    u32  length of the hash input
      payload_len  u64
      payload_sum  u64  xxh3_64 of the payload bytes
      head_sum     u64  xxh3_64 of everything before the payload except this field
    shape          ndim x u32
    block hash     key_len bytes
    hash input     input_len bytes
    payload        payload_len bytes
    mac            32 bytes: keyed blake3 of everything before it, under the store's secret

Every byte is covered by one of the two checksums, so a flipped bit anywhere, a truncated
file or a file renamed to another block's name is detected on load; the checksums catch
damage, the MAC catches forgery: an entry is accepted only if it was written by a holder of
the store's secret (:mod:`ragkv.cache_engine.kv_tiers.private_files`). A file is written to
a temporary name and renamed into place, so a reader (or a restart after ``kill -9``) sees
a whole file or none.
"""

from __future__ import annotations

import hmac
import os
import struct
from dataclasses import dataclass
from io import BufferedIOBase
from typing import BinaryIO

import torch
import xxhash
from blake3 import blake3

from ragkv.cache_engine.kv_tiers.payload import DTYPE_CODES, DTYPES_BY_CODE, payload_bytes

MAGIC = b"RAGKVBLK"
FORMAT_VERSION = 2  # 2: the MAC trailer
MAC_LEN = 32
MAX_NDIM = 8
MAX_INPUT_LEN = 1 << 24  # a hash input is a few hundred bytes; anything huge is damage
MAX_KEY_LEN = 64
_HEAD = struct.Struct("<8sHBBIIQQQ")


class DamagedEntry(Exception):
    """A block file that is not a whole, intact entry for the block asked for."""


@dataclass(slots=True, frozen=True)
class EntryHeader:
    """The parsed, checked front of a block file (everything but the payload)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    block_hash: bytes
    hash_input: bytes
    payload_len: int
    payload_sum: int
    head: bytes  # the header's bytes as read, which the MAC covers


def storable(block_hash: bytes, hash_input: bytes, payload: torch.Tensor) -> str | None:
    """Why this entry cannot be written in this format (a reader would reject it), or None."""
    if len(block_hash) > MAX_KEY_LEN:
        return f"block hash of {len(block_hash)} bytes (at most {MAX_KEY_LEN})"
    if len(hash_input) > MAX_INPUT_LEN:
        return f"hash input of {len(hash_input)} bytes (at most {MAX_INPUT_LEN})"
    if payload.dim() > MAX_NDIM or any(n >= 1 << 32 for n in payload.shape):
        return f"payload shape {tuple(payload.shape)} (at most {MAX_NDIM} dims < 2**32)"
    return None


def encode_head(block_hash: bytes, hash_input: bytes, payload: torch.Tensor, payload_sum: int):
    """The bytes that precede ``payload`` in its file."""
    shape = tuple(payload.shape)
    rest = struct.pack(f"<{len(shape)}I", *shape) + block_hash + hash_input
    fields = (
        MAGIC,
        FORMAT_VERSION,
        DTYPE_CODES[payload.dtype],
        len(shape),
        len(block_hash),
        len(hash_input),
        payload.nbytes,
        payload_sum,
    )
    head_sum = _head_checksum(_HEAD.pack(*fields, 0), rest)
    return _HEAD.pack(*fields, head_sum) + rest


def entry_size(block_hash: bytes, hash_input: bytes, payload: torch.Tensor) -> int:
    """Bytes the entry's file takes."""
    return len(encode_head(block_hash, hash_input, payload, 0)) + payload.nbytes + MAC_LEN


def write_entry(
    file: BinaryIO, block_hash: bytes, hash_input: bytes, payload: torch.Tensor, key: bytes
) -> int:
    """Write one whole entry for a contiguous CPU ``payload``, authenticated under ``key``
    (32 bytes); returns its size in bytes."""
    data = payload_bytes(payload)
    head = encode_head(block_hash, hash_input, payload, xxhash.xxh3_64_intdigest(data))
    file.write(head)
    file.write(data)
    file.write(_mac(key, head, data))
    return len(head) + payload.nbytes + MAC_LEN


def read_header(file: BinaryIO) -> EntryHeader:
    """Parse and check the header, shape, block hash and hash input; ``DamagedEntry`` if bad."""
    fixed = file.read(_HEAD.size)
    if len(fixed) != _HEAD.size:
        raise DamagedEntry("truncated header")
    magic, version, code, ndim, key_len, input_len, payload_len, payload_sum, head_sum = (
        _HEAD.unpack(fixed)
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise DamagedEntry("not a ragkv block file of this version")
    if (
        code not in DTYPES_BY_CODE
        or ndim > MAX_NDIM
        or key_len > MAX_KEY_LEN
        or input_len > MAX_INPUT_LEN
    ):
        raise DamagedEntry("header fields out of range")
    rest = file.read(4 * ndim + key_len + input_len)
    if len(rest) != 4 * ndim + key_len + input_len:
        raise DamagedEntry("truncated header")
    if _head_checksum(fixed[:-8] + b"\0" * 8, rest) != head_sum:
        raise DamagedEntry("header checksum mismatch")
    shape = struct.unpack_from(f"<{ndim}I", rest)
    dtype = DTYPES_BY_CODE[code]
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != payload_len:
        raise DamagedEntry("payload length does not match its shape")
    key_end = 4 * ndim + key_len
    return EntryHeader(
        dtype,
        shape,
        rest[4 * ndim : key_end],
        rest[key_end:],
        payload_len,
        payload_sum,
        fixed + rest,
    )


def read_payload(file: BufferedIOBase, header: EntryHeader, key: bytes) -> torch.Tensor:
    """Read the payload after :func:`read_header` into a fresh tensor; checksum and MAC
    (under ``key``) verified. Check the header's dtype and shape against what the reader
    expects first: this allocates ``payload_len`` bytes."""
    # The file's size is checked before allocating, so a damaged length cannot ask for more.
    if os.fstat(file.fileno()).st_size - file.tell() != header.payload_len + MAC_LEN:
        raise DamagedEntry("payload length differs from the header's")
    payload = torch.empty(header.shape, dtype=header.dtype)
    data = payload_bytes(payload)
    if file.readinto(data) != header.payload_len:
        raise DamagedEntry("payload length differs from the header's")
    mac = file.read(MAC_LEN + 1)
    if len(mac) != MAC_LEN:
        raise DamagedEntry("payload length differs from the header's")
    if xxhash.xxh3_64_intdigest(data) != header.payload_sum:
        raise DamagedEntry("payload checksum mismatch")
    if not hmac.compare_digest(mac, _mac(key, header.head, data)):
        raise DamagedEntry("not written with this store's secret (MAC mismatch)")
    return payload


def _mac(key: bytes, head: bytes, data: memoryview) -> bytes:
    hasher = blake3(head, key=key)
    hasher.update(data)
    return hasher.digest()


def _head_checksum(fixed_with_zero_sum: bytes, rest: bytes) -> int:
    hasher = xxhash.xxh3_64(fixed_with_zero_sum)
    hasher.update(rest)
    return hasher.intdigest()
