"""Sub-slot stability: learn which tokens of a "static" slot really are static.

A production system prompt is rarely constant: ``"You are X. Today is DATE. Rules: …"``
has two large parts that repeat on every request and a small part that changes on almost
every request. Moving the whole slot after the chunks (what a slot-level detector can do)
loses the repeating parts as a shared prefix; keeping it in place loses everything after it.

The policy, per slot (``"system"``, ``"few_shot[0]"``, or one marked part of a structured
system prompt):

0. **Group.** One slot may hold several templates interleaved (a RAG service that serves a
   chat mode and a search mode: different system prompts in one field). Versions are grouped
   by their leading block: a leading block seen at least twice names a template, learned on
   its own; versions whose leading block is new (a prompt that starts with a date, or a
   template's first request) share one catch-all group. Without this, the common prefix of
   two templates' versions is empty and every request would move its whole system prompt.
1. **Detect.** A version is *novel* when it is not among its group's recent versions. After
   ``after`` novel versions in a row the slot is *changing*; it is static again only after
   ``settle_after`` non-novel ones in a row (hysteresis: a session that repeats its own
   system prompt for a few turns does not flip the layout back and forth).
2. **Learn.** While changing, the group's ``versions`` most recent distinct versions are
   compared at token level: their common prefix is the *stable head*, their common suffix
   (over what is left) the *stable tail*. The assembler then moves each cut to a text
   boundary (the head ends at the last newline or sentence end in it, the tail starts at the
   first one), so a boundary that jitters by a token or two (a clock's digits) does not move
   the split, and no sentence is cut in half.
3. **Split.** The current version is cut into ``head ⊕ volatile ⊕ tail``: head and tail stay
   in place, joined (``"You are X. " ⊕ "Rules: …"``), and the volatile middle moves after the
   chunks, before the history and the question. A slot that never changes is never split.

The reordering this implies: the changing text (a date, a user name) reaches the model
after the retrieved context instead of inside the instructions, and the instructions read
without it. Several changing regions in one slot are treated as one: the stable text
between the first and the last change moves with them (split the prompt with
:class:`~ragkv.assembler.Volatile` parts when that matters).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragkv.defaults import DEFAULT_BLOCK_SIZE
from ragkv.errors import ConfigError

logger = logging.getLogger(__name__)

# Memory bound per assembler (one per tenant on a server): at most 16 slots x 4 groups x
# 8 versions x 16,384 tokens, stored as int32 arrays (32 MiB); larger slots are never split.
_MAX_SLOTS = 16
_MAX_GROUPS = 4  # per slot: the catch-all and the three most recently used templates
_MAX_LEADS = 256  # leading blocks counted per slot
_CATCH_ALL = b""


@dataclass(slots=True, frozen=True)
class SlotSplit:
    """What one version of a slot shares with the others: ``ids[:head]`` and
    ``ids[len - tail:]`` (in tokens, before the assembler moves each cut to a text boundary)."""

    head: int
    tail: int


@dataclass(slots=True)
class _Group:
    versions: deque[tuple[bytes, array]]
    novel_streak: int = 0
    settled_streak: int = 0
    changing: bool = False
    keys: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class _Slot:
    groups: OrderedDict[bytes, _Group] = field(default_factory=OrderedDict)  # LRU last
    leads: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # sightings
    warned: bool = False


class SlotLearner:
    """Learns the stable head and tail of each static slot from its recent versions."""

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        versions: int = 8,
        after: int = 3,
        settle_after: int = 16,
        max_slot_tokens: int = 16_384,
    ) -> None:
        if block_size < 1 or versions < 2:
            raise ConfigError("block_size must be >= 1 and versions >= 2.")
        if after < 2 or settle_after < 1:
            raise ConfigError("Changing slots are detected after >= 2 novel versions in a row.")
        self.block_size = block_size
        self.versions = versions
        self.after = after
        self.settle_after = settle_after
        self.max_slot_tokens = max_slot_tokens
        self._slots: OrderedDict[str, _Slot] = OrderedDict()

    def observe(self, slot: str, key: bytes, token_ids: Sequence[int]) -> SlotSplit | None:
        """Record this request's version of ``slot``; its split, or ``None`` to keep it whole.

        A split may still be empty (``head == tail == 0``: nothing stable to keep in front).
        """
        slot_state = self._slot(slot)
        if slot_state is None or len(token_ids) > self.max_slot_tokens:
            return None
        state = self._group(slot_state, token_ids)
        novel = key not in state.keys
        if novel:
            state.novel_streak, state.settled_streak = state.novel_streak + 1, 0
            versions = state.versions
            if len(versions) == versions.maxlen:
                state.keys.discard(versions[0][0])
            versions.append((key, array("i", token_ids)))
            state.keys.add(key)
        else:
            state.novel_streak, state.settled_streak = 0, state.settled_streak + 1
        if not state.changing and state.novel_streak >= self.after:
            state.changing = True
            if not slot_state.warned:
                slot_state.warned = True
                logger.warning(
                    "The %s segment is marked static but changed on each of the last %d "
                    "requests (a timestamp or a user name?). The assembler keeps its stable "
                    "head and tail in place and moves the changing part after the retrieved "
                    "chunks; mark it yourself with Volatile(...) or SystemPrompt(...).",
                    slot,
                    state.novel_streak,
                )
        elif state.changing and state.settled_streak >= self.settle_after:
            state.changing = False
        if not state.changing:
            return None
        return self._split(state, token_ids)

    def peek(self, slot: str, token_ids: Sequence[int]) -> SlotSplit | None:
        """What :meth:`observe` would answer for this version, learning nothing."""
        state = self._slots.get(slot)
        if state is None or len(token_ids) > self.max_slot_tokens:
            return None
        lead = array("i", token_ids[: self.block_size]).tobytes()
        name = lead if state.leads.get(lead, 0) >= 2 else _CATCH_ALL
        group = state.groups.get(name)
        if group is None or not group.changing:
            return None
        return self._split(group, token_ids)

    def is_changing(self, slot: str) -> bool:
        """Whether some template of ``slot`` is currently treated as changing."""
        state = self._slots.get(slot)
        return state is not None and any(g.changing for g in state.groups.values())

    def _slot(self, slot: str) -> _Slot | None:
        state = self._slots.get(slot)
        if state is None:
            if len(self._slots) >= _MAX_SLOTS:
                return None  # bounded: unknown slots beyond the cap stay whole
            state = self._slots[slot] = _Slot()
        return state

    def _group(self, state: _Slot, ids: Sequence[int]) -> _Group:
        """The group this version is learned in: its template's, or the catch-all."""
        lead = array("i", ids[: self.block_size]).tobytes()
        leads = state.leads
        leads[lead] = leads.get(lead, 0) + 1
        leads.move_to_end(lead)
        if len(leads) > _MAX_LEADS:
            leads.popitem(last=False)
        name = lead if leads[lead] >= 2 else _CATCH_ALL
        groups = state.groups
        group = groups.get(name)
        if group is None:
            group = groups[name] = _Group(deque(maxlen=self.versions))
            if len(groups) > _MAX_GROUPS:
                oldest = next(k for k in groups if k != _CATCH_ALL and k != name)
                del groups[oldest]
        groups.move_to_end(name)
        return group

    def _split(self, state: _Group, ids: Sequence[int]) -> SlotSplit:
        others = [v for _, v in state.versions]
        head = len(ids)
        for other in others:
            head = min(head, _common_prefix(ids, other, head))
        tail = len(ids) - head
        for other in others:
            tail = min(tail, _common_suffix(ids, other, min(tail, len(other) - head)))
        return SlotSplit(head, tail)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), max(limit, 0))
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i
