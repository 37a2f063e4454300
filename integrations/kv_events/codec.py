"""vLLM's KV event batches as msgpack bytes, both ways.

A batch is ``[ts, events, data_parallel_rank]`` (older vLLM: ``[ts, events]``). An event is
a map with a ``"type"`` (vLLM 0.11 on) or, from older vLLM, a positional array whose first
item is the type. Fields are read by name, or by position in vLLM's field order; fields this
module does not know are ignored, and so are events of an unknown type, so a newer vLLM
still decodes. Missing required fields (a block's hashes, tokens, block size) are an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple
from typing import Any

from ragkv.cache_engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from ragkv.errors import InvalidInputError
from ragkv.integrations._extras import require

# vLLM's field order (the positional form), and the fields an event cannot do without.
_FIELDS: dict[str, tuple[type, tuple[str, ...], tuple[str, ...]]] = {
    "BlockStored": (
        BlockStored,
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ),
        ("block_hashes", "token_ids", "block_size"),
    ),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium", "group_idx"), ("block_hashes",)),
    "AllBlocksCleared": (AllBlocksCleared, (), ()),
}
FORMS = ("map", "array")


def _msgpack() -> Any:
    return require("msgpack", "msgpack", "events")


def encode_batch(batch: KVEventBatch, *, form: str = "map") -> bytes:
    """``batch`` as a msgpack payload: events as maps (vLLM 0.11 on) or, with
    ``form="array"``, as positional arrays led by their type (older vLLM)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    events = [_encode_event(e, form) for e in batch.events]
    return _msgpack().packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def _encode_event(event: KVEvent, form: str) -> Any:
    name = type(event).__name__
    if form == "array":
        return [name, *astuple(event)]
    return {"type": name, **{f: getattr(event, f) for f in _FIELDS[name][1]}}


def decode_batch(payload: bytes) -> KVEventBatch:
    """A msgpack payload as a :class:`KVEventBatch`; events of an unknown type are left
    out. Raises :class:`~ragkv.errors.InvalidInputError` for a payload that is not a batch."""
    msgpack = _msgpack()
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise InvalidInputError(f"KV event payload is not msgpack: {exc}") from None
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list | tuple) or len(obj) < 2 or not isinstance(obj[1], list | tuple):
        raise InvalidInputError("KV event payload is not [ts, events, ...]")
    ts = obj[0] if isinstance(obj[0], int | float) else 0.0
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    events = [e for e in map(decode_event, obj[1]) if e is not None]
    return KVEventBatch(float(ts), events, rank)


def decode_event(obj: Any) -> KVEvent | None:
    """One event (map or positional array); None for a type this module does not know."""
    if isinstance(obj, dict):
        name = obj.get("type")
        fields = obj
    elif isinstance(obj, list | tuple) and obj:
        name = obj[0]
        spec = _FIELDS.get(name) if isinstance(name, str) else None
        fields = dict(zip(spec[1], obj[1:], strict=False)) if spec else {}
    else:
        raise InvalidInputError(f"KV event is neither a map nor an array: {obj!r:.80}")
    spec = _FIELDS.get(name) if isinstance(name, str) else None
    if spec is None:
        return None
    cls, names, required = spec
    missing = [f for f in required if fields.get(f) is None]
    if missing:
        raise InvalidInputError(f"KV event {name} lacks {', '.join(missing)}")
    values = {f: fields[f] for f in names if f in fields}
    if cls is BlockStored:
        values.setdefault("parent_block_hash", None)  # absent: a prompt's first block
    event = cls(**values)
    _check(event)
    return event


def _check(event: KVEvent) -> None:
    if isinstance(event, BlockStored):
        size = event.block_size
        if not isinstance(size, int) or size < 1:
            raise InvalidInputError(f"BlockStored block_size must be a positive int: {size!r}")
        _check_list(event.block_hashes, "block_hashes")
        _check_list(event.token_ids, "token_ids")
        if len(event.token_ids) != size * len(event.block_hashes):
            raise InvalidInputError(
                f"BlockStored has {len(event.token_ids)} token ids for "
                f"{len(event.block_hashes)} blocks of {size}"
            )
        if event.extra_keys is not None:
            _check_list(event.extra_keys, "extra_keys")
    elif isinstance(event, BlockRemoved):
        _check_list(event.block_hashes, "block_hashes")


def _check_list(value: Any, name: str) -> None:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise InvalidInputError(f"KV event field {name} must be a list, got {value!r:.80}")


__all__ = ["FORMS", "decode_batch", "decode_event", "encode_batch"]
