"""Silent invalidators: a "static" segment that changes on every request."""

from __future__ import annotations

import logging

from ragkv.assembler import Assembler, SegmentKind, Stability

CHUNKS = ["Lists are mutable sequences.", "Tuples are immutable sequences."]


def _system(i: int) -> str:
    return f"You are a helpful assistant. Current time: 2024-05-01T10:00:{i:02d}Z."


def test_changing_system_prompt_is_detected_warned_once_and_demoted(local_tokenizer, caplog):
    asm = Assembler(local_tokenizer)
    with caplog.at_level(logging.WARNING, logger="ragkv.assembler"):
        plans = [asm.assemble(system=_system(i), chunks=CHUNKS, question="q") for i in range(6)]
    assert plans[0].stats.invalidators == ()
    assert all(p.stats.invalidators == ("system",) for p in plans[3:])
    warnings = [r for r in caplog.records if "system segment is marked static" in r.message]
    assert len(warnings) == 1
    system = plans[-1].spans(SegmentKind.SYSTEM)[0]
    assert system.demoted and system.stability is Stability.VOLATILE
    assert system.start > max(s.end for s in plans[-1].spans(SegmentKind.CHUNK))
    # Once demoted, consecutive prompts share everything up to the moved timestamp.
    shared = 0
    for x, y in zip(plans[-2].token_ids, plans[-1].token_ids, strict=False):
        if x != y:
            break
        shared += 1
    assert shared >= plans[-1].spans(SegmentKind.CHUNK)[-1].end


def test_demotion_can_be_switched_off(local_tokenizer):
    asm = Assembler(local_tokenizer, demote_invalidators=False)
    for i in range(5):
        plan = asm.assemble(system=_system(i), chunks=CHUNKS, question="q")
    assert plan.stats.invalidators == ("system",) and plan.stats.demoted == ()
    system = plan.spans(SegmentKind.SYSTEM)[0]
    assert system.start < plan.spans(SegmentKind.CHUNK)[0].start
    assert system.stability is Stability.STATIC and not system.demoted


def test_a_repeating_system_prompt_is_never_flagged(local_tokenizer):
    asm = Assembler(local_tokenizer)
    for i in range(6):
        plan = asm.assemble(system=_system(0), chunks=CHUNKS, question=f"question {i}")
    assert plan.stats.invalidators == ()
    assert plan.spans(SegmentKind.SYSTEM)[0].start < plan.spans(SegmentKind.CHUNK)[0].start


def test_flag_clears_when_the_segment_stops_changing(local_tokenizer):
    asm = Assembler(local_tokenizer)
    for i in range(4):
        asm.assemble(system=_system(i), chunks=CHUNKS, question="q")
    asm.assemble(system=_system(0), chunks=CHUNKS, question="q")  # seen before: not novel
    plan = asm.assemble(system=_system(0), chunks=CHUNKS, question="q")
    assert plan.stats.invalidators == ()
    assert plan.spans(SegmentKind.SYSTEM)[0].stability is Stability.STATIC


def test_changing_few_shot_example_is_detected_per_slot(local_tokenizer):
    asm = Assembler(local_tokenizer)
    for i in range(4):
        plan = asm.assemble(
            system="Fixed.", few_shot=["Q: 1+1? A: 2", f"Request id {i}"], question="q"
        )
    assert plan.stats.invalidators == ("few_shot[1]",)


def test_caller_marked_volatile_system_goes_after_the_chunks(local_tokenizer):
    asm = Assembler(local_tokenizer)
    plan = asm.assemble(
        system="Today is Monday.", chunks=CHUNKS, question="q", stability={"system": "volatile"}
    )
    assert plan.spans(SegmentKind.SYSTEM)[0].start > plan.spans(SegmentKind.CHUNK)[-1].end
    assert plan.stats.invalidators == ()
