"""``ReplicaRouter``: one :class:`~ragkv.cache_engine.engine_like.EngineLike` over several
replicas of a model (``ragkv serve``, vLLM, SGLang behind
:class:`~ragkv.integrations.openai.RemoteEngine`, or in-process
:class:`~ragkv.cache_engine.Engine` objects), routed by cached prefix.

Per request: the prompt's token ids are block-hashed at the replicas' block size (salted, so
the index is per ``cache_salt``); the policy (:mod:`.policies`) ranks the healthy replicas;
the first one gets the request. Its :class:`~.prefix_index.PrefixIndex` records the prompt's
blocks at once (tentative, so a burst on one prefix follows the first request), and again
when the answer comes back (confirmed); an answer whose ``usage.cached_tokens`` is below
the prediction corrects the index.

Failover: a replica failure (no connection at all, a 502 or 503, an in-process engine that
is closed or unhealthy) marks the replica unhealthy for a backoff (doubling per consecutive
failure, capped), forgets its index (it may come back empty), and the request goes to the
next replica of the ranking, at most ``max_attempts`` replicas in all; the last healthy
replica is never marked down. A failure that may be the request's own (a timeout, a 500
or 504, a broken or malformed answer) marks nothing and is re-sent at most once, so one
slow request cannot take every replica out. A 429 moves the request on without marking
the replica. Any other error (a 4xx: the request's own fault) is raised at once. A stream moves on only while nothing has reached the caller; after its
first delta a failure raises :class:`~ragkv.errors.RemoteEngineError` and the request is
never sent again. A replica whose backoff has passed is probed (``GET /health``, else
``/v1/models``; ``Engine.health()`` in process) when a request next needs a replica, or
when :meth:`ReplicaRouter.check_health` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.engine_like import ChecksHealth, EngineLike, Prompt, ReportsHealth
from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import (
    ConfigError,
    EngineClosedError,
    EngineUnhealthyError,
    InvalidInputError,
    RemoteEngineError,
)
from ragkv.integrations.routing.policies import Candidate, check_policy, rank
from ragkv.integrations.routing.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

# A remote replica does not say how big its pool is: 32k blocks (512k tokens at block size
# 16) is a mid-size GPU's pool; pass index_blocks= to match yours. ~100 B per entry.
DEFAULT_INDEX_BLOCKS = 1 << 15
MAX_SESSIONS = 10_000

_session: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ragkv_router_session", default=None
)


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
    succeeded: int = 0
    failures: int = 0
    failovers: int = 0
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    index_blocks: int = 0
    index_capacity: int = 0
    corrections: int = 0


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


class _Replica:
    """Router-side state of one replica (guarded by the router's lock)."""

    __slots__ = ("engine", "position", "index", "stats", "down_until", "backoff_s", "probing")

    def __init__(self, engine: EngineLike, position: int, name: str, capacity: int) -> None:
        self.engine = engine
        self.position = position
        self.index = PrefixIndex(capacity)
        self.stats = ReplicaStats(name=name, index_capacity=capacity)
        self.down_until = 0.0  # monotonic time its backoff ends (healthy: unused)
        self.backoff_s = 0.0  # the current backoff; 0 while healthy
        self.probing = False


@dataclass(slots=True)
class _Route:
    """One request's routing facts: its block hashes and what has been tried."""

    hashes: list[bytes]
    max_blocks: int  # blocks a replica can reuse: a prompt's last token is always computed
    session: tuple[bytes, str] | None
    tried: set[int] = field(default_factory=set)
    predicted: int = 0  # blocks the current attempt's replica was expected to reuse
    last_error: BaseException | None = None
    resent: int = 0  # re-sends after a failure that may be the request's own


class ReplicaRouter:
    """An :class:`EngineLike` that routes each request to one of ``replicas``.

    ``replicas`` are EngineLike objects serving the same model with the same tokenizer and
    block size (one :class:`~ragkv.integrations.openai.RemoteEngine` per server, built by
    :meth:`from_urls`, or in-process engines). ``policy``: ``prefix`` (default),
    ``least-loaded`` or ``round-robin`` (see :mod:`.policies`). ``balance_threshold``: how
    many more requests in flight than the least loaded replica the prefix choice may have;
    ``match_threshold``: the share of the prompt's blocks by which a replica's match must
    exceed every replica's before it is followed (below it, the request is spread by load).
    ``index_blocks``: the per-replica index bound in blocks (one int or one per replica;
    default: an in-process engine's pool, else ``DEFAULT_INDEX_BLOCKS``). ``backoff_s`` /
    ``max_backoff_s``: how long a failed replica is skipped (doubling per consecutive
    failure). ``max_attempts``: replicas one request may try (default: all).

    ``knows_residency`` is False: :meth:`cached_prefix_length` answers from the router's
    index (a prediction, not an observation of any replica's cache).
    """

    knows_residency = False

    def __init__(
        self,
        replicas: Sequence[EngineLike],
        *,
        policy: str = "prefix",
        names: Sequence[str] | None = None,
        balance_threshold: int = 4,
        match_threshold: float = 0.25,
        index_blocks: int | Sequence[int] | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_attempts: int | None = None,
        health_timeout_s: float = 2.0,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if not replicas:
            raise ConfigError("ReplicaRouter needs at least one replica")
        sizes = {r.block_size for r in replicas}
        if len(sizes) != 1:
            raise ConfigError(f"replicas must share one block size, got {sorted(sizes)}")
        if not 0 <= match_threshold <= 1:
            raise ConfigError(f"match_threshold must be in [0, 1], got {match_threshold}")
        if balance_threshold < 0 or backoff_s < 0 or max_backoff_s < backoff_s:
            raise ConfigError("need balance_threshold >= 0 and 0 <= backoff_s <= max_backoff_s")
        if max_attempts is not None and max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
        if names is not None and len(names) != len(replicas):
            raise ConfigError("pass one name per replica")
        self.policy = check_policy(policy)
        self.tokenizer = replicas[0].tokenizer
        self.block_size = replicas[0].block_size
        self.balance_threshold = balance_threshold
        self.match_threshold = match_threshold
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_attempts = max_attempts or len(replicas)
        self.health_timeout_s = health_timeout_s
        self.max_sessions = max_sessions
        capacities = _capacities(replicas, index_blocks)
        self._replicas = [
            _Replica(engine, i, (names or [])[i] if names else _name(engine, i), capacities[i])
            for i, engine in enumerate(replicas)
        ]
        self._lock = threading.Lock()
        self._turn = 0
        self._sessions: OrderedDict[tuple[bytes, str], int] = OrderedDict()

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        *,
        tokenizer: Any,
        routing: str = "prefix",
        model: str | None = None,
        api_key: str | None = None,
        block_size: int | None = None,
        cache_salt: str | None = None,
        timeout_s: float = 120.0,
        send_token_ids: bool = True,
        **router_options: Any,
    ) -> ReplicaRouter:
        """A router over servers: one :class:`~ragkv.integrations.openai.RemoteEngine` per
        URL (each ``.../v1``), sharing one tokenizer, routed by ``routing`` (``prefix``,
        ``least-loaded``, ``round-robin``).

        ``tokenizer`` is the servers' model's, loaded once by
        :func:`~ragkv.integrations.openai.load_tokenizer`; ``model``, ``api_key``,
        ``block_size``, ``cache_salt``, ``timeout_s`` and ``send_token_ids`` are each
        RemoteEngine's. The replicas do not retry (``max_retries=0``): the router retries
        across replicas. ``router_options`` go to :class:`ReplicaRouter`
        (``balance_threshold``, ``index_blocks``, ``backoff_s``, ...).
        """
        from ragkv.cache_engine.config import DEFAULTS
        from ragkv.integrations.openai.client import RemoteEngine
        from ragkv.integrations.openai.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        replicas = [
            RemoteEngine(
                url,
                tokenizer=tok,
                model=model,
                api_key=api_key,
                block_size=block_size or DEFAULTS.block_size,
                cache_salt=cache_salt,
                timeout_s=timeout_s,
                max_retries=0,
                send_token_ids=send_token_ids,
            )
            for url in urls
        ]
        return cls(replicas, policy=routing, names=list(urls), **router_options)

    # -- the Engine surface (EngineLike) ------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._replicas[0].engine.model_name

    @property
    def replicas(self) -> list[EngineLike]:
        return [r.engine for r in self._replicas]

    @contextlib.contextmanager
    def session(self, session_id: str | None) -> Iterator[None]:
        """Requests made inside this block (threads and tasks started in it included) belong
        to ``session_id``: a follow-up prefers its session's previous replica."""
        token = _session.set(session_id)
        try:
            yield
        finally:
            _session.reset(token)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Output | list[Output]:
        """One prompt → an :class:`Output`; a list → a list, each prompt routed on its own."""
        if _is_single(prompts):
            return self._generate_one(prompts, params, cache_salt, session_id)
        return [self._generate_one(p, params, cache_salt, session_id) for p in prompts]

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Iterator[StreamDelta]:
        """The chosen replica's deltas. A failure before the first delta moves the request
        to the next replica; after it, the failure is raised (nothing is sent twice)."""
        route = self._route(prompt, cache_salt, session_id)  # validated in the caller's thread
        return self._stream(route, prompt, params, cache_salt)

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Output:
        route = self._route(prompt, cache_salt, session_id)
        while True:
            replica = await self._apick(route)
            try:
                output = await replica.engine.agenerate(prompt, params, cache_salt=cache_salt)
            except BaseException as exc:
                self._failed(replica, route, exc)
                continue
            self._answered(replica, route, output)
            return output

    def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        route = self._route(prompt, cache_salt, session_id)
        return self._astream(route, prompt, params, cache_salt)

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The longest prefix of ``token_ids`` the index believes a healthy replica holds
        (a prediction; ``knows_residency`` is False)."""
        route = self._route(token_ids, cache_salt, None)
        with self._lock:
            best = max(
                (r.index.match(route.hashes) for r in self._replicas if r.stats.healthy),
                default=0,
            )
        return min(best, route.max_blocks) * self.block_size

    def stats(self) -> RouterStats:
        """A snapshot of the per-replica counters."""
        with self._lock:
            replicas = []
            for r in self._replicas:
                s = r.stats
                s.index_blocks = len(r.index)
                replicas.append(ReplicaStats(**{k: getattr(s, k) for k in s.__slots__}))
        return RouterStats(self.policy, replicas)

    def check_health(self) -> list[bool]:
        """Probe every replica whose backoff has passed now (call it periodically to bring
        replicas back without waiting for traffic); returns each replica's healthy flag."""
        self._revive()
        with self._lock:
            return [r.stats.healthy for r in self._replicas]

    def close(self) -> None:
        for r in self._replicas:
            closer = getattr(r.engine, "close", None)
            if closer is not None:
                closer()

    async def aclose(self) -> None:
        for r in self._replicas:
            closer = getattr(r.engine, "aclose", None)
            if closer is not None:
                await closer()
            elif getattr(r.engine, "close", None) is not None:
                r.engine.close()

    def __enter__(self) -> ReplicaRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ReplicaRouter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- routing ------------------------------------------------------------------------------
    def _route(self, prompt: Prompt, cache_salt: str | None, session_id: str | None) -> _Route:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty", param="prompt")
            ids = list(self.tokenizer.encode(prompt))  # for routing only: the server tokenizes
        else:
            ids = list(prompt)
            if not ids:
                raise InvalidInputError("prompt is empty", param="prompt")
        salt = cache_salt if cache_salt is not None else _default_salt(self._replicas[0].engine)
        salt_digest = digest_salt(salt) if salt is not None else None
        hashes = BlockHasher(self.block_size, salt_digest=salt_digest).extend(ids)
        session_id = session_id if session_id is not None else _session.get()
        session = None
        if session_id is not None:  # kept as a digest: a client's id is any length
            digest = hashlib.blake2b(
                str(session_id).encode("utf-8", "surrogatepass"), digest_size=16
            )
            session = (salt_digest or b"", digest.hexdigest())
        return _Route(hashes, max(len(ids) - 1, 0) // self.block_size, session)

    def _pick(self, route: _Route) -> _Replica:
        """The best healthy replica not yet tried; its in-flight count and tentative index
        updated. Replicas past their backoff are probed first (:meth:`_revive`)."""
        if self._due():
            self._revive()
        return self._choose(route)

    async def _apick(self, route: _Route) -> _Replica:
        if self._due():
            await asyncio.to_thread(self._revive)
        return self._choose(route)

    def _choose(self, route: _Route) -> _Replica:
        if len(route.tried) >= self.max_attempts:
            raise _exhausted(route, self.max_attempts)
        with self._lock:
            candidates = [
                Candidate(r.position, r.stats.in_flight, r.index.match(route.hashes), len(r.index))
                for r in self._replicas
                if r.position not in route.tried and r.stats.healthy
            ]
            session = self._sessions.get(route.session) if route.session else None
            order = rank(
                self.policy,
                candidates,
                turn=self._turn,
                num_replicas=len(self._replicas),
                balance_threshold=self.balance_threshold,
                match_threshold=self.match_threshold,
                total_blocks=len(route.hashes),
                session_position=session,
            )
            if not order:
                raise _exhausted(route, self.max_attempts)
            self._turn += 1
            replica = self._replicas[order[0]]
            route.tried.add(replica.position)
            route.predicted = min(replica.index.match(route.hashes), route.max_blocks)
            replica.stats.requests += 1
            replica.stats.in_flight += 1
            replica.index.insert(route.hashes, confirmed=False)
            return replica

    def _answered(self, replica: _Replica, route: _Route, output: Output) -> None:
        bs = self.block_size
        with self._lock:
            s = replica.stats
            s.in_flight -= 1
            s.succeeded += 1
            # No _mark_healthy here: an answer to a request sent before the replica failed
            # proves nothing about it now; only a probe after the backoff brings it back.
            predicted = route.predicted
            cached = output.usage.cached_tokens if output.usage is not None else None
            if cached is not None:
                s.predicted_cached_tokens += predicted * bs
                s.reported_cached_tokens += cached
                if cached // bs < predicted:
                    s.corrections += 1
                    replica.index.correct(route.hashes, cached // bs, predicted)
            replica.index.insert(route.hashes, confirmed=True)
            if route.session is not None:
                self._sessions[route.session] = replica.position
                self._sessions.move_to_end(route.session)
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)

    def _failed(self, replica: _Replica, route: _Route, exc: BaseException) -> None:
        """Account a failed attempt; return to try the next replica, else raise ``exc``."""
        with self._lock:
            replica.stats.in_flight -= 1
            kind = _failure_kind(exc)
            if kind == "replica":
                replica.stats.failures += 1
                self._mark_down(replica)
            if kind == "uncertain":
                if route.resent >= 1:
                    raise exc  # twice: the request's own doing, not the replicas'
                route.resent += 1
            if kind is None:
                raise exc
            now = time.monotonic()
            moving_on = len(route.tried) < self.max_attempts and any(
                r.position not in route.tried and (r.stats.healthy or r.down_until <= now)
                for r in self._replicas
            )
            if moving_on:
                replica.stats.failovers += 1
        logger.warning("replica %s failed (%s): %s", replica.stats.name, kind, exc)
        route.last_error = exc
        if not moving_on:
            raise _exhausted(route, len(route.tried)) from exc

    def _mark_down(self, replica: _Replica) -> None:
        """Skip ``replica`` for a backoff (doubling per consecutive failure) and forget its
        index: a replica that comes back may have restarted empty. Holds the lock."""
        if not any(r.stats.healthy for r in self._replicas if r is not replica):
            logger.warning("replica %s failed but is the last healthy one", replica.stats.name)
            return  # never take the last healthy replica out
        replica.backoff_s = min(self.max_backoff_s, max(self.backoff_s, 2 * replica.backoff_s))
        replica.down_until = time.monotonic() + replica.backoff_s
        replica.stats.healthy = False
        replica.index.clear()

    def _due(self) -> bool:
        """Whether some unhealthy replica's backoff has passed (a cheap check, no lock)."""
        now = time.monotonic()
        return any(not r.stats.healthy and r.down_until <= now for r in self._replicas)

    def _revive(self) -> None:
        """Probe replicas whose backoff has passed; a passing probe marks them healthy, a
        failing one doubles the backoff."""
        now = time.monotonic()
        with self._lock:
            due = [
                r
                for r in self._replicas
                if not r.stats.healthy and r.down_until <= now and not r.probing
            ]
            for r in due:
                r.probing = True
        for r in due:
            ok = _probe(r.engine, self.health_timeout_s)
            with self._lock:
                r.probing = False
                if ok:
                    _mark_healthy(r)
                else:
                    self._mark_down(r)

    # -- requests ---------------------------------------------------------------------------
    def _generate_one(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        cache_salt: str | None,
        session_id: str | None,
    ) -> Output:
        route = self._route(prompt, cache_salt, session_id)
        while True:
            replica = self._pick(route)
            try:
                output = replica.engine.generate(prompt, params, cache_salt=cache_salt)
            except BaseException as exc:
                self._failed(replica, route, exc)
                continue
            self._answered(replica, route, output)
            return output

    def _stream(
        self, route: _Route, prompt: Prompt, params: SamplingParams | None, salt: str | None
    ) -> Iterator[StreamDelta]:
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
                self._release(replica)
                raise
            except BaseException as exc:
                if not started:
                    self._failed(replica, route, exc)
                    continue
                self._failed_midstream(replica, exc)
            finally:
                _close(deltas)
            self._finish_stream(replica, route, output)
            return

    async def _astream(
        self, route: _Route, prompt: Prompt, params: SamplingParams | None, salt: str | None
    ) -> AsyncIterator[StreamDelta]:
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
                self._release(replica)
                raise
            except BaseException as exc:
                if not started:
                    self._failed(replica, route, exc)
                    continue
                self._failed_midstream(replica, exc)
            finally:
                closer = getattr(deltas, "aclose", None)
                if closer is not None:
                    await closer()
            self._finish_stream(replica, route, output)
            return

    def _finish_stream(self, replica: _Replica, route: _Route, output: Output | None) -> None:
        if output is None:  # a stream without a final output: count it, learn nothing
            self._release(replica, succeeded=True)
            return
        self._answered(replica, route, output)

    def _failed_midstream(self, replica: _Replica, exc: BaseException) -> None:
        """A failure after deltas reached the caller: raised, never re-sent."""
        with self._lock:
            replica.stats.in_flight -= 1
            if _failure_kind(exc) == "replica":
                replica.stats.failures += 1
                self._mark_down(replica)
        if isinstance(exc, RemoteEngineError | InvalidInputError):
            raise exc
        raise RemoteEngineError(
            f"replica {replica.stats.name} failed after streaming began; not re-sent: {exc}",
            status_code=getattr(exc, "status_code", None),
        ) from exc

    def _release(self, replica: _Replica, succeeded: bool = False) -> None:
        with self._lock:
            replica.stats.in_flight -= 1
            replica.stats.succeeded += int(succeeded)


def _mark_healthy(replica: _Replica) -> None:
    replica.stats.healthy = True
    replica.backoff_s = 0.0
    replica.down_until = 0.0


def _failure_kind(exc: BaseException) -> str | None:
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


def _exhausted(route: _Route, attempts: int) -> RemoteEngineError:
    last = route.last_error
    status = getattr(last, "status_code", None) if last is not None else 503
    return RemoteEngineError(
        f"no replica could answer ({attempts} tried); last error: {last}", status_code=status
    )


def _probe(engine: Any, timeout_s: float) -> bool:
    if isinstance(engine, ChecksHealth):
        return bool(engine.check_health(timeout_s=timeout_s))
    if isinstance(engine, ReportsHealth):
        try:
            return bool(engine.health().ok)
        except Exception:  # noqa: BLE001 - any failure of a probe means "not back yet"
            return False
    return True


def _close(deltas: Any) -> None:
    closer = getattr(deltas, "close", None)
    if closer is not None:
        closer()


def _default_salt(engine: Any) -> str | None:
    return getattr(engine, "cache_salt", None)


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
        tokens = getattr(r, "kv_cache_tokens", None)
        out.append(tokens // r.block_size if isinstance(tokens, int) else DEFAULT_INDEX_BLOCKS)
    return out


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, Sequence) and (
        not prompts or not isinstance(prompts[0], str | Sequence)
    )


__all__ = ["DEFAULT_INDEX_BLOCKS", "ReplicaRouter", "ReplicaStats", "RouterStats"]
