"""What the routes of one app share."""

from __future__ import annotations

import dataclasses
from typing import Any

from ragkv.cache_engine import Engine
from ragkv.cache_engine.engine_like import EngineLike
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS
from ragkv.integrations.openai.limits import RequestLimits, rate_limited
from ragkv.integrations.openai.server.fair_work import FairWorkers
from ragkv.integrations.openai.server.metrics import ServerMetrics


@dataclasses.dataclass(slots=True)
class Served:
    """What the routes share: the engine, the pipeline and the limits."""

    engine: EngineLike
    local: Engine | None  # the same engine when it runs in this process
    pipeline: Any
    model_name: str
    limits: RequestLimits
    max_body_bytes: int
    request_timeout_s: float
    metrics: ServerMetrics
    reuse: str | None = None  # "blend": requests may opt into chunk reuse (--reuse blend)
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # a chat request without max_tokens
    tenant_secret: bytes = b""  # keys the tenants' cache namespaces (auth.deployment_secret)
    # Admission: requests in flight (queued in the engine or running) per tenant and in all.
    max_requests_per_tenant: int = 64
    max_requests: int = 256
    in_flight: dict[str, int] = dataclasses.field(default_factory=dict)
    # With KV events on: notes each request's engine salt against its client's (SaltViews).
    salt_views: Any = None
    # Decoding, tokenizing and assembling, round-robin by tenant (fair_work.py).
    workers: FairWorkers = dataclasses.field(
        default_factory=lambda: FairWorkers(max_per_tenant=64, max_total=256)
    )

    def admit(self, tenant: str) -> None:
        """Count a request in, or refuse it (429, ``Retry-After``) when its tenant, or the
        server, already has its share in flight. The event loop runs this, so no lock."""
        total = sum(self.in_flight.values())
        mine = self.in_flight.get(tenant, 0)
        if mine >= self.max_requests_per_tenant or total >= self.max_requests:
            raise rate_limited(mine >= self.max_requests_per_tenant, "requests in flight")
        self.in_flight[tenant] = mine + 1

    def release(self, tenant: str) -> None:
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
