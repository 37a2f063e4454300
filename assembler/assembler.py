"""The Assembler: token-level, stable-first, cache-aware prompt assembly.

Every segment is tokenized once (chunks and static segments through the
:class:`~ragkv.dedup.ChunkRegistry`, keyed by content hash) and the prompt is the
concatenation of segment token ids with fixed separator token ids, so a chunk produces the
same token ids whatever surrounds it. Where the segments go is described in
:mod:`ragkv.assembler.template`; in which order chunks go, in :mod:`ragkv.assembler.ordering`.

Because tokenization is not compositional, ``token_ids`` can differ from tokenizing the
rendered ``text`` in one go at segment seams (typically whitespace runs split differently).
Decoding ``token_ids`` still gives back ``text`` exactly for byte-level BPE tokenizers
(GPT-2 style, SmolLM2, Llama 3, Qwen); ``measure_seams=True`` reports the difference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from ragkv.assembler.budget import fit_budget
from ragkv.assembler.invalidators import InvalidatorDetector
from ragkv.assembler.ordering import (
    cache_aware_order,
    canonical_order,
    check_order,
    retrieval_order,
)
from ragkv.assembler.plan import AssemblyStats, DroppedChunk, PromptPlan, SegmentSpan
from ragkv.assembler.prefix_tree import ChunkPrefixTree
from ragkv.assembler.segments import (
    DEFAULT_STABILITY,
    Segment,
    SegmentKind,
    Stability,
    parse_overrides,
)
from ragkv.assembler.stability import StabilityTracker
from ragkv.assembler.template import Layout, Piece, PromptTemplate
from ragkv.assembler.tokenization import TextTokenizer
from ragkv.dedup import Chunk, ChunkRegistry, content_hash
from ragkv.errors import ConfigError, InvalidInputError

Residency = Callable[[Sequence[int]], int]
"""``(token_ids) -> int``: how many leading tokens the engine has cached
(``engine.cached_prefix_length``)."""

Turn = Mapping[str, str] | tuple[str, str]


@dataclass(slots=True)
class _Request:
    """One request's segments, grouped by region of the layout."""

    head: list[Segment]  # static items before the chunks
    chunks: list[Segment]
    tail: list[Segment]  # demoted / volatile system items after the chunks
    turns: list[Segment]
    question: Segment


