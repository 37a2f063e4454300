"""The server's pre-queue work pool: round-robin over tenants, bounded shares, cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from ragkv.integrations.openai.limits import APIError
from ragkv.integrations.openai.server.fair_work import FairWorkers


async def until(condition, timeout_s: float = 10.0) -> None:
    """Poll ``condition`` on the event loop (worker threads start when the OS runs them)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


def gated_job() -> tuple[Callable[[str], str], list[str], threading.Event]:
    """A job that waits for the gate, then records its name in ``ran`` and returns it."""
    ran: list[str] = []
    gate = threading.Event()

    def job(name: str) -> str:
        gate.wait(timeout=30)
        ran.append(name)
        return name

    return job, ran, gate


def test_a_flood_of_one_tenant_does_not_queue_another_behind_it():
    job, ran, gate = gated_job()

    async def main() -> list[str]:
        workers = FairWorkers(1, max_per_tenant=10, max_total=20)
        flood = [asyncio.create_task(workers.run("flood", job, f"F{i}")) for i in range(5)]
        await asyncio.sleep(0.05)  # F0 runs (held at the gate), F1..F4 wait
        quiet = asyncio.create_task(workers.run("quiet", job, "Q"))
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(*flood, quiet)
        workers.close()
        return results

    results = asyncio.run(main())
    assert results == ["F0", "F1", "F2", "F3", "F4", "Q"]  # each caller gets its own result
    assert ran[:2] == ["F0", "Q"]  # first come, first served would run Q last


def test_no_tenant_holds_every_thread():
    gate = threading.Event()
    started: list[str] = []

    def job(name: str) -> None:
        started.append(name)
        gate.wait(timeout=30)

    async def main() -> None:
        workers = FairWorkers(3, max_per_tenant=10, max_total=20)
        flood = [asyncio.create_task(workers.run("flood", job, f"F{i}")) for i in range(5)]
        await until(lambda: len(started) >= 2)
        await asyncio.sleep(0.05)  # a third would start now if it could
        assert sorted(started) == ["F0", "F1"]  # two of three threads; one stays free
        quiet = asyncio.create_task(workers.run("quiet", job, "Q"))
        await until(lambda: "Q" in started)  # at once, while the flood's jobs still run
        assert sorted(started) == ["F0", "F1", "Q"]
        gate.set()
        await asyncio.gather(*flood, quiet)
        workers.close()

    asyncio.run(main())


def test_past_its_share_a_tenant_gets_429_and_others_do_not():
    gate = threading.Event()

    async def main() -> None:
        workers = FairWorkers(1, max_per_tenant=2, max_total=3)
        held = [asyncio.create_task(workers.run("a", gate.wait, 30)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await workers.run("a", gate.wait, 30)
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        held.append(asyncio.create_task(workers.run("b", gate.wait, 30)))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError, match="the server's"):
            await workers.run("c", gate.wait, 30)
        gate.set()
        await asyncio.gather(*held)
        assert workers.pending("a") == workers.pending("b") == 0
        workers.close()

    asyncio.run(main())


def test_a_cancelled_request_never_runs_its_queued_job_and_errors_reach_their_caller():
    job, ran, gate = gated_job()

    def fails() -> None:
        raise APIError(400, "bad", param="messages")

    async def main() -> None:
        workers = FairWorkers(1, max_per_tenant=10, max_total=10)
        first = asyncio.create_task(workers.run("a", job, "first"))
        queued = asyncio.create_task(workers.run("a", job, "queued"))
        await asyncio.sleep(0.05)
        queued.cancel()
        gate.set()
        await first
        with pytest.raises(APIError, match="bad"):
            await workers.run("a", fails)
        assert workers.pending("a") == 0
        workers.close()

    asyncio.run(main())
    assert ran == ["first"]
