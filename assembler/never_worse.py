"""Never worse than as-given: the candidate plans of one request, and the choice among them.

Besides its own orders (canonical; for cache-aware, the prefix tree's walk too), every
request is built in the order the application gave (system prompt whole and first, chunks
in retrieval order). The candidates are compared by the cached prefix each would get
(engine residency when a probe is given, else the assembler's own record of what it sent,
:mod:`ragkv.assembler.sent`) and the best is sent. Ties and near-ties go to the canonical
plan: the first request of a new canonical layout cannot find it cached yet, and it is the
one later requests share.

Everything here is request-local: the assembler probes and chooses without holding its
lock on the engine's behalf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragkv.assembler.build import Regions, build_plan, head_key
from ragkv.assembler.ordering import retrieval_order
from ragkv.assembler.plan import AssemblyStats, PromptPlan
from ragkv.assembler.segmenter import TokenizedRequest
from ragkv.assembler.segments import Segment, SegmentKind
from ragkv.assembler.template import PromptTemplate


@dataclass(slots=True)
class Candidate:
    """One candidate prompt: the plan, its head's key and chunk order (what the prefix tree
    learns if it is sent), and what the residency probe handed back for it."""

    plan: PromptPlan
    head_key: bytes
    order: list[Segment]
    handoff: Any = None


def as_given(
    template: PromptTemplate,
    tokenized: TokenizedRequest,
    regions: Regions,
    max_prompt_tokens: int | None,
) -> Candidate | None:
    """The application's own order: statics whole and first, chunks as retrieved (None when
    that prompt is over the budget)."""
    system = [s for s in tokenized.statics if s.kind is SegmentKind.SYSTEM]
    head = [system] if system else []
    head += [[s] for s in tokenized.statics if s.kind is not SegmentKind.SYSTEM]
    given = Regions(head, regions.chunks, [], regions.turns, regions.question, regions.frame)
    order = retrieval_order(regions.chunks)
    plan = build_plan(template, given, order, AssemblyStats(order="retrieval"))
    if max_prompt_tokens is not None and len(plan.token_ids) > max_prompt_tokens:
        return None
    return Candidate(plan, head_key(head), order)


def choose(
    candidates: list[Candidate],
    cached: list[int] | None,
    has_given: bool,
    stats: AssemblyStats,
    slack: int,
    *,
    never_worse: bool,
    engine: bool,
) -> Candidate:
    """The candidate with the longest cached prefix; ties go to the earliest (canonical).

    ``cached[i]`` is candidate ``i``'s cached prefix (None: one candidate, not compared);
    ``engine`` says whether the engine was asked (else the assembler's record was).
    ``has_given``: the last candidate is the as-given plan, which must win by more than
    ``slack`` tokens (a block, plus what the canonical head gave up to end on a text
    boundary: a price of meaning, not a worse order). Fills in the choice's ``stats``.
    """
    if cached is None:
        candidate = candidates[0]
        candidate.plan.stats = stats
        same = "the as-given order is the same prompt" if never_worse else "not compared"
        stats.choice_reason = f"canonical: {same}"
        return candidate
    best = max(range(len(candidates)), key=cached.__getitem__)
    if has_given and best == len(candidates) - 1:
        canonical_best = max(range(len(candidates) - 1), key=cached.__getitem__)
        if cached[best] - cached[canonical_best] <= slack:
            best = canonical_best  # a near-tie: the canonical plan is the investment
    candidate = candidates[best]
    candidate.plan.stats = stats
    canonical = cached[:-1] if has_given else cached
    stats.expected_canonical = max(canonical)
    if has_given:
        stats.expected_as_given = cached[-1]
        if best == len(candidates) - 1:
            stats.chosen = "as-given"
        loser = "canonical" if stats.chosen == "as-given" else "as-given"
        reason = f"{cached[best]} cached tokens vs {min(cached)} for the {loser} order"
    else:
        reason = "the as-given order is the same prompt" if never_worse else "not compared"
    source = "engine residency" if engine else "the assembler's record"
    stats.choice_reason = f"{stats.chosen}: {reason} ({source})"
    if engine:
        candidate.plan.expected_cached_tokens = cached[best]
    return candidate
