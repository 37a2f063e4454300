"""Routing policies: rank the replicas for one request, best first.

Pure functions over small records (no I/O, no locks), so every rule is testable alone. The
router sends a request to the first replica of the ranking and, when that one fails, to the
next (failover keeps the policy's order).

- ``round-robin``: replicas in turn, whatever they hold.
- ``least-loaded``: fewest requests in flight; ties go round-robin.
- ``prefix`` (default): the replica believed to hold the longest prefix of the prompt (ties:
  least loaded, then round-robin), when that prefix is worth following: it must exceed what
  *every* candidate holds (a system prompt all replicas share says nothing) by at least
  ``match_threshold`` (1/8) of the prompt's blocks. A request below that is new to all of
  them and is *spread*: first to a replica with *room*, where the prompts in flight and this
  one fit the pool together (elsewhere its blocks would evict everything the pool holds
  unpinned, the prefixes of revisits routed there included), then away from a replica that
  took more than ``SHARE_CAP`` x the mean of the requests routed lately (so new prefixes
  start where traffic is light, and a replica that hot prefixes keep busy keeps its pool for
  them), then least loaded, then the replica that would hold least once it took the request
  (its index size less the blocks it already holds of the prompt: SGLang's "smallest tree",
  and among equally full replicas the longer match, which costs no balance), then
  round-robin. A *short* match (less than ``LONG_MATCH`` of the prompt beyond what every
  candidate holds: a system prompt or a document's head that one replica has and the others
  lack) is spread too when its replica took more than ``FOLLOW_SHARE_CAP`` x that mean:
  following it would herd every request that starts that way onto one replica, while
  computing it once elsewhere is cheap and leaves a second copy. A session's previous
  replica wins (share or not) when it holds a prefix that agrees (at least
  ``match_threshold`` of the prompt and half of the best match). When the chosen replica has
  more than ``balance_threshold`` requests in flight beyond the least loaded one, load wins:
  the ranking becomes the spread order. For a prompt the replica nearly holds
  (``NEARLY_HELD`` of it beyond what every candidate holds) that guard is twice as wide:
  computing it elsewhere would cost nearly the whole prefill and copy the prefix into a
  second pool, evicting what that pool held, where waiting costs only queueing. With
  ``max_load_ratio`` set, the guard is relative instead for a short match, as consistent
  hashing with bounded loads does (Mirrokni et al. 2018): the chosen replica may hold at
  most ``ceil(max_load_ratio x`` the mean in flight, this request counted) requests once it
  takes this one; a long match (a topic's passages) keeps the absolute guard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.errors import ConfigError

POLICIES = ("prefix", "least-loaded", "round-robin")
# A match of at least this share of the prompt's blocks (beyond what every candidate holds)
# is long: ``max_load_ratio`` does not apply to it.
LONG_MATCH = 0.5
# A match of at least this share of the prompt's blocks (beyond what every candidate holds)
# is nearly the whole prompt: the balance guard allows twice ``balance_threshold`` for it.
NEARLY_HELD = 0.75
# A spread request (one no replica holds enough of) avoids a replica whose share of recent
# requests (``Candidate.recent``) exceeds this many times the candidates' mean.
SHARE_CAP = 1.2
# A short match is not followed to a replica whose share of recent requests exceeds this
# many times the candidates' mean (under the 1.5 imbalance the benchmarks hold to).
FOLLOW_SHARE_CAP = 1.4


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica as a policy sees it: its position, requests in flight, matched blocks (a
    medium-weighted count when the replica's KV events say where they are), the size of
    its index (blocks), how many requests it was sent lately (``recent``, a decayed count;
    only its ratio to the other candidates' matters) and whether the prompt fits its pool
    beside the prompts in flight there (``room``)."""

    position: int
    load: int
    matched: float = 0
    size: int = 0
    recent: float = 0.0
    room: bool = True


def check_max_load_ratio(ratio: float | None) -> float | None:
    """``ratio`` when it is None (off) or a finite number >= 1 (a replica may always take
    its mean share; infinity would be no bound, and the guard could not compute it)."""
    if ratio is not None and not (math.isfinite(ratio) and ratio >= 1):
        raise ConfigError(f"max_load_ratio must be a finite number >= 1 (or None), got {ratio}")
    return ratio


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ConfigError(f"unknown routing policy {policy!r}; use one of {', '.join(POLICIES)}")
    return policy


def rank(
    policy: str,
    candidates: Sequence[Candidate],
    *,
    turn: int,
    num_replicas: int,
    balance_threshold: int = 4,
    match_threshold: float = 0.125,
    total_blocks: int = 0,
    session_position: int | None = None,
    max_load_ratio: float | None = None,
) -> list[int]:
    """Positions of ``candidates`` in the order the request should try them.

    ``turn`` is a counter the router advances per request (the round-robin rotation and the
    tie-break of the other policies); ``total_blocks`` the prompt's full blocks;
    ``session_position`` the replica that answered the session's previous request, if any.
    """
    if not candidates:
        return []

    def rotation(c: Candidate) -> int:
        return (c.position - turn) % num_replicas

    if policy == "round-robin":
        return [c.position for c in sorted(candidates, key=rotation)]
    by_load = sorted(candidates, key=lambda c: (c.load, rotation(c)))
    if policy == "least-loaded":
        return [c.position for c in by_load]
    if policy != "prefix":
        check_policy(policy)
    mean_recent = sum(c.recent for c in candidates) / len(candidates)
    share_cap = SHARE_CAP * mean_recent
    spread = [
        c.position
        for c in sorted(
            candidates,
            key=lambda c: (
                not c.room,
                c.recent > share_cap,
                c.load,
                c.size - c.matched,
                rotation(c),
            ),
        )
    ]
    by_prefix = sorted(candidates, key=lambda c: (-c.matched, c.load, rotation(c)))
    best = by_prefix[0]
    needed = max(match_threshold * total_blocks, 1)
    floor = min(c.matched for c in candidates)

    def short(c: Candidate) -> bool:  # under LONG_MATCH of the prompt beyond the floor
        return c.matched - floor < LONG_MATCH * total_blocks

    session = next((c for c in candidates if c.position == session_position), None)
    if session is not None and session.matched >= needed and 2 * session.matched >= best.matched:
        best = session
    elif best.matched - floor < needed or (
        short(best) and best.recent > FOLLOW_SHARE_CAP * mean_recent
    ):
        return spread
    if max_load_ratio is not None and short(best):
        in_flight = sum(c.load for c in candidates) + 1
        if best.load + 1 > math.ceil(max_load_ratio * in_flight / len(candidates)):
            return spread
    else:
        nearly_held = best.matched - floor >= NEARLY_HELD * total_blocks > 0
        if best.load - by_load[0].load > balance_threshold * (2 if nearly_held else 1):
            return spread
    return [best.position] + [c.position for c in by_prefix if c is not best]


__all__ = [
    "FOLLOW_SHARE_CAP",
    "LONG_MATCH",
    "NEARLY_HELD",
    "POLICIES",
    "SHARE_CAP",
    "Candidate",
    "check_max_load_ratio",
    "check_policy",
    "rank",
]
