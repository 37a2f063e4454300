"""Metadata merging: what a surviving chunk remembers of the chunks folded into it."""

from __future__ import annotations

from typing import Any

from ragkv.dedup.chunk import Chunk
from ragkv.errors import InvalidInputError

SOURCES = "ragkv_sources"  # every distinct source id folded into the survivor, in order
DUPLICATES = "ragkv_duplicates"  # how many other input chunks the survivor absorbed


def set_merged(target: Chunk, members: list[Any]) -> None:
    """Fold ``members`` (the first is ``target``'s origin) into ``target``'s metadata and score."""
    sources: dict[str, None] = {}
    absorbed = len(members) - 1
    score = target.score
    for member in members:
        if type(member) is not Chunk and not isinstance(member, Chunk):
            continue
        if member.source_id is not None:
            sources[member.source_id] = None
        meta = member.metadata
        for src in _meta_list(meta, SOURCES):
            sources[src] = None
        absorbed += _meta_int(meta, DUPLICATES)
        if member.score is not None and (score is None or member.score > score):
            score = member.score
    target.score = score
    target.metadata[SOURCES] = tuple(sources)
    target.metadata[DUPLICATES] = absorbed


def _meta_list(meta: dict[str, Any], name: str) -> tuple[str, ...]:
    value = meta.get(name, ())
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise InvalidInputError(f"metadata[{name!r}] must be a tuple/list of str, got {value!r}")
    return tuple(value)


def _meta_int(meta: dict[str, Any], name: str) -> int:
    value = meta.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"metadata[{name!r}] must be a non-negative int, got {value!r}")
    return value
