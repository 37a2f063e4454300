"""Cache-aware routing over replicas of one model: :class:`ReplicaRouter`, an
:class:`~ragkv.cache_engine.engine_like.EngineLike` that sends each request to the replica
believed to hold its longest prefix (``prefix``), or by ``least-loaded`` / ``round-robin``.

An engine combinator: the replicas are any EngineLike objects, in-process
:class:`~ragkv.cache_engine.Engine` s or OpenAI-compatible servers behind
:class:`~ragkv.integrations.openai.RemoteEngine`; :meth:`ReplicaRouter.from_urls` builds the
latter from a list of URLs.

- :mod:`.router`: the router, a facade over the modules below (and its stats);
- :mod:`.replica`: one replica's router-side state and counters;
- :mod:`.settings`: the router's knobs, checked once, read by the parts below;
- :mod:`.selection`: a request's block hashes and session, the choice, what an answer teaches;
- :mod:`.dispatch`: sending a request until a replica answers (failover, re-send, streams);
- :mod:`.health`: which failures take a replica out, its backoff and its probe back;
- :mod:`.policies`: the ranking rules, pure functions;
- :mod:`.prefix_index`: the bounded, self-correcting per-replica index of block hashes.
"""

from __future__ import annotations

from ragkv.integrations.routing.policies import POLICIES
from ragkv.integrations.routing.router import ReplicaRouter, ReplicaStats, RouterStats

__all__ = ["POLICIES", "ReplicaRouter", "ReplicaStats", "RouterStats"]
