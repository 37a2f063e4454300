"""One replica as the router sees it: its engine, its prefix index and its counters
(:class:`ReplicaStats`, summed in :class:`RouterStats`), plus the index bound it starts with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ragkv.cache_engine.engine_like import EngineLike, KnowsPoolSize
from ragkv.errors import ConfigError
from ragkv.integrations.routing.prefix_index import PrefixIndex
from ragkv.integrations.routing.replica_events import ReplicaEvents

# A remote replica does not say how big its pool is: 32k blocks (512k tokens at block size
# 16) is a mid-size GPU's pool; pass index_blocks= to match yours. ~100 B per entry.
DEFAULT_INDEX_BLOCKS = 1 << 15


@dataclass(slots=True)
class ReplicaStats:
    """Counters of one replica since the router started.

    ``requests``: attempts sent to it; ``failures``: attempts that failed with a replica
    error; ``failovers``: requests moved on to another replica after it failed;
    ``predicted_cached_tokens`` / ``reported_cached_tokens``: what the index expected it to
    reuse and what its answers said (answers without ``cached_tokens`` count neither).
    """

    name: str
    healthy: bool = True
    requests: int = 0
    in_flight: int = 0
    in_flight_blocks: int = 0  # the prompt blocks of the requests in flight
    succeeded: int = 0
    failures: int = 0
    failovers: int = 0
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    index_blocks: int = 0
    index_capacity: int = 0
    corrections: int = 0
    # KV events (a replica that publishes them): "off", "synced" (the exact index steers
    # its routing) or "predicting" (events were lost: the index above does, until a clear).
    events: str = "off"
    event_blocks: int = 0  # blocks the exact index holds (any medium)
    event_batches: int = 0
    event_replayed: int = 0  # batches recovered by replay after a gap
    event_gaps: int = 0  # holes replay could not fill
    event_orphans: int = 0  # stored blocks whose parent the index did not know


@dataclass(slots=True)
class RouterStats:
    """``router.stats()``: the policy, per-replica counters and their request imbalance."""

    policy: str
    replicas: list[ReplicaStats] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(r.succeeded for r in self.replicas)

    @property
    def failovers(self) -> int:
        return sum(r.failovers for r in self.replicas)

    @property
    def imbalance(self) -> float:
        """Max ÷ mean answered requests per replica (1.0 is perfectly even)."""
        counts = [r.succeeded for r in self.replicas]
        mean = sum(counts) / len(counts) if counts else 0.0
        return max(counts) / mean if mean else 1.0


class Replica:
    """Router-side state of one replica (guarded by the router's lock)."""

    __slots__ = (
        "engine",
        "position",
        "index",
        "events",
        "stats",
        "down_until",
        "backoff_s",
        "probing",
    )

    def __init__(self, engine: EngineLike, position: int, name: str, capacity: int) -> None:
        self.engine = engine
        self.position = position
        self.index = PrefixIndex(capacity)
        self.events: ReplicaEvents | None = None  # its KV events, when it publishes them
        self.stats = ReplicaStats(name=name, index_capacity=capacity)
        self.down_until = 0.0  # monotonic time its backoff ends (healthy: unused)
        self.backoff_s = 0.0  # the current backoff; 0 while healthy
        self.probing = False

    def snapshot(self) -> ReplicaStats:
        """A copy of the counters, with the index's current size. Caller holds the lock."""
        self.stats.index_blocks = len(self.index)
        events = self.events
        if events is not None:
            s = self.stats
            s.events = "synced" if events.synced else "predicting"
            s.event_blocks = len(events.index)
            s.event_batches = events.batches
            s.event_replayed = events.replayed
            s.event_gaps = events.gaps
            s.event_orphans = events.index.orphans
        return ReplicaStats(**{k: getattr(self.stats, k) for k in self.stats.__slots__})


def build_replicas(
    engines: Sequence[EngineLike],
    names: Sequence[str] | None,
    index_blocks: int | Sequence[int] | None,
) -> list[Replica]:
    """One :class:`Replica` per engine, named by ``names``, else by URL or position."""
    capacities = _capacities(engines, index_blocks)
    return [
        Replica(engine, i, names[i] if names else _name(engine, i), capacities[i])
        for i, engine in enumerate(engines)
    ]


def _name(engine: Any, position: int) -> str:
    return getattr(engine, "base_url", None) or f"replica-{position}"


def _capacities(replicas: Sequence[Any], index_blocks: int | Sequence[int] | None) -> list[int]:
    if isinstance(index_blocks, int):
        return [index_blocks] * len(replicas)
    if index_blocks is not None:
        if len(index_blocks) != len(replicas):
            raise ConfigError("pass one index_blocks value per replica")
        return list(index_blocks)
    out = []
    for r in replicas:
        tokens = r.kv_cache_tokens if isinstance(r, KnowsPoolSize) else None
        out.append(tokens // r.block_size if isinstance(tokens, int) else DEFAULT_INDEX_BLOCKS)
    return out
