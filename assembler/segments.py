"""Prompt segments: the kinds of content a RAG prompt is made of, and how stable each is.

A segment is one piece of caller content (the system prompt, a few-shot example, a retrieved
chunk, a history turn, the question) together with its token ids. Stability decides where it
may sit: static and stable content first, so consecutive requests share a long prefix;
volatile content last, so it never invalidates what follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ragkv.dedup import Chunk
from ragkv.errors import InvalidInputError


class Stability(StrEnum):
    """How often a segment's bytes change between requests."""

    STATIC = "static"  # the same on every request (system prompt, few-shot examples)
    STABLE = "stable"  # recurs across many requests (hot retrieved chunks)
    VOLATILE = "volatile"  # new on (almost) every request (question, history, rare chunks)


class SegmentKind(StrEnum):
    """What a segment holds; the layout places each kind in a fixed region of the prompt."""

    SYSTEM = "system"
    FEW_SHOT = "few_shot"
    CHUNK = "chunk"
    HISTORY = "history"
    QUESTION = "question"


DEFAULT_STABILITY: dict[SegmentKind, Stability] = {
    SegmentKind.SYSTEM: Stability.STATIC,
    SegmentKind.FEW_SHOT: Stability.STATIC,
    SegmentKind.CHUNK: Stability.STABLE,  # refined per chunk by the StabilityTracker
    SegmentKind.HISTORY: Stability.VOLATILE,
    SegmentKind.QUESTION: Stability.VOLATILE,
}

# Only these kinds may be overridden: history and question always close the prompt.
OVERRIDABLE = frozenset({SegmentKind.SYSTEM, SegmentKind.FEW_SHOT, SegmentKind.CHUNK})


@dataclass(slots=True)
class Segment:
    """One piece of prompt content with its token ids.

    ``key`` is the content hash (the registry key), ``rank`` the caller's position among
    segments of the same kind (retrieval rank for chunks), ``role`` the chat role of a
    history turn, and ``slot`` a stable name for invalidator tracking (``"system"``,
    ``"few_shot[0]"``).
    """

    kind: SegmentKind
    stability: Stability
    text: str
    token_ids: tuple[int, ...] | list[int]
    key: bytes
    rank: int = 0
    chunk: Chunk | None = None
    role: str | None = None
    slot: str = ""
    demoted: bool = False  # the changing part of a static slot, moved after the chunks

    @property
    def relevance(self) -> tuple[float, int]:
        """Sort key, higher = more relevant: the chunk's score if set, then retrieval rank."""
        score = self.chunk.score if self.chunk is not None else None
        return (float("-inf") if score is None else float(score), -self.rank)


def parse_overrides(overrides: dict[str, str] | None) -> dict[SegmentKind, Stability]:
    """Validate a ``{"system": "volatile", ...}`` mapping into enum form."""
    if not overrides:
        return {}
    parsed: dict[SegmentKind, Stability] = {}
    for kind_name, stability_name in overrides.items():
        try:
            kind, stability = SegmentKind(kind_name), Stability(stability_name)
        except ValueError as exc:
            raise InvalidInputError(
                f"Bad stability override {kind_name!r}: {stability_name!r}; kinds are "
                f"{[k.value for k in SegmentKind]}, classes {[s.value for s in Stability]}."
            ) from exc
        if kind not in OVERRIDABLE:
            raise InvalidInputError(
                f"The stability of {kind.value!r} cannot be overridden: history and question "
                "always close the prompt. Override 'system', 'few_shot' or 'chunk'."
            )
        parsed[kind] = stability
    return parsed
