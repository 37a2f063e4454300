"""The one seam for K/V that does not come from the pool's own prefix cache: KV sources.

A source offers a waiting request K/V for tokens after the prefix the pool already holds
(the shape of vLLM's KV connector, scheduler side). The scheduler asks its sources in the
order it was given them, at each admission attempt, and knows nothing else of them::

    match = source.match(request, num_computed)   # None: nothing to offer now
      load_pending      the request waits for K/V (RequestStatus.WAITING_FOR_KV), out of
                        the waiting queue, until source.is_ready(request); others step
      num_tokens        exact K/V of the next num_tokens tokens (whole blocks): the next
                        source is asked after them
      positions         the request computes only these positions, all in one step; the
                        rest of its prompt reuses K/V the source placed (approximate from
                        cache_until on: never registered in the prefix cache). No later
                        source is asked.
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
    pinned: list[int] = field(default_factory=list)  # blocks the plan reads from (positions)
    cache_until: int | None = None  # tokens from here on hold approximate K/V (positions)
    handle: Any = None  # the source's own state, handed back to its ``allocated``


class KVSource(Protocol):
    """K/V for a waiting request from somewhere other than the pool's prefix cache."""

    name: str

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
