"""What the routes of one app share."""

from __future__ import annotations

import dataclasses
from typing import Any

from ragkv.cache_engine import Engine
from ragkv.cache_engine.engine_like import EngineLike
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS
from ragkv.integrations.openai.protocol import RequestLimits
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
