"""The KV tiers as a KV source: which blocks to load for a waiting request, and when.

The scheduler asks :meth:`TierSource.match` about a request whose pool prefix ends at
block ``i`` (see :mod:`~ragkv.cache_engine.kv_source`)::

    first time since its last admission -> KVTiers.lookup(hashes[i:cap])   (cheap, unverified)
      nothing there -> None: admit as usual
      a run there   -> load_pending: the loader thread loads (and verifies) the run into
                       CPU staging, stopping at the first miss, then wakes the engine
    loads done -> match(): the staged blocks that still continue the pool prefix
      -> the manager allocates pool blocks -> allocated(): KVOffload.install copies them in

Moving the bytes (the loader, staging, the copy into the pool) is
:class:`~ragkv.cache_engine.offload.KVOffload`'s; this class only decides.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from ragkv.cache_engine.kv_source import KVMatch
from ragkv.cache_engine.tier_loader import StagedBlocks

if TYPE_CHECKING:
    from ragkv.cache_engine.kv_cache_manager import KVCacheManager
    from ragkv.cache_engine.offload import KVOffload
    from ragkv.cache_engine.outputs import EngineStats
    from ragkv.cache_engine.request import Request

logger = logging.getLogger(__name__)

POOL = "pool"  # the tier name of a prefix block found in the KV pool itself
# Lookups of one request between two admissions: a staged run can go stale (the pool evicts
# blocks before it while the request waits); bounded so a request cannot loop forever.
MAX_LOOKUPS = 4


class TierSource:
    """K/V of a request's blocks after the pool's prefix, from the KV tiers."""

    def __init__(self, offload: KVOffload, kv: KVCacheManager) -> None:
        self.offload = offload
        self.kv = kv  # read only: the request's block hashes up to the reuse cap
        self.block_size = kv.block_size
        self._probed: set[str] = set()  # not to be looked up again before admission
        self._lookups: dict[str, int] = {}  # request id -> lookups since its last admission

    def match(self, request: Request, num_computed: int) -> KVMatch | None:
        """Exact K/V of the blocks after the pool's prefix, when the tiers hold them.

        The first time a request is asked about (since its last admission) its next blocks
        are looked up; a run found starts loads, and the request waits for them
        (``load_pending``). Once they are staged the match offers the staged blocks that
        still continue the pool's prefix. A stale staged run (the pool lost blocks before it
        while the request waited) may be looked up once more (bounded by ``MAX_LOOKUPS``).
        """
        num_pool_blocks = num_computed // self.block_size
        if self._begin(request, num_pool_blocks):
            return KVMatch(load_pending=True)
        staged = self._take(request, num_pool_blocks)
        if staged is None:
            return KVMatch(load_pending=True) if self._begin(request, num_pool_blocks) else None
        return KVMatch(num_tokens=len(staged) * self.block_size, handle=staged)

    def is_ready(self, request: Request) -> bool:
        """True once a parked request's loads are done, or abandoned at their deadline."""
        return self.offload.loader.is_ready(request.request_id)

    def allocated(
        self,
        request: Request,
        match: KVMatch | None,
        block_table: list[int],
        num_pool_blocks: int,
    ) -> None:
        """Install the staged blocks after the pool prefix; count where the reused prompt
        tokens came from (pool, host, disk); the request may be looked up again later."""
        staged: StagedBlocks | None = None if match is None else match.handle
        if staged is not None:
            self.offload.install(
                staged, block_table[num_pool_blocks : num_pool_blocks + len(staged)]
            )
        pool_tokens = num_pool_blocks * self.block_size
        if request.cached_tokens_by_tier is None:  # its first admission
            by_tier = {POOL: pool_tokens}
            if staged is not None:
                for tier, tokens in staged.tokens_by_tier(self.block_size).items():
                    by_tier[tier] = by_tier.get(tier, 0) + tokens
            request.cached_tokens_by_tier = by_tier
        offload = self.offload
        with offload.lock:
            offload.counters.hit_tokens[POOL] = (
                offload.counters.hit_tokens.get(POOL, 0) + pool_tokens
            )
        self.release(request)

    def computed(self, request: Request) -> None:
        pass  # written blocks go to the tiers from the engine core (save_written)

    def release(self, request: Request) -> None:
        """Forget the request's staged payloads (and cancel its loads, if any are running),
        and that it was looked up."""
        self.offload.loader.release(request.request_id)
        self._probed.discard(request.request_id)
        self._lookups.pop(request.request_id, None)

    def add_stats(self, stats: EngineStats) -> None:
        """Every tier counter as the ``EngineStats`` field ``tier_<name>``, and the stores'."""
        counters, stores = self.offload.stats()
        for counter in dataclasses.fields(counters):
            setattr(stats, "tier_" + counter.name, getattr(counters, counter.name))
        stats.tiers = stores

    def _begin(self, request: Request, first_block: int) -> bool:
        """Start loading the tiers' run of the request's blocks ``first_block ..`` (up to the
        reuse cap, Invariant 4). True when loads started. False (nothing to wait for) when
        the tiers hold none of the next blocks, when the request was looked up since its
        last admission, or when staging is full."""
        request_id = request.request_id
        if request_id in self._probed:
            return False
        hashes, inputs = self.kv.reusable_hashes(request)
        if first_block >= len(hashes):
            return False
        self._probed.add(request_id)
        self._lookups[request_id] = self._lookups.get(request_id, 0) + 1
        try:
            present = self.offload.tiers.lookup(list(hashes[first_block:]))
        except Exception:
            logger.exception("KV tier lookup failed; computing instead")
            return False
        end = first_block + len(present)
        return self.offload.loader.start(
            request_id, first_block, hashes[first_block:end], inputs[first_block:end]
        )

    def _take(self, request: Request, num_pool_blocks: int) -> StagedBlocks | None:
        """Staged blocks continuing a pool prefix of ``num_pool_blocks``, or None.

        Blocks the pool now holds itself are skipped. A gap makes the staged run useless:
        it is dropped and, up to ``MAX_LOOKUPS`` per admission, the request may be looked
        up again (the lost blocks went to the tiers when they were written). Nothing is
        consumed until it is installed.
        """
        request_id = request.request_id
        loader = self.offload.loader
        staged = loader.ready(request_id)
        if staged is None:
            return None
        skip = num_pool_blocks - staged.first_block
        if skip < 0 or skip >= len(staged):
            loader.release(request_id)
            if skip < 0:
                with self.offload.lock:
                    self.offload.counters.stale_loads += 1
            if skip >= 0 or self._lookups.get(request_id, 0) >= MAX_LOOKUPS:
                self._probed.add(request_id)  # no further lookup before admission
            else:
                self._probed.discard(request_id)
            return None
        return StagedBlocks(
            num_pool_blocks,
            staged.hashes[skip:],
            staged.payloads[skip:],
            staged.tiers[skip:],
        )
