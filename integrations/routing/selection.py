"""Which replica gets a request: the prompt's block hashes, the policy's ranking of the
healthy replicas (:mod:`.policies`) by prefix match, load and session, and what an answer
teaches the index.

The chosen replica's :class:`~.prefix_index.PrefixIndex` records the prompt's blocks at once
(tentative, so a burst on one prefix follows the first request), and again when the answer
comes back (confirmed); an answer whose ``usage.cached_tokens`` is below the prediction
corrects the index.

A replica whose KV events are synced (:mod:`.replica_events`) is ranked by its exact
:class:`~.event_index.EventIndex` instead, scored by medium (a host or disk block is worth
less than a pool block); the prompt's blocks it does not hold yet are *expected* there until
an event stores them (the burst rule, by events), and settle shortly after the answer. Its
prediction index is kept up all the same: it is the fallback if events are lost.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.engine_like import Prompt
from ragkv.cache_engine.outputs import Output
from ragkv.errors import InvalidInputError
from ragkv.integrations.routing.policies import Candidate, rank
from ragkv.integrations.routing.replica import Replica
from ragkv.integrations.routing.settings import RouterSettings

MAX_SESSIONS = 10_000
# How long blocks sent to a replica count as held before its events store them: a request
# may wait in the replica's queue before its prefill is scheduled (and its blocks stored);
# once it answered, its events are at most a publish interval behind.
EXPECT_S = 30.0
SETTLE_S = 1.0
# A replica's share of recent requests (the spread rule of :func:`.policies.rank`) is a
# count that decays by 1/RECENT_REQUESTS per routed request: about the last 128 requests.
RECENT_REQUESTS = 128

_session: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ragkv_router_session", default=None
)


@contextlib.contextmanager
def session_scope(session_id: str | None) -> Iterator[None]:
    """Requests made inside this block (threads and tasks started in it included) belong
    to ``session_id``."""
    token = _session.set(session_id)
    try:
        yield
    finally:
        _session.reset(token)


@dataclass(slots=True)
class Route:
    """One request's routing facts: its block hashes and what has been tried."""

    hashes: list[bytes]
    max_blocks: int  # blocks a replica can reuse: a prompt's last token is always computed
    session: tuple[bytes, str] | None
    tried: set[int] = field(default_factory=set)
    predicted: int = 0  # blocks the current attempt's replica was expected to reuse
    last_error: BaseException | None = None
    resent: int = 0  # re-sends after a failure that may be the request's own


