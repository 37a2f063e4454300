"""``ragkv.Pipeline``: dedup → canonical assembly → prefix-cached generation, in one call.

The pipeline is stateless per call apart from what its stages learn across requests (the
shared :class:`~ragkv.dedup.ChunkRegistry`, the assembler's stability and prefix tree), so
many threads or coroutines can share one pipeline and one engine.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv import batch
from ragkv.assembler import Assembler, AssemblerConfig, PromptPlan
from ragkv.assembler.structured import SystemLike
from ragkv.batch import DEFAULT_WINDOW
from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.cache_engine.engine_like import (
    EngineLike,
    KnowsContextLength,
    KnowsPoolSize,
    MayReuseChunks,
    ProbesPrefix,
)
from ragkv.cache_engine.outputs import Output, Usage
from ragkv.cache_engine.sampling_params import SamplingParams, resolve_params
from ragkv.dedup import Chunk, ChunkRegistry, Deduplicator, DedupResult, DedupStats
from ragkv.errors import ConfigError, InvalidInputError

ChunkLike = str | bytes | Chunk
Turn = Mapping[str, str]


@dataclass(slots=True)
class Prepared:
    """The prompt side of one request: what dedup kept and the assembled plan."""

    dedup: DedupResult
    plan: PromptPlan
    dedup_s: float
    assemble_s: float


@dataclass(slots=True)
class Answer:
    """One answered question: text, usage (``cached_tokens`` included), plan and timings."""

    text: str
    usage: Usage
    plan: PromptPlan
    dedup: DedupStats
    chunks: list[Chunk]
    output: Output
    timings: dict[str, float]

    @property
    def finish_reason(self) -> str:
        return self.output.finish_reason

    @property
    def dropped(self) -> list[Any]:
        """Chunks left out to fit the prompt budget (``DroppedChunk``: chunk, rank, tokens)."""
        return self.plan.dropped

    @property
    def prompt_text(self) -> str:
        """The prompt exactly as the model read it (chat template, reordered parts and all)."""
        return self.plan.text


@dataclass(slots=True)
class AnswerDelta:
    """A streamed text increment; the last one has ``finish_reason`` and the full ``answer``."""

    text: str
    finish_reason: str | None = None
    answer: Answer | None = None


class Pipeline:
    """Dedup + assembler + engine. ``engine`` is any
    :class:`~ragkv.cache_engine.engine_like.EngineLike`: the in-process
    :class:`~ragkv.cache_engine.Engine` or :class:`ragkv.integrations.openai.RemoteEngine`.

    ``dedup=False`` skips the dedup stage (the prompt then carries duplicates as retrieved).
    Collapsing duplicates is the dedup stage's job (it honours the deduplicator's ``key``),
    so the default assembler keeps whatever chunks it is given. ``registry`` is shared with
    the assembler (a given ``assembler`` brings its own).

    ``isolate_by_salt=True`` gives every ``cache_salt`` (or ``namespace``) its own
    assembler state (a :meth:`~ragkv.assembler.Assembler.fork`: chunk stability, learned
    system-prompt heads, prefix tree), so one tenant's traffic never reorders, or reveals,
    another's prompts; at most ``max_namespaces`` are remembered (least recently used
    forgotten). Requests without either share the base assembler.

    Prompts fit by default: ``max_prompt_tokens=None`` means what the engine's context (and
    KV pool) leaves for the request's ``max_tokens``; over it, the least relevant chunks are
    dropped whole, before the prompt exists, and reported in ``answer.dropped``.
    ``fit_context=False`` sends every chunk (a prompt over the context then raises
    :class:`~ragkv.errors.PromptTooLongError`).

    ``learn_system=False`` keeps every system prompt as written: the assembler moves no
    learned part of it (parts the app marks with ``Volatile`` or ``SystemPrompt`` still
    move). By default a system prompt seen changing on every request keeps its stable
    sentences in front and moves the sentences that change after the retrieved context, cut
    only at a newline or a sentence end; ``answer.prompt_text`` shows what the model read.

    ``reuse="blend"`` opts every request into position-independent chunk reuse (an
    in-process :class:`~ragkv.cache_engine.Engine` only): the plan's chunk spans go to the
    engine, and a retrieved chunk whose K/V was computed in an earlier prompt, at another
    position, is reused with ``blend``'s strategy (default ``BlendConfig()``: deviation, ``k=16``,
    ``ratio=0.15``; ``BlendConfig("first-k")`` for the former default). Such
    answers are approximate and say so (``answer.output.approximate``,
    ``usage.reused_nonprefix_tokens``); ``None`` (default) keeps every answer exact.
    """

    def __init__(
        self,
        engine: EngineLike,
        deduplicator: Deduplicator | None = None,
        assembler: Assembler | None = None,
        *,
        order: str = "stable-first",
        registry: ChunkRegistry | None = None,
        learn_system: bool = True,
        dedup: bool = True,
        max_prompt_tokens: int | None = None,
        fit_context: bool = True,
        default_params: SamplingParams | None = None,
        isolate_by_salt: bool = False,
        max_namespaces: int = 1024,
        reuse: str | None = None,
        blend: BlendConfig | None = None,
    ) -> None:
        if max_namespaces < 1:
            raise ConfigError(f"max_namespaces must be >= 1, got {max_namespaces}.")
        self.blend = _check_reuse(engine, reuse, blend)
        if assembler is not None and not learn_system and assembler.demote_invalidators:
            raise ConfigError(
                "learn_system=False with your own assembler: build it with "
                "Assembler(..., demote_invalidators=False) instead",
                param="learn_system",
            )
        self.engine = engine
        self.deduplicator = deduplicator or Deduplicator()
        self.assembler = assembler or Assembler(
            engine.tokenizer,
            registry=registry,
            config=AssemblerConfig(
                block_size=engine.block_size,
                order=order,
                collapse_duplicates=False,
                demote_invalidators=learn_system,
            ),
        )
        self.registry = self.assembler.registry
        self.dedup_enabled = dedup
        self.max_prompt_tokens = max_prompt_tokens
        self.fit_context = fit_context
        self.default_params = resolve_params(default_params, {})
        self.isolate_by_salt = isolate_by_salt
        self.max_namespaces = max_namespaces
        self._namespaces: OrderedDict[str, Assembler] = OrderedDict()
        self._namespaces_lock = threading.Lock()

    def assembler_for(self, namespace: str | None) -> Assembler:
        """The assembler whose learned state serves ``namespace`` (by default the salt)."""
        if not self.isolate_by_salt or namespace is None:
            return self.assembler
        with self._namespaces_lock:
            assembler = self._namespaces.get(namespace)
            if assembler is None:
                assembler = self._namespaces[namespace] = self.assembler.fork(namespace)
                if len(self._namespaces) > self.max_namespaces:
                    self._namespaces.popitem(last=False)
            else:
                self._namespaces.move_to_end(namespace)
            return assembler

    def prepare(
        self,
        question: str,
        chunks: Iterable[ChunkLike] | DedupResult,
        *,
        system: SystemLike | None = None,
        history: Sequence[Turn] | None = None,
        cache_salt: str | None = None,
        namespace: str | None = None,
        params: SamplingParams | None = None,
        chunk_order: Mapping[bytes, int] | None = None,
        learn: bool = True,
    ) -> Prepared:
        """Dedup and assemble without generating (what :meth:`answer` sends to the engine).

        ``namespace`` picks whose learned assembler state serves the request when the
        pipeline isolates (``isolate_by_salt``); it defaults to ``cache_salt``. A server
        passes its tenant here, so a client cannot multiply namespaces by varying salts.
        ``chunk_order`` (content key → rank) replaces the learned chunk order for this
        request, as a batch does (:meth:`answer_batch`); ``learn=False`` leaves the
        system-prompt learner untouched (the batch taught it the window's versions first).
        ``chunks`` may be the :class:`~ragkv.dedup.DedupResult` of an earlier :meth:`dedupe`
        of them (a batch dedups while planning): it is used as is, not deduplicated again.
        """
        t0 = time.perf_counter()
        result = chunks if isinstance(chunks, DedupResult) else self.dedupe(chunks)
        t1 = time.perf_counter()
        residency = None
        if isinstance(self.engine, ProbesPrefix):  # the sent plan's hashes go on with it
            residency = self.engine.prefix_probe(cache_salt)
        elif self.engine.knows_residency:
            residency = functools.partial(self.engine.cached_prefix_length, cache_salt=cache_salt)
        plan = self.assembler_for(namespace if namespace is not None else cache_salt).assemble(
            system=system,
            chunks=result.chunks,
            question=question,
            history=history,
            max_prompt_tokens=self.prompt_budget(params or self.default_params),
            residency=residency,
            chunk_order=chunk_order,
            learn=learn,
        )
        return Prepared(result, plan, t1 - t0, time.perf_counter() - t1)

    def dedupe(self, chunks: Iterable[ChunkLike]) -> DedupResult:
        """The dedup stage alone: what the assembler gets from ``chunks`` (all of them when
        the pipeline was built with ``dedup=False``)."""
        chunk_list = _chunk_list(chunks)
        if self.dedup_enabled:
            return self.deduplicator.dedupe(chunk_list)
        return _identity_result(chunk_list)

    def answer(
        self,
        question: str,
        chunks: Iterable[ChunkLike],
        *,
        system: SystemLike | None = None,
        history: Sequence[Turn] | None = None,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Answer:
        """Answer ``question`` from the retrieved ``chunks`` (a list: each item one chunk).

        ``params`` (default: the pipeline's ``default_params``, greedy, 256 new tokens) and
        keyword settings that change it: ``answer(q, chunks, max_tokens=64, temperature=0.7)``.
        """
        params = self._params(params, sampling)
        prepared = self._prepare_call(question, chunks, system, history, cache_salt, params)
        return self.generate_prepared(prepared, params, cache_salt=cache_salt)

    def generate_prepared(
        self, prepared: Prepared, params: SamplingParams, *, cache_salt: str | None = None
    ) -> Answer:
        """Generate the answer to a :meth:`prepare` d request (same ``cache_salt``)."""
        output = self.engine.generate(
            prepared.plan.token_ids, params, cache_salt=cache_salt, **self._request_kwargs(prepared)
        )
        return _answer(prepared, output)

    async def agenerate_prepared(
        self, prepared: Prepared, params: SamplingParams, *, cache_salt: str | None = None
    ) -> Answer:
        """Asyncio form of :meth:`generate_prepared`."""
        output = await self.engine.agenerate(
            prepared.plan.token_ids, params, cache_salt=cache_salt, **self._request_kwargs(prepared)
        )
        return _answer(prepared, output)

    def stream(
        self,
        question: str,
        chunks: Iterable[ChunkLike],
        *,
        system: SystemLike | None = None,
        history: Sequence[Turn] | None = None,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Iterator[AnswerDelta]:
        """Like :meth:`answer`, yielding text as it is generated; the last delta has the answer."""
        params = self._params(params, sampling)
        prepared = self._prepare_call(question, chunks, system, history, cache_salt, params)
        yield from self.stream_prepared(prepared, params, cache_salt=cache_salt)

    def stream_prepared(
        self, prepared: Prepared, params: SamplingParams, *, cache_salt: str | None = None
    ) -> Iterator[AnswerDelta]:
        """Stream the answer to a :meth:`prepare` d request (same ``cache_salt``)."""
        for delta in self.engine.stream(
            prepared.plan.token_ids,
            params,
            cache_salt=cache_salt,
            **self._request_kwargs(prepared),
        ):
            yield _answer_delta(prepared, delta)

    async def aanswer(
        self,
        question: str,
        chunks: Iterable[ChunkLike],
        *,
        system: SystemLike | None = None,
        history: Sequence[Turn] | None = None,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Answer:
        """Asyncio form of :meth:`answer`."""
        params = self._params(params, sampling)
        # Dedup hashing, tokenization and the residency probe are CPU work: off the loop.
        prepared = await asyncio.to_thread(
            self._prepare_call, question, chunks, system, history, cache_salt, params
        )
        return await self.agenerate_prepared(prepared, params, cache_salt=cache_salt)

    async def astream(
        self,
        question: str,
        chunks: Iterable[ChunkLike],
        *,
        system: SystemLike | None = None,
        history: Sequence[Turn] | None = None,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[AnswerDelta]:
        """Asyncio form of :meth:`stream`."""
        params = self._params(params, sampling)
        # Dedup hashing, tokenization and the residency probe are CPU work: off the loop.
        prepared = await asyncio.to_thread(
            self._prepare_call, question, chunks, system, history, cache_salt, params
        )
        async for delta in self.astream_prepared(prepared, params, cache_salt=cache_salt):
            yield delta

    async def astream_prepared(
        self, prepared: Prepared, params: SamplingParams, *, cache_salt: str | None = None
    ) -> AsyncIterator[AnswerDelta]:
        """Asyncio form of :meth:`stream_prepared`."""
        async for delta in self.engine.astream(
            prepared.plan.token_ids, params, cache_salt=cache_salt, **self._request_kwargs(prepared)
        ):
            yield _answer_delta(prepared, delta)

    # -- batch jobs (ragkv/batch.py) --------------------------------------------------------

    def answer_batch(self, items: Iterable[Any], **options: Any) -> list[Any]:
        """Answer a batch known in advance, scheduled for reuse; answers in the caller's order.

        ``items``: :class:`~ragkv.batch.BatchItem`, mappings of its fields (``question``,
        ``chunks``, ``system``, ``history``, ``session``, ``cache_salt``) or questions.
        ``options`` are :meth:`stream_batch`'s (``params``, ``window``, ``max_in_flight``,
        ``progress``, ``return_exceptions`` and sampling keywords such as ``max_tokens``).
        Each window of items is planned together: their shared chunks get one order and the
        items run so that those sharing a prefix run together (see :mod:`ragkv.batch`). A
        failed item raises (the rest are cancelled) unless ``return_exceptions``: its
        exception is then its result. For batches too large to keep, :meth:`stream_batch`.
        """
        return list(self.stream_batch(items, **options))

    def stream_batch(
        self,
        items: Iterable[Any],
        *,
        params: SamplingParams | None = None,
        window: int = DEFAULT_WINDOW,
        max_in_flight: int | None = None,
        progress: bool = False,
        return_exceptions: bool = False,
        **sampling: Any,
    ) -> Iterator[Any]:
        """:meth:`answer_batch`, yielding answers in the caller's order a window at a time
        (memory: one window of items, and the prompts in flight). ``max_in_flight``: requests
        in the engine at once (default: the engine's ``max_num_seqs``, else 16)."""
        run = self._batch_run(params, window, max_in_flight, progress, return_exceptions, sampling)
        return batch.stream(self, items, run)

    async def aanswer_batch(self, items: Iterable[Any], **options: Any) -> list[Any]:
        """Asyncio form of :meth:`answer_batch`."""
        return [answer async for answer in self.astream_batch(items, **options)]

    def astream_batch(
        self,
        items: Iterable[Any],
        *,
        params: SamplingParams | None = None,
        window: int = DEFAULT_WINDOW,
        max_in_flight: int | None = None,
        progress: bool = False,
        return_exceptions: bool = False,
        **sampling: Any,
    ) -> AsyncIterator[Any]:
        """Asyncio form of :meth:`stream_batch`."""
        run = self._batch_run(params, window, max_in_flight, progress, return_exceptions, sampling)
        return batch.astream(self, items, run)

    def _batch_run(
        self,
        params: SamplingParams | None,
        window: int,
        max_in_flight: int | None,
        progress: bool,
        return_exceptions: bool,
        sampling: dict[str, Any],
    ) -> batch.BatchRun:
        """The batch's settings, checked in the caller's thread."""
        return batch.BatchRun(
            self._params(params, sampling), window, self._in_flight(max_in_flight), progress,
            return_exceptions,
        )  # fmt: skip

    def _in_flight(self, max_in_flight: int | None) -> int:
        if max_in_flight is not None:
            return max_in_flight
        seqs = getattr(getattr(self.engine, "config", None), "max_num_seqs", None)
        return seqs if isinstance(seqs, int) and seqs > 0 else 16

    def _prepare_call(
        self,
        question: str,
        chunks: Iterable[ChunkLike],
        system: SystemLike | None,
        history: Sequence[Turn] | None,
        cache_salt: str | None,
        params: SamplingParams,
    ) -> Prepared:
        """:meth:`prepare` for :meth:`answer` and :meth:`stream` (and, in a worker thread,
        their asyncio forms): the one place they dedup and assemble."""
        return self.prepare(
            question, chunks, system=system, history=history, cache_salt=cache_salt, params=params
        )

    def prompt_budget(self, params: SamplingParams) -> int | None:
        """Prompt tokens a request may take: ``max_prompt_tokens`` if given, else what the
        engine's context (and KV pool) leaves for ``params.max_tokens`` new tokens, at least
        half of it. Over the budget, the least relevant chunks are dropped whole
        (``answer.dropped``); None when the engine does not say its context."""
        if self.max_prompt_tokens is not None or not self.fit_context:
            return self.max_prompt_tokens
        engine = self.engine
        room = engine.max_model_len if isinstance(engine, KnowsContextLength) else None
        if not isinstance(room, int):
            return None
        if isinstance(engine, KnowsPoolSize) and isinstance(engine.kv_cache_tokens, int):
            room = min(room, engine.kv_cache_tokens)
        return max(room - params.max_tokens, room // 2)

    def _params(self, params: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
        """The request's settings, checked in the caller's thread before anything is queued."""
        return resolve_params(self.default_params if params is None else params, sampling)

    def _request_kwargs(self, prepared: Prepared) -> dict[str, Any]:
        """The engine's arguments beyond prompt, params and salt: the prompt's hashes when
        the engine's probe made them (not hashed again), and chunk reuse (only when the
        pipeline opted in)."""
        kwargs: dict[str, Any] = {}
        hashes = prepared.plan.prompt_hashes
        if hashes is not None and isinstance(self.engine, ProbesPrefix):
            kwargs["prompt_hashes"] = hashes
        if self.blend is not None:
            kwargs["chunk_spans"] = [
                (span.start, span.end) for span in prepared.plan.spans("chunk")
            ]
            kwargs["reuse"] = self.blend
        return kwargs


def _check_reuse(
    engine: EngineLike, reuse: str | None, blend: BlendConfig | None
) -> BlendConfig | None:
    """The pipeline's chunk reuse strategy, or None (exact answers only)."""
    if reuse is None:
        if blend is not None:
            raise ConfigError("blend=BlendConfig(...) needs reuse='blend'", param="blend")
        return None
    if reuse != "blend":
        raise ConfigError(f"unknown reuse {reuse!r}; use None or 'blend'", param="reuse")
    if blend is not None and not isinstance(blend, BlendConfig):
        raise ConfigError(f"blend must be a BlendConfig, got {type(blend).__name__}", param="blend")
    if not (isinstance(engine, MayReuseChunks) and engine.supports_chunk_reuse):
        raise ConfigError(
            f"reuse='blend' needs the in-process Engine; {type(engine).__name__} cannot reuse "
            "chunks at another position",
            param="reuse",
        )
    return blend or BlendConfig()


def _answer(prepared: Prepared, output: Output) -> Answer:
    t = output.timings
    return Answer(
        text=output.text,
        usage=output.usage,
        plan=prepared.plan,
        dedup=prepared.dedup.stats,
        chunks=list(prepared.dedup.chunks),
        output=output,
        timings={
            "dedup_s": prepared.dedup_s,
            "assemble_s": prepared.assemble_s,
            "queue_s": t.queue_s,
            "ttft_s": t.ttft_s,
            "total_s": t.total_s,
        },
    )


def _answer_delta(prepared: Prepared, delta: Any) -> AnswerDelta:
    answer = _answer(prepared, delta.output) if delta.output is not None else None
    return AnswerDelta(delta.text, delta.finish_reason, answer)


def _chunk_list(chunks: Any) -> list[ChunkLike]:
    """``chunks`` as a list, refusing what would silently mean something else: a bare string
    iterates as one-character chunks."""
    if isinstance(chunks, str | bytes):
        raise InvalidInputError(
            f"chunks must be a list of retrieved chunks, got one {type(chunks).__name__}; "
            "wrap it: [text]",
            param="chunks",
        )
    try:
        return list(chunks)
    except TypeError:
        raise InvalidInputError(
            f"chunks must be a list of retrieved chunks (str, bytes, Chunk, or a framework's "
            f"document), got {type(chunks).__name__}; pass [] for no context",
            param="chunks",
        ) from None


def _identity_result(chunks: list[ChunkLike]) -> DedupResult:
    """A DedupResult that keeps every chunk as retrieved (dedup switched off)."""
    kept = [Chunk.coerce(c) for c in chunks]
    size = sum(len(c.data) for c in kept)
    stats = DedupStats(len(kept), len(kept), size, size)
    return DedupResult(kept, list(range(len(kept))), list(range(len(kept))), stats)
