"""Which parts of a "static" system prompt stay in front, and where it may be cut.

The assembler shows every static segment (system prompt parts, few-shot examples) to the
:class:`~ragkv.assembler.slots.SlotLearner`; a segment seen changing on every request keeps
its stable head and tail in front and moves the changing middle after the retrieved
chunks. A learned cut falls only on a text boundary (:mod:`ragkv.assembler.boundaries`):
never inside a word, a number or a sentence. :class:`SystemSplitter` does both, for one
assembler (one tenant), under the assembler's lock.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from ragkv.assembler.boundaries import is_boundary, last_boundary, next_boundary
from ragkv.assembler.config import AssemblerConfig
from ragkv.assembler.plan import AssemblyStats
from ragkv.assembler.segments import Segment, SegmentKind, Stability
from ragkv.assembler.slots import SlotLearner, SlotSplit
from ragkv.dedup import content_hash

_MAX_CUTS = 256  # remembered clean cuts (a slot's head and tail, per template)
_MAX_CUT_WALK = 256  # tokens a cut may move back to reach a boundary (each step decodes)
_MAX_BOUNDARY_PRICE = 64  # tokens: about one long sentence

Group = list[Segment]  # segments concatenated directly (the parts of one slot)


class SystemSplitter:
    """Places static segments before or after the chunks, learning which parts change."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], config: AssemblerConfig, hash_algo: str
    ) -> None:
        self.decode = decode
        self.config = config  # block_size, demote_invalidators, invalidator_after
        self.hash_algo = hash_algo
        self.slots = SlotLearner(config.block_size, after=config.invalidator_after)
        self._cuts: OrderedDict[tuple[bool, int, bytes], tuple[int, str]] = OrderedDict()

    def learn(self, segments: Iterable[Segment]) -> None:
        """Show the learner these static segments' versions (volatile ones are skipped)."""
        for segment in segments:
            if segment.stability is not Stability.VOLATILE:
                self.slots.observe(segment.slot, segment.key, segment.token_ids)

    def place(
        self, statics: list[Segment], stats: AssemblyStats, learn: bool = True
    ) -> tuple[list[Group], list[Group], int]:
        """Split static segments into head groups (before chunks) and tail groups (after).

        Caller-marked volatile parts go to the tail. Every other static segment is shown to
        the slot learner; a changing one keeps its stable head and tail in front and moves
        its middle after the chunks (or stays whole with ``demote_invalidators=False``).
        The third value is how many learned-stable tokens moved with the middle because the
        cut had to fall on a text boundary.
        """
        boundary_slack = 0
        flagged, demoted = [], []
        system_head: Group = []
        moved_parts: list[Group] = []  # each its own item: set off by the separator
        head: list[Group] = []
        tail: list[Group] = []
        for segment in statics:
            is_system = segment.kind is SegmentKind.SYSTEM
            if segment.stability is Stability.VOLATILE:
                (moved_parts if is_system else tail).append([segment])
                continue
            if learn:
                split = self.slots.observe(segment.slot, segment.key, segment.token_ids)
            else:
                split = self.slots.peek(segment.slot, segment.token_ids)
            stay: Group = [segment]
            moved: Group = []
            if split is not None:
                flagged.append(segment.slot)
                if self.config.demote_invalidators:
                    demoted.append(segment.slot)
                    stay, moved, kept_head = self._cut(segment, split.head, split.tail)
                    boundary_slack += self._boundary_price(split, kept_head)
            if is_system:
                system_head += stay
                moved_parts += [[piece] for piece in moved]
            else:
                head.append(stay)
                if moved:
                    tail.append(moved)
        if system_head:
            head.insert(0, system_head)
        tail[:0] = moved_parts
        stats.invalidators, stats.demoted = tuple(flagged), tuple(demoted)
        stats.moved_tokens = sum(len(s.token_ids) for group in tail for s in group)
        return head, tail, boundary_slack

    def _boundary_price(self, split: SlotSplit, kept_head: int) -> int:
        """How much longer the app's own order's cached prefix can be than this split's
        because the head had to end on a text boundary: the tokens between the boundary and
        the end of what the versions share, plus a block of rounding.

        Counted only where a boundary was found (the head kept something), and at most
        ``_MAX_BOUNDARY_PRICE``: a part with no boundary in its head moves whole, and must
        then win the never-worse comparison on its own merit.
        """
        if kept_head == 0:
            return 0
        price = split.head - kept_head + self.config.block_size
        return max(0, min(price, _MAX_BOUNDARY_PRICE))

    def _cut(self, segment: Segment, head: int, tail: int) -> tuple[Group, Group, int]:
        """``segment`` as (stable parts kept in place, the volatile middle moved, tokens of
        the head kept)."""
        ids = list(segment.token_ids)
        text = segment.text
        head, head_text = self._clean_cut(ids, head, text, from_end=False)
        tail, tail_text = self._clean_cut(ids, tail, text, from_end=True)
        middle_text = text[len(head_text) : len(text) - len(tail_text)]
        pieces = [
            (ids[:head], head_text, Stability.STATIC),
            (ids[head : len(ids) - tail], middle_text, None),
            (ids[len(ids) - tail :], tail_text, Stability.STATIC),
        ]
        stay: Group = []
        moved: Group = []
        for part, part_text, stability in pieces:
            if not part:
                continue
            key = content_hash(part_text.encode("utf-8", "surrogatepass"), self.hash_algo)
            piece = Segment(
                segment.kind,
                stability or Stability.VOLATILE,
                part_text,
                part,
                key,
                segment.rank,
                segment.chunk,
                slot=segment.slot,
                demoted=stability is None,
            )
            (stay if stability else moved).append(piece)
        return stay, moved, head

    def _clean_cut(
        self, ids: list[int], length: int, text: str, *, from_end: bool
    ) -> tuple[int, str]:
        """:func:`_clean_cut`, memoized: a slot's stable head or tail is the same on every
        request. A remembered cut is checked against this version's text (whether a period
        ends a sentence can depend on text beyond the tokens in the key) before it is used."""
        if length == 0:
            return 0, ""
        region = ids[max(0, len(ids) - length - 2) :] if from_end else ids[: length + 2]
        key = (from_end, length, array("i", region).tobytes())
        found = self._cuts.get(key)
        if found is not None and _still_clean(found[1], text, from_end=from_end):
            return found
        found = self._cuts[key] = _clean_cut(self.decode, ids, length, text, from_end=from_end)
        if len(self._cuts) > _MAX_CUTS:
            self._cuts.popitem(last=False)
        return found


