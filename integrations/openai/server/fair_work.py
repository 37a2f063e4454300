"""A request's CPU work before it is queued (decoding a large body, tokenizing, assembling),
on a few threads shared fairly across tenants.

``asyncio.to_thread`` runs jobs first come, first served on an executor of up to 32
threads, so one tenant's burst of large chats sat in front of every other tenant's small
one (six 7 MB chats made another tenant's chat take 67 s). Here each tenant has its own
queue, a free thread takes the next job of the waiting tenant with the fewest jobs running,
among those the one served longest ago (round-robin), and no tenant holds every thread: one
is kept for the others, so a small request starts at once however long the running jobs
are (a 1 MiB chat takes ~1 s to tokenize). A tenant (or the server) past its share of
waiting jobs gets 429 before anything is done::

    flood: F1 F2 F3 F4 ...      two threads: F1 runs, the other stays free; Q1 arrives and
    quiet: Q1                   runs at once, then F2 follows F1

Everything but the job itself runs on the event loop, so the queues need no lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ragkv.integrations.openai.limits import rate_limited

T = TypeVar("T")

# Tokenizing runs without the GIL (assembler/tokenization.py): a thread per core (2 to 8),
# plus the one no single tenant may take.
DEFAULT_WORK_THREADS = max(2, min(8, os.cpu_count() or 2)) + 1


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]


class FairWorkers:
    """Run blocking jobs on ``threads`` threads, shared fairly over tenants; with two
    threads or more, one tenant's jobs hold at most ``threads - 1`` of them.

    A tenant may have ``max_per_tenant`` jobs waiting or running and the server ``max_total``;
    past either, :meth:`run` raises a 429 :class:`APIError` with ``Retry-After``.
    """

    def __init__(
        self, threads: int = DEFAULT_WORK_THREADS, *, max_per_tenant: int, max_total: int
    ) -> None:
        if min(threads, max_per_tenant, max_total) < 1:
            raise ValueError("threads, max_per_tenant and max_total must be >= 1")
        self.threads = threads
        self.max_per_tenant = max_per_tenant
        self.max_total = max_total
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="ragkv-work"
        )
        self._running = 0
        self._running_by: dict[str, int] = {}  # tenant -> its jobs on a thread now
        self._served_at: dict[str, int] = {}  # tenant -> when a job of it last started
        self._dispatched = 0
        self._queues: dict[str, deque[_Job]] = {}  # tenants with jobs waiting
        self._pending: dict[str, int] = {}  # tenant -> jobs waiting or running

    def pending(self, tenant: str) -> int:
        """Jobs of ``tenant`` waiting or running now."""
        return self._pending.get(tenant, 0)

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread, when ``tenant``'s turn comes; its result or error."""
        mine = self._pending.get(tenant, 0)
        if mine >= self.max_per_tenant or sum(self._pending.values()) >= self.max_total:
            raise rate_limited(mine >= self.max_per_tenant, "requests being prepared")
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future())
        self._pending[tenant] = mine + 1
        self._queues.setdefault(tenant, deque()).append(job)
        self._dispatch(loop)
        try:
            return await job.future  # cancelled with the request: a queued job never runs
        finally:
            left = self._pending[tenant] - 1
            if left:
                self._pending[tenant] = left
            else:
                del self._pending[tenant]
                self._served_at.pop(tenant, None)

    def close(self) -> None:
        """Stop taking jobs; running ones finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        cap = max(1, self.threads - 1)  # threads one tenant may hold
        while self._running < self.threads:
            ready = [t for t in self._queues if self._running_by.get(t, 0) < cap]
            if not ready:
                return
            tenant = min(ready, key=self._turn)
            queue = self._queues[tenant]
            job = queue.popleft()
            if not queue:
                del self._queues[tenant]
            if job.future.done():  # its request was cancelled while it waited
                continue
            self._dispatched += 1
            self._served_at[tenant] = self._dispatched
            self._running += 1
            self._running_by[tenant] = self._running_by.get(tenant, 0) + 1
            done = self._executor.submit(job.fn, *job.args)
            done.add_done_callback(functools.partial(self._back_on_loop, loop, tenant, job))

    def _turn(self, tenant: str) -> tuple[int, int]:
        return self._running_by.get(tenant, 0), self._served_at.get(tenant, 0)

    def _back_on_loop(
        self,
        loop: asyncio.AbstractEventLoop,
        tenant: str,
        job: _Job,
        done: concurrent.futures.Future[Any],
    ) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(self._finished, loop, tenant, done, job)

    def _finished(
        self,
        loop: asyncio.AbstractEventLoop,
        tenant: str,
        done: concurrent.futures.Future[Any],
        job: _Job,
    ) -> None:
        self._running -= 1
        left = self._running_by[tenant] - 1
        if left:
            self._running_by[tenant] = left
        else:
            del self._running_by[tenant]
        if not job.future.done():
            if done.cancelled():
                job.future.cancel()
            elif (error := done.exception()) is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(done.result())
        self._dispatch(loop)
