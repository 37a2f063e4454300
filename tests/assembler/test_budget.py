"""max_prompt_tokens: whole chunks are dropped, least relevant volatile ones first."""

from __future__ import annotations

import pytest

from ragkv.assembler import Assembler, SegmentKind, Stability
from ragkv.dedup import Chunk
from ragkv.errors import PromptTooLongError

HOT = [f"Hot passage {i} about descriptors and the attribute lookup chain." for i in range(2)]
RARE = [f"Rare passage {i} about the struct module and its format strings." for i in range(3)]


def _warm_asm(tokenizer) -> Assembler:
    asm = Assembler(tokenizer)
    for _ in range(2):
        asm.assemble(chunks=HOT, question="warm")
    return asm


def test_budget_drops_least_relevant_volatile_chunks_first(local_tokenizer):
    chunks = [Chunk(RARE[0], score=0.9), Chunk(HOT[0], score=0.1), Chunk(RARE[1], score=0.5)]
    chunks += [Chunk(HOT[1], score=0.2), Chunk(RARE[2], score=0.7)]
    # Measure on a twin: assembling twice would make the rare chunks stable too.
    full = _warm_asm(local_tokenizer).assemble(chunks=chunks, question="q")
    asm = _warm_asm(local_tokenizer)
    rare_tokens = {s.index: s.end - s.start for s in full.spans(SegmentKind.CHUNK)}
    budget = len(full) - rare_tokens[2] - rare_tokens[4] + 1
    plan = asm.assemble(chunks=chunks, question="q", max_prompt_tokens=budget)
    assert len(plan) <= budget
    assert [d.index for d in plan.dropped] == [2, 4]  # scores 0.5 and 0.7, both volatile
    assert all(d.stability is Stability.VOLATILE for d in plan.dropped)
    assert plan.stats.num_dropped == 2
    kept = {s.index for s in plan.spans(SegmentKind.CHUNK)}
    assert kept == {0, 1, 3}


def test_kept_chunks_are_never_cut(local_tokenizer):
    asm = Assembler(local_tokenizer)
    full = asm.assemble(chunks=RARE, question="q")
    for budget in range(len(full) - 40, len(full) + 1, 7):
        plan = asm.assemble(chunks=RARE, question="q", max_prompt_tokens=budget)
        assert len(plan) <= budget
        for span in plan.spans(SegmentKind.CHUNK):
            assert asm.decode(plan.token_ids[span.start : span.end]) == RARE[span.index]
        assert len(plan.spans(SegmentKind.CHUNK)) + len(plan.dropped) == len(RARE)


def test_prompt_too_long_without_chunks_is_an_error(local_tokenizer):
    asm = Assembler(local_tokenizer)
    with pytest.raises(PromptTooLongError, match="max_prompt_tokens=5"):
        asm.assemble(
            system="A long system prompt " * 5, chunks=RARE, question="q", max_prompt_tokens=5
        )
