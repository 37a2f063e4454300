"""Structured system prompts: the application marks what changes."""

from __future__ import annotations

import pytest

from ragkv.assembler import Assembler, SegmentKind, Stability, SystemPrompt, Volatile
from ragkv.errors import InvalidInputError

CHUNKS = ["Lists are mutable sequences.", "Tuples are immutable sequences.", "Sets are unordered."]
RULES = "Rules: answer from the context only; say so when it does not contain the answer.\n"


def _system_spans(plan):
    return plan.spans(SegmentKind.SYSTEM)


@pytest.mark.parametrize(
    ("make", "stable_texts", "volatile_text"),
    [
        (
            lambda day: ["You are a Python expert.\n", Volatile(f"Today is day {day}.\n"), RULES],
            ["You are a Python expert.\n", RULES],
            "Today is day {day}.\n",
        ),
        (
            lambda day: SystemPrompt(
                "You are a Python expert.\nToday is day {day}.\n" + RULES, day=day
            ),
            ["You are a Python expert.\n", RULES],
            "Today is day {day}.\n",  # the whole line moves, label included
        ),
    ],
    ids=["parts", "template"],
)
def test_volatile_parts_go_after_the_chunks_from_the_first_request(
    local_tokenizer, make, stable_texts, volatile_text
):
    asm = Assembler(local_tokenizer, block_size=4)
    first = asm.assemble(system=make(1), chunks=CHUNKS, question="q1")
    second = asm.assemble(system=make(2), chunks=CHUNKS[::-1], question="q2")
    for plan, day in ((first, 1), (second, 2)):
        spans = _system_spans(plan)
        chunk_start = min(s.start for s in plan.spans(SegmentKind.CHUNK))
        chunk_end = max(s.end for s in plan.spans(SegmentKind.CHUNK))
        stable = [s for s in spans if s.stability is Stability.STATIC]
        volatile = [s for s in spans if s.stability is Stability.VOLATILE]
        texts = [local_tokenizer.decode(plan.token_ids[s.start : s.end]) for s in stable]
        assert texts == stable_texts
        assert all(s.end <= chunk_start for s in stable)
        assert len(volatile) == 1 and volatile[0].start >= chunk_end
        moved = local_tokenizer.decode(plan.token_ids[volatile[0].start : volatile[0].end])
        assert moved == volatile_text.format(day=day)
        assert not volatile[0].demoted  # marked by the caller, not learned
    shared = 0
    for a, b in zip(first.token_ids, second.token_ids, strict=False):
        if a != b:
            break
        shared += 1
    assert shared >= max(s.end for s in second.spans(SegmentKind.CHUNK))


def test_a_template_renders_to_the_same_text_as_format(local_tokenizer):
    prompt = SystemPrompt("Hi {name!r}, it is {hour:02d}h. {{literal}}", name="Ann", hour=7)
    assert str(prompt) == "Hi 'Ann', it is 07h. {literal}"
    # Both values sit in one sentence: it moves whole, the literal text after it stays.
    assert prompt.parts() == [Volatile("Hi 'Ann', it is 07h."), " {literal}"]


@pytest.mark.parametrize(
    "system",
    [
        lambda: SystemPrompt("Hello {name}"),
        lambda: SystemPrompt("Hello {"),
        lambda: Volatile(3),
        lambda: Assembler.__call__,  # not a str, list or SystemPrompt
    ],
    ids=["missing-value", "bad-template", "volatile-not-str", "wrong-type"],
)
def test_bad_structured_prompts_raise_typed_errors_naming_system(local_tokenizer, system):
    asm = Assembler(local_tokenizer)
    with pytest.raises(InvalidInputError) as info:
        asm.assemble(system=system(), chunks=CHUNKS, question="q")
    assert info.value.param == "system"


def test_a_list_part_of_the_wrong_type_is_refused(local_tokenizer):
    with pytest.raises(InvalidInputError, match=r"system\[1\]"):
        Assembler(local_tokenizer).assemble(system=["ok", 3], question="q")


def test_the_apps_order_keeps_the_parts_in_place(local_tokenizer):
    """As-given, the parts are written in their order, back to back."""
    app = Assembler(local_tokenizer, order="retrieval", never_worse=False)
    plan = app.assemble(
        system=["A stable start. ", Volatile("Day 3. "), "A stable end."],
        chunks=CHUNKS,
        question="q",
        stability={"system": "static"},
    )
    assert "A stable start. Day 3. A stable end." not in plan.text  # canonical moves Day 3
    asm = Assembler(local_tokenizer, never_worse_slack=0)
    asm.sent.record(
        Assembler(local_tokenizer, order="retrieval", never_worse=False)
        .assemble(system="A stable start. Day 3. A stable end.", chunks=CHUNKS, question="q0")
        .token_ids
    )
    chosen = asm.assemble(
        system=["A stable start. ", Volatile("Day 3. "), "A stable end."],
        chunks=CHUNKS,
        question="q",
    )
    assert chosen.stats.chosen == "as-given"
    assert "A stable start. Day 3. A stable end." in chosen.text
