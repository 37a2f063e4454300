"""The stepping thread: schedule → run → update, and every failure handled once, here.

One background thread takes submissions from an inbox and steps while requests are in
flight::

    batch = scheduler.schedule()            # who runs, how many tokens (under the lock)
    result = runner.execute(batch)          # inputs + attention plan once, forward, sample
    scheduler.update(batch, result)         # append tokens, finish on stop / length
    outputs.on_token(...)                   # text, stop strings, deltas, final Output

No request can hurt another (Invariant 9):

- work done for one request in this thread (its hashing and admission, its detokenization
  and stop check, the delivery to its caller) is wrapped so that an error fails that
  request alone, waiting or running;
- a step that fails for no single request (the forward pass, the batched sampler) fails the
  requests it ran; after ``MAX_CONSECUTIVE_STEP_FAILURES`` such steps in a row the engine
  declares itself unhealthy, fails everything queued with
  :class:`~ragkv.errors.EngineUnhealthyError` and refuses new requests; :meth:`health`
  reports it (and a stepping thread that died).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from ragkv.cache_engine.kv_cache_manager import KVCacheManager
from ragkv.cache_engine.model_runner import ModelRunner, StepResult
from ragkv.cache_engine.offload import KVOffload, written_blocks
from ragkv.cache_engine.output_processor import OutputProcessor, RequestState, Sink
from ragkv.cache_engine.outputs import EngineHealth, EngineStats, StreamDelta
from ragkv.cache_engine.request import Request
from ragkv.cache_engine.scheduler import Scheduler
from ragkv.cache_engine.step import SchedulerOutput
from ragkv.errors import EngineClosedError, EngineUnhealthyError, RequestAbortedError

logger = logging.getLogger(__name__)

# Steps that fail for no single request, in a row, before the engine gives up: one can be
# a transient fault (an allocation spike), three in a row is a broken device or model.
MAX_CONSECUTIVE_STEP_FAILURES = 3
LOAD_POLL_S = 0.1  # idle wait while a parked request may time out of its tier loads


class EngineCore:
    """Owns the scheduler, the model runner, the output processor and the stepping thread."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: OutputProcessor,
        offload: KVOffload | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.runner = runner
        self.outputs = outputs
        self.offload = offload  # KV tiers below the pool (None: off)
        if offload is not None:
            offload.loader.wake = self._wake  # the loader wakes an idle stepping thread
            scheduler.tiers = offload
        self.stats = EngineStats(num_blocks=runner.num_blocks)
        self.lock = threading.Lock()  # guards scheduler + KV manager across threads
        # Orders submissions against close(): an "add" is never queued behind "close".
        self._intake = threading.Lock()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.closed = False
        # Health, written by the stepping thread only (read without the lock: plain values).
        self._consecutive_failures = 0
        self._last_step_end: float | None = None
        self._unhealthy: str | None = None  # why the engine gave up; None while healthy

    # -- callers' threads -------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise if no request can be taken in (closed or unhealthy)."""
        if self.closed:
            raise EngineClosedError("the engine is closed; create a new Engine")
        if self._unhealthy is not None:
            raise EngineUnhealthyError(self._unhealthy_message())

    def submit(self, state: RequestState, sink: Sink) -> None:
        state.sink = sink
        with self._intake:
            self.check_open()
            self._ensure_thread()
            self._inbox.put(("add", state))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def snapshot(self) -> EngineStats:
        with self.lock:
            cache = self.kv.stats()
            snapshot = dataclasses.replace(self.stats)
        snapshot.evictions = cache.evictions
        snapshot.num_free_blocks = cache.num_free_blocks
        snapshot.preemptions = self.scheduler.num_preemptions
        snapshot.blend_fallbacks = self.scheduler.num_blend_fallbacks
        snapshot.extra = {"cache": cache}
        if self.offload is not None:
            self._add_tier_stats(snapshot)
        return snapshot

    def _add_tier_stats(self, snapshot: EngineStats) -> None:
        assert self.offload is not None  # called only with tiers configured
        counters, stores = self.offload.stats()
        snapshot.tier_hit_tokens = counters.hit_tokens
        snapshot.tier_loaded_blocks = counters.loaded_blocks
        snapshot.tier_loaded_bytes = counters.loaded_bytes
        snapshot.tier_load_s = counters.load_s
        snapshot.tier_load_misses = counters.load_misses
        snapshot.tier_stale_loads = counters.stale_loads
        snapshot.tier_offered_blocks = counters.offered_blocks
        snapshot.tier_offered_bytes = counters.offered_bytes
        snapshot.tier_save_s = counters.save_s
        snapshot.tier_install_s = counters.install_s
        snapshot.tier_load_timeouts = counters.load_timeouts
        snapshot.tier_stalled_skips = counters.stalled_skips
        snapshot.tiers = stores

    def cached_prefix(self, hasher: Any, num_tokens: int) -> int:
        """Leading blocks of a hashed token sequence the pool holds now, and after them the
        KV tiers (an upper bound: their loads are verified when a request asks)."""
        with self.lock:
            blocks = self.kv.cached_prefix(hasher, num_tokens)
        if self.offload is None:
            return blocks
        max_blocks = (num_tokens - 1) // self.kv.block_size
        return blocks + self.offload.resident_blocks(hasher.hashes[:max_blocks], blocks)

    def health(self) -> EngineHealth:
        thread = self._thread
        alive = thread is not None and thread.is_alive()
        reason = self._unhealthy
        if reason is None and self.closed:
            reason = "the engine is closed"
        elif reason is None and thread is not None and not alive:
            reason = "the stepping thread stopped"
        last = self._last_step_end
        return EngineHealth(
            ok=reason is None,
            thread_alive=alive,
            last_step_age_s=None if last is None else time.monotonic() - last,
            busy=bool(self.outputs.states) or not self._inbox.empty(),
            consecutive_failures=self._consecutive_failures,
            reason=reason,
            kv_loader=None if self.offload is None else self.offload.loader_health(),
        )

    def close(self) -> None:
        with self._intake:
            if self.closed:
                return
            self.closed = True
            self._inbox.put(("close", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.offload is not None:  # after the last step: every written block is offered
            try:
                self.offload.close()
            except Exception:  # a store that cannot flush loses entries, not the shutdown
                logger.exception("closing the KV tiers failed")

    def _wake(self) -> None:
        """Called by the tier loader: a parked request can be scheduled."""
        self._inbox.put(("wake", None))

    def start(self) -> None:
        """Start the stepping thread unless it runs (or the core is closed)."""
        if not self.closed:
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self.lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="ragkv-engine", daemon=True
                    )
                    self._thread.start()

    # -- the stepping thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the thread is ending: nobody may wait forever
            logger.exception("engine stepping thread died")
            error = self._give_up(f"the stepping thread died: {exc!r}", exc)
            while True:  # submissions queued but never taken in
                try:
                    command, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if command == "add":
                    self._refuse(arg, error)
            raise

    def _serve(self) -> None:
        while True:
            block = not self.scheduler.has_work()
            # Parked requests time out of their tier loads (offload.py): poll while any wait.
            timeout = LOAD_POLL_S if self.scheduler.loading else None
            try:
                while True:
                    command, arg = self._inbox.get(block=block, timeout=timeout)
                    block = False
                    if command == "close":
                        self._fail_all(EngineClosedError("the engine was closed"))
                        return
                    try:
                        self._handle(command, arg)
                    except Exception:  # a bad command must not stop the engine
                        logger.exception("engine could not handle %s", command)
            except queue.Empty:
                pass
            if self.scheduler.has_work():
                try:
                    self.step()
                except Exception as exc:  # pinned on no request: fail those in flight
                    logger.exception("engine step failed")
                    self._step_failed(exc)
                else:
                    self._consecutive_failures = 0
                self._last_step_end = time.monotonic()

    def _handle(self, command: str, arg: Any) -> None:
        if command == "wake":  # only ends a blocking wait: the loop steps next
            return
        with self.lock:
            if command == "add":
                if self._unhealthy is not None:
                    self._refuse(arg, EngineUnhealthyError(self._unhealthy_message()))
                    return
                try:
                    self.scheduler.add(arg.request)
                except Exception as exc:  # e.g. it cannot fit: its caller must hear of it
                    self._refuse(arg, exc)
                    return
                self.outputs.add(arg)
            elif command == "abort":
                request = self.outputs.get(arg)
                if request is not None:
                    self.scheduler.finish(request, "abort")
                    with self._failing_alone(request):
                        self._emit_final(request, self.outputs.flush(request), [])

    def step(self) -> None:
        """One engine step: schedule, run the model, take in what it produced."""
        started = time.perf_counter()
        with self.lock:
            batch = self.scheduler.schedule()
            for request, exc in batch.failed:
                self._fail_request(request, exc)
            if not batch.slices:
                if not batch.failed and self.scheduler.waiting:
                    self._fail_unschedulable()
                return
            self._count(batch, time.perf_counter())
        result = self.runner.execute(batch)
        self._save_to_tiers(batch)
        with self.lock:
            self._update(batch, result)
            stats = self.stats
            stats.steps += 1
            stats.peak_used_blocks = max(
                stats.peak_used_blocks, self.kv.pool.num_blocks - self.kv.num_free_blocks
            )
            stats.model_s += result.forward_s
            stats.step_s += time.perf_counter() - started

    def _save_to_tiers(self, batch: SchedulerOutput) -> None:
        """Offer the blocks this step's forward wrote (and the pool registered) to the tiers.

        Runs before ``_update`` can finish a request and before the next step can reuse a
        block, so the copy reads exactly what the forward wrote.
        """
        if self.offload is None:
            return
        with self.lock:
            blocks = written_blocks(batch, self.kv.pool, self.kv.block_size)
        self.offload.save_written(blocks)

    def _count(self, batch: SchedulerOutput, now: float) -> None:
        stats = self.stats
        for chunk in batch.slices:
            request = chunk.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                stats.prompt_tokens += request.num_prompt_tokens
                stats.prefill_tokens_reused += request.num_cached_tokens or 0
                stats.prefill_tokens_reused_nonprefix += request.reused_nonprefix_tokens
            if chunk.num_tokens == 1 and chunk.start >= request.num_prompt_tokens:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens_computed += chunk.num_tokens

    def _update(self, batch: SchedulerOutput, result: StepResult) -> None:
        self.outputs.keep_logits(batch, result.logits)
        sampled = self.scheduler.update(batch, result.token_ids)
        for i, request in enumerate(sampled):
            token = result.token_ids[i]
            with self._failing_alone(request):
                reason, delta = self.outputs.on_token(request, token, result.logprobs[i])
                if reason is None:
                    self._deliver(request, StreamDelta(request.request_id, delta, [token]))
                    continue
                if not request.finished:  # a stop string: the scheduler could not see it
                    self.scheduler.finish(request, reason)
                request.finish_reason = reason  # a stop string wins over "length"
                self._emit_final(request, delta, [token])

    def _emit_final(self, request: Request, delta: str, tokens: list[int]) -> None:
        self.stats.requests_finished += 1
        self._deliver(request, self.outputs.final(request, delta, tokens), last=True)

    def _deliver(
        self, request: Request, event: StreamDelta | BaseException, last: bool = False
    ) -> None:
        """Hand an event to the request's caller; a caller that is gone (its event loop
        closed, say) gets its request aborted instead of taking the engine down."""
        if not self.outputs.deliver(request, event, last) and not request.finished:
            self.scheduler.finish(request, "abort")

    def _refuse(self, state: RequestState, exc: BaseException) -> None:
        """Fail a submission that was never taken in."""
        self.outputs.add(state)
        self._deliver(state.request, exc, last=True)

    def _fail_unschedulable(self) -> None:
        # Only reachable if the head request cannot fit even with the pool to itself,
        # which check_fits rules out; fail loudly rather than spin.
        request = self.scheduler.waiting[0]
        self.scheduler.finish(request, "abort")
        error = RequestAbortedError(f"request {request.request_id} could not be scheduled")
        self._deliver(request, error, last=True)

    @contextlib.contextmanager
    def _failing_alone(self, request: Request) -> Iterator[None]:
        """Run work done for ``request`` alone: an error in it fails that request only."""
        try:
            yield
        except Exception as exc:
            logger.exception("request %s failed", request.request_id)
            if not request.finished:
                self.scheduler.finish(request, "abort")
            self._fail_request(request, exc)

    def _fail_request(self, request: Request, exc: Exception) -> None:
        """Deliver a request's own failure (it is already finished and freed)."""
        self._deliver(request, exc, last=True)

    def _step_failed(self, exc: Exception) -> None:
        """A step failed for no single request: fail the ones that ran, count it, maybe give up."""
        self._consecutive_failures += 1
        with self.lock:
            for request in list(self.scheduler.running):
                self.scheduler.finish(request, "abort")
                self._deliver(request, exc, last=True)
            # The failed step registered its full blocks in the prefix cache before their
            # K/V were written; no request holds a block now, so this forgets all of them
            # and no later request can hit one.
            self.kv.reset_prefix_cache()
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._give_up(
                f"{self._consecutive_failures} engine steps in a row failed, the last with "
                f"{type(exc).__name__}: {exc}",
                exc,
            )

    def _give_up(self, reason: str, cause: BaseException) -> EngineUnhealthyError:
        """Mark the engine unhealthy and fail every request it holds.

        From now on submissions are refused in the caller's thread, and any already in the
        inbox are failed when the stepping thread takes them in.
        """
        with self._intake:  # orders the mark against submissions (see submit)
            self._unhealthy = reason
        error = EngineUnhealthyError(self._unhealthy_message())
        error.__cause__ = cause
        self._fail_all(error)
        return error

    def _unhealthy_message(self) -> str:
        return (
            f"the engine is unhealthy ({self._unhealthy}); create a new Engine (restart the server)"
        )

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request taken in; each caller hears of it even if freeing one fails."""
        with self.lock:
            for request in self.outputs.requests():
                try:
                    self.scheduler.finish(request, "abort")
                except Exception:  # shutting down or giving up: delivery matters more
                    logger.exception("could not free request %s", request.request_id)
                self._deliver(request, exc, last=True)
