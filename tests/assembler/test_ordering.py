"""Chunk order: stable-first and cache-aware share prefixes across retrieval orders."""

from __future__ import annotations

import pytest
from support import common_prefix

from ragkv.assembler import Assembler, SegmentKind, Stability
from ragkv.errors import ConfigError

HOT = [
    "The with statement wraps a block with methods defined by a context manager.",
    "A generator function returns an iterator; each yield suspends its frame.",
    "Dictionaries map hashable keys to arbitrary values and keep insertion order.",
]
SYSTEM = "You answer questions about Python using only the context."


def rare(i: int) -> str:
    return f"Rare passage number {i}: slices take start, stop and step."


def _warm(asm: Assembler) -> None:
    for i in range(2):
        asm.assemble(system=SYSTEM, chunks=HOT[::-1] if i else HOT, question=f"warm {i}?")


def _two_requests(asm: Assembler):
    a = asm.assemble(system=SYSTEM, chunks=[HOT[0], HOT[1], rare(1), HOT[2]], question="Why?")
    b = asm.assemble(system=SYSTEM, chunks=[HOT[2], rare(2), HOT[1], HOT[0]], question="How?")
    return a, b


@pytest.mark.parametrize("order", ["stable-first", "cache-aware"])
def test_reordering_policies_share_system_and_every_hot_chunk(any_tokenizer, order):
    asm = Assembler(any_tokenizer, order=order)
    _warm(asm)
    a, b = _two_requests(asm)
    hot_end = max(s.end for s in a.spans(SegmentKind.CHUNK) if s.stability is Stability.STABLE)
    assert [s.stability for s in a.spans(SegmentKind.CHUNK)].count(Stability.STABLE) == 3
    assert common_prefix(a.token_ids, b.token_ids) >= hot_end
    assert a.spans(SegmentKind.SYSTEM)[0].end <= hot_end


def test_retrieval_order_keeps_the_callers_order_and_shares_little(any_tokenizer):
    asm = Assembler(any_tokenizer, order="retrieval")
    _warm(asm)
    a, b = _two_requests(asm)
    assert [s.index for s in a.spans(SegmentKind.CHUNK)] == [0, 1, 2, 3]
    first_chunk = a.spans(SegmentKind.CHUNK)[0]
    assert common_prefix(a.token_ids, b.token_ids) < first_chunk.end


def test_volatile_question_never_precedes_a_stable_chunk(local_tokenizer):
    asm = Assembler(local_tokenizer)
    _warm(asm)
    plan = asm.assemble(
        system=SYSTEM,
        chunks=[rare(7), *HOT],
        question="Is today 2024-05-01T10:00:00?",
        history=[("user", "earlier question"), ("assistant", "earlier answer")],
    )
    stable_ends = [s.end for s in plan.segments if s.stability is not Stability.VOLATILE]
    first_volatile = min(s.start for s in plan.segments if s.stability is Stability.VOLATILE)
    assert max(stable_ends) <= first_volatile
    question = plan.spans(SegmentKind.QUESTION)[0]
    assert question.start == max(s.start for s in plan.segments)
    assert plan.stats.stable_prefix_tokens == first_volatile


def test_canonical_order_does_not_depend_on_the_request(local_tokenizer):
    asm = Assembler(local_tokenizer)
    _warm(asm)
    orders = []
    for chunks in ([HOT[1], HOT[0], HOT[2]], [HOT[2], HOT[1], HOT[0]], [HOT[0], HOT[2]]):
        plan = asm.assemble(system=SYSTEM, chunks=chunks, question="q")
        orders.append([s.content_hash for s in plan.spans(SegmentKind.CHUNK)])
    assert orders[0] == orders[1]
    assert orders[2] == [key for key in orders[0] if key in orders[2]]


def test_cache_aware_follows_the_order_actually_sent(local_tokenizer):
    asm = Assembler(local_tokenizer, order="cache-aware")
    # Never-stable chunks: canonical order is by hash, the tree remembers what was sent.
    first = asm.assemble(system=SYSTEM, chunks=[rare(1), rare(2), rare(3)], question="a")
    sent = [s.content_hash for s in first.spans(SegmentKind.CHUNK)]
    again = asm.assemble(system=SYSTEM, chunks=[rare(3), rare(2), rare(1), rare(4)], question="b")
    assert [s.content_hash for s in again.spans(SegmentKind.CHUNK)][:3] == sent
    assert again.stats.tree_path_chunks == 3


def test_residency_picks_the_order_the_engine_has_cached(local_tokenizer):
    cached: list[list[int]] = []

    def residency(ids):
        return max((common_prefix(ids, c) for c in cached), default=0)

    asm = Assembler(local_tokenizer, order="cache-aware", residency=residency)
    plan = asm.assemble(system=SYSTEM, chunks=HOT, question="first")
    assert plan.expected_cached_tokens == 0
    cached.append(plan.token_ids)
    again = asm.assemble(system=SYSTEM, chunks=HOT[::-1], question="second")
    # The tree walk re-sends the first order; the canonical order would not be cached.
    assert again.stats.tree_path_chunks == 3
    assert again.expected_cached_tokens >= again.spans(SegmentKind.CHUNK)[-1].end
    first_order = [s.content_hash for s in plan.spans(SegmentKind.CHUNK)]
    assert [s.content_hash for s in again.spans(SegmentKind.CHUNK)] == first_order
    assert Assembler(local_tokenizer).assemble(question="q").expected_cached_tokens is None


def test_unknown_order_is_a_config_error(local_tokenizer):
    with pytest.raises(ConfigError, match="stable-first"):
        Assembler(local_tokenizer, order="alphabetical")
