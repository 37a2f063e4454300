"""One access-log line per request: route, status, tenant, tokens and time.

``ragkv.serve.access`` logs at INFO (``GET /health`` and ``/metrics`` at DEBUG, so probes do
not drown the log); ``ragkv serve`` prints it. A generation records its usage in the request
state (``ragkv_usage``) when it ends, a stream after its last event, so the line has the
prompt, cached and generated token counts of what was actually served::

    POST /v1/chat/completions 200 tenant=default prompt=262 cached=208 generated=41 2.314s
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ragkv.serve.access")

_QUIET = frozenset({"/health", "/metrics"})


def log_request(scope: Any, status: int, seconds: float) -> None:
    """Log one finished request (called by the gate, which sees every request, refused or
    answered, and its status)."""
    level = logging.DEBUG if scope.get("path", "") in _QUIET else logging.INFO
    if logger.isEnabledFor(level):
        logger.log(level, "%s", line(scope, status, seconds))


def line(scope: Any, status: int, seconds: float) -> str:
    """The access-log line of one finished request."""
    state = scope.get("state") or {}
    parts = [scope.get("method", "-"), scope.get("path", "-"), str(status)]
    parts.append(f"tenant={state.get('ragkv_tenant', '-')}")
    usage = state.get("ragkv_usage")
    if usage is not None:
        cached = "?" if usage.cached_tokens is None else usage.cached_tokens
        parts.append(
            f"prompt={usage.prompt_tokens} cached={cached} generated={usage.completion_tokens}"
        )
    parts.append(f"{seconds:.3f}s")
    return " ".join(parts)
