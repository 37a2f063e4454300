"""What a dedupe call returns: the survivors, where every input went, and the counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ragkv.dedup.chunk import Chunk


@dataclass(slots=True)
class DedupStats:
    """Counts for one :meth:`Deduplicator.dedupe` call (bytes are UTF-8 / raw chunk bytes)."""

    chunks_in: int = 0
    chunks_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    empty_dropped: int = 0
    duplicates_dropped: int = 0  # byte-identical (after normalization) to an earlier chunk
    contained_dropped: int = 0  # a substring of a longer retrieved chunk
    overlaps_merged: int = 0  # merge operations: each joins two windows into one span

    @property
    def bytes_saved(self) -> int:
        """Bytes the prompt no longer carries."""
        return self.bytes_in - self.bytes_out

    def as_dict(self) -> dict[str, int]:
        """Plain dict (for JSON / logging)."""
        return {**asdict(self), "bytes_saved": self.bytes_saved}


@dataclass(slots=True)
class DedupResult:
    """Unique chunks in first-occurrence order plus the mapping from every input to them.

    ``survivor_of[i]`` is the index in ``chunks`` that input ``i`` collapsed into (itself
    included), or None for a dropped empty chunk. ``kept[j]`` is the input position that
    ``chunks[j]`` comes from (its first occurrence). Each survivor's metadata carries
    ``ragkv_sources`` (tuple of every distinct source id folded into it) and ``ragkv_duplicates``
    (how many other input chunks it absorbed).
    """

    chunks: list[Chunk]
    survivor_of: list[int | None]
    kept: list[int]
    stats: DedupStats = field(default_factory=DedupStats)

    @property
    def duplicates(self) -> dict[int, int]:
        """Input position -> survivor index, for every input that did not survive as itself."""
        kept = self.kept
        return {
            pos: s for pos, s in enumerate(self.survivor_of) if s is not None and kept[s] != pos
        }

    def __len__(self) -> int:
        return len(self.chunks)
