"""The Assembler: token-level, stable-first, cache-aware prompt assembly.

Every segment is tokenized once (chunks and static segments through the
:class:`~ragkv.dedup.ChunkRegistry`, keyed by content hash) and the prompt is the
concatenation of segment token ids with fixed separator token ids, so a chunk produces the
same token ids whatever surrounds it. Where the segments go is described in
:mod:`ragkv.assembler.template`; in which order chunks go, in :mod:`ragkv.assembler.ordering`;
which parts of a "static" system prompt stay in front, in :mod:`ragkv.assembler.system_split`
(learning: :mod:`ragkv.assembler.slots`; caller-marked parts: :mod:`ragkv.assembler.structured`).

**Never worse than as-given.** Every request is also assembled in the order the application
gave (system prompt whole and first, chunks in retrieval order); the two plans are compared
by the cached prefix each would get (engine residency when a callback is given, else the
assembler's own record of what it sent, :mod:`ragkv.assembler.sent`) and the better one is
sent. Ties and near-ties (within one block) go to the canonical plan: the first request of a
new canonical layout cannot find it cached yet, and it is the one later requests share. ``plan.stats.chosen`` and ``choice_reason`` say
which and why.

Because tokenization is not compositional, ``token_ids`` can differ from tokenizing the
rendered ``text`` in one go at segment seams (typically whitespace runs split differently).
Decoding ``token_ids`` still gives back ``text`` exactly for byte-level BPE tokenizers
(GPT-2 style, SmolLM2, Llama 3, Qwen); ``measure_seams=True`` reports the difference.

Concurrency: tokenization (the expensive part, O(text)) runs outside any lock shared by
requests; only the learning and ordering step (O(chunks + system tokens)) is serialized.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from ragkv.assembler.budget import fit_budget
from ragkv.assembler.config import AssemblerConfig
from ragkv.assembler.ordering import (
    cache_aware_order,
    canonical_order,
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
from ragkv.assembler.sent import SentPrefixes
from ragkv.assembler.stability import StabilityTracker
from ragkv.assembler.structured import SystemLike, Volatile, system_parts
from ragkv.assembler.system_split import Group, SystemSplitter
from ragkv.assembler.template import Layout, Piece, PromptTemplate
from ragkv.assembler.tokenization import text_tokenizer
from ragkv.dedup import Chunk, ChunkRegistry, content_hash
from ragkv.errors import ConfigError, InvalidInputError

Residency = Callable[[Sequence[int]], int]
"""``(token_ids) -> int``: how many leading tokens the engine has cached
(``engine.cached_prefix_length``)."""

Turn = Mapping[str, str] | tuple[str, str]
HISTORY_ROLES = frozenset({"user", "assistant"})


@dataclass(slots=True)
class _Request:
    """One request's segments, grouped by region of the layout.

    ``head`` and ``tail`` are items of the system message before and after the chunks; an
    item is a group of segments written back to back (a split slot's stable parts).
    """

    head: list[Group]
    chunks: list[Segment]
    tail: list[Group]
    turns: list[Segment]
    question: Segment


@dataclass(slots=True)
class _Tokenized:
    """A request's segments after tokenization (done outside the assembler's lock)."""

    statics: list[Segment]  # system parts and few-shot examples, in the caller's order
    chunks: list[Segment]
    turns: list[Segment]
    question: Segment
    stats: AssemblyStats
    moved: list[str] = field(default_factory=list)


# Learned ranks go after a batch's path (chunk_order ranks are below this).
_PATH_RANKS = 1 << 40


class Assembler:
    """Builds :class:`PromptPlan` s from system prompt, retrieved chunks and question.

    ``config`` (an :class:`~ragkv.assembler.config.AssemblerConfig`) holds every setting:
    block size, order, layout, invalidator demotion, never-worse comparison, bounds. The
    same settings may be given as keywords instead (``Assembler(tok, block_size=16,
    order="cache-aware")`` builds the config); giving both is a
    :class:`~ragkv.errors.ConfigError`. Besides the config, an assembler takes its
    collaborators: ``registry`` (shared with the dedup stage if given), ``residency`` (the
    engine's cached-prefix callback; with it, plans report ``expected_cached_tokens`` and
    candidate orders are compared by what the engine holds) and ``stability`` (a
    :class:`StabilityTracker` to start from).
    """

    def __init__(
        self,
        tokenizer: Any,
        block_size: int | None = None,
        order: str | None = None,
        registry: ChunkRegistry | None = None,
        *,
        config: AssemblerConfig | None = None,
        residency: Residency | None = None,
        stability: StabilityTracker | None = None,
        chat_template: bool | None = None,
        layout: Layout | None = None,
        demote_invalidators: bool | None = None,
        invalidator_after: int | None = None,
        tree_max_nodes: int | None = None,
        measure_seams: bool | None = None,
        collapse_duplicates: bool | None = None,
        never_worse: bool | None = None,
        never_worse_slack: int | None = None,
        sent_max_blocks: int | None = None,
    ) -> None:
        settings = {
            "block_size": block_size,
            "order": order,
            "chat_template": chat_template,
            "layout": layout,
            "demote_invalidators": demote_invalidators,
            "invalidator_after": invalidator_after,
            "tree_max_nodes": tree_max_nodes,
            "measure_seams": measure_seams,
            "collapse_duplicates": collapse_duplicates,
            "never_worse": never_worse,
            "never_worse_slack": never_worse_slack,
            "sent_max_blocks": sent_max_blocks,
        }
        config = _config(config, {k: v for k, v in settings.items() if v is not None})
        self.config = config
        self.tokenizer = text_tokenizer(tokenizer)
        self.block_size = config.block_size
        self.order = config.order
        self.registry = registry if registry is not None else ChunkRegistry()
        self.registry_key = self.tokenizer.key  # a tenant's fork keeps its token ids apart
        self.residency = residency
        self.template = PromptTemplate(self.tokenizer, config.layout, config.chat_template)
        self.demote_invalidators = config.demote_invalidators
        self.tracker = stability if stability is not None else StabilityTracker()
        self.splitter = SystemSplitter(
            self.tokenizer.decode,
            block_size=config.block_size,
            hash_algo=self.registry.hash,
            demote_invalidators=config.demote_invalidators,
            invalidator_after=config.invalidator_after,
        )
        self.slots = self.splitter.slots
        self.tree = ChunkPrefixTree(config.tree_max_nodes)
        self.sent = SentPrefixes(config.block_size, config.sent_max_blocks)
        self.measure_seams = config.measure_seams
        self.collapse_duplicates = config.collapse_duplicates
        self.never_worse = config.never_worse
        slack = config.never_worse_slack
        self.never_worse_slack = config.block_size if slack is None else slack
        self._boundary_slack = slack is None  # see _choose
        self._lock = threading.Lock()

    # -- public ---------------------------------------------------------------------------

    def assemble(
        self,
        *,
        system: SystemLike | None = None,
        chunks: Iterable[str | bytes | Chunk] = (),
        question: str,
        history: Sequence[Turn] | None = None,
        few_shot: Sequence[str] | None = None,
        max_prompt_tokens: int | None = None,
        residency: Residency | None = None,
        stability: Mapping[str, str] | None = None,
        chunk_order: Mapping[bytes, int] | None = None,
        learn: bool = True,
    ) -> PromptPlan:
        """Assemble one prompt.

        ``system`` is a string, a list of ``str`` / :class:`Volatile` parts or a
        :class:`SystemPrompt` (see :mod:`ragkv.assembler.structured`). ``chunks`` are
        whatever :meth:`ragkv.dedup.Chunk.coerce` accepts, in retrieval order;
        byte-identical chunks are collapsed to the first (unless the assembler was built
        with ``collapse_duplicates=False``). ``history`` is a list of ``{"role",
        "content"}`` turns before the question. ``stability`` overrides the class of
        ``"system"``, ``"few_shot"`` or ``"chunk"`` segments. Chunks over
        ``max_prompt_tokens`` are dropped whole (see :mod:`ragkv.assembler.budget`).
        ``chunk_order`` (content key → rank, from a batch that knows its requests in
        advance: :mod:`ragkv.batch`) puts the chunks it names first, by rank, and the rest
        after them in the learned order; the chunks are still recorded as seen.
        ``learn=False`` leaves the system-prompt learner as it is (a batch that taught it
        every version first, with :meth:`learn_system`, runs in another order).
        """
        if not isinstance(question, str):
            raise InvalidInputError(
                f"question must be str, got {type(question).__name__}.", param="question"
            )
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise InvalidInputError(
                f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}.",
                param="max_prompt_tokens",
            )
        overrides = parse_overrides(dict(stability) if stability else None)
        residency = residency if residency is not None else self.residency
        tokenized = self._tokenize(system, chunks, question, history, few_shot, overrides)
        with self._lock:
            return self._plan(
                tokenized, max_prompt_tokens, residency, overrides, chunk_order, learn
            )

    def learn_system(self, systems: Iterable[SystemLike | None]) -> None:
        """Show the system-prompt learner these versions, in this order, as if requests with
        them had been assembled (a batch does this with its requests' arrival order)."""
        for system in systems:
            statics = self._static_segments(system, None, {})
            for segment in statics:
                if segment.chunk is not None:
                    segment.token_ids = self.registry.token_ids(
                        segment.chunk, self.registry_key, self.tokenizer.encode
                    )
            with self._lock:
                self.splitter.learn(statics)

    def fork(self, scope: str | None = None) -> Assembler:
        """A new assembler with this one's settings, tokenizer and registry (one memory
        budget) but none of its learned state: stability, learned system-prompt heads, the
        prefix tree and the sent record start empty. One fork per tenant keeps one tenant's
        traffic from reordering, or revealing, another's prompts. With a ``scope`` (the
        tenant), its token ids are kept apart in the registry too: how fast a document
        tokenizes then cannot tell one tenant what another recently sent."""
        tracker = self.tracker
        fork = Assembler(
            self.tokenizer.tokenizer,
            registry=self.registry,
            residency=self.residency,
            stability=StabilityTracker(
                tracker.promote_after, tracker.window, tracker.demote_after, tracker.max_tracked
            ),
            config=self.config,
        )
        if scope is not None:
            digest = content_hash(scope.encode("utf-8", "surrogatepass")).hex()[:32]
            fork.registry_key = f"{self.tokenizer.key}|scope:{digest}"
        return fork

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens kept)."""
        return self.tokenizer.decode(token_ids)

    # -- tokenization (no shared lock) -----------------------------------------------------

    def _tokenize(
        self,
        system: SystemLike | None,
        raw_chunks: Iterable[str | bytes | Chunk],
        question: str,
        history: Sequence[Turn] | None,
        few_shot: Sequence[str] | None,
        overrides: dict[SegmentKind, Stability],
    ) -> _Tokenized:
        stats = AssemblyStats(order=self.order)
        statics = self._static_segments(system, few_shot, overrides)
        chunks = self._chunk_segments(raw_chunks, stats)
        registry, key = self.registry, self.registry_key
        misses = 0

        def encode(text: str) -> list[int]:
            nonlocal misses
            misses += 1
            return self.tokenizer.encode(text)

        for segment in statics:
            if segment.chunk is None:  # a volatile part: not worth a registry entry
                segment.token_ids = self.tokenizer.encode(segment.text)
            else:
                segment.token_ids = registry.token_ids(segment.chunk, key, self.tokenizer.encode)
        for segment in chunks:
            segment.text = segment.chunk.text  # type: ignore[union-attr]
            segment.token_ids = registry.token_ids(segment.chunk, key, encode)  # type: ignore[arg-type]
        stats.chunks_tokenized, stats.chunks_reused = misses, len(chunks) - misses
        registry.observe([s.key for s in statics if s.chunk is not None] + [s.key for s in chunks])
        turns = self._turns(history)
        return _Tokenized(statics, chunks, turns, self._volatile(question), stats)

    def _static_segments(
        self,
        system: SystemLike | None,
        few_shot: Sequence[str] | None,
        overrides: dict[SegmentKind, Stability],
    ) -> list[Segment]:
        parts = system_parts(system)
        segments = []
        for i, part in enumerate(parts):
            slot = "system" if len(parts) == 1 else f"system[{i}]"
            if isinstance(part, Volatile):
                key = content_hash(part.text.encode("utf-8", "surrogatepass"), self.registry.hash)
                segments.append(
                    Segment(
                        SegmentKind.SYSTEM, Stability.VOLATILE, part.text, (), key, i, slot=slot
                    )
                )
            else:
                segments.append(self._static(SegmentKind.SYSTEM, part, i, slot, overrides))
        for i, example in enumerate(few_shot or ()):
            text = _text(example, "few_shot example", "few_shot")
            segments.append(
                self._static(SegmentKind.FEW_SHOT, text, i, f"few_shot[{i}]", overrides)
            )
        return segments

    def _static(
        self,
        kind: SegmentKind,
        text: str,
        index: int,
        slot: str,
        overrides: dict[SegmentKind, Stability],
    ) -> Segment:
        chunk = Chunk(text)
        stability = overrides.get(kind, DEFAULT_STABILITY[kind])
        return Segment(
            kind, stability, text, (), self.registry.key(chunk), index, chunk, None, slot
        )

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
                    f"history[{i}] must be {{'role': str, 'content': str}} or (role, content).",
                    param="history",
                )
            if role not in HISTORY_ROLES:  # a role is template text: never free-form
                raise InvalidInputError(
                    f"history[{i}] has role {role[:40]!r}; history turns are 'user' or "
                    "'assistant' (the system prompt goes in system=...)",
                    param=f"history[{i}].role",
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

    # -- learning, ordering and choice (under the lock) -------------------------------------

    def _plan(
        self,
        tokenized: _Tokenized,
        max_prompt_tokens: int | None,
        residency: Residency | None,
        overrides: dict[SegmentKind, Stability],
        chunk_order: Mapping[bytes, int] | None = None,
        learn: bool = True,
    ) -> PromptPlan:
        stats = tokenized.stats
        head, tail, boundary_slack = self.splitter.place(tokenized.statics, stats, learn)
        chunks = tokenized.chunks
        ranks = self._classify_chunks(chunks, overrides.get(SegmentKind.CHUNK), stats, chunk_order)
        request = _Request(head, chunks, tail, tokenized.turns, tokenized.question)
        frame = self.template.frame(tuple(turn.role or "" for turn in request.turns))

        dropped: list[Segment] = []
        if max_prompt_tokens is not None:
            request.chunks, dropped = fit_budget(
                chunks, max_prompt_tokens, lambda kept: self._length(request, frame, kept)
            )
        head_key = _head_key(head)
        if chunk_order is None:
            orders = self._orders(request.chunks, ranks, head_key, stats)
        else:  # the batch's shared order first; the sent orders' walk may still win
            orders = [canonical_order(request.chunks, ranks)]
            if self.order == "cache-aware":
                walked, _ = cache_aware_order(request.chunks, ranks, self.tree, head_key)
                if walked != orders[0]:
                    orders.append(walked)
        candidates = [
            (self._build(request, frame, order, stats), head_key, order) for order in orders
        ]
        has_given = False
        if self.never_worse:
            given = self._as_given(tokenized, request, frame, max_prompt_tokens)
            if given is not None and given[0].token_ids != candidates[0][0].token_ids:
                candidates.append(given)
                has_given = True
        plan, head_key, order = self._choose(
            candidates,
            has_given,
            residency,
            stats,
            self.never_worse_slack + (boundary_slack if self._boundary_slack else 0),
        )
        if self.order == "cache-aware":
            self.tree.insert(head_key, [s.key for s in order])
        self.sent.record(plan.token_ids)
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

    def _classify_chunks(
        self,
        chunks: list[Segment],
        forced: Stability | None,
        stats: AssemblyStats,
        chunk_order: Mapping[bytes, int] | None = None,
    ) -> dict[bytes, int]:
        """Record the request with the tracker; set each chunk's class; return stable ranks
        (the tracker's, or ``chunk_order``'s when a batch gives one)."""
        tracker = self.tracker
        tracker.observe([s.key for s in chunks])
        ranks: dict[bytes, int] = {}
        for segment in chunks:
            rank = tracker.rank(segment.key)
            if chunk_order is not None:  # the batch's path first, then the learned order
                path = chunk_order.get(segment.key)
                rank = path if path is not None else None if rank is None else _PATH_RANKS + rank
            if rank is not None:
                ranks[segment.key] = rank
            if forced is not None:
                segment.stability = Stability.STABLE if forced is Stability.STATIC else forced
            elif rank is None:
                segment.stability = Stability.VOLATILE
        stats.stable_chunks = sum(s.stability is Stability.STABLE for s in chunks)
        return ranks

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

    def _as_given(
        self,
        tokenized: _Tokenized,
        request: _Request,
        frame: tuple[Piece, ...],
        max_prompt_tokens: int | None,
    ) -> tuple[PromptPlan, bytes, list[Segment]] | None:
        """The application's own order: statics whole and first, chunks as retrieved."""
        system = [s for s in tokenized.statics if s.kind is SegmentKind.SYSTEM]
        head = [system] if system else []
        head += [[s] for s in tokenized.statics if s.kind is not SegmentKind.SYSTEM]
        given = _Request(head, request.chunks, [], request.turns, request.question)
        order = retrieval_order(request.chunks)
        stats = AssemblyStats(order="retrieval")
        plan = self._build(given, frame, order, stats)
        if max_prompt_tokens is not None and len(plan.token_ids) > max_prompt_tokens:
            return None
        return plan, _head_key(head), order

    def _choose(
        self,
        candidates: list[tuple[PromptPlan, bytes, list[Segment]]],
        has_given: bool,
        residency: Residency | None,
        stats: AssemblyStats,
        slack: int,
    ) -> tuple[PromptPlan, bytes, list[Segment]]:
        """The candidate with the longest cached prefix; ties go to the earliest (canonical).

        ``has_given``: the last candidate is the as-given plan, which must win by more than
        ``slack`` tokens (a block, plus what the canonical head gave up to end on a text
        boundary: a price of meaning, not a worse order).
        """
        if len(candidates) == 1 and residency is None:
            plan = candidates[0][0]
            plan.stats = stats
            same = "the as-given order is the same prompt" if self.never_worse else "not compared"
            stats.choice_reason = f"canonical: {same}"
            return candidates[0]
        probe = residency if residency is not None else self.sent.cached_prefix_length
        cached = [probe(plan.token_ids) for plan, _, _ in candidates]
        best = max(range(len(candidates)), key=cached.__getitem__)
        if has_given and best == len(candidates) - 1:
            canonical_best = max(range(len(candidates) - 1), key=cached.__getitem__)
            if cached[best] - cached[canonical_best] <= slack:
                best = canonical_best  # a near-tie: the canonical plan is the investment
        plan, head_key, order = candidates[best]
        plan.stats = stats
        canonical = cached[:-1] if has_given else cached
        stats.expected_canonical = max(canonical)
        if has_given:
            stats.expected_as_given = cached[-1]
            if best == len(candidates) - 1:
                stats.chosen = "as-given"
            loser = "canonical" if stats.chosen == "as-given" else "as-given"
            reason = f"{cached[best]} cached tokens vs {min(cached)} for the {loser} order"
        else:
            reason = "the as-given order is the same prompt" if self.never_worse else "not compared"
        source = "engine residency" if residency is not None else "the assembler's record"
        stats.choice_reason = f"{stats.chosen}: {reason} ({source})"
        if residency is not None:
            plan.expected_cached_tokens = cached[best]
        return plan, head_key, order

    # -- layout ---------------------------------------------------------------------------

    def _items(self, request: _Request, chunks: Sequence[Segment]) -> list[Any]:
        """System-message items in order: segment groups, and the chunk list as one item."""
        items: list[Any] = list(request.head)
        if chunks:
            items.append(("chunks", chunks))
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
            if isinstance(item, tuple):
                listed = item[1]
                total += len(template.context_header.token_ids)
                total += sum(len(s.token_ids) for s in listed)
                total += (len(listed) - 1) * len(template.chunk_delimiter.token_ids)
            else:
                total += sum(len(s.token_ids) for s in item)
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
            spans.append(
                SegmentSpan(s.kind, s.stability, start, len(ids), s.key, s.rank, s.demoted)
            )

        template = self.template
        piece(frame[0])
        for i, item in enumerate(self._items(request, chunks)):
            if i:
                piece(template.separator)
            if not isinstance(item, tuple):
                for s in item:
                    segment(s)
                continue
            piece(template.context_header)
            for j, chunk in enumerate(item[1]):
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


def _head_key(head: list[Group]) -> bytes:
    return content_hash(b"".join(s.key for group in head for s in group))


def _text(value: object, what: str, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be str, got {type(value).__name__}.", param=param)
    return value


def _config(config: AssemblerConfig | None, settings: dict[str, Any]) -> AssemblerConfig:
    """``config``, or one built from the keyword ``settings``; never both."""
    if config is None:
        return AssemblerConfig(**settings)
    if settings:
        raise ConfigError(
            f"give the assembler's settings either as config= or as keywords "
            f"({', '.join(sorted(settings))}), not both; use config.replace(...) to change some",
            param="config",
        )
    if not isinstance(config, AssemblerConfig):
        raise ConfigError(
            f"config must be an AssemblerConfig, got {type(config).__name__}", param="config"
        )
    return config
