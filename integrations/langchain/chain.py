"""``create_rag_chain``: retrieve → dedup → token-level assembly → engine, as one runnable."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Unpack

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableGenerator
from langchain_core.runnables.utils import AddableDict

from ragkv.assembler.structured import SystemLike
from ragkv.batch import BatchItem
from ragkv.cache_engine.engine_like import EngineLike
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.integrations._pipeline import PipelineOptions, pipeline_for
from ragkv.integrations.langchain.chat_model import ChatRagKV, usage_metadata
from ragkv.integrations.langchain.documents import document_to_chunk
from ragkv.pipeline import Answer, AnswerDelta, Pipeline


def create_rag_chain(
    retriever: BaseRetriever,
    chat_model: ChatRagKV | Pipeline,
    *,
    system: SystemLike | None = None,
    **options: Unpack[PipelineOptions],
) -> Runnable[str | dict[str, Any], dict[str, Any]]:
    """A runnable answering a question from ``retriever``'s documents with ``chat_model``.

    ``chat_model`` is a :class:`ChatRagKV` (its engine, sampling fields and ``cache_salt``
    are used, and the pipeline options below build the :class:`ragkv.Pipeline`), or a
    ready :class:`ragkv.Pipeline`, which then decides everything: its own options, and its
    ``default_params`` for sampling. Giving a pipeline and pipeline options
    (``deduplicator``, ``order``, ``max_prompt_tokens``, ``reuse``, ``blend``) is a
    :class:`~ragkv.errors.ConfigError`.

    The documents are never flattened into one prompt string: :class:`ragkv.Pipeline`
    dedups them and assembles the prompt from per-chunk token ids in a cache-friendly
    ``order``, so chunk boundaries (and the prefix cache) survive. Input: the question, or
    ``{"question": ..., "history": [{"role": ..., "content": ...}, ...], "system": ...}``
    (``system`` overrides the chain's for that call). ``system`` may be structured:
    ``["stable text", Volatile("Today is …")]`` or ``SystemPrompt(template, **values)``
    (see :mod:`ragkv.assembler.structured`). Output: a dict
    with ``answer`` (str), ``usage`` (LangChain ``UsageMetadata``, ``cache_read`` included),
    ``documents`` (the retrieved ones), ``plan`` (the :class:`~ragkv.assembler.PromptPlan`)
    and ``result`` (the full :class:`ragkv.Answer`). ``stream()`` / ``astream()`` yield
    ``{"answer": text}`` deltas as they are generated, then one last chunk with ``usage``
    (cached tokens included), ``documents``, ``plan`` and ``result``; added up, the chunks
    are what ``invoke()`` returns. ``reuse="blend"`` (with ``blend``) opts
    into approximate chunk reuse, as :class:`ragkv.Pipeline` does
    (``result.output.approximate``).

    ``batch()`` / ``abatch()`` retrieve for every input, then answer them as one batch
    job (:meth:`ragkv.Pipeline.answer_batch`): inputs that share documents run together
    and share one document order. Outputs come in the inputs' order, as ``invoke()`` gives
    them; an input may carry ``"session"`` so that its turns run in order, each with the
    session's earlier answers as history when it has none.
    """
    given = chat_model if isinstance(chat_model, Pipeline) else None
    model = None if isinstance(chat_model, Pipeline) else chat_model

    def engine() -> EngineLike:  # pipeline_for calls it only when no pipeline was given
        assert model is not None
        return model.get_engine()

    pipeline = pipeline_for(given, engine, **options)

    def params() -> SamplingParams | None:  # None: the pipeline's default_params
        return None if model is None else model.sampling_params()

    def kwargs(inputs: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
        question, history, call_system = _parse(inputs, system)
        return question, {
            "system": call_system,
            "history": history,
            "params": params(),
            "cache_salt": None if model is None else model.cache_salt,
        }

    def transform(
        inputs: Iterator[str | dict[str, Any]], config: RunnableConfig
    ) -> Iterator[AddableDict]:
        for item in inputs:
            question, settings = kwargs(item)
            docs = retriever.invoke(question, config=config)
            chunks = [document_to_chunk(d) for d in docs]
            for delta in pipeline.stream(question, chunks, **settings):
                yield from _chunks(delta, docs)

    async def atransform(
        inputs: AsyncIterator[str | dict[str, Any]], config: RunnableConfig
    ) -> AsyncIterator[AddableDict]:
        async for item in inputs:
            question, settings = kwargs(item)
            docs = await retriever.ainvoke(question, config=config)
            chunks = [document_to_chunk(d) for d in docs]
            async for delta in pipeline.astream(question, chunks, **settings):
                for chunk in _chunks(delta, docs):
                    yield chunk

    def questions(inputs: list[str | dict[str, Any]]) -> list[str]:
        return [_parse(item, system)[0] for item in inputs]

    def items(
        inputs: list[str | dict[str, Any]], docs: list[Any]
    ) -> list[BatchItem | BaseException]:
        out: list[BatchItem | BaseException] = []
        for item, found in zip(inputs, docs, strict=True):
            if isinstance(found, BaseException):  # the retriever failed for this input
                out.append(found)
                continue
            question, settings = kwargs(item)
            session = item.get("session") if isinstance(item, dict) else None
            chunks = [document_to_chunk(d) for d in found]
            out.append(BatchItem(question, chunks, system=settings["system"],
                                 history=settings["history"], session=session,
                                 cache_salt=settings["cache_salt"]))  # fmt: skip
        return out

    def results(
        batch: list[BatchItem | BaseException],
        answers: list[Any],
        docs: list[Any],
        return_exceptions: bool,
    ) -> list[dict[str, Any] | BaseException]:
        """The outputs in the inputs' order: ``answers`` are those of the batch's items, in
        order; an input whose retrieval failed keeps its exception."""
        answered = iter(answers)
        out: list[dict[str, Any] | BaseException] = []
        for item, found in zip(batch, docs, strict=True):
            answer = item if isinstance(item, BaseException) else next(answered)
            if isinstance(answer, BaseException):
                if not return_exceptions:
                    raise answer
                out.append(answer)
            else:
                out.append(_result(answer, found))
        return out

    class RagChain(RunnableGenerator):
        def batch(
            self,
            inputs: list[str | dict[str, Any]],
            config: RunnableConfig | list[RunnableConfig] | None = None,
            *,
            return_exceptions: bool = False,
            **_: Any,
        ) -> list[Any]:
            if not inputs:
                return []
            docs = retriever.batch(questions(inputs), config, return_exceptions=return_exceptions)
            batch = items(inputs, docs)
            answers = pipeline.answer_batch(
                _answerable(batch), params=params(), return_exceptions=return_exceptions
            )
            return results(batch, answers, docs, return_exceptions)

        async def abatch(
            self,
            inputs: list[str | dict[str, Any]],
            config: RunnableConfig | list[RunnableConfig] | None = None,
            *,
            return_exceptions: bool = False,
            **_: Any,
        ) -> list[Any]:
            if not inputs:
                return []
            docs = await retriever.abatch(
                questions(inputs), config, return_exceptions=return_exceptions
            )
            batch = items(inputs, docs)
            answers = await pipeline.aanswer_batch(
                _answerable(batch), params=params(), return_exceptions=return_exceptions
            )
            return results(batch, answers, docs, return_exceptions)

    # The ignore: RunnableGenerator passes the config to a transform that takes one (as
    # these do, for the retriever's callbacks); its annotations leave that form out.
    return RagChain(transform, atransform, name="ragkv_rag_chain")  # type: ignore[arg-type]


def _answerable(batch: list[BatchItem | BaseException]) -> list[BatchItem]:
    """The batch items to answer: all but the inputs whose retrieval failed."""
    return [item for item in batch if isinstance(item, BatchItem)]


def _chunks(delta: AnswerDelta, docs: list[Document]) -> Iterator[AddableDict]:
    """Stream chunks of one delta: its text as ``{"answer": ...}``; the last delta adds the
    usage, documents, plan and result. Added up (``invoke``), they are the whole answer."""
    if delta.text:
        yield AddableDict(answer=delta.text)
    if delta.answer is not None:
        final = _result(delta.answer, docs)
        final["answer"] = ""  # already streamed
        yield AddableDict(final)


def _parse(
    inputs: str | dict[str, Any], system: SystemLike | None
) -> tuple[str, Sequence[dict[str, str]] | None, SystemLike | None]:
    if isinstance(inputs, str):
        return inputs, None, system
    return inputs["question"], inputs.get("history"), inputs.get("system", system)


def _result(answer: Answer, docs: list[Document]) -> dict[str, Any]:
    return {
        "answer": answer.text,
        "usage": usage_metadata(answer.usage),
        "documents": docs,
        "plan": answer.plan,
        "result": answer,
    }