class Assembler:
    """Builds :class:`PromptPlan` s from system prompt, retrieved chunks and question.

    ``order`` is ``"stable-first"`` (default), ``"cache-aware"`` or ``"retrieval"`` (see
    :mod:`ragkv.assembler.ordering`). ``registry`` is shared with the dedup stage if given.
    ``residency`` is the engine's cached-prefix callback; with it, plans report
    ``expected_cached_tokens`` and the cache-aware order checks which candidate order the
    engine has cached more of. ``demote_invalidators`` moves a "static" segment that
    changes on every request (a timestamp in the system prompt) after the chunks.
    ``collapse_duplicates=False`` keeps byte-identical chunks as retrieved (what an
    application without a dedup stage sends; the benchmark's baseline lanes need it).
    """

    def __init__(
        self,
        tokenizer: Any,
        block_size: int = 16,
        order: str = "stable-first",
        registry: ChunkRegistry | None = None,
        *,
        residency: Residency | None = None,
        chat_template: bool = True,
        layout: Layout | None = None,
        demote_invalidators: bool = True,
        invalidator_after: int = 3,
        stability: StabilityTracker | None = None,
        tree_max_nodes: int = 16_384,
        measure_seams: bool = False,
        collapse_duplicates: bool = True,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}.")
        self.tokenizer = TextTokenizer(tokenizer)
        self.block_size = block_size
        self.order = check_order(order)
        self.registry = registry if registry is not None else ChunkRegistry()
        self.residency = residency
        self.template = PromptTemplate(self.tokenizer, layout, chat_template)
        self.demote_invalidators = demote_invalidators
        self.tracker = stability if stability is not None else StabilityTracker()
        self.detector = InvalidatorDetector(self.registry, invalidator_after)
        self.tree = ChunkPrefixTree(tree_max_nodes)
        self.measure_seams = measure_seams
        self.collapse_duplicates = collapse_duplicates
        self._misses = 0  # registry misses (tokenizer calls) of the current request
        self._lock = threading.Lock()
        self._settings = {
            "block_size": block_size,
            "order": order,
            "chat_template": chat_template,
            "layout": layout,
            "demote_invalidators": demote_invalidators,
            "invalidator_after": invalidator_after,
            "tree_max_nodes": tree_max_nodes,
            "measure_seams": measure_seams,
            "collapse_duplicates": collapse_duplicates,
        }

    # -- public ---------------------------------------------------------------------------

    def assemble(
        self,
        *,
        system: str | None = None,
        chunks: Iterable[str | bytes | Chunk] = (),
        question: str,
        history: Sequence[Turn] | None = None,
        few_shot: Sequence[str] | None = None,
        max_prompt_tokens: int | None = None,
        residency: Residency | None = None,
        stability: Mapping[str, str] | None = None,
    ) -> PromptPlan:
        """Assemble one prompt.

        ``chunks`` are whatever :meth:`ragkv.dedup.Chunk.coerce` accepts, in retrieval
        order; byte-identical chunks are collapsed to the first (unless the assembler was
        built with ``collapse_duplicates=False``). ``history`` is a list of
        ``{"role", "content"}`` turns before the question. ``stability`` overrides the
        class of ``"system"``, ``"few_shot"`` or ``"chunk"`` segments. Chunks over
        ``max_prompt_tokens`` are dropped whole (see :mod:`ragkv.assembler.budget`).
        """
        if not isinstance(question, str):
            raise InvalidInputError(f"question must be str, got {type(question).__name__}.")
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise InvalidInputError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}.")
        overrides = parse_overrides(dict(stability) if stability else None)
        residency = residency if residency is not None else self.residency
        with self._lock:
            return self._assemble(
                system, chunks, question, history, few_shot, max_prompt_tokens, residency, overrides
            )

    def fork(self) -> Assembler:
        """A new assembler with this one's settings, tokenizer and registry (token ids are a
        pure function of the text) but none of its learned state: stability, invalidator
        streaks and the prefix tree start empty. One fork per tenant keeps one tenant's
        traffic from reordering, or revealing, another's prompts."""
        stability = self.tracker
        tracker = StabilityTracker(
            stability.promote_after,
            stability.window,
            stability.demote_after,
            stability.max_tracked,
        )
        return Assembler(
            self.tokenizer.tokenizer,
            registry=self.registry,
            residency=self.residency,
            stability=tracker,
            **self._settings,
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens kept)."""
        return self.tokenizer.decode(token_ids)

    # -- steps ----------------------------------------------------------------------------

    def _assemble(
        self,
        system: str | None,
        raw_chunks: Iterable[str | bytes | Chunk],
        question: str,
        history: Sequence[Turn] | None,
        few_shot: Sequence[str] | None,
        max_prompt_tokens: int | None,
        residency: Residency | None,
        overrides: dict[SegmentKind, Stability],
    ) -> PromptPlan:
        stats = AssemblyStats(order=self.order)
        statics = self._static_segments(system, few_shot, overrides)
        chunks = self._chunk_segments(raw_chunks, stats)
        self.registry.observe([s.key for s in statics] + [s.key for s in chunks])
        head, tail = self._place_statics(statics, stats)
        self._tokenize(head, tail, chunks, stats)
        ranks = self._classify_chunks(chunks, overrides.get(SegmentKind.CHUNK), stats)
        request = _Request(head, chunks, tail, self._turns(history), self._volatile(question))
        frame = self.template.frame(tuple(turn.role or "" for turn in request.turns))

        dropped: list[Segment] = []
        if max_prompt_tokens is not None:
            request.chunks, dropped = fit_budget(
                chunks, max_prompt_tokens, lambda kept: self._length(request, frame, kept)
            )
        head_key = content_hash(b"".join(s.key for s in head))
        candidates = self._orders(request.chunks, ranks, head_key, stats)
        plans = [self._build(request, frame, order, stats) for order in candidates]
        plan = plans[0]
        if residency is not None:
            cached = [residency(p.token_ids) for p in plans]
            best = max(range(len(plans)), key=cached.__getitem__)
            plan, plan.expected_cached_tokens = plans[best], cached[best]
            candidates = candidates[best : best + 1]
        if self.order == "cache-aware":
            self.tree.insert(head_key, [s.key for s in candidates[0]])
        plan.dropped = [
            DroppedChunk(s.chunk, s.rank, len(s.token_ids), s.stability)  # type: ignore[arg-type]
            for s in dropped
        ]
        stats.num_dropped = len(dropped)
        stats.num_tokens, stats.num_chunks = len(plan.token_ids), len(request.chunks)
        volatile = [s.start for s in plan.segments if s.stability is Stability.VOLATILE]
        stats.stable_prefix_tokens = volatile[0] if volatile else len(plan.token_ids)
        if self.measure_seams:
            self._measure_seams(plan)
        return plan

    def _static_segments(
        self,
        system: str | None,
        few_shot: Sequence[str] | None,
        overrides: dict[SegmentKind, Stability],
    ) -> list[Segment]:
        texts: list[tuple[SegmentKind, str, int]] = []
        if system:
            texts.append((SegmentKind.SYSTEM, _text(system, "system"), 0))
        for i, example in enumerate(few_shot or ()):
            texts.append((SegmentKind.FEW_SHOT, _text(example, "few_shot example"), i))
        segments = []
        for kind, text, index in texts:
            chunk = Chunk(text)
            stability = overrides.get(kind, DEFAULT_STABILITY[kind])
            slot = kind.value if kind is SegmentKind.SYSTEM else f"few_shot[{index}]"
            segments.append(
                Segment(
                    kind, stability, text, (), self.registry.key(chunk), index, chunk, None, slot
                )
            )
        return segments

    def _chunk_segments(
        self, raw_chunks: Iterable[str | bytes | Chunk], stats: AssemblyStats
    ) -> list[Segment]:
        segments: list[Segment] = []
        seen: set[bytes] = set()
        key = self.registry.key
        for rank, raw in enumerate(raw_chunks):
            chunk = Chunk.coerce(raw)
            chunk_key = key(chunk)
            if chunk_key in seen and self.collapse_duplicates:
                stats.duplicates_collapsed += 1
                continue
            seen.add(chunk_key)
            segments.append(
                Segment(SegmentKind.CHUNK, Stability.STABLE, "", (), chunk_key, rank, chunk)
            )
        return segments

    def _place_statics(
        self, statics: list[Segment], stats: AssemblyStats
    ) -> tuple[list[Segment], list[Segment]]:
        """Split static segments into the head (before chunks) and the tail (after them)."""
        head, tail, flagged, demoted = [], [], [], []
        for segment in statics:
            if segment.stability is not Stability.VOLATILE and self.detector.check(
                segment.slot, segment.key
            ):
                flagged.append(segment.slot)
                if self.demote_invalidators:
                    segment.stability = Stability.VOLATILE
                    demoted.append(segment.slot)
            (tail if segment.stability is Stability.VOLATILE else head).append(segment)
        stats.invalidators, stats.demoted = tuple(flagged), tuple(demoted)
        return head, tail

    def _tokenize(
        self, head: list[Segment], tail: list[Segment], chunks: list[Segment], stats: AssemblyStats
    ) -> None:
        """Token ids via the registry, except volatile statics (they would only pollute it)."""
        registry, key, encode = self.registry, self.tokenizer.key, self._encode_miss
        for segment in head:
            segment.token_ids = registry.token_ids(segment.chunk, key, encode)  # type: ignore[arg-type]
        for segment in tail:
            segment.token_ids = self.tokenizer.encode(segment.text)
        self._misses = 0
        for segment in chunks:
            chunk = segment.chunk
            segment.text = chunk.text  # type: ignore[union-attr]
            segment.token_ids = registry.token_ids(chunk, key, encode)  # type: ignore[arg-type]
        stats.chunks_tokenized, stats.chunks_reused = self._misses, len(chunks) - self._misses

    def _encode_miss(self, text: str) -> list[int]:
        self._misses += 1
        return self.tokenizer.encode(text)

    def _classify_chunks(
        self, chunks: list[Segment], forced: Stability | None, stats: AssemblyStats
    ) -> dict[bytes, int]:
        """Record the request with the tracker; set each chunk's class; return stable ranks."""
        tracker = self.tracker
        tracker.observe([s.key for s in chunks])
        ranks: dict[bytes, int] = {}
        for segment in chunks:
            rank = tracker.rank(segment.key)
            if rank is not None:
                ranks[segment.key] = rank
            if forced is not None:
                segment.stability = Stability.STABLE if forced is Stability.STATIC else forced
            elif rank is None:
                segment.stability = Stability.VOLATILE
        stats.stable_chunks = sum(s.stability is Stability.STABLE for s in chunks)
        return ranks

    def _turns(self, history: Sequence[Turn] | None) -> list[Segment]:
        turns = []
        for i, turn in enumerate(history or ()):
            if isinstance(turn, Mapping):
                role, content = turn.get("role"), turn.get("content")
            elif isinstance(turn, tuple) and len(turn) == 2:
                role, content = turn
            else:
                role = content = None
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidInputError(
                    f"history[{i}] must be {{'role': str, 'content': str}} or (role, content)."
                )
            segment = self._volatile(content, SegmentKind.HISTORY, i)
            segment.role = role
            turns.append(segment)
        return turns

    def _volatile(
        self, text: str, kind: SegmentKind = SegmentKind.QUESTION, index: int = 0
    ) -> Segment:
        key = content_hash(text.encode("utf-8", "surrogatepass"), self.registry.hash)
        ids = self.tokenizer.encode(text)
        return Segment(kind, Stability.VOLATILE, text, ids, key, index)

    def _orders(
        self,
        chunks: list[Segment],
        ranks: dict[bytes, int],
        head_key: bytes,
        stats: AssemblyStats,
    ) -> list[list[Segment]]:
        """Candidate chunk orders, preferred first (several only for cache-aware)."""
        if self.order == "retrieval":
            return [retrieval_order(chunks)]
        canonical = canonical_order(chunks, ranks)
        if self.order == "stable-first":
            return [canonical]
        walked, stats.tree_path_chunks = cache_aware_order(chunks, ranks, self.tree, head_key)
        if stats.tree_path_chunks == 0 or walked == canonical:
            return [walked]
        return [walked, canonical]

    # -- layout ---------------------------------------------------------------------------

    def _items(self, request: _Request, chunks: Sequence[Segment]) -> list[Any]:
        """System-message items in order: segments, and the chunk list as one item."""
        items: list[Any] = list(request.head)
        if chunks:
            items.append(chunks)
        items.extend(request.tail)
        return items

    def _length(
        self, request: _Request, frame: tuple[Piece, ...], chunks: Sequence[Segment]
    ) -> int:
        template = self.template
        items = self._items(request, chunks)
        total = sum(len(p.token_ids) for p in frame) + len(request.question.token_ids)
        total += sum(len(t.token_ids) for t in request.turns)
        total += max(0, len(items) - 1) * len(template.separator.token_ids)
        for item in items:
            if isinstance(item, Segment):
                total += len(item.token_ids)
            else:
                total += len(template.context_header.token_ids)
                total += sum(len(s.token_ids) for s in item)
                total += (len(item) - 1) * len(template.chunk_delimiter.token_ids)
        return total

    def _build(
        self,
        request: _Request,
        frame: tuple[Piece, ...],
        chunks: list[Segment],
        stats: AssemblyStats,
    ) -> PromptPlan:
        """Concatenate frame pieces, separators and segment token ids; record the spans."""
        ids: list[int] = []
        texts: list[str] = []
        spans: list[SegmentSpan] = []

        def piece(p: Piece) -> None:
            ids.extend(p.token_ids)
            texts.append(p.text)

        def segment(s: Segment) -> None:
            start = len(ids)
            ids.extend(s.token_ids)
            texts.append(s.text)
            demoted = s.slot in stats.demoted
            spans.append(SegmentSpan(s.kind, s.stability, start, len(ids), s.key, s.rank, demoted))

        template = self.template
        piece(frame[0])
        for i, item in enumerate(self._items(request, chunks)):
            if i:
                piece(template.separator)
            if isinstance(item, Segment):
                segment(item)
                continue
            piece(template.context_header)
            for j, chunk in enumerate(item):
                if j:
                    piece(template.chunk_delimiter)
                segment(chunk)
        for turn, p in zip(request.turns, frame[1:], strict=False):
            piece(p)
            segment(turn)
        piece(frame[-2])
        segment(request.question)
        piece(frame[-1])

        return PromptPlan(ids, spans, "".join(texts), stats)

    def _measure_seams(self, plan: PromptPlan) -> None:
        reference = self.tokenizer.encode(plan.text)
        matcher = SequenceMatcher(None, plan.token_ids, reference, autojunk=False)
        matched = sum(block.size for block in matcher.get_matching_blocks())
        plan.stats.seam_mismatch_tokens = len(plan.token_ids) - matched
        plan.stats.token_count_delta = len(plan.token_ids) - len(reference)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be str, got {type(value).__name__}.")
    return value
