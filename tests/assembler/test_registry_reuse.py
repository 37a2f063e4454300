"""Chunk token ids come from the ChunkRegistry: a known chunk is never tokenized again."""

from __future__ import annotations

from ragkv.assembler import Assembler
from ragkv.dedup import Chunk, ChunkRegistry

CHUNKS = [f"Passage {i}: the import system finds, loads and binds modules." for i in range(5)]


def _count_encodes(asm: Assembler) -> list[str]:
    calls: list[str] = []
    encode = asm.tokenizer.encode

    def counting(text: str) -> list[int]:
        calls.append(text)
        return encode(text)

    asm.tokenizer.encode = counting  # type: ignore[method-assign]
    return calls


def test_known_chunks_are_never_tokenized_again(local_tokenizer):
    asm = Assembler(local_tokenizer)
    calls = _count_encodes(asm)
    first = asm.assemble(system="Sys.", chunks=CHUNKS[:3], question="q1")
    assert sum(text in CHUNKS for text in calls) == 3
    assert first.stats.chunks_tokenized == 3
    calls.clear()
    second = asm.assemble(system="Sys.", chunks=[CHUNKS[2], CHUNKS[0], CHUNKS[4]], question="q2")
    assert [text for text in calls if text in CHUNKS] == [CHUNKS[4]]
    assert "Sys." not in calls  # static segments are registry-cached too
    assert (second.stats.chunks_tokenized, second.stats.chunks_reused) == (1, 2)


def test_a_shared_registry_serves_chunks_tokenized_elsewhere(local_tokenizer):
    registry = ChunkRegistry()
    warm = Assembler(local_tokenizer, registry=registry)
    warm.assemble(chunks=CHUNKS, question="q")
    asm = Assembler(local_tokenizer, registry=registry)
    calls = _count_encodes(asm)
    plan = asm.assemble(chunks=[Chunk(c.encode()) for c in CHUNKS], question="q")
    assert not any(text in CHUNKS for text in calls)
    assert plan.stats.chunks_reused == len(CHUNKS)


def test_duplicate_chunks_in_one_request_appear_once(local_tokenizer):
    plan = Assembler(local_tokenizer).assemble(
        chunks=[CHUNKS[0], CHUNKS[1], CHUNKS[0].encode()], question="q"
    )
    assert len(plan.spans("chunk")) == 2
    assert plan.stats.duplicates_collapsed == 1
