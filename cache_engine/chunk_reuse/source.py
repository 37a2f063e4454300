"""Chunk reuse as a KV source: plan an opted-in request, hand the plan on, record chunks.

:class:`ChunkReuseSource` is one of the scheduler's :mod:`~ragkv.cache_engine.kv_source`
sources. Pure Python. Safety, in the order of the protocol:

- **pin**: a plan's source blocks (``KVMatch.pinned``) are referenced by the scheduler
  before the request's own blocks are allocated (a free source block would otherwise be the
  next one handed out), and stay referenced until the step that copies from them has run;
- **never cache approximate K/V as exact**: K/V is approximate from the first copied token
  on (every later token attends to it): ``KVMatch.cache_until``, past which the request's
  blocks are registered only under approximate keys (the manager's ``scope``). Blocks and
  chunks wholly before it (the exact prefix, then tokens computed over exact K/V only) are
  exact and are cached and recorded like any;
- **learn every chunk**: once the prompt has been computed, every chunk span is recorded in
  the index: exact before the first copied token, approximate (under the reuse settings)
  after it. Chunks are taken from the request's own prefill, not computed again alone;
- **compute a chunk once**: an opted-in request that would compute a chunk an admitted
  request is computing now (not yet recorded; exact, or approximate under its settings)
  waits for it (``KVMatch.load_pending``) until that request has recorded its chunks or
  left, then is planned again: requests admitted together would otherwise each compute it.
  A request waits at most once per admission.

A request is planned at its first admission only; a recompute after preemption is exact.
A plan is computed in one step. A ``deviation`` plan whose probe (every token from the
plan's start) does not fit one step's token budget runs as the ``first-k`` plan of the same
per-chunk budget (counted: ``blend_probe_fallbacks``); a plan whose computed tokens do not
fit falls back to the exact path (counted: ``blend_fallbacks``).

A deviation request run as first-k keeps the deviation settings' scope (its approximate
blocks and chunk entries are keyed by the settings *asked*, not by the selection a step
could afford): what those settings do on a long prompt is first-k, so requests asking the
same settings may share its K/V, and requests that ask ``first-k`` never see K/V made under
``deviation`` settings, nor the reverse. Keying it by first-k would mix scopes within one
request (an approximate prefix shared under the deviation scope, then blocks under another)
and let a deviation request's K/V leak into explicit first-k requests' results.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ragkv.cache_engine.block_hash import tokens_to_bytes
from ragkv.cache_engine.chunk_reuse.config import BlendConfig
from ragkv.cache_engine.chunk_reuse.index import ChunkIndex
from ragkv.cache_engine.chunk_reuse.planner import BlendPlan, plan_blend
from ragkv.cache_engine.kv_source import KVMatch

if TYPE_CHECKING:
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager
    from ragkv.cache_engine.outputs import EngineStats
    from ragkv.cache_engine.request import Request

_ChunkKey = tuple[bytes | None, bytes]  # (salt digest, the chunk's tokens)


class ChunkReuseSource:
    """Approximate K/V of chunks computed elsewhere, for requests that opt in."""

    def __init__(self, index: ChunkIndex, kv: KVCacheManager, max_step_tokens: int) -> None:
        self.index = index
        self.kv = kv
        self.max_step_tokens = max_step_tokens  # a plan is computed in one step, whole
        self.num_fallbacks = 0  # opted-in requests run exactly: too big, or no room for it
        self.num_probe_fallbacks = 0  # deviation requests run as first-k: probe too big
        self.num_waits = 0  # opted-in requests that waited for a chunk in flight
        self._offered: set[str] = set()  # planned, not yet admitted
        # Chunks admitted requests compute now, until recorded: (salt, tokens) -> (request
        # id, the scope its entry will have: None exact), and each such request's keys.
        self._computing: dict[_ChunkKey, tuple[str, bytes | None]] = {}
        self._computes: dict[str, list[_ChunkKey]] = {}
        self._awaits: dict[str, set[str]] = {}  # a waiting request -> the ones it waits for
        self._waited: set[str] = set()  # waited since its admission began: never twice

    def match(self, request: Request, num_computed: int) -> KVMatch | None:
        self._offered.discard(request.request_id)  # an earlier attempt's plan is stale
        if request.reuse is None or request.blend_tried:
            return None
        kv = self.kv
        scope = reuse_scope(request.reuse)
        shared: list[int] = []
        if num_computed % kv.block_size == 0:  # approximate blocks left by requests like it
            shared = kv.approximate_prefix(request, num_computed // kv.block_size, scope)
        num_shared = len(shared) * kv.block_size

        def lookup(token_ids):
            return self.index.lookup(request.salt_digest, token_ids, kv.generations, scope)

        plan = plan_blend(
            request.token_ids,
            request.chunk_spans,
            num_computed + num_shared,
            request.reuse,
            lookup,
            kv.block_size,
        )
        if plan is not None and len(plan.positions) > self.max_step_tokens:
            request.blend_tried = True
            self.num_fallbacks += 1
            plan = None
        elif plan is not None and self._probe_tokens(request, plan) > self.max_step_tokens:
            plan.keep_first_k()  # the same budget, without the probe (see the docstring)
            plan.probe_fallback = True
        # A request that fell back (blend_tried) runs exactly: nothing to wait for.
        if not request.blend_tried and self._wait_for_chunks(
            request, num_computed + num_shared, plan, scope
        ):
            return KVMatch(load_pending=True)
        if plan is None and not shared:
            return None
        self._offered.add(request.request_id)
        exact_until = num_computed if shared else plan.exact_until if plan is not None else None
        return KVMatch(
            num_tokens=num_shared,
            shared_blocks=shared,
            approximate=bool(shared),
            positions=None if plan is None else plan.positions,
            pinned=[] if plan is None else plan.pinned,
            cache_until=exact_until,
            scope=scope,
            handle=plan,
        )

    @staticmethod
    def _probe_tokens(request: Request, plan: BlendPlan) -> int:
        """Tokens a ``deviation`` plan's probe runs through the model: every token from the
        plan's start (two layers, but attending over the whole sequence: bounded like any
        step); 0 when the plan has nothing to choose."""
        return request.num_tokens - plan.start if plan.choose else 0

    def is_ready(self, request: Request) -> bool:
        """True once every request it waits for has recorded its chunks or left."""
        awaited = self._awaits.get(request.request_id)
        return not awaited or not any(r in self._computes for r in awaited)

    def _wait_for_chunks(
        self, request: Request, start: int, plan: BlendPlan | None, scope: bytes
    ) -> bool:
        """Whether the request should wait for chunks it would compute from ``start`` (all
        but those ``plan`` copies) that admitted requests are computing now, with K/V it
        may reuse (exact, or approximate of its ``scope``)."""
        request_id = request.request_id
        self._awaits.pop(request_id, None)
        if request_id in self._waited or not self._computing:
            return False
        awaited: set[str] = set()
        for key, _ in _computed_chunks(request, start, plan):
            owner = self._computing.get(key)
            if owner is not None and owner[0] != request_id and owner[1] in (None, scope):
                awaited.add(owner[0])
        if not awaited:
            return False
        self._waited.add(request_id)
        self._awaits[request_id] = awaited
        self.num_waits += 1
        return True

    def allocated(
        self,
        request: Request,
        match: KVMatch | None,
        block_table: list[int],
        num_pool_blocks: int,
    ) -> None:
        request.blend_tried = True
        offered = request.request_id in self._offered
        self._offered.discard(request.request_id)
        if match is not None:
            plan: BlendPlan | None = match.handle
            if plan is not None:
                request.blend = plan
                request.reused_nonprefix_tokens = plan.reused_tokens
                self.num_probe_fallbacks += plan.probe_fallback
            request.reused_approximate_prefix_tokens = match.num_tokens
        elif offered:  # the plan did not fit the pool; the exact path did
            self.num_fallbacks += 1
        self._waited.discard(request.request_id)
        if request.chunk_spans and not request.chunks_recorded:
            self._mark_computing(request, num_pool_blocks * self.kv.block_size)

    def _mark_computing(self, request: Request, start: int) -> None:
        """Note the chunks the admitted request computes (from ``start``, or its plan's),
        with the scope their entries will have, until it records them."""
        plan = request.blend
        if plan is not None:
            start = plan.start
        exact_until = request.exact_until
        scope = None if request.reuse is None else reuse_scope(request.reuse)
        keys = []
        for key, end in _computed_chunks(request, start, plan):
            if key not in self._computing:
                approximate = exact_until is not None and end > exact_until
                if approximate and scope is None:
                    continue  # never recorded
                self._computing[key] = (request.request_id, scope if approximate else None)
                keys.append(key)
        if keys:
            self._computes[request.request_id] = keys

    def computed(self, request: Request) -> None:
        if (
            request.chunk_spans
            and not request.chunks_recorded
            and request.num_computed_tokens >= request.num_prompt_tokens
        ):
            self._record_chunks(request)
            self._forget_computing(request.request_id)

    def release(self, request: Request) -> None:
        request_id = request.request_id
        self._offered.discard(request_id)
        self._awaits.pop(request_id, None)
        self._waited.discard(request_id)
        self._forget_computing(request_id)

    def _forget_computing(self, request_id: str) -> None:
        for key in self._computes.pop(request_id, ()):
            if self._computing.get(key, (None,))[0] == request_id:
                del self._computing[key]

    def add_stats(self, stats: EngineStats) -> None:
        stats.blend_fallbacks = self.num_fallbacks
        stats.blend_probe_fallbacks = self.num_probe_fallbacks
        stats.blend_waits = self.num_waits

    def _record_chunks(self, request: Request) -> None:
        """Record where the request's chunks' K/V lives (its prompt has been computed): exact
        for chunks wholly before its first copied token, approximate for the rest."""
        request.chunks_recorded = True
        exact_until = request.num_prompt_tokens
        if request.exact_until is not None:
            exact_until = request.exact_until
        kv = self.kv
        block_table = kv.block_table(request)
        token_ids = request.token_ids
        scope = None if request.reuse is None else reuse_scope(request.reuse)
        for start, end in request.chunk_spans:
            approximate = end > exact_until
            if approximate and scope is None:
                break  # only an opted-in request has approximate K/V: defensive
            self.index.record(
                request.salt_digest,
                token_ids[start:end],
                start,
                block_table,
                kv.block_size,
                kv.generations,
                scope if approximate else None,
            )


def reuse_scope(config: BlendConfig) -> bytes:
    """What approximate K/V depends on besides the tokens: the reuse settings that made it
    (requests reuse each other's approximate blocks only under the same settings)."""
    return f"blend:{config.strategy}:{config.k}:ratio={config.ratio!r}:head={config.head}".encode()


def _computed_chunks(
    request: Request, start: int, plan: BlendPlan | None
) -> Iterator[tuple[_ChunkKey, int]]:
    """``(key, span end)`` of each chunk the request computes from ``start``: every span
    ending after it that ``plan`` does not copy (from)."""
    copied = [] if plan is None else sorted(plan.dst_positions)
    token_ids, salt = request.token_ids, request.salt_digest
    for span_start, end in request.chunk_spans:
        if end <= start:
            continue
        i = bisect_left(copied, span_start)
        if i < len(copied) and copied[i] < end:
            continue  # found elsewhere: copied, not computed
        yield (salt, tokens_to_bytes(token_ids[span_start:end])), end