class Selector:
    """Ranks ``replicas`` for a :class:`Route` by ``policy`` and keeps their indexes and
    the session → replica map. Shares the router's ``lock``."""

    def __init__(
        self, replicas: list[Replica], lock: threading.Lock, settings: RouterSettings
    ) -> None:
        self.replicas = replicas
        self.lock = lock
        self.settings = settings
        # The replicas share one tokenizer and block size (the router checked).
        self.tokenizer = replicas[0].engine.tokenizer
        self.block_size = replicas[0].engine.block_size
        self.sessions: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        self._turn = 0
        self._recent = [0.0] * len(replicas)  # by position: requests sent lately, decayed

    def route(self, prompt: Prompt, cache_salt: str | None, session_id: str | None) -> Route:
        """The prompt's salted block hashes and session key (a 400 for an empty prompt)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty", param="prompt")
            ids = list(self.tokenizer.encode(prompt))  # for routing only: the server tokenizes
        else:
            ids = list(prompt)
            if not ids:
                raise InvalidInputError("prompt is empty", param="prompt")
        salt = cache_salt if cache_salt is not None else _default_salt(self.replicas[0].engine)
        salt_digest = digest_salt(salt) if salt is not None else None
        hashes = BlockHasher(self.block_size, salt_digest=salt_digest).extend(ids)
        session_id = session_id if session_id is not None else _session.get()
        session = None
        if session_id is not None:  # kept as a digest: a client's id is any length
            digest = hashlib.blake2b(
                str(session_id).encode("utf-8", "surrogatepass"), digest_size=16
            )
            session = (salt_digest or b"", digest.hexdigest())
        return Route(hashes, max(len(ids) - 1, 0) // self.block_size, session)

    def choose(self, route: Route) -> Replica | None:
        """The best healthy replica not yet tried, its in-flight count and tentative index
        updated; None when no replica is left."""
        now = time.monotonic()
        with self.lock:
            candidates = []
            held: dict[int, int] = {}  # by position: leading blocks held (the prediction)
            for r in self.replicas:
                if r.position in route.tried or not r.stats.healthy:
                    continue
                held[r.position], score, size = _match(r, route.hashes, now)
                room = r.stats.in_flight_blocks + len(route.hashes) <= r.index.capacity
                candidates.append(
                    Candidate(
                        r.position, r.stats.in_flight, score, size, self._recent[r.position], room
                    )
                )
            session = self.sessions.get(route.session) if route.session else None
            settings = self.settings
            order = rank(
                settings.policy,
                candidates,
                turn=self._turn,
                num_replicas=len(self.replicas),
                balance_threshold=settings.balance_threshold,
                match_threshold=settings.match_threshold,
                total_blocks=len(route.hashes),
                session_position=session,
                max_load_ratio=settings.max_load_ratio,
            )
            if not order:
                return None
            self._turn += 1
            replica = self.replicas[order[0]]
            keep = 1 - 1 / RECENT_REQUESTS
            self._recent = [n * keep for n in self._recent]
            self._recent[replica.position] += 1
            route.tried.add(replica.position)
            route.predicted = min(held[replica.position], route.max_blocks)
            replica.stats.requests += 1
            replica.stats.in_flight += 1
            replica.stats.in_flight_blocks += len(route.hashes)
            replica.index.insert(route.hashes, confirmed=False)
            if replica.events is not None:
                replica.events.index.expect(route.hashes, now + EXPECT_S, now)
            return replica

    def leave(self, replica: Replica, route: Route) -> None:
        """The attempt on ``replica`` is over (answered, failed or dropped): it is no longer
        in flight there. Caller holds the lock."""
        replica.stats.in_flight -= 1
        replica.stats.in_flight_blocks -= len(route.hashes)

    def learn(self, replica: Replica, route: Route, output: Output) -> None:
        """Confirm (or correct) ``replica``'s index from its answer and remember the
        session's replica. Caller holds the lock."""
        bs = self.block_size
        s = replica.stats
        predicted = route.predicted
        cached = output.usage.cached_tokens if output.usage is not None else None
        if cached is not None:
            s.predicted_cached_tokens += predicted * bs
            s.reported_cached_tokens += cached
            if cached // bs < predicted:
                s.corrections += 1
                replica.index.correct(route.hashes, cached // bs, predicted)
        replica.index.insert(route.hashes, confirmed=True)
        if replica.events is not None:
            replica.events.index.settle(route.hashes, time.monotonic() + SETTLE_S)
        if route.session is not None:
            self.sessions[route.session] = replica.position
            self.sessions.move_to_end(route.session)
            while len(self.sessions) > self.settings.max_sessions:
                self.sessions.popitem(last=False)

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """The longest prefix of ``token_ids`` the index believes a healthy replica holds."""
        route = self.route(token_ids, cache_salt, None)
        now = time.monotonic()
        with self.lock:
            best = max(
                (_match(r, route.hashes, now)[0] for r in self.replicas if r.stats.healthy),
                default=0,
            )
        return min(best, route.max_blocks) * self.block_size


def _match(replica: Replica, hashes: list[bytes], now: float) -> tuple[int, float, int]:
    """``(blocks, score, index size)`` of ``replica`` for a prompt's ``hashes``: from its
    exact event index while synced, else from its prediction index. Caller holds the lock."""
    events = replica.events
    if events is not None and events.synced:
        blocks, score = events.index.match(hashes, now)
        return blocks, score, len(events.index)
    blocks = replica.index.match(hashes)
    return blocks, float(blocks), len(replica.index)


def _default_salt(engine: Any) -> str | None:
    return getattr(engine, "cache_salt", None)
