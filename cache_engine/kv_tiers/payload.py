"""A block's K/V payload as opaque bytes: dtype codes, byte views and the checksum.

Stores never interpret a payload: they keep its bytes, dtype and shape, and check its xxh3_64
on every load. bfloat16 has no numpy dtype, so bytes are always taken through a ``uint8``
view of the (contiguous, CPU) tensor, which costs no copy.
"""

from __future__ import annotations

import torch
import xxhash

from ragkv.errors import InvalidInputError

# Stable on-disk codes; append only (a code's meaning never changes).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


def payload_bytes(payload: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a view sharing its memory."""
    return payload.reshape(-1).view(torch.uint8).numpy().data


def checksum(payload: torch.Tensor) -> int:
    """xxh3_64 of the payload's bytes (tens of GB/s: negligible next to a copy)."""
    return xxhash.xxh3_64_intdigest(payload_bytes(payload))


def cpu_copy(payload: torch.Tensor, *, pin_memory: bool = False) -> torch.Tensor:
    """A contiguous CPU copy of ``payload`` that shares no memory with it."""
    out = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=pin_memory)
    out.copy_(payload)
    return out


def check_payload(payload: object) -> torch.Tensor:
    """``payload`` if it is a tensor of a storable dtype, else ``InvalidInputError``."""
    if not isinstance(payload, torch.Tensor):
        raise InvalidInputError(
            f"payload must be a torch.Tensor, got {type(payload).__name__}", param="payload"
        )
    if payload.dtype not in DTYPE_CODES:
        raise InvalidInputError(
            f"payload dtype {payload.dtype} cannot be stored in a KV tier; use one of "
            f"{', '.join(str(d) for d in DTYPE_CODES)}",
            param="payload",
        )
    return payload
