"""Which failures take a replica out, for how long, and how it comes back.

A replica failure (no connection at all, a 502 or 503, an in-process engine that is closed
or unhealthy) marks the replica down for a backoff that doubles per consecutive failure,
capped, and forgets its index (it may come back empty); the last healthy replica is never
marked down. A replica whose backoff has passed is probed (``GET /health``, else
``/v1/models``; ``Engine.health()`` in process) before it gets traffic again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ragkv.cache_engine.engine_like import ChecksHealth, ReportsHealth
from ragkv.errors import EngineClosedError, EngineUnhealthyError, RemoteEngineError
from ragkv.integrations.routing.replica import Replica
from ragkv.integrations.routing.settings import RouterSettings

logger = logging.getLogger(__name__)


def failure_kind(exc: BaseException) -> str | None:
    """``"replica"`` (mark it down, move on), ``"busy"`` (move on), ``"uncertain"`` (maybe
    the request's own: move on once, mark nothing), or None (raise)."""
    if isinstance(exc, RemoteEngineError):
        if exc.status_code == 429:
            return "busy"
        if exc.unreachable or exc.status_code in (502, 503):
            return "replica"
        if exc.status_code is None or exc.status_code >= 500:
            return "uncertain"
        return None
    if isinstance(exc, EngineClosedError | EngineUnhealthyError | ConnectionError):
        return "replica"
    return None


@dataclass(slots=True, eq=False)  # a breaker is itself, not its contents
class ReplicaHealth:
    """The breaker over ``replicas``: marks them down and probes them back.

    Shares the router's ``lock``; :meth:`mark_down` expects it held, :meth:`revive` takes it.
    """

    replicas: list[Replica]
    lock: threading.Lock
    settings: RouterSettings

    def mark_down(self, replica: Replica) -> None:
        """Skip ``replica`` for a backoff (doubling per consecutive failure) and forget its
        index: a replica that comes back may have restarted empty. Holds the lock."""
        if not any(r.stats.healthy for r in self.replicas if r is not replica):
            logger.warning("replica %s failed but is the last healthy one", replica.stats.name)
            return  # never take the last healthy replica out
        cap, floor = self.settings.max_backoff_s, self.settings.backoff_s
        replica.backoff_s = min(cap, max(floor, 2 * replica.backoff_s))
        replica.down_until = time.monotonic() + replica.backoff_s
        replica.stats.healthy = False
        replica.index.clear()

    def due(self) -> bool:
        """Whether some unhealthy replica's backoff has passed (a cheap check, no lock)."""
        now = time.monotonic()
        return any(not r.stats.healthy and r.down_until <= now for r in self.replicas)

    def revive(self) -> None:
        """Probe replicas whose backoff has passed; a passing probe marks them healthy, a
        failing one doubles the backoff."""
        now = time.monotonic()
        with self.lock:
            due = [
                r
                for r in self.replicas
                if not r.stats.healthy and r.down_until <= now and not r.probing
            ]
            for r in due:
                r.probing = True
        for r in due:
            ok = _probe(r.engine, self.settings.health_timeout_s)
            with self.lock:
                r.probing = False
                if ok:
                    _mark_healthy(r)
                else:
                    self.mark_down(r)


def _mark_healthy(replica: Replica) -> None:
    replica.stats.healthy = True
    replica.backoff_s = 0.0
    replica.down_until = 0.0


def _probe(engine: Any, timeout_s: float) -> bool:
    if isinstance(engine, ChecksHealth):
        return bool(engine.check_health(timeout_s=timeout_s))
    if isinstance(engine, ReportsHealth):
        try:
            return bool(engine.health().ok)
        except Exception:  # noqa: BLE001 - any failure of a probe means "not back yet"
            return False
    return True
