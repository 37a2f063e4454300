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
  after it. Chunks are taken from the request's own prefill, not computed again alone.

A request is planned at its first admission only; a recompute after preemption is exact.
A plan larger than one step's token budget (a deviation plan: its probe too) falls back to
the exact path (counted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragkv.cache_engine.chunk_reuse.config import BlendConfig
from ragkv.cache_engine.chunk_reuse.index import ChunkIndex
from ragkv.cache_engine.chunk_reuse.planner import BlendPlan, plan_blend
from ragkv.cache_engine.kv_source import KVMatch

if TYPE_CHECKING:
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager
    from ragkv.cache_engine.outputs import EngineStats
    from ragkv.cache_engine.request import Request


class ChunkReuseSource:
    """Approximate K/V of chunks computed elsewhere, for requests that opt in."""

    def __init__(self, index: ChunkIndex, kv: KVCacheManager, max_step_tokens: int) -> None:
        self.index = index
        self.kv = kv
        self.max_step_tokens = max_step_tokens  # a plan is computed in one step, whole
        self.num_fallbacks = 0  # opted-in requests run exactly: too big, or no room for it
        self._offered: set[str] = set()  # planned, not yet admitted

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
        if plan is not None and self._step_tokens(request, plan) > self.max_step_tokens:
            request.blend_tried = True
            self.num_fallbacks += 1
            plan = None
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
    def _step_tokens(request: Request, plan: BlendPlan) -> int:
        """Tokens the plan's step runs through the model: the computed ones, and with
        ``deviation`` its probe over every token from the plan's start (two layers, but
        attending over the whole sequence: bounded like any step)."""
        if plan.choose:
            return max(len(plan.positions), request.num_tokens - plan.start)
        return len(plan.positions)

    def is_ready(self, request: Request) -> bool:
        return True  # nothing loads: the K/V is in the pool

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
            request.reused_approximate_prefix_tokens = match.num_tokens
        elif offered:  # the plan did not fit the pool; the exact path did
            self.num_fallbacks += 1

    def computed(self, request: Request) -> None:
        if (
            request.chunk_spans
            and not request.chunks_recorded
            and request.num_computed_tokens >= request.num_prompt_tokens
        ):
            self._record_chunks(request)

    def release(self, request: Request) -> None:
        self._offered.discard(request.request_id)

    def add_stats(self, stats: EngineStats) -> None:
        stats.blend_fallbacks = self.num_fallbacks

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
