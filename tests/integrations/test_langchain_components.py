"""DedupRetriever, DedupCompressor, ChatRagKV and create_rag_chain on a tiny random model."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from support import tiny_engine_fixture, training_text  # noqa: E402

from ragkv.dedup import Deduplicator  # noqa: E402
from ragkv.errors import InvalidInputError, RequestAbortedError  # noqa: E402
from ragkv.integrations.langchain import (  # noqa: E402
    ChatRagKV,
    DedupCompressor,
    DedupRetriever,
    create_rag_chain,
)


class ListRetriever(BaseRetriever):
    """Returns its documents in order; records the kwargs it was called with."""

    docs: list[Document]
    calls: list[dict] = []

    def _get_relevant_documents(self, query, *, run_manager, **kwargs):
        self.calls.append(kwargs)
        k = kwargs.get("k", len(self.docs))
        return self.docs[:k]


class TokenRecorder(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


engine = tiny_engine_fixture("lc", 3, kv_cache_tokens=8192)


@pytest.fixture
def passages() -> list[str]:
    return [t[:400] for t in training_text()[:4]]


def docs_with_duplicates(passages):
    return [
        Document(passages[0], metadata={"source": "a.txt", "score": 0.9}),
        Document(passages[1], metadata={"source": "b.txt", "score": 0.8}),
        Document(passages[0], metadata={"source": "a-copy.txt", "score": 0.95}),
        Document(passages[2], metadata={"source": "c.txt", "score": 0.5}),
    ]


def test_retriever_drops_byte_identical_documents_and_merges_their_info(passages):
    base = ListRetriever(docs=docs_with_duplicates(passages))
    docs = DedupRetriever(base, order="retrieval").invoke("q")
    assert [d.page_content for d in docs] == passages[:3]
    first = docs[0].metadata
    assert first["ragkv_duplicates"] == 1
    assert first["ragkv_sources"] == ["a.txt", "a-copy.txt"]
    assert first["score"] == 0.95  # the duplicate's better score
    assert [d.metadata["ragkv_rank"] for d in docs] == [0, 1, 2]


def test_canonical_order_does_not_depend_on_retrieval_order(passages):
    docs = docs_with_duplicates(passages)
    forward = DedupRetriever(ListRetriever(docs=docs)).invoke("q")
    backward = DedupRetriever(ListRetriever(docs=docs[::-1])).invoke("q")
    assert [d.page_content for d in forward] == [d.page_content for d in backward]
    hashes = [d.metadata["ragkv_content_hash"] for d in forward]
    assert hashes == sorted(hashes)


def test_k_is_forwarded_and_fetch_k_leaves_k_unique_documents(passages):
    base = ListRetriever(docs=docs_with_duplicates(passages), calls=[])
    assert len(DedupRetriever(base).invoke("q", k=3)) == 2  # 3 fetched, one duplicate
    assert base.calls[-1]["k"] == 3
    docs = DedupRetriever(base, fetch_k=4).invoke("q", k=3, extra="x")
    assert len(docs) == 3
    assert base.calls[-1] == {"k": 4, "extra": "x"}


def test_async_retrieval_matches_sync(passages):
    retriever = DedupRetriever(ListRetriever(docs=docs_with_duplicates(passages)))
    sync = retriever.invoke("q")
    asyn = asyncio.run(retriever.ainvoke("q"))
    assert [d.page_content for d in asyn] == [d.page_content for d in sync]


def test_dedup_key_keeps_equal_text_from_different_sources(passages):
    retriever = DedupRetriever(
        ListRetriever(docs=docs_with_duplicates(passages)),
        deduplicator=Deduplicator(key="source"),
    )
    assert len(retriever.invoke("q")) == 4


def test_compressor_and_transformer_forms_agree(passages):
    docs = docs_with_duplicates(passages)
    compressor = DedupCompressor(order="retrieval")
    compressed = compressor.compress_documents(docs, "q")
    transformed = compressor.transform_documents(docs)
    assert [d.page_content for d in compressed] == passages[:3]
    assert [d.metadata for d in transformed] == [d.metadata for d in compressed]


def test_chat_model_fires_a_callback_per_streamed_token(engine):
    model = ChatRagKV(engine=engine, max_tokens=8)
    recorder = TokenRecorder()
    message = model.invoke("Hello there", config={"callbacks": [recorder]})
    usage = message.usage_metadata
    assert usage["output_tokens"] == 8 or message.response_metadata["finish_reason"] == "stop"
    texts = [t for t in recorder.tokens if t]
    assert len(texts) >= 2 and "".join(recorder.tokens) == message.content
    assert len(recorder.tokens) <= usage["output_tokens"] + 1


def test_astream_fires_callbacks_and_ends_with_the_last_chunk(engine):
    model = ChatRagKV(engine=engine, max_tokens=6)
    recorder = TokenRecorder()

    async def run():
        return [c async for c in model.astream("Hi", config={"callbacks": [recorder]})]

    chunks = asyncio.run(run())
    assert chunks[-1].chunk_position == "last"
    usage = chunks[-1].usage_metadata  # usage rides on the last chunk, cache_read included
    assert usage["input_tokens"] > 0
    assert usage["input_token_details"]["cache_read"] <= usage["input_tokens"]
    assert "".join(recorder.tokens) == "".join(c.content for c in chunks)


def test_second_identical_conversation_reports_cache_read(engine, passages):
    model = ChatRagKV(engine=engine, max_tokens=2)
    messages = [SystemMessage(passages[3]), HumanMessage("What is this about?")]
    first = model.invoke(messages)
    second = model.invoke(messages)
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    prompt = second.usage_metadata["input_tokens"]
    assert cached == (prompt - 1) // engine.block_size * engine.block_size > 0


def test_cache_salt_isolates_conversations(engine, passages):
    messages = [SystemMessage(passages[1][:300]), HumanMessage("Tenant question?")]
    ChatRagKV(engine=engine, max_tokens=1, cache_salt="t1").invoke(messages)
    other = ChatRagKV(engine=engine, max_tokens=1, cache_salt="t2").invoke(messages)
    assert other.usage_metadata["input_token_details"]["cache_read"] == 0


def test_image_content_is_rejected_with_a_clear_error(engine):
    model = ChatRagKV(engine=engine, max_tokens=1)
    image = {"type": "image", "url": "https://example.com/cat.png"}
    with pytest.raises(InvalidInputError, match="text only"):
        model.invoke([HumanMessage(content=[{"type": "text", "text": "hi"}, image])])


def test_identifying_params_name_model_and_generation_settings(engine):
    model = ChatRagKV(engine=engine, dtype="float32", temperature=0.5, max_tokens=7, seed=1)
    params = model._identifying_params
    assert params["model_name"] == engine.model_name
    assert (params["dtype"], params["temperature"], params["max_tokens"], params["seed"]) == (
        "float32",
        0.5,
        7,
        1,
    )
    assert model.sampling_params(max_tokens=3).max_tokens == 3


def test_rag_chain_assembles_unique_chunks_at_token_level(engine, passages):
    retriever = ListRetriever(docs=docs_with_duplicates(passages))
    chain = create_rag_chain(retriever, ChatRagKV(engine=engine, max_tokens=2), system="Be brief.")
    first = chain.invoke("What is this about?")
    plan = first["plan"]
    spans = plan.spans("chunk")
    assert len(spans) == 3  # 4 retrieved, one byte-identical duplicate
    assert {engine.tokenizer.decode(plan.token_ids[s.start : s.end]) for s in spans} == set(
        passages[:3]
    )
    assert len(first["documents"]) == 4
    second = asyncio.run(chain.ainvoke({"question": "And what else?"}))
    assert second["usage"]["input_token_details"]["cache_read"] > sum(
        s.end - s.start for s in spans
    )
    assert isinstance(second["answer"], str)


def test_rag_chain_streams_answer_deltas_then_usage_documents_and_plan(engine, passages):
    retriever = ListRetriever(docs=docs_with_duplicates(passages))
    model = ChatRagKV(engine=engine, max_tokens=6, cache_salt="chain-stream")
    chain = create_rag_chain(retriever, model, system="Be brief.")
    whole = chain.invoke("What is streaming?")
    chunks = list(chain.stream("What is streaming?"))
    *deltas, last = chunks
    assert deltas and all(set(c) == {"answer"} for c in deltas)
    assert "".join(c["answer"] for c in chunks) == whole["answer"]
    assert last["usage"]["input_token_details"]["cache_read"] > 0  # the same prompt again
    assert len(last["documents"]) == 4 and last["plan"].token_ids == whole["plan"].token_ids

    async def collect():
        return [c async for c in chain.astream({"question": "What is streaming?"})]

    async_chunks = asyncio.run(collect())
    assert "".join(c["answer"] for c in async_chunks) == whole["answer"]
    assert async_chunks[-1]["result"].usage.completion_tokens == whole["usage"]["output_tokens"]


def test_timeout_aborts_the_generation(engine):
    model = ChatRagKV(engine=engine, max_tokens=200, timeout=0.0)
    with pytest.raises(RequestAbortedError, match="timed out"):
        model.invoke("Write a long story.")


def test_rag_chain_passes_chunk_reuse_through_the_pipeline(engine, passages):
    from ragkv import BlendConfig

    model = ChatRagKV(engine=engine, max_tokens=2, cache_salt="chain-blend")

    def chain(docs):
        retriever = ListRetriever(docs=[Document(p) for p in docs])
        return create_rag_chain(
            retriever, model, order="retrieval", reuse="blend", blend=BlendConfig(k=2)
        )

    first = chain(passages[:3]).invoke("What is this about?")["result"]
    assert not first.output.approximate  # nothing known yet: exact, and its chunks recorded
    moved = chain([passages[3], passages[2], passages[0]]).invoke("And this?")["result"]
    assert moved.output.approximate and moved.usage.reused_nonprefix_tokens > 0


def test_rag_chain_batch_answers_every_input_as_invoke_does(engine, passages):
    class PerQuestion(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager, **kwargs):
            picks = {"one?": [0, 1], "two?": [2], "three?": [1, 0]}[query]
            return [Document(passages[i], metadata={"source": f"{i}.txt"}) for i in picks]

    chain = create_rag_chain(PerQuestion(), ChatRagKV(engine=engine, max_tokens=3))
    inputs = ["one?", {"question": "two?"}, "three?"]
    batch = chain.batch(inputs)
    assert [len(out["documents"]) for out in batch] == [2, 1, 2]
    for out in batch:  # greedy: each is the engine's own answer to its prompt
        alone = engine.generate(out["plan"].token_ids, ChatRagKV(engine=engine, max_tokens=3)
                                .sampling_params())  # fmt: skip
        assert out["answer"] == alone.text
        assert out["usage"]["input_tokens"] == len(out["plan"].token_ids)
    one, three = batch[0]["plan"], batch[2]["plan"]
    assert [s.content_hash for s in one.spans("chunk")] == [
        s.content_hash for s in three.spans("chunk")
    ]  # the same two documents in one order
    again = asyncio.run(chain.abatch(inputs))
    assert [out["answer"] for out in again] == [out["answer"] for out in batch]
    assert chain.batch([]) == []


def test_rag_chain_takes_a_ready_pipeline_and_refuses_options_next_to_it(engine, passages):
    from ragkv import Pipeline, SamplingParams
    from ragkv.errors import ConfigError

    pipeline = Pipeline(engine, order="retrieval", default_params=SamplingParams(max_tokens=2))
    chain = create_rag_chain(ListRetriever(docs=docs_with_duplicates(passages)), pipeline)
    result = chain.invoke("What is this about?")
    assert result["result"].usage.completion_tokens <= 2  # the pipeline's default_params
    assert result["plan"].stats.order == "retrieval"
    assert len(result["plan"].spans("chunk")) == 3
    [batched] = chain.batch(["What is this about?"])
    assert batched["answer"] == result["answer"]
    with pytest.raises(ConfigError, match="order"):
        create_rag_chain(ListRetriever(docs=[]), pipeline, order="stable-first")
