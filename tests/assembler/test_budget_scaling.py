"""fit_budget drops the same chunks as the one-at-a-time rule, with O(log n) length calls."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from ragkv.assembler.budget import fit_budget
from ragkv.assembler.segments import Segment, SegmentKind, Stability
from ragkv.dedup import Chunk

HEADER, DELIMITER, FRAME = 5, 2, 30


def segment(i: int, num_tokens: int, stable: bool, score: float | None) -> Segment:
    chunk = None if score is None else Chunk(f"chunk {i}", score=score)
    return Segment(
        SegmentKind.CHUNK,
        Stability.STABLE if stable else Stability.VOLATILE,
        f"chunk {i}",
        (7,) * num_tokens,
        i.to_bytes(4, "little"),
        rank=i,
        chunk=chunk,
    )


def prompt_length(chunks: Sequence[Segment]) -> int:
    """The assembler's shape: a frame, a context header once, a delimiter between chunks."""
    if not chunks:
        return FRAME
    return FRAME + HEADER + sum(len(s.token_ids) for s in chunks) + DELIMITER * (len(chunks) - 1)


def one_at_a_time(chunks, max_tokens, length):
    """The original rule: drop victims in order, re-measuring after each, until it fits."""
    if length(chunks) <= max_tokens:
        return list(chunks), []
    victims = sorted(chunks, key=lambda s: (s.stability is Stability.STABLE, s.relevance))
    dropped: set[int] = set()
    kept = list(chunks)
    for victim in victims:
        dropped.add(id(victim))
        kept = [s for s in chunks if id(s) not in dropped]
        if length(kept) <= max_tokens:
            break
    return kept, [s for s in chunks if id(s) in dropped]


chunk_specs = st.lists(
    st.tuples(
        st.integers(0, 40),
        st.booleans(),
        st.one_of(st.none(), st.sampled_from([0.1, 0.5, 0.9])),  # ties included
    ),
    max_size=30,
)


@given(specs=chunk_specs, slack=st.integers(0, 400))
def test_drops_exactly_what_the_one_at_a_time_rule_drops(specs, slack):
    chunks = [segment(i, *spec) for i, spec in enumerate(specs)]
    budget = FRAME + slack
    assert fit_budget(chunks, budget, prompt_length) == one_at_a_time(chunks, budget, prompt_length)


def test_twenty_thousand_chunks_need_a_logarithmic_number_of_length_calls():
    chunks = [segment(i, 10 + i % 7, i % 3 == 0, (i % 11) / 10) for i in range(20_000)]
    calls = 0

    def counting_length(kept: Sequence[Segment]) -> int:
        nonlocal calls
        calls += 1
        return prompt_length(kept)

    budget = prompt_length(chunks) // 3
    kept, dropped = fit_budget(chunks, budget, counting_length)
    assert prompt_length(kept) <= budget and len(kept) + len(dropped) == len(chunks)
    assert calls <= 2 + 16  # the full prompt, the floor, then a binary search over 20k
