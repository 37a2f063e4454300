"""Sub-slot stability: a "static" slot that changes keeps its stable parts in front."""

from __future__ import annotations

import logging

from support import common_prefix

from ragkv.assembler import Assembler, SegmentKind, Stability

CHUNKS = [
    "Lists are mutable sequences, typically used to store collections of items.",
    "Tuples are immutable sequences, typically used to store heterogeneous data.",
]
RULES = (
    "Rules: answer only from the context documents. If they do not contain the answer, say "
    "so plainly. Quote identifiers exactly as they appear, keep answers short, and never "
    "invent functions, modules or options that the context does not mention."
)
INTRO = (
    "You are a helpful assistant for the Python language reference. Your readers are "
    "experienced programmers who want precise statements about semantics, not tutorials."
)


def _tail_changes(i: int) -> str:
    return f"{INTRO} {RULES}\nCurrent time: 2024-05-01T10:{i:02d}:{i * 7 % 60:02d}Z."


def _middle_changes(i: int) -> str:
    return f"{INTRO}\nToday is 2024-05-{i + 1:02d}; the user is user{i * 37}.\n{RULES}"


def _run(asm: Assembler, systems, **kwargs):
    return [
        asm.assemble(system=s, chunks=CHUNKS, question=f"q{i}", **kwargs)
        for i, s in enumerate(systems)
    ]


def test_a_slot_whose_tail_changes_keeps_its_head_in_front(local_tokenizer, caplog):
    asm = Assembler(local_tokenizer, block_size=4)
    with caplog.at_level(logging.WARNING, logger="ragkv.assembler"):
        plans = _run(asm, [_tail_changes(i) for i in range(8)])
    assert plans[0].stats.invalidators == ()
    assert all(p.stats.invalidators == ("system",) for p in plans[3:])
    warnings = [r for r in caplog.records if "system segment is marked static" in r.message]
    assert len(warnings) == 1
    last = plans[-1]
    systems = last.spans(SegmentKind.SYSTEM)
    kept = [s for s in systems if not s.demoted]
    moved = [s for s in systems if s.demoted]
    chunk_end = max(s.end for s in last.spans(SegmentKind.CHUNK))
    assert kept and all(s.stability is Stability.STATIC and s.end < chunk_end for s in kept)
    assert moved and all(s.stability is Stability.VOLATILE and s.start > chunk_end for s in moved)
    version = _tail_changes(7)
    head_text = local_tokenizer.decode(last.token_ids[kept[0].start : kept[-1].end])
    moved_text = local_tokenizer.decode(last.token_ids[moved[0].start : moved[0].end])
    assert head_text + moved_text == version
    assert INTRO in head_text and RULES in head_text  # the stable head stays in front
    assert moved_text.endswith(":07:49Z.")  # what changes between requests moved
    # Consecutive prompts now share the stable head and every chunk.
    assert common_prefix(plans[-2].token_ids, last.token_ids) >= chunk_end
    assert last.stats.moved_tokens == sum(s.end - s.start for s in moved)


def test_a_slot_that_changes_in_the_middle_keeps_its_stable_runs(local_tokenizer):
    asm = Assembler(local_tokenizer, block_size=4)
    plans = _run(asm, [_middle_changes(i) for i in range(8)])
    last = plans[-1]
    systems = last.spans(SegmentKind.SYSTEM)
    kept = [
        local_tokenizer.decode(last.token_ids[s.start : s.end]) for s in systems if not s.demoted
    ]
    moved = [local_tokenizer.decode(last.token_ids[s.start : s.end]) for s in systems if s.demoted]
    assert len(kept) == 2 and len(moved) == 1
    assert kept[0].startswith(INTRO[:60]) and RULES[-60:] in kept[1]
    assert kept[0] + moved[0] + kept[1] == _middle_changes(7)
    # The whole sentence moves, label included: never half a date.
    assert moved[0] == "Today is 2024-05-08; the user is user259."
    chunk_start = min(s.start for s in last.spans(SegmentKind.CHUNK))
    chunk_end = max(s.end for s in last.spans(SegmentKind.CHUNK))
    assert all(s.end <= chunk_start for s in systems if not s.demoted)
    assert all(s.start >= chunk_end for s in systems if s.demoted)
    assert common_prefix(plans[-2].token_ids, last.token_ids) >= chunk_end
    # Nothing was lost or invented: the system tokens are the version's tokens, rearranged.
    ids = local_tokenizer(_middle_changes(7), add_special_tokens=False)["input_ids"]
    parts = [last.token_ids[s.start : s.end] for s in systems]
    assert sorted(sum(parts, [])) == sorted(ids)


