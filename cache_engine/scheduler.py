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
head until it fits (bounded: a large request is delayed, never starved). While requests run
(their blocks will come free), a head that may be passed does not take the free blocks a
queued request demands (its cached prefix, :meth:`KVCacheManager.note_demand`): it is
passed, so the request behind it is admitted onto the prefix it was routed to reuse instead
of recomputing it after the head evicted it.

K/V that does not come from the pool's prefix cache (the KV tiers, chunk reuse) comes from
the KV sources handed to the scheduler (:mod:`~ragkv.cache_engine.kv_source`): each is asked
in order what it offers after the pool's prefix; a source that must load first sends the
request out of the queue to wait for K/V (``RequestStatus.WAITING_FOR_KV``) while others
step, and it is put back at the front once its K/V is ready.

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

from ragkv.cache_engine.config import DEFAULTS, EngineConfig
from ragkv.cache_engine.kv_source import KVMatch, KVSource
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
        sources: Sequence[KVSource] = (),
    ) -> None:
        # Reads max_num_seqs, max_num_batched_tokens, enable_prefix_caching and
        # schedule_policy from ``config`` (validated when it was built).
        self.kv = kv_manager
        self.config = config
        self.max_model_len = max_model_len
        self.sources = tuple(sources)  # asked in this order (kv_source.py)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests waiting for a source's K/V, and the source they wait for.
        self.waiting_for_kv: dict[str, tuple[Request, KVSource]] = {}
        self.num_preemptions = 0

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
        if prompt_blocks > self.kv.num_blocks:
            raise PromptTooLongError(
                f"prompt of {request.num_prompt_tokens} tokens needs {prompt_blocks} KV blocks "
                f"but the whole pool has {self.kv.num_blocks} (block size "
                f"{self.kv.block_size}); shorten the prompt or raise kv_cache_tokens",
                param="prompt",
            )
        needed = self.blocks_needed(request)
        if needed > self.kv.num_blocks:
            raise CacheCapacityError(
                f"request {request.request_id} needs {needed} KV blocks "
                f"({request.num_prompt_tokens} prompt tokens + max_tokens "
                f"{request.params.max_tokens}, block size {self.kv.block_size}) but the whole "
                f"pool has {self.kv.num_blocks}; raise kv_cache_tokens or lower max_tokens",
                param="max_tokens",
            )

    def add(self, request: Request) -> None:
        """Queue a request; one that could never fit the whole pool is refused now."""
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self._note_demand(request)  # its own hashing failing: refused, leaving nothing behind
        self.waiting.append(request)

    def _note_demand(self, request: Request) -> None:
        """Ask the pool to keep the queued request's cached prefix (evicted last)."""
        if self.config.enable_prefix_caching:
            try:
                self.kv.note_demand(request)
            except Exception:
                self.kv.free(request)
                raise

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def has_work(self) -> bool:
        """Whether a step now would schedule something (some may wait for K/V)."""
        return bool(
            self.waiting
            or self.running
            or any(source.is_ready(r) for r, source in self.waiting_for_kv.values())
        )

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and release its blocks (they stay cached until reused)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self._release(request)
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
        self._resume_ready()
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
                blocks, num_computed = [], 0
                if self.config.enable_prefix_caching:
                    blocks, num_computed = self.kv.get_computed_blocks(request, record=False)
                matches = self._match_sources(request, num_computed)
                if matches is None:  # gone to wait for K/V
                    continue
                # A head that may be passed does not take the blocks queued requests will
                # reuse while running ones will free others: the requests behind go first.
                passable = (
                    not matches
                    and len(passed) < MAX_SKIP_AHEAD
                    and request.num_skipped < MAX_TIMES_SKIPPED
                    and len(self.waiting) > 1
                )
                spare = passable and bool(self.running)
                admitted = self._allocate(request, blocks, num_computed, matches, budget, spare)
                if admitted is not None:
                    table = self.kv.block_table(request)
                    used = {id(source): match for source, match in matches}
                    for source in self.sources:
                        source.allocated(request, used.get(id(source)), table, len(blocks))
            except Exception as exc:  # its own blocks' hashing or allocation: it alone fails
                self._fail(request, exc, out)
                continue
            if admitted is None:
                if passable:
                    request.num_skipped += 1  # a smaller one behind it may fit: look past it
                    passed.append(self.waiting.popleft())
                    continue
                break
            if self.config.enable_prefix_caching:  # counted once admitted, not per retry
                self.kv.record_lookup(request.num_tokens, len(blocks))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            num_computed += sum(match.num_tokens for _, match in matches)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:  # exact reuse only
                approximate = sum(m.num_tokens for _, m in matches if m.approximate)
                request.num_cached_tokens = num_computed - approximate
                request.exact_until = next(
                    (m.cache_until for _, m in matches if m.cache_until is not None), None
                )
            self.running.append(request)
            num_new, positions = admitted
            start = num_computed if positions is None else request.num_tokens - num_new
            block_table = self.kv.block_table(request)
            out.slices.append(ScheduledSlice(request, start, num_new, block_table, positions))
            budget -= num_new

    def _match_sources(
        self, request: Request, num_computed: int
    ) -> list[tuple[KVSource, KVMatch]] | None:
        """What the sources offer after the pool's ``num_computed`` tokens, in order; None
        when one must load first (the request has left the queue to wait for it)."""
        matches: list[tuple[KVSource, KVMatch]] = []
        written = False  # a match before wrote its tokens into new blocks
        for source in self.sources:
            match = source.match(request, num_computed)
            if match is None or (written and match.shared_blocks):
                continue  # shared blocks must continue the pool's prefix
            if match.load_pending:
                self.waiting.popleft()
                request.status = RequestStatus.WAITING_FOR_KV
                self.waiting_for_kv[request.request_id] = (request, source)
                return None
            matches.append((source, match))
            if match.positions is not None:  # it computes the rest: no later source
                break
            num_computed += match.num_tokens
            written = written or (match.num_tokens > 0 and not match.shared_blocks)
        return matches

    def _allocate(
        self,
        request: Request,
        blocks: list[int],
        num_computed: int,
        matches: list[tuple[KVSource, KVMatch]],
        budget: int,
        spare: bool = False,
    ) -> tuple[int, list[int] | None] | None:
        """Allocate the request's blocks: ``(tokens computed this step, explicit positions or
        None)``, or None when they do not fit (nothing changed; with ``spare``, also when
        they fit only in blocks queued requests demand). A match with positions that cannot
        be placed is dropped from ``matches`` for the exact path."""
        kv = self.kv
        last = matches[-1][1] if matches else None
        if last is not None and last.positions is not None:
            if len(last.positions) > budget:  # one step, whole: wait for room
                return None
            computed = blocks + _shared(matches)
            # Pin its sources first: a free source block would be the next one handed out.
            kv.pin(last.pinned)
            kv.limit_caching(request, last.cache_until, last.scope)
            num_tokens = request.num_tokens - len(computed) * kv.block_size
            if kv.allocate_slots(request, num_tokens, computed) is not None:
                request.pinned_blocks = list(last.pinned)
                return len(last.positions), last.positions
            kv.limit_caching(request, None)
            kv.unpin(last.pinned)
            matches.pop()  # the exact path (counted as a fallback by its source)
        computed = blocks + _shared(matches)
        written = sum(m.num_tokens for _, m in matches if not m.shared_blocks)
        num_done = len(computed) * kv.block_size + written
        num_new = min(request.num_tokens - num_done, budget)
        limit = next((m for _, m in matches if m.cache_until is not None), None)
        if limit is not None:
            kv.limit_caching(request, limit.cache_until, limit.scope)
        if kv.allocate_slots(request, written + num_new, computed, spare_demanded=spare) is None:
            if limit is not None:
                kv.limit_caching(request, None)
            return None
        return num_new, None

    def update(self, out: SchedulerOutput, sampled: Sequence[int]) -> list[Request]:
        """Take in what the step computed: ``sampled[i]`` is the token of the i-th sampling chunk.

        Appends each token and finishes (frees) a request that ends on it: a stop token
        first ("stop"), then ``max_tokens`` or the context length ("length"). Returns the
        requests that sampled, in order, finished or not.
        """
        for chunk in out.slices:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            self._unpin(request)
            for source in self.sources:
                source.computed(request)
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

    # -- KV sources (see cache_engine/kv_source.py) ----------------------------------------
    def _resume_ready(self) -> None:
        """Requests whose K/V is ready go back to the front, oldest first."""
        if not self.waiting_for_kv:
            return
        ready = [r for r, source in self.waiting_for_kv.values() if source.is_ready(r)]
        for request in sorted(ready, key=lambda r: r.arrival_time, reverse=True):
            del self.waiting_for_kv[request.request_id]
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _unpin(self, request: Request) -> None:
        """Drop the references on blocks its step read from (idempotent)."""
        if request.pinned_blocks:
            self.kv.unpin(request.pinned_blocks)
            request.pinned_blocks = []

    def _release(self, request: Request) -> None:
        """It leaves (finished, failed or preempted): its pins go, the sources forget it."""
        self._unpin(request)
        self.waiting_for_kv.pop(request.request_id, None)
        for source in self.sources:
            source.release(request)

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
        self._release(request)
        self.kv.discard(request, request.num_computed_tokens)
        out.failed.append((request, exc))

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.kv.free(request)
        with contextlib.suppress(Exception):  # a hint: admission hashes it again, failing alone
            self._note_demand(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)


def _shared(matches: list[tuple[KVSource, KVMatch]]) -> list[int]:
    """Pool blocks the matches share (they continue the pool's prefix, in order)."""
    return [block for _, match in matches for block in match.shared_blocks]
