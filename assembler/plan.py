"""PromptPlan: what the assembler hands to the engine, and why it looks the way it does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragkv.assembler.segments import SegmentKind, Stability
from ragkv.dedup import Chunk


@dataclass(slots=True)
class SegmentSpan:
    """One row of the segment table: where a segment's tokens sit in ``token_ids``.

    ``start``/``end`` are token offsets (``token_ids[start:end]`` are exactly the segment's
    token ids); ``index`` is the caller's position (retrieval rank for chunks, turn or
    example number otherwise).
    """

    kind: SegmentKind
    stability: Stability
    start: int
    end: int
    content_hash: bytes
    index: int = 0
    demoted: bool = False


@dataclass(slots=True)
class DroppedChunk:
    """A chunk left out to meet ``max_prompt_tokens`` (never cut inside)."""

    chunk: Chunk
    index: int
    num_tokens: int
    stability: Stability


@dataclass(slots=True)
class AssemblyStats:
    """Counters of one assembly.

    ``stable_prefix_tokens`` is the length of the prompt before its first volatile segment,
    the part a later request can reuse. ``seam_mismatch_tokens`` and ``token_count_delta``
    compare ``token_ids`` with tokenizing ``text`` in one go; they are ``None`` unless the
    assembler measures seams (``measure_seams=True``).

    ``invalidators`` names the static slots seen changing on every request, ``demoted``
    those whose changing part was moved after the chunks (``moved_tokens`` tokens in all,
    caller-marked volatile parts included). ``chosen`` is ``"canonical"`` or
    ``"as-given"`` (the application's own order won on cached prefix), with
    ``expected_canonical`` / ``expected_as_given`` the cached-prefix estimates compared and
    ``choice_reason`` a sentence saying why.
    """

    order: str
    num_tokens: int = 0
    num_chunks: int = 0
    num_dropped: int = 0
    duplicates_collapsed: int = 0
    chunks_tokenized: int = 0
    chunks_reused: int = 0
    stable_chunks: int = 0
    stable_prefix_tokens: int = 0
    tree_path_chunks: int = 0
    invalidators: tuple[str, ...] = ()
    demoted: tuple[str, ...] = ()
    moved_tokens: int = 0
    chosen: str = "canonical"
    choice_reason: str = ""
    expected_canonical: int | None = None
    expected_as_given: int | None = None
    seam_mismatch_tokens: int | None = None
    token_count_delta: int | None = None


@dataclass(slots=True)
class PromptPlan:
    """The assembled prompt: token ids for the engine plus the segment table.

    ``text`` is the prompt as text (what ``decode(token_ids)`` reads as);
    ``expected_cached_tokens`` is the engine's cached-prefix length for ``token_ids`` when a
    residency callback was given, else ``None``. ``prompt_hashes`` is what an engine's
    residency probe handed back with it (its block hashes of ``token_ids``), for
    ``engine.generate(..., prompt_hashes=)``; ``None`` otherwise.
    """

    token_ids: list[int]
    segments: list[SegmentSpan]
    text: str
    stats: AssemblyStats
    dropped: list[DroppedChunk] = field(default_factory=list)
    expected_cached_tokens: int | None = None
    prompt_hashes: Any = field(default=None, repr=False, compare=False)

    def spans(self, kind: SegmentKind | str) -> list[SegmentSpan]:
        """The segment table rows of one kind, in prompt order."""
        return [span for span in self.segments if span.kind == kind]

    def __len__(self) -> int:
        return len(self.token_ids)
