"""Continuous batching over a paged KV pool: who runs in the next step, and how many tokens.

Every step packs, under one token budget, (1) the next slice of every running request
(one token when decoding, the rest of a chunked prefill otherwise) and then (2) new
requests from the waiting queue, each starting after its longest cached prefix. When the
pool cannot hold a running request's next slice, the youngest running request is
preempted: its blocks are freed (they stay findable in the prefix cache) and it goes back
to the front of the waiting queue to be recomputed. Pure Python, no torch.

After the step ran, :meth:`Scheduler.update` appends each sampled token and decides which
requests finish on it (a stop token, ``max_tokens``, the context length); stop strings need
the text, so the output processor decides those.

Fair shares: under ``fcfs``, waiting requests of several cache salts (tenants) are admitted
round-robin across salts, each salt's own requests in arrival order, so one tenant's burst
cannot hold another tenant's requests behind it. When the request at the head does not fit
the pool, at most ``MAX_SKIP_AHEAD`` requests behind it that do fit are admitted past it in
a step; a request is passed at most ``MAX_TIMES_SKIPPED`` times in all, then it waits at the
head until it fits (bounded: a large request is delayed, never starved).

A request whose own scheduling work raises (hashing its blocks, a lookup, an allocation)
is taken out of the queues alone and reported in ``SchedulerOutput.failed``; the others
are scheduled as if it had never been there (Invariant 9).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ragkv.cache_engine.chunk_reuse import BlendPlan, ChunkIndex
from ragkv.cache_engine.chunk_reuse.scheduling import (
    admit_blended,
    plan_request,
    record_chunks,
    release_pins,
)
from ragkv.cache_engine.config import DEFAULTS, EngineConfig
from ragkv.cache_engine.request import Request, RequestStatus
from ragkv.cache_engine.step import ScheduledSlice, SchedulerOutput
from ragkv.errors import CacheCapacityError, PromptTooLongError

logger = logging.getLogger(__name__)

MAX_SKIP_AHEAD = 8  # requests admitted past a head that does not fit, per step
MAX_TIMES_SKIPPED = 16  # times one request may be passed before everyone waits for it


class Scheduler:
    """Waiting and running queues over a :class:`~ragkv.cache_engine.KVCacheManager`."""

    def __init__(
        self,
        kv_manager,
        config: EngineConfig = DEFAULTS,
        max_model_len: int | None = None,
        chunk_index: ChunkIndex | None = None,
    ) -> None:
        # Reads max_num_seqs, max_num_batched_tokens, enable_prefix_caching and
        # schedule_policy from ``config`` (validated when it was built).
        self.kv = kv_manager
        self.config = config
        self.max_model_len = max_model_len
        self.chunk_index = chunk_index  # None: no chunk reuse, nothing recorded
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_blend_fallbacks = 0  # opted-in requests run exactly: too big for one step
        # KV tiers below the pool (an offload.KVOffload, set by the engine; None: off) and
        # the requests parked while their tier loads run (see _park_for_tier_loads).
        self.tiers: Any = None
        self.loading: dict[str, Request] = {}

    # -- queue management -------------------------------------------------------------
    def blocks_needed(self, request: Request) -> int:
        """Blocks the request holds at its longest (prompt + max_tokens)."""
        total = request.num_prompt_tokens + request.params.max_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        return self.kv.blocks_needed(total)

    def check_fits(self, request: Request) -> None:
        """Raise if the request could never fit the whole pool, even running alone."""
        prompt_blocks = self.kv.blocks_needed(request.num_prompt_tokens)
        if prompt_blocks > self.kv.pool.num_blocks:
            raise PromptTooLongError(
                f"prompt of {request.num_prompt_tokens} tokens needs {prompt_blocks} KV blocks "
                f"but the whole pool has {self.kv.pool.num_blocks} (block size "
                f"{self.kv.block_size}); shorten the prompt or raise kv_cache_tokens",
                param="prompt",
            )
        needed = self.blocks_needed(request)
        if needed > self.kv.pool.num_blocks:
            raise CacheCapacityError(
                f"request {request.request_id} needs {needed} KV blocks "
                f"({request.num_prompt_tokens} prompt tokens + max_tokens "
                f"{request.params.max_tokens}, block size {self.kv.block_size}) but the whole "
                f"pool has {self.kv.pool.num_blocks}; raise kv_cache_tokens or lower max_tokens",
                param="max_tokens",
            )

    def add(self, request: Request) -> None:
        """Queue a request; one that could never fit the whole pool is refused now."""
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def has_work(self) -> bool:
        """Whether a step now would schedule something (parked requests wait for loads)."""
        return bool(self.waiting or self.running or self._any_loaded())

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and release its blocks (they stay cached until reused)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        release_pins(self.kv, request)
        self._forget_tier_loads(request)
        self.kv.free(request)

    # -- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            allocated = None
            while True:
                try:
                    allocated = self.kv.allocate_slots(request, num_new)
                except Exception as exc:  # hashing its new full blocks: it alone fails
                    self._fail(request, exc, out)
                    break
                if allocated is not None:
                    break
                # Requests before i are already scheduled this step; the victim is always
                # the youngest, at the end of the list, so it is never one of them.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            if allocated is None:  # failed and removed: i is now the next request
                continue
            start = request.num_computed_tokens
            out.slices.append(ScheduledSlice(request, start, num_new, self.kv.block_table(request)))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self._resume_loaded()
        if self.config.schedule_policy == "longest-prefix" and len(self.waiting) > 1:
            self._order_by_cached_prefix(out)
        elif len(self.waiting) > 1:
            self._order_fairly()
        passed: list[Request] = []  # heads that did not fit, admitted past (put back after)
        try:
            self._admit_waiting(out, budget, passed)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, passed: list[Request]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            try:
                blocks, num_computed, staged = [], 0, None
                if self.config.enable_prefix_caching:
                    blocks, num_computed = self.kv.get_computed_blocks(request, record=False)
                    if self.tiers is not None:
                        if self._park_for_tier_loads(request, len(blocks)):
                            continue
                        staged = self.tiers.take(request, len(blocks))
                        # a stale staged run (the pool lost blocks before it): look again
                        if staged is None and self._park_for_tier_loads(request, len(blocks)):
                            continue
                num_loaded = len(staged) * self.kv.block_size if staged else 0
                plan = self._plan_blend(request, num_computed + num_loaded)
                allocated = None
                if plan is not None:
                    if len(plan.positions) > budget:  # one step, whole: wait for room
                        break
                    num_new = len(plan.positions)
                    allocated = admit_blended(self.kv, request, plan, blocks, num_computed)
                if allocated is None:  # the exact path (also when pinning left no room)
                    num_new = min(request.num_tokens - num_computed - num_loaded, budget)
                    allocated = self.kv.allocate_slots(request, num_loaded + num_new, blocks)
                    if allocated is not None and plan is not None:
                        self.num_blend_fallbacks += 1
                        plan = None
                if allocated is not None and staged:
                    self._install_loaded(request, staged, len(blocks))
            except Exception as exc:  # its own blocks' hashing or allocation: it alone fails
                self._fail(request, exc, out)
                continue
            if allocated is None:
                if (
                    not staged
                    and plan is None
                    and len(passed) < MAX_SKIP_AHEAD
                    and request.num_skipped < MAX_TIMES_SKIPPED
                    and len(self.waiting) > 1
                ):
                    request.num_skipped += 1  # a smaller one behind it may fit: look past it
                    passed.append(self.waiting.popleft())
                    continue
                break
            request.blend_tried = True
            if self.config.enable_prefix_caching:  # counted once admitted, not per retry
                self.kv.record_lookup(request.num_tokens, len(blocks))
                if self.tiers is not None:
                    self.tiers.admitted(request, len(blocks))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            num_computed += num_loaded
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
                if self.tiers is not None:
                    request.cached_tokens_by_tier = _tokens_by_tier(
                        len(blocks) * self.kv.block_size, staged, self.kv.block_size
                    )
            self.running.append(request)
            block_table = self.kv.block_table(request)
            if plan is None:
                out.slices.append(ScheduledSlice(request, num_computed, num_new, block_table))
            else:  # explicit positions: the slice ends at the prompt's end (its ``end``)
                start = request.num_tokens - num_new
                out.slices.append(
                    ScheduledSlice(request, start, num_new, block_table, positions=plan.positions)
                )
            budget -= num_new

    def update(self, out: SchedulerOutput, sampled: Sequence[int]) -> list[Request]:
        """Take in what the step computed: ``sampled[i]`` is the token of the i-th sampling chunk.

        Appends each token and finishes (frees) a request that ends on it: a stop token
        first ("stop"), then ``max_tokens`` or the context length ("length"). Returns the
        requests that sampled, in order, finished or not.
        """
        for chunk in out.slices:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            release_pins(self.kv, request)
            if (
                request.chunk_spans
                and not request.chunks_recorded
                and self.chunk_index is not None
                and request.num_computed_tokens >= request.num_prompt_tokens
            ):
                record_chunks(self.chunk_index, self.kv, request)
        sampling = [chunk.request for chunk in out.slices if chunk.samples]
        now = time.perf_counter()
        for request, token in zip(sampling, sampled, strict=True):
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.finish(request, reason)
        return sampling

    def _stop_reason(self, request: Request, token: int) -> str | None:
        if token in request.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= request.params.max_tokens:
            return "length"
        if self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _plan_blend(self, request: Request, num_computed: int) -> BlendPlan | None:
        """An opted-in request's blended prefill at first admission, or None (exact path).

        A plan larger than one step's token budget falls back to the exact path (counted)."""
        if request.reuse is None or request.blend_tried or self.chunk_index is None:
            return None
        plan = plan_request(request, num_computed, self.chunk_index, self.kv)
        if plan is not None and len(plan.positions) > self.config.max_num_batched_tokens:
            request.blend_tried = True
            self.num_blend_fallbacks += 1
            return None
        return plan

    def _order_fairly(self) -> None:
        """Round-robin across salts (tenants), each salt's requests in queue order; salts
        take turns in the order of their first waiting request. One salt: unchanged."""
        by_salt: dict[bytes | None, list[Request]] = {}
        for request in self.waiting:
            by_salt.setdefault(request.salt_digest, []).append(request)
        if len(by_salt) < 2:
            return
        queues = list(by_salt.values())
        fair: list[Request] = []
        for turn in range(max(map(len, queues))):
            fair.extend(queue[turn] for queue in queues if turn < len(queue))
        self.waiting = deque(fair)

    def _order_by_cached_prefix(self, out: SchedulerOutput) -> None:
        cached: dict[Request, int] = {}
        for request in list(self.waiting):
            try:
                cached[request] = (
                    self.kv.get_computed_blocks(request, record=False)[1]
                    if self.config.enable_prefix_caching
                    else 0
                )
            except Exception as exc:  # its own hashing: it alone fails
                self._fail(request, exc, out)
        ranked = sorted(self.waiting, key=lambda r: (-cached[r], r.arrival_time))
        self.waiting = deque(ranked)

    # -- KV tiers (see cache_engine/offload.py) --------------------------------------------
    def _park_for_tier_loads(self, request: Request, num_pool_blocks: int) -> bool:
        """Park the head request while the tiers load the blocks after its pool prefix.

        True when loads started: the request leaves ``waiting`` for ``loading`` and other
        requests are scheduled meanwhile; :meth:`_resume_loaded` puts it back once its
        payloads are staged in memory, and this is not asked again before it is admitted.
        """
        if not self.tiers.may_look_up(request):
            return False
        hashes, inputs = self.kv.reusable_hashes(request)
        if not self.tiers.begin(request, hashes, inputs, num_pool_blocks):
            return False
        self.waiting.popleft()
        self.loading[request.request_id] = request
        return True

    def _install_loaded(self, request: Request, staged: Any, num_pool_blocks: int) -> None:
        """Copy staged tier payloads into the blocks just allocated after the pool prefix."""
        table = self.kv.block_table(request)
        self.tiers.install(request, staged, table[num_pool_blocks : num_pool_blocks + len(staged)])

    def _resume_loaded(self) -> None:
        """Parked requests whose loads are done go back to the front, oldest first."""
        if not self.loading:
            return
        ready = [r for r in self.loading.values() if self.tiers.is_ready(r)]
        for request in sorted(ready, key=lambda r: r.arrival_time, reverse=True):
            del self.loading[request.request_id]
            self.waiting.appendleft(request)

    def _any_loaded(self) -> bool:
        return any(self.tiers.is_ready(r) for r in self.loading.values())

    def _forget_tier_loads(self, request: Request) -> None:
        if self.tiers is not None:
            self.loading.pop(request.request_id, None)
            self.tiers.drop(request)

    def _fail(self, request: Request, exc: Exception, out: SchedulerOutput) -> None:
        """Take a request whose own processing raised out of the queues, alone.

        Its blocks past ``num_computed_tokens`` may be registered in the prefix cache
        without K/V (registration happens at allocation, before the step runs): they are
        forgotten, not left findable. No other request can hold them yet: a later request
        of this step would have hit them, and none has been scheduled after this one.
        """
        logger.exception("request %s failed while being scheduled", request.request_id)
        if request in self.running:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = "abort"
        release_pins(self.kv, request)
        self._forget_tier_loads(request)
        self.kv.discard(request, request.num_computed_tokens)
        out.failed.append((request, exc))

    def _preempt(self, request: Request) -> None:
        release_pins(self.kv, request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)


def _tokens_by_tier(pool_tokens: int, staged: Any, block_size: int) -> dict[str, int]:
    """A request's reused prompt tokens by where they came from (pool, host, disk)."""
    counts = {"pool": pool_tokens}
    if staged:
        for tier, tokens in staged.tokens_by_tier(block_size).items():
            counts[tier] = counts.get(tier, 0) + tokens
    return counts