def _still_clean(part: str, text: str, *, from_end: bool) -> bool:
    """Whether a remembered cut-off ``part`` is still this ``text``'s own and on a boundary."""
    if from_end:
        return text.endswith(part) and is_boundary(text, len(text) - len(part))
    return text.startswith(part) and is_boundary(text, len(part))


def _clean_cut(
    decode: Callable[[list[int]], str], ids: list[int], length: int, text: str, *, from_end: bool
) -> tuple[int, str]:
    """``length`` shortened so the cut falls on a text boundary (:mod:`.boundaries`), with the
    text of the cut-off part; ``(0, "")`` when the part holds no boundary.

    The head ends at the last newline or sentence end in it, the tail starts at the first one
    in it: a learned split never leaves half a sentence, half a word or half a number on
    either side, and never splits a UTF-8 character that byte-level BPE spread over tokens.
    """
    looked = False
    floor = max(0, length - _MAX_CUT_WALK)  # a "sentence" longer than that is no sentence
    while length > floor:
        part = decode(ids[len(ids) - length :] if from_end else ids[:length])
        if text.endswith(part) if from_end else text.startswith(part):
            edge = len(text) - len(part) if from_end else len(part)
            if is_boundary(text, edge):
                return length, part
            if not looked:  # no boundary anywhere in the part: stop walking at once
                looked = True
                nearest = next_boundary(text, edge) if from_end else last_boundary(text, edge)
                if nearest in (0, len(text)):
                    return 0, ""
        length -= 1
    return 0, ""
