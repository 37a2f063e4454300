"""The scheduler's side of chunk reuse: plan an opted-in request, pin, admit, record.

Kept out of :mod:`~ragkv.cache_engine.scheduler` so the exact path reads as before; the
scheduler calls these four functions and nothing else of chunk reuse. Pure Python.

Safety, in order of the protocol:

- **pin**: the source blocks of a plan are referenced before the request's own blocks are
  allocated (a free source block would otherwise be the next one handed out), and stay
  referenced until the step that copies from them has run (:func:`release_pins`);
- **never cache approximate K/V**: K/V is approximate from the first copied token on (every
  later token attends to it); the request's blocks from there are never registered in the
  prefix cache, and its chunks from there are never recorded. Blocks and chunks wholly
  before it (the exact prefix, then tokens computed over exact K/V only) are exact and are
  cached and recorded like any;
- **record only exact K/V**: :func:`record_chunks` runs once the prompt has been computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragkv.cache_engine.chunk_reuse.index import ChunkIndex
from ragkv.cache_engine.chunk_reuse.planner import BlendPlan, plan_blend

if TYPE_CHECKING:
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager
    from ragkv.cache_engine.request import Request


def plan_request(
    request: Request, num_computed: int, index: ChunkIndex, kv: KVCacheManager
) -> BlendPlan | None:
    """The request's blended prefill after its exact prefix, or None (nothing to reuse)."""
    assert request.reuse is not None  # called for requests that opted in
    generations = kv.pool.generation

    def lookup(token_ids):
        return index.lookup(request.salt_digest, token_ids, generations)

    return plan_blend(
        request.token_ids, request.chunk_spans, num_computed, request.reuse, lookup, kv.block_size
    )


def admit_blended(
    kv: KVCacheManager,
    request: Request,
    plan: BlendPlan,
    computed_blocks: list[int],
    num_computed: int,
) -> list[int] | None:
    """Pin the plan's sources and allocate the request's blocks, none of them cacheable from
    the first copied token on; None (nothing changed) when the pool cannot hold them."""
    kv.pool.touch(plan.pinned)
    kv.limit_caching(request, plan.exact_until)
    allocated = kv.allocate_slots(request, request.num_tokens - num_computed, computed_blocks)
    if allocated is None:
        kv.limit_caching(request, None)
        kv.pool.free(plan.pinned)
        return None
    request.blend = plan
    request.reused_nonprefix_tokens = plan.reused_tokens
    return allocated


def release_pins(kv: KVCacheManager, request: Request) -> None:
    """Drop the references on the plan's source blocks (idempotent)."""
    plan = request.blend
    if plan is not None and plan.pinned:
        kv.pool.free(plan.pinned)
        plan.pinned = []


def record_chunks(index: ChunkIndex, kv: KVCacheManager, request: Request) -> None:
    """Record where the request's chunks' exact K/V lives (its prompt has been computed):
    every chunk, or for a blended request those wholly before its first copied token."""
    request.chunks_recorded = True
    exact_until = request.num_prompt_tokens
    if request.blend is not None and request.blend.exact_until is not None:
        exact_until = request.blend.exact_until
    block_table = kv.block_table(request)
    generations = kv.pool.generation
    token_ids = request.token_ids
    for start, end in request.chunk_spans:
        if end > exact_until:
            break
        index.record(
            request.salt_digest,
            token_ids[start:end],
            start,
            block_table,
            kv.block_size,
            generations,
        )
