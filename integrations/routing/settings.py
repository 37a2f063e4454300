"""``RouterSettings``: the router's knobs, checked once and read where they are used (the
selector, the breaker, the dispatcher), so no part keeps a copy of its own."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import ConfigError
from ragkv.integrations.routing.policies import check_max_load_ratio, check_policy


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What :class:`~.router.ReplicaRouter` was built with (its docstring says what each
    knob means); ``max_attempts`` is resolved (the router's None: every replica)."""

    # Choosing a replica (:mod:`.selection`):
    policy: str
    balance_threshold: int
    match_threshold: float
    max_sessions: int
    max_load_ratio: float | None
    # Failing over and probing back (:mod:`.dispatch`, :mod:`.health`):
    max_attempts: int
    backoff_s: float
    max_backoff_s: float
    health_timeout_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.match_threshold <= 1:
            raise ConfigError(f"match_threshold must be in [0, 1], got {self.match_threshold}")
        if self.balance_threshold < 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ConfigError("need balance_threshold >= 0 and 0 <= backoff_s <= max_backoff_s")
        check_max_load_ratio(self.max_load_ratio)
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        check_policy(self.policy)
