"""DedupPostprocessor, RagKVLLM and RagKVSynthesizer through LlamaIndex's public query flow
(in-memory VectorStoreIndex, MockEmbedding) on a tiny random model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.embeddings import MockEmbedding  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatInProgressEvent,
    LLMCompletionInProgressEvent,
)
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from support import tiny_engine_fixture, training_text  # noqa: E402

from ragkv.integrations.llama_index import (  # noqa: E402
    DedupPostprocessor,
    RagKVLLM,
    RagKVSynthesizer,
)


class Recorder(BaseEventHandler):
    events: list[Any] = []

    @classmethod
    def class_name(cls) -> str:
        return "Recorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def recorder():
    handler = Recorder(events=[])
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


engine = tiny_engine_fixture("li", 4, kv_cache_tokens=8192)


@pytest.fixture
def passages() -> list[str]:
    return [t[:300] for t in training_text()[:3]]


def nodes_with_a_reingested_copy(passages) -> list[TextNode]:
    # The same passage stored twice under different ids: LlamaIndex keeps both.
    return [
        TextNode(text=passages[0], id_="a"),
        TextNode(text=passages[1], id_="b"),
        TextNode(text=passages[0], id_="a-again"),
        TextNode(text=passages[2], id_="c"),
    ]


def index_of(nodes) -> VectorStoreIndex:
    return VectorStoreIndex(nodes=nodes, embed_model=MockEmbedding(embed_dim=8))


def test_postprocessor_dedups_llm_visible_text_and_keeps_the_best_score(passages):
    nodes = [
        NodeWithScore(node=TextNode(text=passages[0], id_="x"), score=0.2),
        NodeWithScore(node=TextNode(text=passages[0], id_="y"), score=0.7),
        NodeWithScore(node=TextNode(text=passages[1], id_="z"), score=0.5),
    ]
    out = DedupPostprocessor(order="retrieval").postprocess_nodes(nodes)
    assert [n.node.node_id for n in out] == ["x", "z"]
    assert out[0].score == 0.7
    assert out[0].node.metadata["ragkv_duplicates"] == 1
    assert out[0].node.get_content(metadata_mode="llm") == passages[0]  # ragkv keys hidden
    assert "ragkv_rank" not in nodes[0].node.metadata  # the stored node is untouched


def test_postprocessor_collapses_equal_text_from_different_files_by_default(passages):
    a = TextNode(text=passages[0], id_="a", metadata={"file": "a.txt"})
    b = TextNode(text=passages[0], id_="b", metadata={"file": "b.txt"})
    nodes = [NodeWithScore(node=a, score=1.0), NodeWithScore(node=b, score=1.0)]
    (kept,) = DedupPostprocessor().postprocess_nodes(nodes)  # content compared
    assert kept.node.metadata["ragkv_sources"] and kept.node.metadata["ragkv_duplicates"] == 1
    # Comparing what the LLM sees (file names included) keeps both, as configured.
    llm_text = DedupPostprocessor(metadata_mode=MetadataMode.LLM)
    assert len(llm_text.postprocess_nodes(nodes)) == 2
    b.excluded_llm_metadata_keys = ["file"]
    a.excluded_llm_metadata_keys = ["file"]
    assert len(llm_text.postprocess_nodes(nodes)) == 1


def test_synthesizer_reports_what_the_postprocessor_removed(engine, passages):
    nodes = [
        NodeWithScore(node=TextNode(text=passages[0], id_="a"), score=0.9),
        NodeWithScore(node=TextNode(text=passages[0], id_="b"), score=0.8),
        NodeWithScore(node=TextNode(text=passages[1], id_="c"), score=0.7),
    ]
    kept = DedupPostprocessor().postprocess_nodes(nodes)
    response = RagKVSynthesizer(RagKVLLM(engine=engine, max_tokens=1)).synthesize("Q?", kept)
    dedup = response.metadata["dedup"]
    assert dedup["postprocessor_duplicates"] == 1 and dedup["chunks_in"] == 2


def test_query_engine_drops_duplicates_and_reports_cached_tokens(engine, passages, recorder):
    index = index_of(nodes_with_a_reingested_copy(passages))
    llm = RagKVLLM(engine=engine, max_tokens=3)
    query_engine = index.as_query_engine(
        llm=llm, similarity_top_k=4, node_postprocessors=[DedupPostprocessor()]
    )
    first = query_engine.query("What is this about?")
    assert len(first.source_nodes) == 3
    assert len({n.node.get_content() for n in first.source_nodes}) == 3
    query_engine.query("What is this about?")
    ends = recorder.of(LLMChatEndEvent)
    assert len(ends) == 2
    usage = [e.response.raw["usage"] for e in ends]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = ends[1].response.additional_kwargs["cached_tokens"]
    assert cached == usage[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert ends[1].response.additional_kwargs["prompt_tokens"] == usage[1]["prompt_tokens"]


def test_synthesizer_assembles_nodes_as_chunks_and_hits_the_cache(engine, passages):
    index = index_of(nodes_with_a_reingested_copy(passages))
    llm = RagKVLLM(engine=engine, max_tokens=2)
    query_engine = index.as_query_engine(
        llm=llm, similarity_top_k=4, response_synthesizer=RagKVSynthesizer(llm, system="Brief.")
    )
    first = query_engine.query("First question?")
    assert first.metadata["dedup"]["chunks_in"] == 4
    assert first.metadata["dedup"]["chunks_out"] == 3  # the pipeline's own dedup
    assert len(first.metadata["plan"].spans("chunk")) == 3
    second = asyncio.run(query_engine.aquery("A different question?"))
    chunk_tokens = sum(s.end - s.start for s in second.metadata["plan"].spans("chunk"))
    assert second.metadata["usage"]["prompt_tokens_details"]["cached_tokens"] > chunk_tokens


def test_synthesizer_passes_chunk_reuse_through_the_pipeline(engine, passages):
    from ragkv import BlendConfig

    llm = RagKVLLM(engine=engine, max_tokens=2)
    synth = RagKVSynthesizer(llm, order="retrieval", reuse="blend", blend=BlendConfig(k=2))
    nodes = [NodeWithScore(node=TextNode(text=p), score=1.0) for p in passages]
    first = synth.synthesize("First?", nodes)
    assert "reused_nonprefix_tokens" not in first.metadata["usage"]
    moved = synth.synthesize("Moved?", nodes[1:])  # the later chunks at new positions
    assert moved.metadata["usage"]["reused_nonprefix_tokens"] > 0


def test_a_streaming_synthesizer_reports_usage_when_done(engine, passages):
    llm = RagKVLLM(engine=engine, max_tokens=5)
    nodes = [NodeWithScore(node=TextNode(text=p), score=1.0) for p in passages[:3]]
    whole = RagKVSynthesizer(llm).synthesize("What is it?", nodes)
    streamed = RagKVSynthesizer(llm, streaming=True).synthesize("What is it?", nodes)
    assert streamed.metadata == {}  # nothing generated yet
    assert "".join(streamed.response_gen) == str(whole)
    usage = streamed.metadata["usage"]
    assert usage["completion_tokens"] == whole.metadata["usage"]["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again
    assert streamed.metadata["plan"].token_ids == whole.metadata["plan"].token_ids

    async def consume():
        response = await RagKVSynthesizer(llm, streaming=True).asynthesize("What is it?", nodes)
        text = "".join([t async for t in response.async_response_gen()])
        return text, response.metadata

    text, metadata = asyncio.run(consume())
    assert text == str(whole) and metadata["usage"]["prompt_tokens"] == usage["prompt_tokens"]


def test_streamed_completion_fires_an_instrumentation_event_per_token(engine, recorder):
    llm = RagKVLLM(engine=engine, max_tokens=6)
    responses = list(llm.stream_complete("Tell me something."))
    progress = recorder.of(LLMCompletionInProgressEvent)
    assert len(progress) == len(responses) >= 2
    assert [e.response.delta for e in progress] == [r.delta for r in responses]
    assert responses[-1].raw["usage"]["completion_tokens"] == 6 or (
        responses[-1].raw["finish_reason"] == "stop"
    )


def test_a_completion_stream_ends_on_text_carrying_the_usage(engine):
    llm = RagKVLLM(engine=engine, max_tokens=6)
    responses = list(llm.stream_complete("Tell me something."))
    assert all(r.delta for r in responses)  # no empty delta, the last one included
    assert "".join(r.delta for r in responses) == responses[-1].text
    assert responses[-1].raw["usage"]["completion_tokens"] >= 1
    assert all(r.raw is None or not r.raw for r in responses[:-1])
    assert responses[-1].text == llm.complete("Tell me something.").text


def test_streamed_chat_fires_events_and_matches_async_chat(engine, recorder):
    llm = RagKVLLM(engine=engine, max_tokens=5)
    messages = [ChatMessage(role="user", content="Hello")]
    streamed = list(llm.stream_chat(messages))
    assert len(recorder.of(LLMChatInProgressEvent)) == len(streamed)
    full = asyncio.run(llm.achat(messages))
    assert full.message.content == streamed[-1].message.content
    assert full.additional_kwargs["cached_tokens"] > 0  # same prompt as the stream


def test_metadata_reports_the_real_context_window(engine):
    meta = RagKVLLM(engine=engine, max_tokens=9).metadata
    assert meta.context_window == engine.max_model_len
    assert meta.num_output == 9 and meta.is_chat_model
    assert meta.model_name == engine.model_name


def test_formatted_completion_sends_the_prompt_verbatim(engine):
    llm = RagKVLLM(engine=engine, max_tokens=1)
    raw = llm.complete("plain text", formatted=True)
    templated = llm.complete("plain text")
    ids = engine.tokenizer("plain text", add_special_tokens=False).input_ids
    assert raw.additional_kwargs["prompt_tokens"] == len(ids)
    assert templated.additional_kwargs["prompt_tokens"] > len(ids)


def test_synthesize_batch_answers_each_query_as_synthesize_does(engine, passages):
    def nodes(*which):
        return [NodeWithScore(node=TextNode(text=passages[i], id_=f"n{i}"), score=1.0 - i / 10)
                for i in which]  # fmt: skip

    synth = RagKVSynthesizer(RagKVLLM(engine=engine, max_tokens=3, temperature=0), system="Brief.")
    queries = [("First?", nodes(0, 1)), ("Second?", nodes(2)), ("Third?", nodes(1, 0))]
    batch = synth.synthesize_batch(queries)
    assert [r.source_nodes for r in batch] == [q[1] for q in queries]
    for response in batch:  # greedy: the engine's own answer to that response's prompt
        plan = response.metadata["plan"]
        alone = engine.generate(plan.token_ids, RagKVLLM(engine=engine, max_tokens=3,
                                                         temperature=0).sampling_params())  # fmt: skip
        assert response.response == alone.text
    first, third = batch[0].metadata["plan"], batch[2].metadata["plan"]
    assert [s.content_hash for s in first.spans("chunk")] == [
        s.content_hash for s in third.spans("chunk")
    ]  # the same two nodes, one order
    again = asyncio.run(synth.asynthesize_batch(queries))
    assert [r.response for r in again] == [r.response for r in batch]


def test_synthesizer_takes_a_ready_pipeline_and_refuses_options_next_to_it(engine, passages):
    from ragkv import Pipeline
    from ragkv.errors import ConfigError

    llm = RagKVLLM(engine=engine, max_tokens=2)
    pipeline = Pipeline(engine, order="retrieval")
    synth = RagKVSynthesizer(llm, pipeline=pipeline)
    assert synth.pipeline is pipeline
    nodes = [NodeWithScore(node=TextNode(text=p), score=1.0) for p in passages]
    response = synth.synthesize("Which?", nodes)
    assert response.metadata["plan"].stats.order == "retrieval"
    assert response.metadata["usage"]["completion_tokens"] <= 2  # the llm's sampling fields
    with pytest.raises(ConfigError, match="max_prompt_tokens"):
        RagKVSynthesizer(llm, pipeline=pipeline, max_prompt_tokens=64)
