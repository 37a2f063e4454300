"""BM25 retrieval over the bundled corpus (``bm25s``), multi-query with duplicates kept.

A multi-query retriever (LangChain's ``MultiQueryRetriever``, an ensemble retriever) asks
several phrasings of one question and concatenates the top-k of each; the same chunk comes
back once per phrasing that found it. That concatenation, duplicates included, is what
the benchmark's requests carry, so the dedup stage has real work to do.
"""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.dedup import Chunk
from ragkv.errors import InvalidInputError, MissingDependencyError


class BM25Retriever:
    """Okapi BM25 (``bm25s``) over ``chunks``; English stopwords, lower-cased word tokens."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        try:
            import bm25s
        except ImportError as exc:  # pragma: no cover - bm25s is a core dependency
            raise MissingDependencyError("bm25s", "bench") from exc
        if not chunks:
            raise InvalidInputError("BM25Retriever needs at least one chunk")
        self._bm25s = bm25s
        self.chunks = list(chunks)
        corpus_tokens = bm25s.tokenize(
            [c.text for c in self.chunks], stopwords="en", show_progress=False
        )
        self.index = bm25s.BM25()
        self.index.index(corpus_tokens, show_progress=False)

    def search(self, queries: Sequence[str], k: int) -> list[list[int]]:
        """Indices of the top ``k`` chunks for each query, best first."""
        k = min(k, len(self.chunks))
        # Strings, not ids: ids from a second tokenize() call would not match the index vocab.
        tokens = self._bm25s.tokenize(
            list(queries), stopwords="en", return_ids=False, show_progress=False
        )
        tokens = [t or ["the"] for t in tokens]  # an all-stopword query still gets k hits
        results, _ = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [[int(i) for i in row] for row in results]

    def multi_query(self, queries: Sequence[str], k: int) -> list[Chunk]:
        """Concatenated top-``k`` of every query, in query order, duplicates kept."""
        return [self.chunks[i] for row in self.search(queries, k) for i in row]
