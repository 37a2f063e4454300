"""``ReplicaRouter``: one :class:`~ragkv.cache_engine.engine_like.EngineLike` over several
replicas of a model (``ragkv serve``, vLLM, SGLang behind
:class:`~ragkv.integrations.openai.RemoteEngine`, or in-process
:class:`~ragkv.cache_engine.Engine` objects), routed by cached prefix.

Per request: the prompt's token ids are block-hashed at the replicas' block size (salted, so
the index is per ``cache_salt``); the policy ranks the healthy replicas and the first one
gets the request (:mod:`.selection`). Failures move the request on (:mod:`.dispatch`) and
take failing replicas out for a backoff until a probe brings them back (:mod:`.health`);
:meth:`ReplicaRouter.check_health` probes without waiting for traffic.

With ``kv_events``, each replica that publishes KV events (vLLM's schema: ``ragkv serve
--kv-events-endpoint``, vLLM's ``--kv-events-config``, or an in-process engine's own) is
ranked by what its events say it holds (:mod:`.replica_events`, :mod:`.event_index`), and
by prediction again whenever its events are lost.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from typing import Any

from ragkv.cache_engine.engine_like import (
    Closes,
    ClosesAsync,
    EngineLike,
    ForwardingEngine,
    Prompt,
)
from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import ConfigError
from ragkv.integrations.routing.dispatch import Dispatcher
from ragkv.integrations.routing.event_index import DEFAULT_EVENT_INDEX_BLOCKS
from ragkv.integrations.routing.health import ReplicaHealth
from ragkv.integrations.routing.replica import (
    DEFAULT_INDEX_BLOCKS,
    ReplicaStats,
    RouterStats,
    build_replicas,
)
from ragkv.integrations.routing.replica_events import EngineFeed, EventFeed, ReplicaEvents
from ragkv.integrations.routing.selection import MAX_SESSIONS, Selector, session_scope
from ragkv.integrations.routing.settings import RouterSettings


class ReplicaRouter(ForwardingEngine):
    """An :class:`EngineLike` that routes each request to one of ``replicas``.

    ``replicas`` are EngineLike objects serving the same model with the same tokenizer and
    block size (one :class:`~ragkv.integrations.openai.RemoteEngine` per server, built by
    :meth:`from_urls`, or in-process engines). ``policy``: ``prefix`` (default),
    ``least-loaded`` or ``round-robin`` (see :mod:`.policies`). ``balance_threshold``: how
    many more requests in flight than the least loaded replica the prefix choice may have
    (twice as many for a prompt it nearly holds); ``match_threshold``: the share of the
    prompt's blocks by which a replica's match must exceed every replica's before it is
    followed (below it, the request is spread: by share of recent requests, then load); a
    match under half the prompt is not followed to a replica over 1.4x its share of recent
    requests either (``FOLLOW_SHARE_CAP``).
    ``max_load_ratio``: when set (>= 1), a request whose match is short (under half the
    prompt) is guarded relatively instead: the chosen replica may have at most that multiple
    of the mean requests in flight once it takes it (bounded loads; see :mod:`.policies`).
    ``index_blocks``: the per-replica index bound in blocks (one int or one per replica;
    default: an in-process engine's pool, else ``DEFAULT_INDEX_BLOCKS``). ``backoff_s`` /
    ``max_backoff_s``: how long a failed replica is skipped (doubling per consecutive
    failure). ``max_attempts``: replicas one request may try (default: all).
    ``kv_events``: one :class:`~.replica_events.EventFeed` (or None) per replica, or True
    for every in-process engine's own (:class:`~.replica_events.EngineFeed`); a replica
    with one is ranked by its events while they are in order (``event_index_blocks``
    bounds each exact index). :meth:`from_urls` builds ZMQ feeds.

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
        match_threshold: float = 0.125,
        max_load_ratio: float | None = None,
        index_blocks: int | Sequence[int] | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_attempts: int | None = None,
        health_timeout_s: float = 2.0,
        max_sessions: int = MAX_SESSIONS,
        kv_events: bool | Sequence[EventFeed | None] | None = None,
        event_index_blocks: int = DEFAULT_EVENT_INDEX_BLOCKS,
    ) -> None:
        if not replicas:
            raise ConfigError("ReplicaRouter needs at least one replica")
        sizes = {r.block_size for r in replicas}
        if len(sizes) != 1:
            raise ConfigError(f"replicas must share one block size, got {sorted(sizes)}")
        if names is not None and len(names) != len(replicas):
            raise ConfigError("pass one name per replica")
        self.settings = RouterSettings(
            policy,
            balance_threshold,
            match_threshold,
            max_sessions,
            max_load_ratio,
            max_attempts=len(replicas) if max_attempts is None else max_attempts,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            health_timeout_s=health_timeout_s,
        )
        self.tokenizer = replicas[0].tokenizer
        self.block_size = replicas[0].block_size
        self._replicas = build_replicas(replicas, names, index_blocks)
        lock = threading.Lock()
        self._lock = lock
        self._follow_events(kv_events, event_index_blocks)
        self._selector = Selector(self._replicas, lock, self.settings)
        self._health = ReplicaHealth(self._replicas, lock, self.settings)
        self._dispatch = Dispatcher(self._selector, self._health, self.settings.max_attempts)

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
        kv_events: Mapping[str, str | tuple[str, str | None]] | None = None,
        kv_events_topic: str = "",
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

        ``kv_events`` maps a URL to its server's KV event publisher: its PUB endpoint, or
        ``(endpoint, replay_endpoint)`` (``ragkv serve --kv-events-endpoint`` /
        ``--kv-events-replay-endpoint``, vLLM's ``--kv-events-config`` ``endpoint`` /
        ``replay_endpoint``, with ``*`` replaced by the server's host), all on
        ``kv_events_topic``. Needs ``pip install 'ragkv[events]'``.
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
        feeds: list[Any] | None = None  # ZmqFeed or None per replica
        if kv_events:
            from ragkv.integrations.kv_events.subscriber import ZmqFeed

            unknown = set(kv_events) - set(urls)
            if unknown:
                raise ConfigError(f"kv_events names URLs that are not replicas: {sorted(unknown)}")
            feeds = []
            for url in urls:
                spec = kv_events.get(url)
                if spec is None:
                    feeds.append(None)
                    continue
                endpoint, replay = (spec, None) if isinstance(spec, str) else spec
                feeds.append(ZmqFeed(endpoint, replay_endpoint=replay, topic=kv_events_topic))
        return cls(replicas, policy=routing, names=list(urls), kv_events=feeds, **router_options)

    # -- the Engine surface (EngineLike) ------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._replicas[0].engine.model_name

    @property
    def policy(self) -> str:
        return self.settings.policy

    @property
    def replicas(self) -> list[EngineLike]:
        return [r.engine for r in self._replicas]

    def session(self, session_id: str | None) -> contextlib.AbstractContextManager[None]:
        """Requests made inside this block (threads and tasks started in it included) belong
        to ``session_id``: a follow-up prefers its session's previous replica."""
        return session_scope(session_id)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Generator[StreamDelta, None, None]:
        """The chosen replica's deltas. A failure before the first delta moves the request
        to the next replica; after it, the failure is raised (nothing is sent twice)."""
        route = self._selector.route(prompt, cache_salt, session_id)  # in the caller's thread
        return self._dispatch.stream(route, prompt, params, cache_salt)

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Output:
        route = self._selector.route(prompt, cache_salt, session_id)
        return await self._dispatch.agenerate(route, prompt, params, cache_salt)

    def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        route = self._selector.route(prompt, cache_salt, session_id)
        return self._dispatch.astream(route, prompt, params, cache_salt)

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The longest prefix of ``token_ids`` the index believes a healthy replica holds
        (a prediction; ``knows_residency`` is False)."""
        return self._selector.cached_prefix_length(token_ids, cache_salt)

    def stats(self) -> RouterStats:
        """A snapshot of the per-replica counters."""
        with self._lock:
            replicas = [r.snapshot() for r in self._replicas]
        return RouterStats(self.policy, replicas)

    def check_health(self) -> list[bool]:
        """Probe every replica whose backoff has passed now (call it periodically to bring
        replicas back without waiting for traffic); returns each replica's healthy flag."""
        self._health.revive()
        with self._lock:
            return [r.stats.healthy for r in self._replicas]

    def close(self) -> None:
        self._stop_events()
        for r in self._replicas:
            if isinstance(r.engine, Closes):
                r.engine.close()

    async def aclose(self) -> None:
        self._stop_events()
        for r in self._replicas:
            if isinstance(r.engine, ClosesAsync):
                await r.engine.aclose()
            elif isinstance(r.engine, Closes):
                r.engine.close()

    def _follow_events(
        self, kv_events: bool | Sequence[EventFeed | None] | None, capacity: int
    ) -> None:
        """Start following each replica's feed (``True``: every in-process engine's own)."""
        if not kv_events:
            return
        if kv_events is True:
            feeds: list[EventFeed | None] = [
                EngineFeed(r.engine) if hasattr(r.engine, "kv_events") else None
                for r in self._replicas
            ]
        else:
            feeds = list(kv_events)
            if len(feeds) != len(self._replicas):
                raise ConfigError("pass one kv_events feed (or None) per replica")
        for replica, feed in zip(self._replicas, feeds, strict=True):
            if feed is None:
                continue
            replica.events = ReplicaEvents(
                feed,
                self.block_size,
                self._lock,
                name=replica.stats.name,
                capacity=capacity,
            )
            replica.events.start()

    def _stop_events(self) -> None:
        for r in self._replicas:
            if r.events is not None:
                r.events.close()

    def _generate_one(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        cache_salt: str | None,
        session_id: str | None = None,
    ) -> Output:
        """:meth:`generate` for one prompt, routed on its own (``session_id`` as in
        :meth:`stream`)."""
        route = self._selector.route(prompt, cache_salt, session_id)
        return self._dispatch.generate(route, prompt, params, cache_salt)


__all__ = ["DEFAULT_INDEX_BLOCKS", "ReplicaRouter", "ReplicaStats", "RouterStats"]
