"""ragkv.Pipeline: dedup, canonical assembly and the engine stack, end to end on a tiny model."""

from __future__ import annotations

import asyncio

import pytest
from support import tiny_engine, tiny_engine_fixture, training_text

import ragkv
from ragkv.cache_engine import SamplingParams
from ragkv.dedup import Chunk

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
SYSTEM = "Answer the question from the context."


engine = tiny_engine_fixture("llama", 5, kv_cache_tokens=8192)


@pytest.fixture
def passages() -> list[str]:
    text = training_text()
    return [text[i][:600] for i in range(6)]


def test_duplicates_are_removed_before_the_prompt_exists(engine, passages):
    pipe = ragkv.Pipeline(engine)
    retrieved = [passages[0], passages[1], passages[0], Chunk(passages[1], source_id="b")]
    answer = pipe.answer("What is this about?", retrieved, system=SYSTEM, params=PARAMS)
    assert answer.dedup.chunks_in == 4 and answer.dedup.chunks_out == 2
    assert len(answer.plan.spans("chunk")) == 2
    assert answer.usage.prompt_tokens == len(answer.plan.token_ids)
    assert answer.output.prompt_token_ids == answer.plan.token_ids


def test_same_chunks_in_another_retrieval_order_hit_the_cache(engine, passages):
    pipe = ragkv.Pipeline(engine)
    first = pipe.answer("First question?", passages[:4], system=SYSTEM, params=PARAMS)
    second = pipe.answer("Second one?", passages[:4][::-1], system=SYSTEM, params=PARAMS)
    shared = 0
    for a, b in zip(first.plan.token_ids, second.plan.token_ids, strict=False):
        if a != b:
            break
        shared += 1
    assert shared > sum(s.end - s.start for s in second.plan.spans("chunk"))
    assert second.usage.cached_tokens == shared // engine.block_size * engine.block_size


def test_without_dedup_duplicates_reach_the_assembler(engine, passages):
    pipe = ragkv.Pipeline(engine, dedup=False)
    prepared = pipe.prepare("Q?", [passages[2], passages[2]], system=SYSTEM)
    assert prepared.dedup.stats.chunks_out == 2
    assert len(prepared.plan.spans("chunk")) == 2


def test_stream_and_async_give_the_same_answer(engine, passages):
    pipe = ragkv.Pipeline(engine)
    full = pipe.answer("Streaming?", passages[:2], system=SYSTEM, params=PARAMS)
    deltas = list(pipe.stream("Streaming?", passages[:2], system=SYSTEM, params=PARAMS))
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].answer is not None
    assert deltas[-1].answer.output.token_ids == full.output.token_ids

    async def many():
        return await asyncio.gather(
            *(
                pipe.aanswer("Streaming?", passages[:2], system=SYSTEM, params=PARAMS)
                for _ in range(3)
            )
        )

    answers = asyncio.run(many())
    assert {tuple(a.output.token_ids) for a in answers} == {tuple(full.output.token_ids)}
    assert all(a.usage.cached_tokens > 0 for a in answers)


def test_cache_salt_isolates_tenants(engine, passages):
    pipe = ragkv.Pipeline(engine)
    pipe.answer("Q1?", passages[3:5], system=SYSTEM, params=PARAMS, cache_salt="tenant-1")
    other = pipe.answer("Q1?", passages[3:5], system=SYSTEM, params=PARAMS, cache_salt="tenant-2")
    assert other.usage.cached_tokens == 0


def test_the_callers_registry_is_shared_with_the_assembler(engine):
    from ragkv.dedup import ChunkRegistry

    registry = ChunkRegistry()  # empty, hence falsy: it must still be used
    pipe = ragkv.Pipeline(engine, registry=registry)
    assert pipe.registry is registry and pipe.assembler.registry is registry


def test_the_deduplicators_key_is_not_undone_by_the_assembler(engine, passages):
    from ragkv.dedup import Deduplicator

    pipe = ragkv.Pipeline(engine, deduplicator=Deduplicator(key="source_id"))
    same_text = [Chunk(passages[0], source_id="a"), Chunk(passages[0], source_id="b")]
    prepared = pipe.prepare("Q?", same_text, system=SYSTEM)
    assert prepared.dedup.stats.chunks_out == 2
    assert len(prepared.plan.spans("chunk")) == 2


