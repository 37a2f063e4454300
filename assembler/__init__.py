"""Canonical prompt assembly: token-level, stable-first, cache-aware.

``Assembler(tokenizer).assemble(system=..., chunks=..., question=...)`` returns a
:class:`PromptPlan` whose ``token_ids`` put static content first, then retrieved chunks in
a request-independent (or cache-aware) order, then volatile content, so consecutive RAG
requests share long prefixes in the engine's prefix cache. Its settings are one
:class:`AssemblerConfig`: ``Assembler(tokenizer, config=AssemblerConfig(order="cache-aware"))``.

Quality trade-off: reordering chunks discards the retriever's relevance order, which a
model may use. ``order="retrieval"`` restores it (and shares little prefix).

Per-request values (dates, request ids, user names) inside a "static" system prompt are
"silent invalidators". Mark them (``system=["stable", Volatile("Today is …")]`` or
``SystemPrompt(template, **values)``), or let the assembler learn them: with
``demote_invalidators=True`` (the default) it keeps the stable head and tail of such a slot
in front and moves only the changing part after the chunks. Each request is also compared
with the application's own order, and the plan with the longer cached prefix is sent.
"""

from ragkv.assembler.assembler import Assembler, Residency
from ragkv.assembler.config import AssemblerConfig
from ragkv.assembler.ordering import ORDERS
from ragkv.assembler.plan import AssemblyStats, DroppedChunk, PromptPlan, SegmentSpan
from ragkv.assembler.prefix_tree import ChunkPrefixTree
from ragkv.assembler.segments import SegmentKind, Stability
from ragkv.assembler.sent import SentPrefixes
from ragkv.assembler.slots import SlotLearner, SlotSplit
from ragkv.assembler.stability import StabilityTracker
from ragkv.assembler.structured import SystemPrompt, Volatile
from ragkv.assembler.template import Layout

__all__ = [
    "ORDERS",
    "Assembler",
    "AssemblerConfig",
    "AssemblyStats",
    "ChunkPrefixTree",
    "DroppedChunk",
    "Layout",
    "PromptPlan",
    "Residency",
    "SegmentKind",
    "SegmentSpan",
    "SentPrefixes",
    "SlotLearner",
    "SlotSplit",
    "Stability",
    "StabilityTracker",
    "SystemPrompt",
    "Volatile",
]
