"""``create_rag_chain``: retrieve → dedup → token-level assembly → engine, as one runnable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

from ragkv.assembler.structured import SystemLike
from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.dedup import Deduplicator
from ragkv.integrations.langchain.chat_model import ChatRagKV
from ragkv.integrations.langchain.documents import document_to_chunk
from ragkv.pipeline import Answer, Pipeline


def create_rag_chain(
    retriever: BaseRetriever,
    chat_model: ChatRagKV,
    *,
    system: SystemLike | None = None,
    deduplicator: Deduplicator | None = None,
    order: str = "stable-first",
    max_prompt_tokens: int | None = None,
    reuse: str | None = None,
    blend: BlendConfig | None = None,
) -> Runnable[str | dict[str, Any], dict[str, Any]]:
    """A runnable answering a question from ``retriever``'s documents with ``chat_model``.

    The documents are never flattened into one prompt string: :class:`ragkv.Pipeline`
    dedups them and assembles the prompt from per-chunk token ids in a cache-friendly
    ``order``, so chunk boundaries (and the prefix cache) survive. Input: the question, or
    ``{"question": ..., "history": [{"role": ..., "content": ...}, ...], "system": ...}``
    (``system`` overrides the chain's for that call). ``system`` may be structured:
    ``["stable text", Volatile("Today is …")]`` or ``SystemPrompt(template, **values)``
    (see :mod:`ragkv.assembler.structured`). Output: a dict
    with ``answer`` (str), ``usage`` (LangChain ``UsageMetadata``, ``cache_read`` included),
    ``documents`` (the retrieved ones), ``plan`` (the :class:`~ragkv.assembler.PromptPlan`)
    and ``result`` (the full :class:`ragkv.Answer`). ``reuse="blend"`` (with ``blend``) opts
    into approximate chunk reuse, as :class:`ragkv.Pipeline` does
    (``result.output.approximate``).
    """
    pipeline = Pipeline(
        chat_model.get_engine(),
        deduplicator=deduplicator,
        order=order,
        max_prompt_tokens=max_prompt_tokens,
        reuse=reuse,
        blend=blend,
    )

    def run(inputs: str | dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        question, history, call_system = _parse(inputs, system)
        docs = retriever.invoke(question, config=config)
        answer = pipeline.answer(
            question,
            [document_to_chunk(d) for d in docs],
            system=call_system,
            history=history,
            params=chat_model.sampling_params(),
            cache_salt=chat_model.cache_salt,
        )
        return _result(answer, docs)

    async def arun(inputs: str | dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        question, history, call_system = _parse(inputs, system)
        docs = await retriever.ainvoke(question, config=config)
        answer = await pipeline.aanswer(
            question,
            [document_to_chunk(d) for d in docs],
            system=call_system,
            history=history,
            params=chat_model.sampling_params(),
            cache_salt=chat_model.cache_salt,
        )
        return _result(answer, docs)

    return RunnableLambda(run, afunc=arun, name="ragkv_rag_chain")


def _parse(
    inputs: str | dict[str, Any], system: SystemLike | None
) -> tuple[str, Sequence[dict[str, str]] | None, SystemLike | None]:
    if isinstance(inputs, str):
        return inputs, None, system
    return inputs["question"], inputs.get("history"), inputs.get("system", system)


def _result(answer: Answer, docs: list[Document]) -> dict[str, Any]:
    u = answer.usage
    return {
        "answer": answer.text,
        "usage": {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "input_token_details": {"cache_read": u.cached_tokens},
        },
        "documents": docs,
        "plan": answer.plan,
        "result": answer,
    }
