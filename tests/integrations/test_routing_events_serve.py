"""ReplicaRouter on KV events end to end: ``ragkv serve`` replicas on loopback (in-thread
uvicorn, tiny model) each publishing its events over ZMQ, followed through ``from_urls``."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("fastapi")

from support import serve_in_thread  # noqa: E402

from ragkv.cache_engine import SamplingParams  # noqa: E402
from ragkv.integrations.routing import ReplicaRouter  # noqa: E402

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)


def doc(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(64)]


@pytest.fixture
def publishing_replicas(serve_model_dir, api_key):
    from ragkv.cache_engine import Engine

    engines, threads, publishers, urls = [], [], [], []
    for _ in range(3):
        engine = Engine.from_pretrained(
            serve_model_dir, device="cpu", kv_cache_tokens=512, max_model_len=512
        )
        url, thread, publisher = serve_in_thread(engine, api_key)
        urls.append(url)
        engines.append(engine)
        threads.append(thread)
        publishers.append(publisher)
    yield engines, publishers, urls
    for t in threads:
        t.stop()
    for p in publishers:
        p.close()
    for e in engines:
        e.close()


def settle(router, engines, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for replica, engine in zip(router._replicas, engines, strict=True):
        while replica.events.applied < engine.kv_events().accepted:
            assert time.monotonic() < deadline, "events not applied in time"
            time.sleep(0.01)


def test_served_replicas_events_make_predictions_exact(
    publishing_replicas, serve_model_dir, api_key
):
    engines, publishers, urls = publishing_replicas
    feeds = {u: (p.endpoint, p.replay_address) for u, p in zip(urls, publishers, strict=True)}
    rng = random.Random(0)
    with ReplicaRouter.from_urls(
        urls, tokenizer=serve_model_dir, api_key=api_key, kv_events=feeds
    ) as router:
        for i in range(40):
            salt = "tenant-x" if i % 5 == 4 else None
            prompt = doc(rng.randrange(8)) + [400 + i, 501, 502]
            router.generate(prompt, PARAMS, cache_salt=salt)
            settle(router, engines)
        salted = doc(99) + [7, 8, 9]
        router.generate(salted, PARAMS, cache_salt="tenant-y")
        settle(router, engines)
        assert router.cached_prefix_length(salted, cache_salt="tenant-y") == 64
        assert router.cached_prefix_length(salted) == 0
        assert router.cached_prefix_length(salted, cache_salt="tenant-x") == 0
        stats = router.stats().replicas
    assert all(s.events == "synced" and s.event_gaps == 0 for s in stats), stats
    reported = sum(s.reported_cached_tokens for s in stats)
    assert reported > 0
    for s in stats:  # one request at a time, events applied: predictions are exact
        assert s.predicted_cached_tokens == s.reported_cached_tokens
