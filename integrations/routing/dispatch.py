"""Sending one request to replicas until one answers.

A replica failure (:func:`~.health.failure_kind`) marks the replica down and the request goes
to the next replica of the ranking, at most ``max_attempts`` replicas in all. A failure that
may be the request's own (a timeout, a 500 or 504, a broken or malformed answer) marks
nothing and is re-sent at most once, so one slow request cannot take every replica out. A
429 moves the request on without marking the replica. Any other error (a 4xx: the request's
own fault) is raised at once. A stream moves on only while nothing has reached the caller;
after its first delta a failure raises :class:`~ragkv.errors.RemoteEngineError` and the
request is never sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

from ragkv.cache_engine.engine_like import Prompt
from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import InvalidInputError, RemoteEngineError
from ragkv.integrations.routing.health import ReplicaHealth, failure_kind
from ragkv.integrations.routing.replica import Replica
from ragkv.integrations.routing.selection import Route, Selector

logger = logging.getLogger(__name__)


class Dispatcher:
    """Runs a routed request on the replicas :class:`Selector` picks, failing over as the
    module describes and keeping the in-flight and answer counters."""

    def __init__(self, selector: Selector, health: ReplicaHealth, max_attempts: int) -> None:
        self.selector = selector
        self.health = health
        self.max_attempts = max_attempts
        self.lock = selector.lock
        self.replicas = selector.replicas

    def generate(
        self, route: Route, prompt: Prompt, params: SamplingParams | None, salt: str | None
    ) -> Output:
        while True:
            replica = self._pick(route)
            try:
                output = replica.engine.generate(prompt, params, cache_salt=salt)
            except BaseException as exc:
                self._failed(replica, route, exc)
                continue
            self._answered(replica, route, output)
            return output

    async def agenerate(
        self, route: Route, prompt: Prompt, params: SamplingParams | None, salt: str | None
    ) -> Output:
        while True:
            replica = await self._apick(route)
            try:
                output = await replica.engine.agenerate(prompt, params, cache_salt=salt)
            except BaseException as exc:
                self._failed(replica, route, exc)
                continue
            self._answered(replica, route, output)
            return output

    def stream(
        self, route: Route, prompt: Prompt, params: SamplingParams | None, salt: str | None
    ) -> Generator[StreamDelta, None, None]:
        while True:
            replica = self._pick(route)
            deltas = replica.engine.stream(prompt, params, cache_salt=salt)
            started, output = False, None
            try:
                for delta in deltas:
                    output = delta.output or output
                    started = True
                    yield delta
            except GeneratorExit:
                self._release(replica, route)
                raise
            except BaseException as exc:
                self._stream_failed(replica, route, exc, started)
                continue
            finally:
                _close(deltas)
            self._finish_stream(replica, route, output)
            return

    async def astream(
        self, route: Route, prompt: Prompt, params: SamplingParams | None, salt: str | None
    ) -> AsyncGenerator[StreamDelta, None]:
        while True:
            replica = await self._apick(route)
            deltas = replica.engine.astream(prompt, params, cache_salt=salt)
            started, output = False, None
            try:
                async for delta in deltas:
                    output = delta.output or output
                    started = True
                    yield delta
            except (GeneratorExit, asyncio.CancelledError):
                self._release(replica, route)
                raise
            except BaseException as exc:
                self._stream_failed(replica, route, exc, started)
                continue
            finally:
                closer = getattr(deltas, "aclose", None)
                if closer is not None:
                    await closer()
            self._finish_stream(replica, route, output)
            return

    def _pick(self, route: Route) -> Replica:
        """The next replica for ``route``; replicas past their backoff are probed first."""
        if self.health.due():
            self.health.revive()
        return self._choose(route)

    async def _apick(self, route: Route) -> Replica:
        if self.health.due():
            await asyncio.to_thread(self.health.revive)
        return self._choose(route)

    def _choose(self, route: Route) -> Replica:
        if len(route.tried) >= self.max_attempts:
            raise _exhausted(route, self.max_attempts)
        replica = self.selector.choose(route)
        if replica is None:
            raise _exhausted(route, self.max_attempts)
        return replica

    def _answered(self, replica: Replica, route: Route, output: Output) -> None:
        with self.lock:
            self.selector.leave(replica, route)
            replica.stats.succeeded += 1
            # Not marked healthy here: an answer to a request sent before the replica failed
            # proves nothing about it now; only a probe after the backoff brings it back.
            self.selector.learn(replica, route, output)

    def _failed(self, replica: Replica, route: Route, exc: BaseException) -> None:
        """Account a failed attempt; return to try the next replica, else raise ``exc``."""
        with self.lock:
            self.selector.leave(replica, route)
            kind = failure_kind(exc)
            if kind == "replica":
                replica.stats.failures += 1
                self.health.mark_down(replica)
            if kind == "uncertain":
                if route.resent >= 1:
                    raise exc  # twice: the request's own doing, not the replicas'
                route.resent += 1
            if kind is None:
                raise exc
            now = time.monotonic()
            moving_on = len(route.tried) < self.max_attempts and any(
                r.position not in route.tried and (r.stats.healthy or r.down_until <= now)
                for r in self.replicas
            )
            if moving_on:
                replica.stats.failovers += 1
        logger.warning("replica %s failed (%s): %s", replica.stats.name, kind, exc)
        route.last_error = exc
        if not moving_on:
            raise _exhausted(route, len(route.tried)) from exc

    def _stream_failed(
        self, replica: Replica, route: Route, exc: BaseException, started: bool
    ) -> None:
        """A failed stream: before its first delta as :meth:`_failed` (return to try the next
        replica); after deltas reached the caller, raised, never re-sent."""
        if not started:
            self._failed(replica, route, exc)
            return
        with self.lock:
            self.selector.leave(replica, route)
            if failure_kind(exc) == "replica":
                replica.stats.failures += 1
                self.health.mark_down(replica)
        if isinstance(exc, RemoteEngineError | InvalidInputError):
            raise exc
        raise RemoteEngineError(
            f"replica {replica.stats.name} failed after streaming began; not re-sent: {exc}",
            status_code=getattr(exc, "status_code", None),
        ) from exc

    def _finish_stream(self, replica: Replica, route: Route, output: Output | None) -> None:
        if output is None:  # a stream without a final output: count it, learn nothing
            self._release(replica, route, succeeded=True)
            return
        self._answered(replica, route, output)

    def _release(self, replica: Replica, route: Route, succeeded: bool = False) -> None:
        with self.lock:
            self.selector.leave(replica, route)
            replica.stats.succeeded += int(succeeded)


def _exhausted(route: Route, attempts: int) -> RemoteEngineError:
    last = route.last_error
    status = getattr(last, "status_code", None) if last is not None else 503
    return RemoteEngineError(
        f"no replica could answer ({attempts} tried); last error: {last}", status_code=status
    )


def _close(deltas: Any) -> None:
    closer = getattr(deltas, "close", None)
    if closer is not None:
        closer()