def test_isolated_salts_learn_chunk_order_separately(engine, passages):
    """With isolate_by_salt, tenant A's traffic never changes the order tenant B is sent."""
    shared = ragkv.Pipeline(engine)
    isolated = ragkv.Pipeline(engine, isolate_by_salt=True)
    for pipe in (shared, isolated):
        for other in (0, 1, 5, 0):  # tenant a makes passages[2] stable (hot) in its state
            pipe.prepare("q?", [passages[2], passages[3], passages[other]], cache_salt="a")
    order_b = {}
    for name, pipe in (("shared", shared), ("isolated", isolated)):
        plan = pipe.prepare("q?", [passages[4], passages[2]], cache_salt="b").plan
        order_b[name] = [s.index for s in plan.spans("chunk")]
    # New chunks go by content hash (passages[4] sorts first); a stable one goes first.
    fresh = ragkv.Pipeline(engine).prepare("q?", [passages[4], passages[2]]).plan
    assert [s.index for s in fresh.spans("chunk")] == [0, 1]
    assert order_b["shared"] == [1, 0]  # tenant a's traffic reordered tenant b's prompt
    assert order_b["isolated"] == [0, 1]
    assert isolated.assembler_for("a") is not isolated.assembler_for("b")
    assert isolated.assembler_for(None) is isolated.assembler


def test_isolated_namespaces_are_bounded(engine, passages):
    pipe = ragkv.Pipeline(engine, isolate_by_salt=True, max_namespaces=2)
    first = pipe.assembler_for("a")
    pipe.assembler_for("b")
    pipe.assembler_for("c")
    assert pipe.assembler_for("a") is not first  # "a" was forgotten, a fresh fork serves it


def test_reuse_blend_reuses_a_chunk_seen_at_another_position(engine, passages):
    blend = ragkv.BlendConfig("first-k", k=2)
    pipe = ragkv.Pipeline(engine, order="retrieval", reuse="blend", blend=blend)
    salt = "blend-pipeline"  # its own prefix cache and chunk index entries
    first = pipe.answer("Q one?", passages[:3], system=SYSTEM, params=PARAMS, cache_salt=salt)
    assert not first.output.approximate and first.usage.reused_nonprefix_tokens == 0
    moved = [passages[4], passages[2], passages[0]]  # two known chunks, new context before
    second = pipe.answer("Q two?", moved, system=SYSTEM, params=PARAMS, cache_salt=salt)
    spans = second.plan.spans("chunk")
    known = sum(s.end - s.start - 2 for s in spans[1:])
    assert second.output.approximate and second.usage.reused_nonprefix_tokens == known
    streamed = list(
        pipe.stream("Q two?", moved[::-1], system=SYSTEM, params=PARAMS, cache_salt=salt)
    )[-1].answer
    assert streamed.usage.reused_nonprefix_tokens > 0
    exact = ragkv.Pipeline(engine, order="retrieval").answer(
        "Q two?", moved, system=SYSTEM, params=PARAMS, cache_salt=salt
    )
    assert not exact.output.approximate and exact.usage.reused_nonprefix_tokens == 0


def test_reuse_settings_are_checked(engine):
    from ragkv.errors import ConfigError

    for kwargs, param in [
        ({"reuse": "magic"}, "reuse"),
        ({"blend": ragkv.BlendConfig()}, "blend"),
        ({"reuse": "blend", "blend": "first-k"}, "blend"),
    ]:
        with pytest.raises(ConfigError) as err:
            ragkv.Pipeline(engine, **kwargs)
        assert err.value.param == param

    class Remote:  # an EngineLike without chunk reuse (e.g. RemoteEngine)
        tokenizer, block_size = engine.tokenizer, engine.block_size

    with pytest.raises(ConfigError) as err:
        ragkv.Pipeline(Remote(), reuse="blend")
    assert err.value.param == "reuse"


