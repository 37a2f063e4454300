"""``collapse_duplicates=False``: byte-identical chunks reach the prompt as retrieved."""

from __future__ import annotations

import pytest

from ragkv.assembler import Assembler

A = "The import statement finds a module, loads it and binds a name."
B = "A with statement wraps a block in a context manager's enter and exit."
C = "The for statement iterates over the elements of a sequence."


def _chunk_texts(asm: Assembler, chunks: list[str]) -> list[str]:
    plan = asm.assemble(chunks=chunks, question="Which statement?")
    return [asm.decode(plan.token_ids[s.start : s.end]) for s in plan.spans("chunk")]


@pytest.mark.parametrize("order", ["retrieval", "stable-first", "cache-aware"])
def test_uncollapsed_duplicates_are_all_kept(local_tokenizer, order):
    asm = Assembler(local_tokenizer, order=order, collapse_duplicates=False)
    retrieved = [A, B, A, C, B]
    for _ in range(3):  # later requests walk the prefix tree / use stable ranks
        texts = _chunk_texts(asm, retrieved)
        assert sorted(texts) == sorted(retrieved)
    plan = asm.assemble(chunks=retrieved, question="q")
    assert plan.stats.duplicates_collapsed == 0


def test_retrieval_order_without_collapse_is_exactly_the_retrieved_list(local_tokenizer):
    asm = Assembler(local_tokenizer, order="retrieval", collapse_duplicates=False)
    assert _chunk_texts(asm, [B, A, B, B]) == [B, A, B, B]


def test_default_still_collapses(local_tokenizer):
    plan = Assembler(local_tokenizer).assemble(chunks=[A, A, B], question="q")
    assert len(plan.spans("chunk")) == 2
    assert plan.stats.duplicates_collapsed == 1
