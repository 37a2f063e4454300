"""``RagKVSynthesizer``: LlamaIndex response synthesis through :class:`ragkv.Pipeline`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

from llama_index.core.base.response.schema import (
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ragkv.assembler.structured import SystemLike
from ragkv.batch import BatchItem
from ragkv.dedup import Chunk
from ragkv.dedup.merge import DUPLICATES
from ragkv.integrations._documents import make_chunk
from ragkv.integrations._pipeline import PipelineOptions, pipeline_for
from ragkv.integrations.llama_index.llm import RagKVLLM
from ragkv.pipeline import Answer, Pipeline


def node_to_chunk(item: NodeWithScore, metadata_mode: MetadataMode = MetadataMode.LLM) -> Chunk:
    """The chunk the LLM will see: the node's content rendered with ``metadata_mode``."""
    node = item.node
    text = node.get_content(metadata_mode=metadata_mode)
    source = node.ref_doc_id or node.node_id
    return make_chunk(text, source, item.score, {"node_id": node.node_id})


class RagKVSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes with :class:`ragkv.Pipeline`, not a flat prompt string.

    Each node becomes one chunk (its LLM-visible text), so dedup applies and the prompt is
    assembled from per-chunk token ids in a cache-friendly ``order``. ``llm`` must be a
    :class:`~ragkv.integrations.llama_index.RagKVLLM`; its sampling fields are used.
    ``Response.metadata`` carries ``usage`` (OpenAI shape, ``cached_tokens`` included; a
    streaming response's once its text has been consumed),
    ``dedup`` (counts) and ``plan`` (the :class:`~ragkv.assembler.PromptPlan`).

    ``system`` may be structured (``["stable text", Volatile("Today is …")]`` or
    ``SystemPrompt(template, **values)``, see :mod:`ragkv.assembler.structured`); set
    ``synthesizer.system`` before a query to change it per request.

    ``reuse="blend"`` (with ``blend``) opts into approximate chunk reuse, as
    :class:`ragkv.Pipeline` does (``usage`` then carries ``reused_nonprefix_tokens``).

    ``pipeline``: a ready :class:`ragkv.Pipeline` to answer with, instead of one built from
    the pipeline options here (``deduplicator``, ``order``, ``max_prompt_tokens``,
    ``reuse``, ``blend``; giving both is a :class:`~ragkv.errors.ConfigError`). ``llm``
    still supplies the sampling fields and ``cache_salt``.

    Use: ``index.as_query_engine(llm=llm, response_synthesizer=RagKVSynthesizer(llm))``.
    """

    def __init__(
        self,
        llm: RagKVLLM,
        *,
        system: SystemLike | None = None,
        streaming: bool = False,
        metadata_mode: MetadataMode = MetadataMode.LLM,
        pipeline: Pipeline | None = None,
        **options: Unpack[PipelineOptions],
    ) -> None:
        super().__init__(llm=llm, streaming=streaming)
        self._rag_llm = llm  # the base class keeps it typed as any LLM
        self.system = system
        self.metadata_mode = metadata_mode
        self.pipeline = pipeline_for(pipeline, llm.get_engine, **options)

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        pass

    def synthesize(
        self,
        query: str | QueryBundle,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> Response | StreamingResponse:
        question, chunks, sources = self._inputs(query, nodes, additional_source_nodes)
        if self._streaming:
            deltas = self.pipeline.stream(question, chunks, **self._call_kwargs())
            metadata: dict[str, Any] = {}  # filled when the last delta arrives
            return StreamingResponse(
                _texts(deltas, metadata, nodes), source_nodes=sources, metadata=metadata
            )
        answer = self.pipeline.answer(question, chunks, **self._call_kwargs())
        return Response(answer.text, source_nodes=sources, metadata=_metadata(answer, nodes))

    async def asynthesize(
        self,
        query: str | QueryBundle,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> Response | AsyncStreamingResponse:
        question, chunks, sources = self._inputs(query, nodes, additional_source_nodes)
        if self._streaming:
            deltas = self.pipeline.astream(question, chunks, **self._call_kwargs())
            metadata: dict[str, Any] = {}
            return AsyncStreamingResponse(
                _atexts(deltas, metadata, nodes), source_nodes=sources, metadata=metadata
            )
        answer = await self.pipeline.aanswer(question, chunks, **self._call_kwargs())
        return Response(answer.text, source_nodes=sources, metadata=_metadata(answer, nodes))

    def synthesize_batch(
        self,
        queries: Sequence[tuple[str | QueryBundle, list[NodeWithScore]]],
        *,
        return_exceptions: bool = False,
    ) -> list[Response | BaseException]:
        """Responses to many (query, retrieved nodes) pairs, answered as one batch job
        (:meth:`ragkv.Pipeline.answer_batch`): queries that share nodes run together and
        share one node order. Responses come in the queries' order (never streaming)."""
        items, nodes = self._batch_items(queries)
        answers = self.pipeline.answer_batch(
            items, params=self._rag_llm.sampling_params(), return_exceptions=return_exceptions
        )
        return [_response(a, n) for a, n in zip(answers, nodes, strict=True)]

    async def asynthesize_batch(
        self,
        queries: Sequence[tuple[str | QueryBundle, list[NodeWithScore]]],
        *,
        return_exceptions: bool = False,
    ) -> list[Response | BaseException]:
        """Asyncio form of :meth:`synthesize_batch`."""
        items, nodes = self._batch_items(queries)
        answers = await self.pipeline.aanswer_batch(
            items, params=self._rag_llm.sampling_params(), return_exceptions=return_exceptions
        )
        return [_response(a, n) for a, n in zip(answers, nodes, strict=True)]

    def _batch_items(
        self, queries: Sequence[tuple[str | QueryBundle, list[NodeWithScore]]]
    ) -> tuple[list[BatchItem], list[list[NodeWithScore]]]:
        items, nodes = [], []
        for query, found in queries:
            question, chunks, _ = self._inputs(query, found)
            items.append(BatchItem(question, chunks, system=self.system,
                                   cache_salt=self._rag_llm.cache_salt))  # fmt: skip
            nodes.append(found)
        return items, nodes

    def _inputs(
        self,
        query: str | QueryBundle,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
    ) -> tuple[str, list[Chunk], list[NodeWithScore]]:
        """The question, one chunk per node (its text as the LLM sees it) and the sources."""
        question = query.query_str if isinstance(query, QueryBundle) else query
        chunks = [node_to_chunk(n, self.metadata_mode) for n in nodes]
        return question, chunks, [*nodes, *(additional_source_nodes or ())]

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """The answer text for plain text chunks (the ``BaseSynthesizer`` hook)."""
        return self.pipeline.answer(query_str, text_chunks, **self._call_kwargs()).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """Asyncio form of :meth:`get_response`."""
        answer = await self.pipeline.aanswer(query_str, text_chunks, **self._call_kwargs())
        return answer.text

    def _call_kwargs(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "params": self._rag_llm.sampling_params(),
            "cache_salt": self._rag_llm.cache_salt,
        }


def _response(answer: Answer | BaseException, nodes: list[NodeWithScore]) -> Any:
    if isinstance(answer, BaseException):
        return answer
    return Response(answer.text, source_nodes=nodes, metadata=_metadata(answer, nodes))


def _metadata(answer: Answer, nodes: Sequence[NodeWithScore]) -> dict[str, Any]:
    dedup = answer.dedup.as_dict()
    # What a DedupPostprocessor upstream already removed (its survivors say how many).
    dedup["postprocessor_duplicates"] = sum(
        int(n.node.metadata.get(DUPLICATES, 0) or 0) for n in nodes
    )
    return {
        "usage": answer.usage.to_openai(),
        "dedup": dedup,
        "plan": answer.plan,
        "timings": answer.timings,
    }


def _texts(deltas: Any, metadata: dict[str, Any], nodes: Sequence[NodeWithScore]) -> Any:
    """The deltas' text; once the answer is done, its usage, dedup figures, plan and timings
    land in ``metadata`` (the streaming response's, read after consuming it)."""
    for delta in deltas:
        if delta.text:
            yield delta.text
        if delta.answer is not None:
            metadata.update(_metadata(delta.answer, nodes))


async def _atexts(deltas: Any, metadata: dict[str, Any], nodes: Sequence[NodeWithScore]) -> Any:
    async for delta in deltas:
        if delta.text:
            yield delta.text
        if delta.answer is not None:
            metadata.update(_metadata(delta.answer, nodes))