def test_a_slot_that_never_changes_is_never_moved(local_tokenizer):
    asm = Assembler(local_tokenizer, block_size=4)
    for i in range(10):
        plan = asm.assemble(system=_tail_changes(0), chunks=CHUNKS, question=f"question {i}")
        assert plan.stats.invalidators == () and plan.stats.moved_tokens == 0
        (system,) = plan.spans(SegmentKind.SYSTEM)
        assert system.start < plan.spans(SegmentKind.CHUNK)[0].start and not system.demoted


def test_a_rotating_set_of_system_prompts_is_not_changing(local_tokenizer):
    asm = Assembler(local_tokenizer, block_size=4)
    for i in range(12):
        plan = asm.assemble(system=_tail_changes(i % 2), chunks=CHUNKS, question="q")
    assert plan.stats.invalidators == ()


def test_a_repeat_does_not_flip_the_layout_back_but_settling_does(local_tokenizer):
    asm = Assembler(local_tokenizer, block_size=4)
    _run(asm, [_tail_changes(i) for i in range(5)])
    again = asm.assemble(system=_tail_changes(4), chunks=CHUNKS, question="q")  # a repeat
    assert again.stats.demoted == ("system",)
    for _ in range(asm.slots.settle_after):
        settled = asm.assemble(system=_tail_changes(4), chunks=CHUNKS, question="q")
    assert settled.stats.invalidators == () and settled.stats.moved_tokens == 0


def test_demotion_can_be_switched_off(local_tokenizer):
    asm = Assembler(local_tokenizer, demote_invalidators=False)
    plans = _run(asm, [_tail_changes(i) for i in range(5)])
    plan = plans[-1]
    assert plan.stats.invalidators == ("system",) and plan.stats.demoted == ()
    (system,) = plan.spans(SegmentKind.SYSTEM)
    assert system.start < plan.spans(SegmentKind.CHUNK)[0].start
    assert system.stability is Stability.STATIC and not system.demoted


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


def test_learned_state_is_bounded_in_slots_and_slot_size():
    from ragkv.assembler.slots import _MAX_SLOTS, SlotLearner

    learner = SlotLearner(block_size=4, max_slot_tokens=32)
    for i in range(_MAX_SLOTS + 10):
        learner.observe(f"system[{i}]", b"k", [1, 2, 3])
    assert len(learner._slots) == _MAX_SLOTS
    # A slot over max_slot_tokens is never split, however often it changes.
    splits = [learner.observe("system[0]", bytes([i]), [i] * 33) for i in range(6)]
    assert splits == [None] * 6
    fresh = SlotLearner(block_size=4, max_slot_tokens=32)
    small = [fresh.observe("system", bytes([i]), [9] * 8 + [i]) for i in range(6)]
    assert small[-1] is not None and small[-1].head == 8


def test_a_batch_teaches_the_learner_first_and_then_reads_it_without_learning(local_tokenizer):
    # A batch runs identical versions together: learning in that order, the same version
    # seen again and again would read as settled. learn_system shows the versions in arrival
    # order; assembling with learn=False then splits every one and changes nothing.
    asm = Assembler(local_tokenizer, block_size=4)
    versions = [_tail_changes(i % 4) for i in range(8)]  # four users, interleaved
    asm.learn_system(versions)
    batch_order = sorted(versions)  # identical versions next to each other
    plans = _run(asm, batch_order * 3, learn=False)
    assert all(p.stats.invalidators == ("system",) for p in plans)
    untaught = Assembler(local_tokenizer, block_size=4)
    assert all(p.stats.invalidators == () for p in _run(untaught, batch_order, learn=False))
