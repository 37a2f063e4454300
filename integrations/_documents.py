"""Framework documents ↔ :class:`ragkv.dedup.Chunk`, and dedup + cache-friendly ordering over them.

Framework-neutral: the LangChain and LlamaIndex adapters turn their objects into chunks
(text, source id, score, metadata), call :func:`dedupe_and_order`, and map each
:class:`Survivor` back to the object at ``survivor.index``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.dedup import Chunk, Deduplicator
from ragkv.dedup.merge import DUPLICATES, SOURCES
from ragkv.errors import ConfigError

DOC_ORDERS = ("canonical", "retrieval")
SCORE_KEYS = ("score", "relevance_score", "similarity_score")


@dataclass(slots=True)
class Survivor:
    """One unique item: where it was retrieved and what it absorbed."""

    index: int  # input position of its first occurrence
    rank: int  # its position among the survivors in retrieval order
    score: float | None  # the best score among it and its duplicates
    duplicates: int  # how many other inputs collapsed into it
    sources: tuple[str, ...]  # every distinct source id folded into it
    content_hash: str  # hex digest of its bytes (the dedup identity)

    def metadata(self) -> dict[str, Any]:
        """The ``ragkv_*`` fields added to a surviving document's metadata."""
        return {
            "ragkv_rank": self.rank,
            SOURCES: list(self.sources),
            DUPLICATES: self.duplicates,
            "ragkv_content_hash": self.content_hash,
        }


def check_doc_order(order: str) -> str:
    """Validate an ``order=`` for document lists."""
    if order not in DOC_ORDERS:
        raise ConfigError(f"Unknown order {order!r}; choose one of {', '.join(DOC_ORDERS)}.")
    return order


def make_chunk(
    text: str, source_id: object, score: object, metadata: Mapping[Any, Any] | None
) -> Chunk:
    """A chunk from a framework object's parts; unusable ids, scores and keys are left out."""
    source = None if source_id is None else str(source_id)
    meta = {k: v for k, v in (metadata or {}).items() if isinstance(k, str)}
    return Chunk(text, source_id=source, score=_score(score), metadata=meta)


def score_from_metadata(metadata: Mapping[str, Any]) -> float | None:
    """The first numeric relevance score in a LangChain-style metadata dict."""
    for key in SCORE_KEYS:
        score = _score(metadata.get(key))
        if score is not None:
            return score
    return None


def dedupe_and_order(
    chunks: Sequence[Chunk], deduplicator: Deduplicator, order: str = "canonical"
) -> list[Survivor]:
    """Collapse byte-identical chunks and order the survivors.

    ``"canonical"`` sorts by content hash: any request that retrieves the same chunks, in
    any order, gets them in the same order, so the prompts built from them share a prefix.
    ``"retrieval"`` keeps first-occurrence order. ``Survivor.rank`` keeps relevance order.
    """
    result = deduplicator.dedupe(chunks)
    algo = deduplicator.hash
    survivors = [
        Survivor(
            index=result.kept[j],
            rank=j,
            score=chunk.score,
            duplicates=chunk.metadata.get(DUPLICATES, 0),
            sources=tuple(chunk.metadata.get(SOURCES, ())),
            content_hash=chunk.digest(algo).hex(),
        )
        for j, chunk in enumerate(result.chunks)
    ]
    if check_doc_order(order) == "canonical":
        survivors.sort(key=lambda s: s.content_hash)
    return survivors


def _score(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)
