"""SpanFolder: the opt-in passes after exact dedup (containment, overlap merging).

It works on the exact-dedup survivors; a survivor folded into another is set to None and
remembers its host, so every input position can be re-pointed at the end.
"""

from __future__ import annotations

from collections.abc import Hashable

from ragkv.dedup.chunk import Chunk, make_chunk
from ragkv.dedup.containment import find_contained
from ragkv.dedup.hashing import content_hash
from ragkv.dedup.merge import set_merged
from ragkv.dedup.overlap import find_overlap_chains
from ragkv.dedup.result import DedupStats


class SpanFolder:
    """Folds survivors into each other; :meth:`finish` returns the compacted result lists."""

    def __init__(
        self, chunks: list[Chunk], kept: list[int], extras: list[Hashable], stats: DedupStats
    ) -> None:
        self.chunks: list[Chunk | None] = list(chunks)
        self.kept = list(kept)
        self.extras = extras
        self.stats = stats
        self.host = list(range(len(chunks)))

    def drop_contained(self) -> None:
        """Fold every chunk that lies inside a longer one (same key group) into it."""
        alive = self._alive()
        datas = [self.chunks[i].data for i in alive]  # type: ignore[union-attr]
        found = find_contained(datas, [self.extras[i] for i in alive])
        for needle, container in found.items():
            self._absorb(alive[container], alive[needle])
        self.stats.contained_dropped += len(found)

    def merge_overlaps(self, min_overlap: int) -> bool:
        """Join same-source windows that overlap by >= ``min_overlap`` bytes; True if any."""
        alive = self._alive()
        chunks = [self.chunks[i] for i in alive]
        groups = [
            None if c.source_id is None else (c.source_id, self.extras[i])  # type: ignore[union-attr]
            for i, c in zip(alive, chunks, strict=True)
        ]
        chains = find_overlap_chains([c.data for c in chunks], groups, min_overlap)  # type: ignore[union-attr]
        for order, seams in chains:
            self._merge([alive[o] for o in order], seams)
        return bool(chains)

    def drop_duplicates(self) -> None:
        """Fold byte-identical survivors (same key group) into the earliest one."""
        seen: dict[tuple[bytes, Hashable], int] = {}
        for i in sorted(self._alive(), key=self.kept.__getitem__):
            k = (content_hash(self.chunks[i].data), self.extras[i])  # type: ignore[union-attr]
            first = seen.setdefault(k, i)
            if first != i:
                self._absorb(first, i)
                self.stats.duplicates_dropped += 1

    def finish(
        self, survivor_of: list[int | None]
    ) -> tuple[list[Chunk], list[int], list[int | None]]:
        """Survivors in first-occurrence order, their input positions, the re-pointed map."""
        alive = sorted(self._alive(), key=self.kept.__getitem__)
        final = {old: new for new, old in enumerate(alive)}
        remap = [final[self._resolve(i)] for i in range(len(self.chunks))]
        return (
            [self.chunks[i] for i in alive],  # type: ignore[misc]
            [self.kept[i] for i in alive],
            [None if s is None else remap[s] for s in survivor_of],
        )

    def _merge(self, idx: list[int], seams: list[int]) -> None:
        pieces: list[Chunk] = [self.chunks[i] for i in idx]  # type: ignore[misc]
        data = pieces[0].data + b"".join(p.data[k:] for p, k in zip(pieces[1:], seams, strict=True))
        # A byte overlap between valid UTF-8 texts starts on a character boundary (a
        # continuation byte cannot begin a valid text), so the join is valid UTF-8 too.
        is_text = all(isinstance(p.content, str) for p in pieces)
        first = pieces[0]
        merged = make_chunk(
            data.decode("utf-8", "surrogatepass") if is_text else data,
            first.source_id,
            first.score,
            dict(first.metadata),
        )
        set_merged(merged, pieces)
        home = min(idx, key=self.kept.__getitem__)
        self.chunks[home] = merged
        for i in idx:
            if i != home:
                self.chunks[i] = None
                self.host[i] = home
        self.stats.overlaps_merged += len(idx) - 1

    def _absorb(self, host: int, other: int) -> None:
        target = self.chunks[host]
        set_merged(target, [target, self.chunks[other]])  # type: ignore[arg-type]
        self.chunks[other] = None
        self.host[other] = host

    def _alive(self) -> list[int]:
        return [i for i, c in enumerate(self.chunks) if c is not None]

    def _resolve(self, i: int) -> int:
        while self.host[i] != i:
            i = self.host[i]
        return i
