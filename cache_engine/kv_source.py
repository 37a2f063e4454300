"""The one seam for K/V that does not come from the pool's own prefix cache: KV sources.

A source offers a waiting request K/V for tokens after the prefix the pool already holds
(the shape of vLLM's KV connector, scheduler side). The scheduler asks its sources in the
order it was given them, at each admission attempt, and knows nothing else of them::

    match = source.match(request, num_computed)   # None: nothing to offer now
      load_pending      the request waits for K/V (RequestStatus.WAITING_FOR_KV), out of
                        the waiting queue, until source.is_ready(request); others step
      num_tokens        K/V of the next num_tokens tokens (whole blocks), written by the
                        source into new blocks, or already in the pool (shared_blocks);
                        exact unless ``approximate``. The next source is asked after them
      positions         the request computes only these positions, all in one step; the
                        rest of its prompt reuses K/V the source placed. No later source
                        is asked.
      cache_until       K/V from this token on is approximate: never registered under exact
                        keys (with a ``scope``, under approximate keys of that scope, which
                        only KVCacheManager.approximate_prefix finds)
    source.allocated(request, match, block_table, num_pool_blocks)
                        every source, once the request holds its blocks (match is None
                        when the source offered nothing, or its offer was not used)
    source.computed(request)    after each step that computed some of its tokens
    source.release(request)     finished, preempted or failed: forget it
    source.add_stats(stats)     its counters into an EngineStats snapshot

The scheduler allocates and pins through the KV manager; a source reads the manager and
writes K/V into the blocks it is handed, and never touches the block pool. The engine
builds its sources (the KV tiers, chunk reuse) and hands them to the scheduler, so adding
one (a remote store, say) changes neither the scheduler nor the engine core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ragkv.cache_engine.outputs import EngineStats
    from ragkv.cache_engine.request import Request


@dataclass(slots=True)
class KVMatch:
    """What one source offers a waiting request (see the module docstring)."""

    num_tokens: int = 0
    load_pending: bool = False
    positions: list[int] | None = None
    # Pool blocks already holding the ``num_tokens`` tokens: shared, not written. Only right
    # after the pool's exact prefix (a match after one that writes its tokens is skipped).
    shared_blocks: list[int] = field(default_factory=list)
    approximate: bool = False  # its ``num_tokens`` are not exact: not in ``cached_tokens``
    pinned: list[int] = field(default_factory=list)  # blocks the plan reads from (positions)
    cache_until: int | None = None  # tokens from here on hold approximate K/V
    scope: bytes | None = None  # approximate blocks are cached under this (None: never)
    handle: Any = None  # the source's own state, handed back to its ``allocated``


class KVSource(Protocol):
    """K/V for a waiting request from somewhere other than the pool's prefix cache."""

    def match(self, request: Request, num_computed: int) -> KVMatch | None: ...

    def is_ready(self, request: Request) -> bool: ...

    def allocated(
        self,
        request: Request,
        match: KVMatch | None,
        block_table: list[int],
        num_pool_blocks: int,
    ) -> None: ...

    def computed(self, request: Request) -> None: ...

    def release(self, request: Request) -> None: ...

    def add_stats(self, stats: EngineStats) -> None: ...
