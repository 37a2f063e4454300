"""Deduplicator: collapse byte-identical retrieved chunks, keep the first, merge metadata."""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.dedup.chunk import Chunk, encode_text, make_chunk
from ragkv.dedup.hashing import hasher
from ragkv.dedup.merge import DUPLICATES, SOURCES, set_merged
from ragkv.dedup.normalize import normalizer
from ragkv.dedup.result import DedupResult, DedupStats
from ragkv.dedup.spans import SpanFolder
from ragkv.errors import ConfigError, InvalidInputError

KeyFunction = Callable[[Chunk], Hashable]


@dataclass(slots=True)
class _Collapsed:
    """The outcome of the one hash pass over the input."""

    survivor_of: list[int | None]  # input position -> survivor index (None: empty, dropped)
    kept: list[int]  # survivor index -> input position of its first occurrence
    # survivor index -> its dedup key: the digest (bytes), or (digest, extra) with a key function
    keys: list[Any]
    rich: bool  # Chunk objects exist: metadata must be merged, not counted
    counts: list[int] | None = None  # survivor index -> inputs folded into it, if counted


class Deduplicator:
    """Removes retrieved chunks whose bytes already appeared, before a prompt is built.

    Args:
        hash: ``"blake3"`` (default, collision resistant) or ``"xxh3_128"`` (faster).
        normalize: ``None`` (default: byte-exact), ``"nfc"`` or ``"whitespace"``; only the
            hash input is canonicalized, survivors keep their original bytes.
        key: what besides content must match for two chunks to be duplicates. ``None``
            (default): content only. A metadata field name or a sequence of names
            (``"source_id"`` means :attr:`Chunk.source_id`, anything else a metadata key,
            missing = None), or a callable ``Chunk -> hashable``. Content is always part of
            the key: dedup never removes chunks whose bytes differ.
        drop_contained: also drop a chunk whose bytes occur inside a longer retrieved chunk
            (same key group). Opt-in: it costs several times the plain hash pass.
        merge_overlaps: join chunks of the same ``source_id`` whose suffix/prefix overlap
            by at least ``min_overlap`` bytes into one span (sliding-window chunkers).
        min_overlap: minimum shared bytes for ``merge_overlaps``.
    """

    def __init__(
        self,
        hash: str = "blake3",
        normalize: str | None = None,
        key: str | Sequence[str] | KeyFunction | None = None,
        drop_contained: bool = False,
        merge_overlaps: bool = False,
        min_overlap: int = 64,
    ) -> None:
        if isinstance(min_overlap, bool) or not isinstance(min_overlap, int) or min_overlap < 1:
            raise ConfigError(f"min_overlap must be a positive int, got {min_overlap!r}")
        self.hash = hash
        self.normalize = normalize
        self.key = key
        self.drop_contained = bool(drop_contained)
        self.merge_overlaps = bool(merge_overlaps)
        self.min_overlap = min_overlap
        self._digest = hasher(hash)
        self._canonical = normalizer(normalize)
        self._extra = _key_function(key)

    def dedupe(self, chunks: Iterable[str | bytes | Chunk]) -> DedupResult:
        """Unique chunks in first-occurrence order, the input -> survivor map, and stats.

        Empty chunks are dropped and counted. Raises :class:`InvalidChunkError` for an
        item that is not ``str``/``bytes``/:class:`Chunk` and :class:`InvalidInputError`
        when ``chunks`` is not an iterable of chunks.
        """
        items = _as_list(chunks)
        stats = DedupStats(chunks_in=len(items))
        # No gc.disable() around this: pausing the collector would pause it for the
        # caller's other threads too; a library leaves interpreter state alone.
        return self._dedupe(items, stats)

    def _dedupe(self, items: list[Any], stats: DedupStats) -> DedupResult:
        found = self._collapse(items, stats)
        survivor_of, kept, keys = found.survivor_of, found.kept, found.keys
        extras = [None] * len(keys) if self._extra is None else [k[1] for k in keys]
        digests: list[bytes] | None = keys
        if self._canonical is not None:
            digests = None  # canonical digests are not the chunks' content hashes
        elif self._extra is not None:
            digests = [k[0] for k in keys]
        survivors = _survivors(items, found, digests, self.hash)
        if (self.drop_contained or self.merge_overlaps) and len(survivors) > 1:
            folder = SpanFolder(survivors, kept, extras, stats)
            if self.drop_contained:
                folder.drop_contained()
            if self.merge_overlaps and folder.merge_overlaps(self.min_overlap):
                folder.drop_duplicates()  # a merged span may equal a chunk already kept
                if self.drop_contained:
                    folder.drop_contained()  # ... or contain one that straddles its seam
            survivors, kept, survivor_of = folder.finish(survivor_of)
            stats.bytes_out = sum(len(c.data) for c in survivors)
        stats.chunks_out = len(survivors)
        return DedupResult(survivors, survivor_of, kept, stats)

    def _collapse(self, items: list[Any], stats: DedupStats) -> _Collapsed:
        if self._canonical is None and self._extra is None and items:
            kinds = set(map(type, items))
            if kinds == {str} or kinds == {bytes}:
                try:
                    return self._collapse_uniform(items, stats, kinds.pop() is str)
                except UnicodeEncodeError:
                    pass  # lone surrogates: the general loop encodes them with surrogatepass
        return self._collapse_general(items, stats)

    def _collapse_uniform(self, items: list[Any], stats: DedupStats, text: bool) -> _Collapsed:
        # All-str or all-bytes input, content key: the per-chunk work is C-level map/dict
        # calls (one dict probe per chunk), so the pass costs little more than the hashing.
        # Hash everything first, then probe: interleaved, every 1 KB chunk streaming through
        # the CPU cache evicts the dict (measured: probes ~1.5x dearer; a digest is ~50 B).
        digest = self._digest
        index: dict[bytes, int] = {}
        digests = list(map(digest, map(str.encode, items) if text else items))
        first_of = list(map(index.setdefault, digests, itertools.count()))
        del digests
        index.pop(digest(b""), None)  # empty chunks are dropped: they map to None
        kept = list(index.values())
        rank: list[int | None] = [None] * len(items)
        for _ in map(rank.__setitem__, kept, range(len(kept))):
            pass
        survivor_of = list(map(rank.__getitem__, first_of))
        survivors = list(map(items.__getitem__, kept))
        if not text or all(map(str.isascii, survivors)):  # isascii is O(1): len == bytes
            sizes = list(map(len, survivors))
        else:
            sizes = list(map(len, map(str.encode, survivors)))
        by_survivor = Counter(survivor_of)
        counts = list(map(by_survivor.__getitem__, range(len(kept))))
        stats.empty_dropped = by_survivor[None]
        stats.duplicates_dropped = len(items) - by_survivor[None] - len(kept)
        stats.bytes_out = sum(sizes)
        stats.bytes_in = sum(map(operator.mul, sizes, counts))
        return _Collapsed(survivor_of, kept, list(index), False, counts)

    def _collapse_general(self, items: list[Any], stats: DedupStats) -> _Collapsed:
        # The hot loop: one hash and one dict probe per chunk, nothing else kept alive per
        # chunk (holding every encoded chunk costs more than hashing it). The dict's keys,
        # in insertion order, are the survivors' keys.
        digest, canonical, extra = self._digest, self._canonical, self._extra
        index: dict[Hashable, int] = {}
        survivor_of: list[int | None] = []
        point = survivor_of.append
        kept: list[int] = []
        bytes_in = bytes_out = empty = 0
        rich = extra is not None  # Chunk objects exist: metadata must be merged, not counted
        for pos, obj in enumerate(items):
            kind = type(obj)
            if kind is str:
                try:
                    data = obj.encode()
                except UnicodeEncodeError:
                    data = encode_text(obj)
            elif kind is bytes:
                data = obj
            else:
                if kind is not Chunk:
                    obj = items[pos] = Chunk.coerce(obj)
                data = obj.data
                rich = True
            if not data:
                empty += 1
                point(None)
                continue
            size = len(data)
            bytes_in += size
            h = digest(data if canonical is None else canonical(data))
            k = h if extra is None else _extra_key(h, extra, obj, items, pos)
            s = index.get(k)
            if s is None:
                s = index[k] = len(kept)
                kept.append(pos)
                bytes_out += size
            point(s)
        stats.bytes_in = bytes_in
        stats.bytes_out = bytes_out
        stats.empty_dropped = empty
        stats.duplicates_dropped = len(items) - empty - len(kept)
        return _Collapsed(survivor_of, kept, list(index), rich)


