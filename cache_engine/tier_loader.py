"""The KV tiers' loader thread: staged payloads of parked requests, bounded and on a deadline.

:class:`~ragkv.cache_engine.offload.KVOffload` decides what to load (the tiers' run after a
request's pool prefix); a :class:`TierLoader` loads it, verified, into CPU staging on its
own thread, stopping at the first miss, and tells the engine when a request's payloads are
ready. Staging is bounded (``max_staged_blocks``). Each request waits at most
``load_timeout_s`` from the moment it was parked: the loader stops a slow job between
blocks and keeps what it staged, and a job stuck inside one read (a hung mount) is abandoned
by the stepping thread with what was loaded by then. While one read has run longer than the
deadline, no new job is started (the request computes instead); :meth:`TierLoader.health`
reports it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StagedBlocks:
    """Verified payloads of blocks ``first_block ..`` of one request, loaded from the tiers."""

    first_block: int
    hashes: list[bytes]
    payloads: list[torch.Tensor]
    tiers: list[str]

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        counts: dict[str, int] = {}
        for tier in self.tiers:
            counts[tier] = counts.get(tier, 0) + block_size
        return counts

    def __len__(self) -> int:
        return len(self.payloads)


@dataclass(slots=True)
class _Job:
    request_id: str
    first_block: int
    hashes: list[bytes]
    inputs: list[bytes]
    deadline: float  # time.monotonic(): the request stops waiting then


class TierLoader:
    """Loads tier runs for parked requests on one thread. ``counters`` (a ``TierCounters``)
    and ``lock`` are the offload's: the loader counts into them under that lock."""

    def __init__(
        self,
        tiers: Any,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        block_bytes: int,
        max_staged_blocks: int,
        load_timeout_s: float,
        counters: Any,
        lock: threading.Lock,
        wake: Callable[[], None],
    ) -> None:
        self.tiers = tiers
        self.shape = shape
        self.dtype = dtype
        self.block_bytes = block_bytes
        self.max_staged_blocks = max_staged_blocks
        self.load_timeout_s = load_timeout_s
        self.counters = counters
        self.wake = wake
        self._lock = lock  # guards everything below and the counters
        self._loading: dict[str, int] = {}  # request id -> blocks reserved for its job
        self._deadlines: dict[str, float] = {}  # request id -> when it stops waiting
        self._partial: dict[str, StagedBlocks] = {}  # request id -> loaded so far
        self._ready: dict[str, StagedBlocks] = {}
        self._staged_blocks = 0
        self._read_started: float | None = None  # the current block load began
        self._jobs_done = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(
        self, request_id: str, first_block: int, hashes: Sequence[bytes], inputs: Sequence[bytes]
    ) -> bool:
        """Queue loading ``hashes`` (blocks ``first_block ..``); False when staging is full
        or the loader is stuck in a read (the request then computes)."""
        count = len(hashes)
        now = time.monotonic()
        with self._lock:
            if not count or self._staged_blocks + count > self.max_staged_blocks:
                return False
            if self._stuck_s(now) > self.load_timeout_s:  # it would only wait to time out
                self.counters.stalled_skips += 1
                return False
            self._staged_blocks += count
            self._loading[request_id] = count
            self._deadlines[request_id] = deadline = now + self.load_timeout_s
        self._ensure_thread()
        self._jobs.put(_Job(request_id, first_block, list(hashes), list(inputs), deadline))
        return True

    def is_ready(self, request_id: str) -> bool:
        """True once the request's loads are done, or abandoned at their deadline."""
        with self._lock:
            if request_id not in self._loading:
                return True
            if time.monotonic() < self._deadlines[request_id]:
                return False
            # Inside a read at the deadline: stop waiting with what was loaded by then; the
            # loader drops the job when its read returns.
            reserved = self._loading.pop(request_id)
            del self._deadlines[request_id]
            staged = self._partial.pop(request_id, None)
            kept = 0 if staged is None else len(staged)
            self._staged_blocks -= reserved - kept
            if staged is not None and kept:
                self._ready[request_id] = staged
            self.counters.load_timeouts += 1
        logger.warning("KV tier loads for %s timed out; computing instead", request_id)
        return True

    def ready(self, request_id: str) -> StagedBlocks | None:
        """The request's staged payloads, if its loads gave any (kept until released)."""
        with self._lock:
            return self._ready.get(request_id)

    def release(self, request_id: str) -> None:
        """Free the request's staged payloads and cancel its running loads, if any."""
        with self._lock:
            staged = self._ready.pop(request_id, None)
            if staged is not None:
                self._staged_blocks -= len(staged)
            reserved = self._loading.pop(request_id, None)
            if reserved is not None:
                self._staged_blocks -= reserved
            self._deadlines.pop(request_id, None)
            self._partial.pop(request_id, None)

    @property
    def staged_blocks(self) -> int:
        """Blocks staged or reserved for running jobs."""
        with self._lock:
            return self._staged_blocks

    def health(self) -> dict[str, Any]:
        """Progress: jobs waiting, jobs done, how long the current block load has run."""
        now = time.monotonic()
        with self._lock:
            stuck = self._stuck_s(now)
            return {
                "jobs_waiting": len(self._loading),
                "jobs_done": self._jobs_done,
                "current_read_s": None if self._read_started is None else round(stuck, 3),
                "stalled": stuck > self.load_timeout_s,
                "load_timeouts": self.counters.load_timeouts,
            }

    def close(self, timeout_s: float = 30) -> None:
        """Stop the thread after the jobs queued before this call."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=timeout_s)

    # -- the thread --------------------------------------------------------------------
    def _stuck_s(self, now: float) -> float:
        """How long the current block load has run (0 when none runs); hold the lock."""
        return 0.0 if self._read_started is None else now - self._read_started

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ragkv-kv-loader", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._load(job)
            except Exception:  # a store bug costs this request its hits, nothing more
                logger.exception("KV tier loads for %s failed", job.request_id)
                with self._lock:
                    reserved = self._loading.pop(job.request_id, None)
                    if reserved is not None:
                        self._staged_blocks -= reserved
                    self._deadlines.pop(job.request_id, None)
                    self._partial.pop(job.request_id, None)
            with self._lock:
                self._read_started = None
                self._jobs_done += 1
            self.wake()

    def _load(self, job: _Job) -> None:
        """Load the job's run in order, stopping at the first miss (a prefix must be whole)
        or at the job's deadline (what was loaded by then is used)."""
        staged = StagedBlocks(job.first_block, [], [], [])
        with self._lock:
            if job.request_id not in self._loading:
                return  # dropped before its turn
            self._partial[job.request_id] = staged  # is_ready takes it at the deadline
        for block_hash, hash_input in zip(job.hashes, job.inputs, strict=True):
            started = time.perf_counter()
            with self._lock:
                if job.request_id not in self._loading:
                    return  # dropped (finished, aborted, timed out) while loading
                if time.monotonic() >= job.deadline:
                    self.counters.load_timeouts += 1
                    break
                self._read_started = time.monotonic()
            loaded = self.tiers.load(block_hash, hash_input)
            elapsed = time.perf_counter() - started
            with self._lock:
                self._read_started = None
            if loaded is not None and not self._fits(loaded[0]):
                logger.warning("KV tier payload of the wrong shape or dtype; recomputing")
                loaded = None
            if loaded is None:
                with self._lock:
                    self.counters.load_misses += 1
                break
            payload, tier = loaded
            with self._lock:
                if job.request_id not in self._loading:
                    return  # timed out during this read: is_ready took what came before
                staged.hashes.append(block_hash)
                staged.payloads.append(payload)
                staged.tiers.append(tier)
                c = self.counters
                c.loaded_blocks[tier] = c.loaded_blocks.get(tier, 0) + 1
                c.loaded_bytes[tier] = c.loaded_bytes.get(tier, 0) + self.block_bytes
                c.load_s[tier] = c.load_s.get(tier, 0.0) + elapsed
        with self._lock:
            reserved = self._loading.pop(job.request_id, None)
            self._partial.pop(job.request_id, None)
            if reserved is None:
                return
            del self._deadlines[job.request_id]
            self._staged_blocks -= reserved - len(staged)
            if staged.payloads:
                self._ready[job.request_id] = staged

    def _fits(self, payload: Any) -> bool:
        return (
            isinstance(payload, torch.Tensor)
            and tuple(payload.shape) == self.shape
            and payload.dtype == self.dtype
        )
