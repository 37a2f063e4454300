"""The Assembler: token-level, stable-first, cache-aware prompt assembly.

An assembly runs in steps, each in its own module: the request's segments are tokenized
once (:mod:`ragkv.assembler.segmenter`: chunks and static segments through the
:class:`~ragkv.dedup.ChunkRegistry`, keyed by content hash); the static ones are placed
before or after the chunks (:mod:`ragkv.assembler.system_split`; learning:
:mod:`ragkv.assembler.slots`; caller-marked parts: :mod:`ragkv.assembler.structured`); the
chunks are ordered (:mod:`ragkv.assembler.ordering`); each candidate order is built into a
prompt, the concatenation of segment token ids with the template's fixed pieces
(:mod:`ragkv.assembler.build`, :mod:`ragkv.assembler.template`), so a chunk produces the
same token ids whatever surrounds it; and the candidate with the longest cached prefix is
sent, never worse than the application's own order (:mod:`ragkv.assembler.never_worse`;
``plan.stats.chosen`` and ``choice_reason`` say which and why).

Because tokenization is not compositional, ``token_ids`` can differ from tokenizing the
rendered ``text`` in one go at segment seams (typically whitespace runs split differently).
Decoding ``token_ids`` still gives back ``text`` exactly for byte-level BPE tokenizers
(GPT-2 style, SmolLM2, Llama 3, Qwen); ``measure_seams=True`` reports the difference.

Concurrency: only what reads or changes the learned state shared by requests runs under the
assembler's lock: learning and ordering (O(chunks + system tokens)), then, once the
candidates are probed, the choice and the record of what was sent. Tokenization (O(text)),
building the candidates and the engine's residency probes run outside it; a probe takes the
engine's lock, and a slow one (a busy engine) never holds up another request's assembly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from difflib import SequenceMatcher
from typing import Any, Unpack

from ragkv.assembler.budget import fit_budget
from ragkv.assembler.build import Regions, build_plan, head_key, prompt_length
from ragkv.assembler.config import AssemblerConfig, AssemblerSettings
from ragkv.assembler.never_worse import Candidate, as_given, choose
from ragkv.assembler.ordering import (
    cache_aware_order,
    canonical_order,
    retrieval_order,
)
from ragkv.assembler.plan import AssemblyStats, DroppedChunk, PromptPlan
from ragkv.assembler.prefix_tree import ChunkPrefixTree
from ragkv.assembler.segmenter import Segmenter, TokenizedRequest, Turn
from ragkv.assembler.segments import Segment, SegmentKind, Stability, parse_overrides
from ragkv.assembler.sent import SentPrefixes
from ragkv.assembler.stability import StabilityTracker
from ragkv.assembler.structured import SystemLike
from ragkv.assembler.system_split import SystemSplitter
from ragkv.assembler.template import PromptTemplate
from ragkv.assembler.tokenization import text_tokenizer
from ragkv.dedup import Chunk, ChunkRegistry, content_hash
from ragkv.errors import ConfigError, InvalidInputError

Residency = Callable[[Sequence[int]], int | tuple[int, Any]]
"""``(token_ids) -> int``: how many leading tokens the engine has cached
(``engine.cached_prefix_length``). A probe may also answer ``(int, handoff)``
(``engine.prefix_probe(cache_salt)``): the chosen plan keeps its handoff, the engine's
hashes of its token ids, as ``plan.prompt_hashes``."""


@dataclass(slots=True)
class _Draft:
    """What the locked step decided for one request: its regions (chunks over the budget
    dropped), head key, candidate chunk orders (preferred first) and the never-worse
    slack."""

    stats: AssemblyStats
    regions: Regions
    dropped: list[Segment]
    key: bytes
    orders: list[list[Segment]]
    slack: int


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
        **settings: Unpack[AssemblerSettings],
    ) -> None:
        config = _config(config, {"block_size": block_size, "order": order, **settings})
        self.config = config
        self.tokenizer = text_tokenizer(tokenizer)
        self.block_size = config.block_size
        self.order = config.order
        self.registry = registry if registry is not None else ChunkRegistry()
        self.segmenter = Segmenter(
            self.tokenizer, self.registry, collapse_duplicates=config.collapse_duplicates
        )
        self.residency = residency
        self.template = PromptTemplate(self.tokenizer, config.layout, config.chat_template)
        self.demote_invalidators = config.demote_invalidators
        self.tracker = stability if stability is not None else StabilityTracker()
        self.splitter = SystemSplitter(self.tokenizer.decode, config, self.registry.hash)
        self.slots = self.splitter.slots
        self.tree = ChunkPrefixTree(config.tree_max_nodes)
        self.sent = SentPrefixes(config.block_size, config.sent_max_blocks)
        self.measure_seams = config.measure_seams
        self.collapse_duplicates = config.collapse_duplicates
        self.never_worse = config.never_worse
        slack = config.never_worse_slack
        self.never_worse_slack = config.block_size if slack is None else slack
        self._boundary_slack = slack is None  # see never_worse.choose
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
        tokenized = self.segmenter.segment(
            system, chunks, question, history, few_shot, overrides, self.order
        )
        with self._lock:  # learning and ordering read and change the shared state
            draft = self._draft(tokenized, max_prompt_tokens, overrides, chunk_order, learn)
        candidates, has_given = self._candidates(draft, tokenized, max_prompt_tokens)
        cached = None
        if residency is not None:  # the engine's lock, never ours: the probe may wait on it
            cached = [_probe(residency, c) for c in candidates]
        with self._lock:
            if cached is None and len(candidates) > 1:
                cached = [self.sent.cached_prefix_length(c.plan.token_ids) for c in candidates]
            chosen = choose(
                candidates,
                cached,
                has_given,
                draft.stats,
                draft.slack,
                never_worse=self.never_worse,
                engine=residency is not None,
            )
            if self.order == "cache-aware":
                self.tree.insert(chosen.head_key, [s.key for s in chosen.order])
            if residency is None:  # the record stands in for an engine that cannot tell
                self.sent.record(chosen.plan.token_ids)
        chosen.plan.prompt_hashes = chosen.handoff
        return self._finish(chosen.plan, draft)

    def learn_system(self, systems: Iterable[SystemLike | None]) -> None:
        """Show the system-prompt learner these versions, in this order, as if requests with
        them had been assembled (a batch does this with its requests' arrival order)."""
        for system in systems:
            statics = self.segmenter.statics(system)
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
            fork.segmenter.key = f"{self.tokenizer.key}|scope:{digest}"
        return fork

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens kept)."""
        return self.tokenizer.decode(token_ids)

    @property
    def registry_key(self) -> str:
        """Whose token ids this assembler reads from the registry (a tenant's fork has its
        own key, so it keeps its token ids apart)."""
        return self.segmenter.key

    # -- learning, ordering and choice (under the lock) -------------------------------------

    def _draft(
        self,
        tokenized: TokenizedRequest,
        max_prompt_tokens: int | None,
        overrides: dict[SegmentKind, Stability],
        chunk_order: Mapping[bytes, int] | None,
        learn: bool,
    ) -> _Draft:
        """Learn from the request and choose its candidate chunk orders (under the lock)."""
        stats = tokenized.stats
        head, tail, boundary_slack = self.splitter.place(tokenized.statics, stats, learn)
        chunks = tokenized.chunks
        ranks = self._classify_chunks(chunks, overrides.get(SegmentKind.CHUNK), stats, chunk_order)
        template = self.template
        frame = template.frame(tuple(turn.role or "" for turn in tokenized.turns))
        regions = Regions(head, chunks, tail, tokenized.turns, tokenized.question, frame)

        dropped: list[Segment] = []
        if max_prompt_tokens is not None:
            regions.chunks, dropped = fit_budget(
                chunks,
                max_prompt_tokens,
                lambda kept: prompt_length(template, regions, kept),
            )
        key = head_key(head)
        if chunk_order is None:
            orders = self._orders(regions.chunks, ranks, key, stats)
        else:  # the batch's shared order first; the sent orders' walk may still win
            orders = [canonical_order(regions.chunks, ranks)]
            if self.order == "cache-aware":
                walked, _ = cache_aware_order(regions.chunks, ranks, self.tree, key)
                if walked != orders[0]:
                    orders.append(walked)
        slack = self.never_worse_slack + (boundary_slack if self._boundary_slack else 0)
        return _Draft(stats, regions, dropped, key, orders, slack)

    def _candidates(
        self, draft: _Draft, tokenized: TokenizedRequest, max_prompt_tokens: int | None
    ) -> tuple[list[Candidate], bool]:
        """The draft's orders built into prompts, preferred first, and the as-given prompt
        last when it differs (then True); request-local, so built outside the lock."""
        template, regions = self.template, draft.regions
        candidates = [
            Candidate(build_plan(template, regions, order, draft.stats), draft.key, order)
            for order in draft.orders
        ]
        if self.never_worse:
            given = as_given(template, tokenized, regions, max_prompt_tokens)
            if given is not None and given.plan.token_ids != candidates[0].plan.token_ids:
                candidates.append(given)
                return candidates, True
        return candidates, False

    def _finish(self, plan: PromptPlan, draft: _Draft) -> PromptPlan:
        """The chosen plan's dropped chunks and counters (request-local: no lock)."""
        stats = draft.stats
        plan.dropped = [
            DroppedChunk(s.chunk, s.rank, len(s.token_ids), s.stability)  # type: ignore[arg-type]
            for s in draft.dropped
        ]
        stats.num_dropped = len(draft.dropped)
        stats.num_tokens, stats.num_chunks = len(plan.token_ids), len(draft.regions.chunks)
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

    def _measure_seams(self, plan: PromptPlan) -> None:
        reference = self.tokenizer.encode(plan.text)
        matcher = SequenceMatcher(None, plan.token_ids, reference, autojunk=False)
        matched = sum(block.size for block in matcher.get_matching_blocks())
        plan.stats.seam_mismatch_tokens = len(plan.token_ids) - matched
        plan.stats.token_count_delta = len(plan.token_ids) - len(reference)


def _probe(residency: Residency, candidate: Candidate) -> int:
    """The candidate's cached prefix; a handoff answered with it is kept on the candidate."""
    answer = residency(candidate.plan.token_ids)
    if isinstance(answer, tuple):
        answer, candidate.handoff = answer
    return answer


def _config(config: AssemblerConfig | None, keywords: dict[str, Any]) -> AssemblerConfig:
    """``config``, or one built from the keyword settings that are not None; never both."""
    unknown = keywords.keys() - {field.name for field in fields(AssemblerConfig)}
    if unknown:  # what a keyword parameter would refuse, and the same error
        raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
    settings = {name: value for name, value in keywords.items() if value is not None}
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
