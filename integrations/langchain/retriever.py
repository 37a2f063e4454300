"""``DedupRetriever``: any LangChain retriever, with byte-exact dedup and a cacheable order."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from ragkv.dedup import Deduplicator
from ragkv.integrations._documents import check_doc_order
from ragkv.integrations.langchain.documents import dedupe_documents


class DedupRetriever(BaseRetriever):
    """Calls ``base_retriever``, drops byte-identical documents, orders the rest for caching.

    Keyword arguments of ``invoke`` (``k``, ``filter``, ...) are forwarded to the base
    retriever. ``k`` (constructor or call) is forwarded too and caps the unique documents
    returned; ``fetch_k`` asks the base for more, so ``k`` unique documents remain after
    duplicates are dropped. Truncation keeps the most relevant; reordering happens after.

    Survivors carry ``ragkv_rank`` (relevance order), ``ragkv_sources``,
    ``ragkv_duplicates`` and ``ragkv_content_hash`` in their metadata.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_retriever: BaseRetriever
    deduplicator: Deduplicator = Field(default_factory=Deduplicator)
    order: str = "canonical"
    k: int | None = None
    fetch_k: int | None = None

    def __init__(self, base_retriever: BaseRetriever | None = None, **kwargs: Any) -> None:
        if base_retriever is not None:
            kwargs["base_retriever"] = base_retriever
        super().__init__(**kwargs)

    def model_post_init(self, context: Any) -> None:
        check_doc_order(self.order)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, base_kwargs = self._base_kwargs(kwargs)
        docs = self.base_retriever.invoke(
            query, config={"callbacks": run_manager.get_child()}, **base_kwargs
        )
        return self._finish(docs, k)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, base_kwargs = self._base_kwargs(kwargs)
        docs = await self.base_retriever.ainvoke(
            query, config={"callbacks": run_manager.get_child()}, **base_kwargs
        )
        return self._finish(docs, k)

    def _base_kwargs(self, kwargs: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        k = kwargs.pop("k", self.k)
        fetch_k = self.fetch_k if k is None or self.fetch_k is None else max(self.fetch_k, k)
        if fetch_k is not None or k is not None:
            kwargs["k"] = fetch_k or k
        return k, kwargs

    def _finish(self, docs: list[Document], k: int | None) -> list[Document]:
        unique = dedupe_documents(docs, self.deduplicator, order="retrieval")[:k]
        if self.order == "canonical":
            unique.sort(key=lambda d: d.metadata["ragkv_content_hash"])
        return unique
