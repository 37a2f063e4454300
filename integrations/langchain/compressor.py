"""``DedupCompressor``: byte-exact dedup as a LangChain document compressor and transformer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, BaseDocumentTransformer, Document
from pydantic import ConfigDict, Field

from ragkv.dedup import Deduplicator
from ragkv.integrations._documents import check_doc_order
from ragkv.integrations.langchain.documents import dedupe_documents


class DedupCompressor(BaseDocumentCompressor, BaseDocumentTransformer):
    """Drop documents whose ``page_content`` bytes already appeared; order for caching.

    Use it in a ``ContextualCompressionRetriever`` / ``DocumentCompressorPipeline``, or as
    a runnable step: ``RunnableLambda(DedupCompressor().transform_documents)``.

    Args:
        deduplicator: the dedup policy (default: byte-exact blake3 on content only; pass
            ``Deduplicator(key="source")`` to keep equal text from different sources).
        order: ``"canonical"`` (content-hash order, the same for any retrieval order) or
            ``"retrieval"``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    deduplicator: Deduplicator = Field(default_factory=Deduplicator)
    order: str = "canonical"

    def model_post_init(self, context: Any) -> None:
        check_doc_order(self.order)

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> list[Document]:
        """Unique documents with ``ragkv_*`` dedup info in metadata (``query`` is unused)."""
        return dedupe_documents(documents, self.deduplicator, self.order)

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[Document]:
        """Same as :meth:`compress_documents`, as a ``BaseDocumentTransformer``."""
        return dedupe_documents(documents, self.deduplicator, self.order)
