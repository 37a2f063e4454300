"""Building a prompt: a request's segments and the template's pieces, concatenated.

The prompt is the concatenation of segment token ids with the template's fixed pieces
(frame, separators, context header, chunk delimiters), so a chunk's token ids are the same
whatever surrounds it. :func:`build_plan` records where each segment sits (the segment
table); :func:`prompt_length` is the same sum without building anything (the budget asks it
O(log n) times per request).

The system message's items, in order::

    head groups | "chunks" (context header, chunks joined by delimiters) | tail groups

joined by the template's separator; then history turns and the question in the frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.assembler.plan import AssemblyStats, PromptPlan, SegmentSpan
from ragkv.assembler.segments import Segment
from ragkv.assembler.system_split import Group
from ragkv.assembler.template import Piece, PromptTemplate
from ragkv.dedup import content_hash


@dataclass(slots=True)
class Regions:
    """One request's segments, grouped by region of the layout, and the template's frame
    around them.

    ``head`` and ``tail`` are items of the system message before and after the chunks; an
    item is a group of segments written back to back (a split slot's stable parts).
    ``frame`` is ``template.frame`` of the turns' roles: the pieces before the system
    message, before each turn and the question, and after the question.
    """

    head: list[Group]
    chunks: list[Segment]
    tail: list[Group]
    turns: list[Segment]
    question: Segment
    frame: tuple[Piece, ...]


def head_key(head: list[Group]) -> bytes:
    """The identity of a head (what the prefix tree's walks start from)."""
    return content_hash(b"".join(s.key for group in head for s in group))


def _items(regions: Regions, chunks: Sequence[Segment]) -> list[Any]:
    """System-message items in order: segment groups, and the chunk list as one item."""
    items: list[Any] = list(regions.head)
    if chunks:
        items.append(("chunks", chunks))
    items.extend(regions.tail)
    return items


def prompt_length(template: PromptTemplate, regions: Regions, chunks: Sequence[Segment]) -> int:
    """Tokens of the prompt :func:`build_plan` would build with these ``chunks``."""
    items = _items(regions, chunks)
    total = sum(len(p.token_ids) for p in regions.frame) + len(regions.question.token_ids)
    total += sum(len(t.token_ids) for t in regions.turns)
    total += max(0, len(items) - 1) * len(template.separator.token_ids)
    for item in items:
        if isinstance(item, tuple):
            listed = item[1]
            total += len(template.context_header.token_ids)
            total += sum(len(s.token_ids) for s in listed)
            total += (len(listed) - 1) * len(template.chunk_delimiter.token_ids)
        else:
            total += sum(len(s.token_ids) for s in item)
    return total


def build_plan(
    template: PromptTemplate, regions: Regions, chunks: list[Segment], stats: AssemblyStats
) -> PromptPlan:
    """Concatenate frame pieces, separators and segment token ids; record the spans."""
    frame = regions.frame
    ids: list[int] = []
    texts: list[str] = []
    spans: list[SegmentSpan] = []

    def piece(p: Piece) -> None:
        ids.extend(p.token_ids)
        texts.append(p.text)

    def segment(s: Segment) -> None:
        start = len(ids)
        ids.extend(s.token_ids)
        texts.append(s.text)
        spans.append(SegmentSpan(s.kind, s.stability, start, len(ids), s.key, s.rank, s.demoted))

    piece(frame[0])
    for i, item in enumerate(_items(regions, chunks)):
        if i:
            piece(template.separator)
        if not isinstance(item, tuple):
            for s in item:
                segment(s)
            continue
        piece(template.context_header)
        for j, chunk in enumerate(item[1]):
            if j:
                piece(template.chunk_delimiter)
            segment(chunk)
    for turn, p in zip(regions.turns, frame[1:], strict=False):
        piece(p)
        segment(turn)
    piece(frame[-2])
    segment(regions.question)
    piece(frame[-1])

    return PromptPlan(ids, spans, "".join(texts), stats)