def _as_list(chunks: Iterable[Any]) -> list[Any]:
    if isinstance(chunks, str | bytes | bytearray | Chunk):
        raise InvalidInputError(
            "dedupe() takes an iterable of chunks; wrap a single chunk in a list"
        )
    if chunks is None:
        raise InvalidInputError("dedupe() got None; pass a list of chunks (may be empty)")
    try:
        return list(chunks)
    except TypeError as exc:
        raise InvalidInputError(
            f"dedupe() takes an iterable of chunks, got {type(chunks).__name__}"
        ) from exc


def _extra_key(h: bytes, extra: KeyFunction, obj: Any, items: list[Any], pos: int) -> Hashable:
    if type(obj) is not Chunk:
        obj = items[pos] = Chunk.coerce(obj)
    k = (h, extra(obj))
    try:
        hash(k)
    except TypeError as exc:
        raise InvalidInputError(f"dedup key of chunk {pos} is not hashable: {exc}") from exc
    return k


def _key_function(key: str | Sequence[str] | KeyFunction | None) -> KeyFunction | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = (key,)
    if callable(key):
        return key
    if isinstance(key, Sequence) and key and all(isinstance(name, str) for name in key):
        names = tuple(key)
        return lambda chunk: tuple(_field(chunk, name) for name in names)
    raise ConfigError(
        f"key must be None, a metadata field name, a sequence of names or a callable; got {key!r}"
    )


