"""Canonical prompt assembly: token-level, stable-first, cache-aware.

``Assembler(tokenizer).assemble(system=..., chunks=..., question=...)`` returns a
:class:`PromptPlan` whose ``token_ids`` put static content first, then retrieved chunks in
a request-independent (or cache-aware) order, then volatile content, so consecutive RAG
requests share long prefixes in the engine's prefix cache.

Quality trade-off: reordering chunks discards the retriever's relevance order, which a
model may use. ``order="retrieval"`` restores it (and shares little prefix).

Tip: keep per-request values (dates, request ids, user names) out of the system prompt, or
after the stable content. The assembler detects such "silent invalidators" and, with
``demote_invalidators=True`` (the default), moves them after the chunks.
"""

from ragkv.assembler.assembler import Assembler, Residency
from ragkv.assembler.ordering import ORDERS
from ragkv.assembler.plan import AssemblyStats, DroppedChunk, PromptPlan, SegmentSpan
from ragkv.assembler.prefix_tree import ChunkPrefixTree
from ragkv.assembler.segments import SegmentKind, Stability
from ragkv.assembler.stability import StabilityTracker
from ragkv.assembler.template import Layout

__all__ = [
    "ORDERS",
    "Assembler",
    "AssemblyStats",
    "ChunkPrefixTree",
    "DroppedChunk",
    "Layout",
    "PromptPlan",
    "Residency",
    "SegmentKind",
    "SegmentSpan",
    "Stability",
    "StabilityTracker",
]
