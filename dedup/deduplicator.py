"""Deduplicator: collapse byte-identical retrieved chunks, keep the first, merge metadata."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from ragkv.dedup.chunk import Chunk, encode_text, make_chunk
from ragkv.dedup.hashing import hasher
from ragkv.dedup.merge import DUPLICATES, SOURCES, set_merged
from ragkv.dedup.normalize import normalizer
from ragkv.dedup.result import DedupResult, DedupStats
from ragkv.dedup.spans import SpanFolder
from ragkv.errors import ConfigError, InvalidInputError

KeyFunction = Callable[[Chunk], Hashable]


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
        survivor_of, kept, datas, digests, extras, dups = self._collapse(items, stats)
        algo = self.hash if self._canonical is None else None
        survivors = _survivors(items, survivor_of, kept, datas, digests, dups, algo)
        if (self.drop_contained or self.merge_overlaps) and len(survivors) > 1:
            folder = SpanFolder(survivors, kept, extras, stats)
            if self.drop_contained:
                folder.drop_contained()
            if self.merge_overlaps and folder.merge_overlaps(self.min_overlap):
                folder.drop_duplicates()  # a merged span may equal a chunk already kept
                if self.drop_contained:
                    folder.drop_contained()  # ... or contain one that straddles its seam
            survivors, kept, survivor_of = folder.finish(survivor_of)
        stats.chunks_out = len(survivors)
        stats.bytes_out = sum(len(c.data) for c in survivors)
        return DedupResult(survivors, survivor_of, kept, stats)

    def _collapse(self, items: list[Any], stats: DedupStats) -> tuple[Any, ...]:
        # The hot loop: one hash and one dict probe per chunk; Chunk objects for survivors
        # are built afterwards, and only for survivors.
        digest, canonical, extra = self._digest, self._canonical, self._extra
        index: dict[Hashable, int] = {}
        survivor_of: list[int | None] = []
        kept: list[int] = []
        datas: list[bytes] = []
        digests: list[bytes] = []
        extras: list[Hashable] = []
        dups: list[int] = []
        bytes_in = empty = 0
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
            if not data:
                empty += 1
                survivor_of.append(None)
                continue
            bytes_in += len(data)
            h = digest(data if canonical is None else canonical(data))
            k = h if extra is None else _extra_key(h, extra, obj, items, pos)
            s = index.get(k)
            if s is None:
                s = index[k] = len(kept)
                kept.append(pos)
                datas.append(data)
                digests.append(h)
                extras.append(None if extra is None else k[1])
            else:
                dups.append(pos)
            survivor_of.append(s)
        stats.bytes_in = bytes_in
        stats.empty_dropped = empty
        stats.duplicates_dropped = len(dups)
        return survivor_of, kept, datas, digests, extras, dups


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
    items: list[Any],
    survivor_of: list[int | None],
    kept: list[int],
    datas: list[bytes],
    digests: list[bytes],
    dups: list[int],
    algo: str | None,
) -> list[Chunk]:
    members: dict[int, list[Any]] = {}
    for pos in dups:
        members.setdefault(survivor_of[pos], []).append(items[pos])  # type: ignore[arg-type]
    out: list[Chunk] = []
    for s, pos in enumerate(kept):
        first = items[pos]
        digest = digests[s] if algo is not None else b""
        others = members.get(s)
        if others is None and type(first) is not Chunk:  # plain str/bytes: nothing to merge
            meta = {SOURCES: [], DUPLICATES: 0}
            out.append(make_chunk(first, None, None, meta, datas[s], algo, digest))
            continue
        base = first if type(first) is Chunk else Chunk.coerce(first)
        chunk = make_chunk(base.content, base.source_id, base.score, {}, datas[s], algo, digest)
        chunk.metadata = dict(base.metadata)
        set_merged(chunk, [base, *(others or ())])
        out.append(chunk)
    return out
