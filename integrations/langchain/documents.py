"""LangChain ``Document`` ↔ :class:`ragkv.dedup.Chunk`, and dedup over document lists."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.documents import Document

from ragkv.dedup import Chunk, Deduplicator
from ragkv.integrations._documents import dedupe_and_order, make_chunk, score_from_metadata


def document_to_chunk(document: Document) -> Chunk:
    """The chunk the LLM will see: ``page_content``; source = ``id`` or ``metadata["source"]``."""
    meta = document.metadata or {}
    source = document.id if document.id is not None else meta.get("source")
    return make_chunk(document.page_content, source, score_from_metadata(meta), meta)


def dedupe_documents(
    documents: Sequence[Document],
    deduplicator: Deduplicator | None = None,
    order: str = "canonical",
) -> list[Document]:
    """Unique documents (first occurrence kept) with ``ragkv_*`` dedup info in metadata.

    ``order="canonical"`` (default) sorts survivors by content hash, so the same chunks
    retrieved in any order reach the prompt in the same order (a shared, cacheable prefix);
    ``"retrieval"`` keeps first-occurrence order. ``metadata["ragkv_rank"]`` keeps relevance
    order either way. A duplicate's better score is merged into ``metadata["score"]`` when the
    input documents carried one.
    """
    docs = list(documents)
    chunks = [document_to_chunk(d) for d in docs]
    survivors = dedupe_and_order(chunks, deduplicator or Deduplicator(), order)
    out = []
    for s in survivors:
        doc = docs[s.index]
        meta = {**doc.metadata, **s.metadata()}
        if s.score is not None and score_from_metadata(doc.metadata) is not None:
            meta["score"] = s.score
        out.append(Document(page_content=doc.page_content, metadata=meta, id=doc.id))
    return out
