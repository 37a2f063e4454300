"""Batch jobs (ragkv/batch.py): the planner's order, sessions, bounded windows, and answers
that do not depend on the schedule, on a tiny random model."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from support import save_tiny_checkpoint, training_text

import ragkv
from ragkv.batch import BatchItem, gather_in_order, windows
from ragkv.batch_plan import keep_turn_order, plan_window, prefix_leaders
from ragkv.bench.simulated import SimulatedEngine
from ragkv.cache_engine import Engine, SamplingParams
from ragkv.errors import InvalidInputError

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
SYSTEM = "Answer the question from the context."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)
    with Engine.from_pretrained(path, device="cpu", kv_cache_tokens=4096, max_num_seqs=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def passages() -> list[str]:
    text = training_text()
    return [text[i][:300] for i in range(8)]


def k(name: str) -> bytes:
    return name.encode()


# -- the planner ---------------------------------------------------------------------------


def test_items_sharing_chunks_run_together_with_the_shared_ones_first():
    keys = [
        [k("a"), k("x1")],
        [k("b"), k("c"), k("y1")],
        [k("x2"), k("a")],
        [k("c"), k("b"), k("y2")],
        [k("a"), k("x3")],
    ]
    order, ranks = plan_window(keys, [""] * 5)
    assert order == [0, 2, 4, 1, 3]

    def chunks(i):
        return sorted(ranks[i], key=ranks[i].get)

    assert [chunks(i)[0] for i in (0, 2, 4)] == [k("a")] * 3  # the shared chunk leads
    assert chunks(1)[:2] == chunks(3)[:2] == [k("b"), k("c")]  # one order for both
    assert chunks(2) == [k("a")]  # only the path: the assembler orders the rest itself
    # each waits for the prefill of the one before it in its subtree
    assert prefix_leaders(order, ranks, [""] * 5) == {2: 0, 4: 2, 3: 1}


def test_a_generic_chunk_does_not_split_a_topic():
    # "g" is in five items of four topics; "t1" "t2" hold four items of one topic together:
    # counting alone would lead with g and split the topic; one level of look-ahead does not.
    keys = [
        [k("g"), k("t1"), k("t2"), k("p")],
        [k("t1"), k("t2"), k("q")],
        [k("g"), k("t1"), k("t2"), k("r")],
        [k("t1"), k("t2"), k("s")],
        [k("g"), k("u")],
        [k("g"), k("v")],
        [k("g"), k("w")],
    ]
    order, ranks = plan_window(keys, [""] * 7)
    topic = [i for i in order if k("t1") in ranks[i]]
    assert topic == order[: len(topic)] or topic == order[-len(topic) :]
    assert all(sorted(ranks[i], key=ranks[i].get)[:2] == [k("t1"), k("t2")] for i in topic)
    assert all(ranks[i] == {} for i in order if i not in topic and k("g") not in keys[i])


def test_a_long_shared_passage_outweighs_short_ones_shared_as_often():
    # Items 0 and 1 share the long passage L; 0 and 2 share short s1, 1 and 3 short s2.
    # Each is one sharing, but L saves the most prefill: with its weight it leads 0 and 1.
    keys = [[k("s1"), k("L")], [k("s2"), k("L")], [k("s1"), k("x")], [k("s2"), k("y")]]
    weights = {k("s1"): 40, k("s2"): 40, k("L"): 900, k("x"): 50, k("y"): 50}
    order, ranks = plan_window(keys, [""] * 4, weights=weights)
    assert ranks[0] == ranks[1] == {k("L"): 0}
    assert abs(order.index(0) - order.index(1)) == 1
    _, unweighted = plan_window(keys, [""] * 4)  # all alike: the first seen leads
    assert unweighted[0] == {k("s1"): 0}


def test_heads_never_mix_and_a_session_keeps_its_turns_in_order():
    keys = [[k("a")], [k("a")], [k("b")], [k("a")]]
    order, _ = plan_window(keys, ["s1", "s2", "s1", "s1"])
    assert {tuple(sorted(order[:3])), tuple(sorted(order[3:]))} == {(0, 2, 3), (1,)}
    turns = keep_turn_order([3, 0, 2, 1], [None, None, "x", "x"])
    assert turns == [0, 2, 3, 1]  # item 3 waits for item 2, then follows it
    assert sorted(turns) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("items", "window", "param"),
    [
        ([42], 4, "items[0]"),
        ([{"question": "q", "chunk": []}], 4, "items[0]"),
        ([{"chunks": []}], 4, "items[0].question"),
        ([BatchItem("q", "one string")], 4, "items[0].chunks"),
        ([BatchItem("q", [], session=[1])], 4, "items[0].session"),
        (["q"], 0, "window"),
        ("a question", 4, "items"),
    ],
)
def test_bad_items_are_refused_naming_the_field(items, window, param):
    with pytest.raises(InvalidInputError) as refused:
        list(windows(items, window))
    assert refused.value.param == param


# -- answers --------------------------------------------------------------------------------


def test_answers_come_in_the_callers_order_and_equal_each_prompt_run_alone(engine, passages):
    rng = random.Random(3)
    items = [
        BatchItem(f"Question {i}?", rng.sample(passages[:5], 3), system=SYSTEM) for i in range(10)
    ]
    pipe = ragkv.Pipeline(engine)
    answers = pipe.answer_batch(items, params=PARAMS, max_in_flight=3)
    assert [a.plan.token_ids[-12:] for a in answers] == [
        pipe.prepare(it.question, it.chunks, system=SYSTEM).plan.token_ids[-12:] for it in items
    ]  # each answer is its own item's (the question ends the prompt)
    with Engine.from_pretrained(
        engine.config.model, device="cpu", kv_cache_tokens=4096, enable_prefix_caching=False
    ) as alone:
        for answer in answers:
            ref = alone.generate(answer.plan.token_ids, PARAMS)
            assert answer.output.token_ids == ref.token_ids  # greedy, fp32: identical
    assert sum(a.usage.cached_tokens for a in answers) > 0


def test_items_sharing_chunks_share_one_order_and_reuse_it(engine, passages):
    pipe = ragkv.Pipeline(engine)
    items = [
        {"question": "First?", "chunks": [passages[5], passages[6]]},
        {"question": "Second?", "chunks": [passages[7], passages[6], passages[5]]},
        {"question": "Third?", "chunks": [passages[6], passages[5]]},
    ]
    answers = pipe.answer_batch(items, params=PARAMS, max_in_flight=3)
    texts = [[s.content_hash for s in a.plan.spans("chunk")] for a in answers]
    assert texts[0] == texts[2] == texts[1][:2]  # one shared order, the shared pair first
    # the later ones wait for the first one's prefill, then reuse its chunks
    shared = answers[0].plan.spans("chunk")[1].end // engine.block_size * engine.block_size
    assert sorted(a.usage.cached_tokens for a in answers)[1:] >= [shared, shared]


def test_a_session_gets_its_earlier_turns_as_history(engine, passages):
    pipe = ragkv.Pipeline(engine)
    items = [
        BatchItem("What is first?", [passages[0]], session="s"),
        BatchItem("Unrelated?", [passages[1]]),
        BatchItem("And then?", [passages[0], passages[2]], session="s"),
    ]
    first, _, second = pipe.answer_batch(items, params=PARAMS)
    text = second.prompt_text
    assert text.index("What is first?") < text.index(first.text) < text.index("And then?")
    assert "Unrelated?" not in text and "And then?" not in first.prompt_text


def test_a_failure_is_that_items_result_or_raises(engine, passages, monkeypatch):
    pipe = ragkv.Pipeline(engine)
    items = [BatchItem("fine?", [passages[0]]), BatchItem("boom?", [passages[1]], session="s"),
             BatchItem("after boom?", [passages[2]], session="s")]  # fmt: skip
    real = pipe.prepare

    def prepare(question, *args, **kwargs):
        if question == "boom?":
            raise InvalidInputError("this one is bad", param="question")
        return real(question, *args, **kwargs)

    monkeypatch.setattr(pipe, "prepare", prepare)
    fine, bad, skipped = pipe.answer_batch(items, params=PARAMS, return_exceptions=True)
    assert isinstance(fine, ragkv.Answer)
    assert isinstance(bad, InvalidInputError)
    assert isinstance(skipped, ragkv.batch.TurnSkippedError)
    with pytest.raises(InvalidInputError, match="this one is bad"):
        pipe.answer_batch(items, params=PARAMS)
    for _ in range(200):  # the others were cancelled: their aborts reach the engine
        if not engine.scheduler.has_unfinished():
            break
        threading.Event().wait(0.025)
    assert not engine.scheduler.has_unfinished()


def test_a_large_batch_is_read_one_window_at_a_time(engine, passages):
    pipe = ragkv.Pipeline(SimulatedEngine(engine.tokenizer, 4096))
    pulled = 0

    def items():
        nonlocal pulled
        for i in range(25):
            pulled += 1
            yield {"question": f"q{i}", "chunks": [passages[i % 4]]}

    stream = pipe.stream_batch(items(), params=PARAMS, window=10)
    first = next(stream)
    assert pulled == 10 and first.plan.token_ids  # one window read, not the batch
    rest = list(stream)
    assert len(rest) == 24 and pulled == 25


def test_the_async_form_gives_the_same_answers(engine, passages):
    pipe = ragkv.Pipeline(engine)
    items = [BatchItem(f"Q{i}?", [passages[i % 3], passages[3]]) for i in range(4)]
    sync = [a.text for a in pipe.answer_batch(items, params=PARAMS)]
    together = asyncio.run(pipe.aanswer_batch(items, params=PARAMS))
    assert [a.text for a in together] == sync


def test_the_whole_tree_look_ahead_shares_more_than_one_level(monkeypatch):
    # On the bench's synthetic workload (no model needed): the prefix tree the plan builds
    # shares more chunk positions with the whole-tree look-ahead than with one level only.
    from ragkv import batch_plan
    from ragkv.bench.workload import SyntheticConfig, synthetic_workload
    from ragkv.dedup import ChunkRegistry, Deduplicator

    workload = synthetic_workload(SyntheticConfig(requests=40, topics=10, timestamp=False))
    dedup, registry = Deduplicator(), ChunkRegistry()
    keys = [[registry.key(c) for c in dedup.dedupe(r.chunks).chunks] for r in workload.requests]

    def sharings(ranks) -> int:  # prefix-tree nodes passed by more than one item
        prefixes = {}
        for rank in ranks:
            path = tuple(sorted(rank, key=rank.get))
            for n in range(1, len(path) + 1):
                prefixes[path[:n]] = prefixes.get(path[:n], 0) + 1
        return sum(count - 1 for count in prefixes.values())

    _, deep = plan_window(keys, [""] * len(keys))
    monkeypatch.setattr(batch_plan, "_LOOKAHEAD_MEMBERS", 0)
    _, shallow = plan_window(keys, [""] * len(keys))
    assert sharings(deep) > sharings(shallow)


def test_a_bad_item_in_a_list_is_refused_before_any_item_runs(engine, passages):
    pipe = ragkv.Pipeline(engine)
    finished = engine.stats().requests_finished
    items = [BatchItem(f"Q{i}?", [passages[0]]) for i in range(3)] + [{"chunks": []}]
    with pytest.raises(InvalidInputError) as refused:
        pipe.answer_batch(items, params=PARAMS, window=2)
    assert refused.value.param == "items[3].question"
    assert engine.stats().requests_finished == finished  # the first window never ran
    with pytest.raises(InvalidInputError, match="window"):
        pipe.stream_batch(items[:3], window=0)  # at the call, not at the first answer


async def _start_order(order, sessions, leaders, limit):
    started = []

    def job(i):
        async def run(prefilled):
            started.append(i)
            await asyncio.sleep(0.01)
            prefilled()
            await asyncio.sleep(0.01)
            return i

        return run

    results = await gather_in_order(
        [job(i) for i in range(len(order))], order, sessions, limit,
        fail_fast=True, leaders=leaders,
    )  # fmt: skip
    assert results == list(range(len(order)))
    return started


async def test_no_job_passes_one_waiting_for_its_leaders_prefill():
    # Job 2 (another subtree) had a free slot while job 1 waited for job 0's prefill; started
    # first, its prefix would crowd the pool before job 1's subtree is done.
    assert await _start_order([0, 1, 2], [None] * 3, {1: 0}, limit=3) == [0, 1, 2]


async def test_a_job_waiting_for_its_sessions_previous_turn_is_passed():
    # A whole answer is a long wait: job 2 runs meanwhile.
    assert await _start_order([0, 1, 2], ["s", "s", None], {}, limit=3) == [0, 2, 1]


def test_history_as_role_content_pairs_or_malformed_fails_only_its_item(engine, passages):
    # Planning read every turn with .get: a (role, content) pair, which the assembler
    # accepts, or any malformed turn raised before any item ran and took the window down.
    pipe = ragkv.Pipeline(engine)
    items = [
        BatchItem("paired?", [passages[0]], history=[("user", "hi"), ("assistant", "hello")]),
        BatchItem("malformed?", [passages[1]], history=[42]),
        BatchItem("fine?", [passages[2]]),
    ]
    paired, malformed, fine = pipe.answer_batch(items, params=PARAMS, return_exceptions=True)
    assert isinstance(paired, ragkv.Answer) and isinstance(fine, ragkv.Answer)
    assert isinstance(malformed, InvalidInputError) and malformed.param == "history"