def test_sampling_settings_as_keywords_everywhere(engine, passages):
    """``answer(q, chunks, max_tokens=3)`` and ``generate(ids, max_tokens=3)``: the first
    thing people write works, and means what SamplingParams(max_tokens=3) means."""
    pipe = ragkv.Pipeline(engine)
    answer = pipe.answer("Q?", passages[:2], max_tokens=3, ignore_eos=True, temperature=0)
    assert answer.usage.completion_tokens == 3
    assert pipe.default_params.max_tokens == 256  # one default answer length
    deltas = list(pipe.stream("Q?", passages[:2], params=PARAMS, max_tokens=2))
    assert deltas[-1].answer.usage.completion_tokens == 2  # keywords change params
    direct = engine.generate(answer.plan.token_ids, max_tokens=3, ignore_eos=True)
    assert direct.token_ids == answer.output.token_ids
    both = engine.generate([[5, 6, 7], [8, 9]], max_tokens=2, ignore_eos=True)
    assert [len(o.token_ids) for o in both] == [2, 2]
    again = asyncio.run(pipe.aanswer("Q?", passages[:2], max_tokens=3, ignore_eos=True))
    assert again.output.token_ids == answer.output.token_ids


@pytest.mark.parametrize(
    ("call", "param", "match"),
    [
        (lambda p, c: p.answer("Q?", c, max_tokenz=3), "max_tokenz", "unknown sampling"),
        (lambda p, c: p.answer("Q?", c, max_tokens=0), "max_tokens", "at least 1"),
        (lambda p, c: p.answer("Q?", c, params={"max_tokens": 3}), "params", r"\*\*params"),
        (lambda p, c: p.engine.generate([1, 2], {"max_tokens": 3}), "params", r"\*\*params"),
        (lambda p, c: p.answer("Q?", "one passage as a string"), "chunks", r"wrap it: \[text\]"),
        (lambda p, c: p.answer("Q?", None), "chunks", "pass \\[\\] for no context"),
        (lambda p, c: p.answer("Q?", [3]), "chunks", "int"),
        (
            lambda p, c: p.answer("Q?", c, history=[{"role": "<|im_start|>x", "content": "y"}]),
            "history[0].role",
            "'user' or 'assistant'",
        ),
    ],
    ids=[
        "unknown-setting",
        "bad-value",
        "params-dict",
        "engine-params-dict",
        "str",
        "none",
        "chunk-type",
        "history-role",
    ],  # fmt: skip
)
def test_wrong_inputs_fail_before_anything_runs_and_name_their_field(
    engine, passages, call, param, match
):
    before = engine.stats().requests_finished
    with pytest.raises(ragkv.errors.InvalidInputError, match=match) as info:
        call(ragkv.Pipeline(engine), passages[:2])
    assert info.value.param == param
    assert engine.stats().requests_finished == before


def test_a_bad_order_names_its_parameter(engine):
    with pytest.raises(ragkv.errors.ConfigError, match="stable-first") as info:
        ragkv.Pipeline(engine, order="canonical")
    assert info.value.param == "order"


def test_a_retrieval_larger_than_the_context_fits_by_dropping_the_least_relevant(
    tmp_path_factory, passages
):
    short = tmp_path_factory.mktemp("short")
    with tiny_engine(short, 5, kv_cache_tokens=4096, max_model_len=400) as e:
        pipe = ragkv.Pipeline(e)
        chunks = [Chunk(p, score=1.0 - i / 10) for i, p in enumerate(passages)]
        answer = pipe.answer("Q?", chunks, max_tokens=16, ignore_eos=True)
        assert pipe.prompt_budget(SamplingParams(max_tokens=16)) == 400 - 16
        assert answer.dropped and answer.usage.prompt_tokens <= 400 - 16
        kept = {s.index for s in answer.plan.spans("chunk")}
        assert min(d.index for d in answer.dropped) > max(kept)  # least relevant went first
        assert answer.usage.completion_tokens == 16
        with pytest.raises(ragkv.errors.PromptTooLongError, match="Pipeline"):
            e.generate(list(range(5, 405)), max_tokens=1)


def test_one_tenant_cannot_learn_from_tokenization_speed_what_another_sent(engine, passages):
    """Token ids are cached per tenant (isolate_by_salt): a document another tenant sent is
    not a registry hit for this one, so timing reveals nothing across tenants."""
    pipe = ragkv.Pipeline(engine, isolate_by_salt=True)
    first = pipe.prepare("Q?", [passages[0]], cache_salt="tenant-a").plan.stats
    again = pipe.prepare("Q?", [passages[0]], cache_salt="tenant-a").plan.stats
    other = pipe.prepare("Q?", [passages[0]], cache_salt="tenant-b").plan.stats
    assert (first.chunks_tokenized, again.chunks_reused) == (1, 1)  # a tenant's own cache
    assert (other.chunks_tokenized, other.chunks_reused) == (1, 0)  # not the other's