def _field(chunk: Chunk, name: str) -> Any:
    return chunk.source_id if name == "source_id" else chunk.metadata.get(name)


def _survivors(
    items: list[Any], found: _Collapsed, digests: list[bytes] | None, algo: str
) -> list[Chunk]:
    survivor_of, kept = found.survivor_of, found.kept
    if digests is None:
        digests = [b""] * len(kept)
        algo = None  # type: ignore[assignment]
    if not found.rich:  # plain str/bytes only: the merged metadata is just a count
        counts = found.counts
        if counts is None:
            by_survivor = Counter(survivor_of)
            counts = list(map(by_survivor.__getitem__, range(len(kept))))
        # A dict of a tuple and ints is not GC-tracked, which keeps 100k survivors cheap.
        return [
            make_chunk(items[pos], None, None, {SOURCES: (), DUPLICATES: n - 1}, algo, h)
            for pos, h, n in zip(kept, digests, counts, strict=True)
        ]
    members: dict[int, list[Any]] = {}
    for pos, s in enumerate(survivor_of):
        if s is not None and kept[s] != pos:
            members.setdefault(s, []).append(items[pos])
    out: list[Chunk] = []
    for s, pos in enumerate(kept):
        first = items[pos]
        base = first if isinstance(first, Chunk) else Chunk(first)
        chunk = make_chunk(
            base.content, base.source_id, base.score, dict(base.metadata), algo, digests[s]
        )
        set_merged(chunk, [base, *members.get(s, ())])
        out.append(chunk)
    return out
