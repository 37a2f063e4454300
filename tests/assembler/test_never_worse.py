"""Never worse than as-given: each plan's cached prefix is at least the application's order's."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragkv.assembler import Assembler, SegmentKind

BS = 4
PASSAGES = [f"Passage {i}: " + " ".join(f"word{i * 7 + j}" for j in range(12)) for i in range(8)]
SYSTEMS = [
    "You are a careful assistant. Answer from the context.",
    "You are a careful assistant. Answer from the context. Today is day {n}.",
    "You are a careful assistant. The user is {n}. Answer from the context only.",
]


class Oracle:
    """A model-free prefix cache: every block-aligned prefix of every prompt sent (unbounded)."""

    def __init__(self) -> None:
        self.prefixes: set[tuple[int, ...]] = set()

    def __call__(self, ids) -> int:
        best = 0
        for k in range(1, (len(ids) - 1) // BS + 1):
            if tuple(ids[: k * BS]) not in self.prefixes:
                break
            best = k * BS
        return best

    def send(self, ids) -> None:
        for k in range(1, len(ids) // BS + 1):
            self.prefixes.add(tuple(ids[: k * BS]))


requests = st.lists(
    st.tuples(
        st.integers(0, len(SYSTEMS) - 1),
        st.integers(0, 3),  # the changing value
        st.lists(st.integers(0, len(PASSAGES) - 1), min_size=0, max_size=5),
        st.integers(0, 2),  # question
    ),
    min_size=1,
    max_size=14,
)


def _replay(tokenizer, workload, order, slack, use_engine):
    asm = Assembler(tokenizer, block_size=BS, order=order, never_worse_slack=slack)
    app = Assembler(
        tokenizer, block_size=BS, order="retrieval", demote_invalidators=False, never_worse=False
    )
    oracle = Oracle()
    for system, n, picks, q in workload:
        kwargs = dict(
            system=SYSTEMS[system].format(n=n),
            chunks=[PASSAGES[i] for i in picks],
            question=f"Question {q}?",
        )
        plan = asm.assemble(residency=oracle if use_engine else None, **kwargs)
        as_given = app.assemble(**kwargs)
        assert oracle(plan.token_ids) >= oracle(as_given.token_ids) - slack
        if plan.stats.expected_as_given is not None and use_engine:
            assert plan.stats.expected_as_given == oracle(as_given.token_ids)
        if plan.stats.chosen == "as-given":
            assert plan.token_ids == as_given.token_ids
        oracle.send(plan.token_ids)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=requests, order=st.sampled_from(["stable-first", "cache-aware"]))
def test_with_engine_residency_a_plan_never_caches_less_than_the_apps_order(
    local_tokenizer, workload, order
):
    _replay(local_tokenizer, workload, order, slack=0, use_engine=True)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=requests)
def test_near_ties_go_canonical_within_one_block(local_tokenizer, workload):
    _replay(local_tokenizer, workload, "cache-aware", slack=BS, use_engine=True)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=requests)
def test_without_an_engine_the_assemblers_own_record_decides(local_tokenizer, workload):
    """The record sees exactly what was sent, so it agrees with the oracle here."""
    _replay(local_tokenizer, workload, "stable-first", slack=0, use_engine=False)


def test_the_apps_order_wins_when_its_prefix_is_cached_and_says_why(local_tokenizer):
    asm = Assembler(local_tokenizer, block_size=BS, never_worse_slack=0)
    oracle = Oracle()
    app = Assembler(local_tokenizer, block_size=BS, order="retrieval")
    chunks = [PASSAGES[5], PASSAGES[0], PASSAGES[3]]
    warm = app.assemble(system=SYSTEMS[0], chunks=chunks, question="Warm?")
    oracle.send(warm.token_ids)  # another client sent the app's order before
    plan = asm.assemble(system=SYSTEMS[0], chunks=chunks, question="Now?", residency=oracle)
    assert plan.stats.chosen == "as-given"
    assert [s.index for s in plan.spans(SegmentKind.CHUNK)] == [0, 1, 2]
    assert plan.stats.expected_as_given > plan.stats.expected_canonical
    assert plan.expected_cached_tokens == plan.stats.expected_as_given
    assert "as-given" in plan.stats.choice_reason and "engine" in plan.stats.choice_reason


def test_canonical_is_chosen_on_a_tie(local_tokenizer):
    asm = Assembler(local_tokenizer, block_size=BS)
    plan = asm.assemble(
        system=SYSTEMS[0], chunks=PASSAGES[:3][::-1], question="q", residency=lambda ids: 0
    )
    assert plan.stats.chosen == "canonical"
    assert plan.stats.expected_as_given == plan.stats.expected_canonical == 0
