"""KV events over ZMQ on loopback: ragkv's publisher, its replay socket, the router's feed."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from ragkv.cache_engine.block_hash import BlockHasher  # noqa: E402
from ragkv.cache_engine.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockStored,
    KVEventBuffer,
)
from ragkv.integrations.kv_events.publisher import KVEventPublisher  # noqa: E402
from ragkv.integrations.kv_events.subscriber import ZmqFeed  # noqa: E402
from ragkv.integrations.routing.replica_events import ReplicaEvents  # noqa: E402

BS = 4


def _stored(i: int) -> BlockStored:
    return BlockStored([i], None, list(range(i, i + BS)), BS, extra_keys=[None])


def _held(events: ReplicaEvents, i: int) -> bool:
    return events.index.match(BlockHasher(BS).extend(list(range(i, i + BS))))[0] == 1


@pytest.fixture
def publisher():
    buffer = KVEventBuffer(max_events=64)
    pub = KVEventPublisher(
        buffer, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv@test"
    )
    yield pub.serve_replay()
    pub.close()


def _next(feed: ZmqFeed, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = feed.next(0.05)
        if message is not None:
            return message
    raise AssertionError("no KV event message arrived")


def test_a_late_subscriber_is_brought_up_to_date_by_replay(publisher):
    publisher.buffer.put(AllBlocksCleared())
    publisher.buffer.put(_stored(1))
    publisher.publish_pending()  # seq 0, before anyone listens
    feed = ZmqFeed(publisher.endpoint, replay_endpoint=publisher.replay_address, topic="kv@test")
    try:
        events = ReplicaEvents(feed, BS, threading.Lock())
        deadline = time.monotonic() + 5
        seq = None
        while seq is None:  # the SUB socket joins some time after connect: publish until it has
            assert time.monotonic() < deadline
            publisher.buffer.put(_stored(10 + publisher.published))
            publisher.publish_pending()
            message = feed.next(0.05)
            if message is not None:
                seq, batch = message
        events.receive(seq, batch)
        assert events.synced and events.replayed == seq
        assert _held(events, 1) and all(_held(events, 10 + s) for s in range(1, seq + 1))
        assert feed.replay(10**6) == []  # nothing kept from there: just the end marker
    finally:
        feed.close()


def test_events_the_engine_dropped_leave_a_hole_no_replay_fills(publisher):
    feed = ZmqFeed(publisher.endpoint, replay_endpoint=publisher.replay_address, topic="kv@test")
    try:
        events = ReplicaEvents(feed, BS, threading.Lock())
        publisher.buffer.put(AllBlocksCleared())
        publisher.publish_pending()
        first, batch = _next_published(publisher, feed)
        events.receive(first, batch)
        assert events.synced
        for i in range(100):  # past the buffer's 64: dropped and counted
            publisher.buffer.put(_stored(i))
        publisher.publish_pending()
        assert publisher.skipped == 1 and publisher.buffer.dropped == 36
        seq, batch = _next(feed)
        assert seq == first + 2  # one number skipped for the dropped events
        events.receive(seq, batch)
        assert not events.synced and events.gaps == 1
    finally:
        feed.close()


def _next_published(publisher, feed):
    """The first message the feed gets (re-publishing a clear until the SUB has joined)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = feed.next(0.05)
        if message is not None:
            return message
        publisher.buffer.put(AllBlocksCleared())
        publisher.publish_pending()
    raise AssertionError("the subscriber never joined")


def test_publisher_thread_publishes_what_the_engine_buffers(publisher):
    feed = ZmqFeed(publisher.endpoint, topic="kv@test")
    try:
        publisher._spawn(publisher._publish_loop)
        deadline = time.monotonic() + 5
        while True:
            publisher.buffer.put(_stored(3))
            message = feed.next(0.1)
            if message is not None:
                break
            assert time.monotonic() < deadline
        seq, batch = message
        assert batch is not None and batch.events[0] == _stored(3)
    finally:
        feed.close()


def test_a_tenant_flooding_salt_views_forgets_its_own_not_anothers():
    from ragkv.cache_engine.block_hash import digest_salt
    from ragkv.cache_engine.kv_events import SALT_DIGEST_KEY
    from ragkv.integrations.kv_events.publisher import SaltViews

    views = SaltViews(max_entries=8, max_per_tenant=3)

    def seen_as(engine_salt: str) -> object:
        extra = [[SALT_DIGEST_KEY, digest_salt(engine_salt)]]
        event = BlockStored([1], None, list(range(BS)), BS, extra_keys=extra)
        return views.client_view(event).extra_keys[0]

    views.note("bob/engine", "bob-salt", tenant="bob")
    for i in range(20):  # alice sends ever new salts
        views.note(f"alice/engine/{i}", f"alice-{i}", tenant="alice")
    assert len(views) == 1 + 3
    assert seen_as("bob/engine") == [SALT_DIGEST_KEY, digest_salt("bob-salt")]
    assert seen_as("alice/engine/19") == [SALT_DIGEST_KEY, digest_salt("alice-19")]
    # alice's oldest are forgotten: the event keeps the engine's salt (a routing miss)
    assert seen_as("alice/engine/0") == [SALT_DIGEST_KEY, digest_salt("alice/engine/0")]
    views.note("bob/engine", None, tenant="bob")  # the same engine salt, seen again
    assert len(views) == 4 and seen_as("bob/engine") is None


def test_one_tenants_salt_views_have_the_whole_bound():
    from ragkv.integrations.kv_events.publisher import SaltViews

    views = SaltViews(max_entries=8)  # as `ragkv serve` builds it without several tenants
    for i in range(20):
        views.note(f"engine/{i}", f"client-{i}", tenant="anonymous")
    assert len(views) == 8
