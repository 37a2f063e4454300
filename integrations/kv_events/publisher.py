"""``ragkv serve``'s KV events on a ZMQ PUB socket, as vLLM's ``ZmqEventPublisher`` sends them.

One thread takes the engine's :class:`~ragkv.cache_engine.kv_events.KVEventBuffer` (the
stepping thread only appends to it), encodes each drain as one batch and publishes
``[topic, seq, payload]``, ``seq`` +1 per batch from 0. When the engine dropped events past
the buffer's bound, one number is skipped: subscribers see a gap that no replay fills, and
fall back. The last ``replay_batches`` messages are kept for the replay socket (a ROUTER:
``[b"", start_seq]`` in; ``[b"", topic, seq, payload]`` per kept batch from ``start_seq``,
then ``[b"", b"", -1, b""]`` out), served by a second thread.

The events carry prompts' token ids: bind the endpoints to loopback or a private network.

Salts as a client sees them (:class:`SaltViews`): ``ragkv serve`` salts every request with
its tenant's namespace (``auth.tenant_salt``), which no router can recompute. The server
notes, per request, which engine salt stands for which client ``cache_salt`` (or none), and
the publisher sends the client's view in a first block's ``extra_keys``, so a router keys the
blocks as it hashes its own prompts. With several tenants (``--api-keys``) their blocks look
alike in the events: a router may follow another tenant's identical prefix to a replica where
its own is a miss (a routing miss; the replica's cache stays split by tenant).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

from ragkv.cache_engine.block_hash import digest_salt
from ragkv.cache_engine.kv_events import (
    SALT_DIGEST_KEY,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventBuffer,
)
from ragkv.integrations._extras import require
from ragkv.integrations.kv_events.codec import encode_batch

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = ""  # vLLM's default
# Batches kept for replay (vLLM keeps 10,000 "buffer steps"); a batch is one drain.
DEFAULT_REPLAY_BATCHES = 10_000
# Events per published batch at most (a drain after a long pause is split).
MAX_BATCH_EVENTS = 4096
# A tenant's share of the salt views when a server has several tenants.
SALT_VIEWS_PER_TENANT = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class SaltViews:
    """Engine salt digest -> the client's salt digest (None: the client sent no salt), for
    the last ``max_entries`` salts seen (least recently seen forgotten first). With several
    tenants, ``max_per_tenant`` caps one tenant's share: a tenant sending ever new salts
    then forgets its own oldest views, not another tenant's (whose blocks would become a
    routing miss). None: no cap besides ``max_entries`` (one tenant)."""

    def __init__(self, max_entries: int = 100_000, max_per_tenant: int | None = None) -> None:
        if max_entries < 1 or (max_per_tenant is not None and max_per_tenant < 1):
            raise ValueError("max_entries and max_per_tenant must be >= 1")
        self.max_entries = max_entries
        self.max_per_tenant = max_entries if max_per_tenant is None else max_per_tenant
        self._views: OrderedDict[bytes, tuple[bytes | None, Hashable]] = OrderedDict()
        self._by_tenant: dict[Hashable, OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._views)

    def note(self, engine_salt: str, client_salt: str | None, tenant: Hashable = None) -> None:
        """A request's salt as the engine sees it, and as its ``tenant``'s client sent it."""
        key = digest_salt(engine_salt)
        view = None if client_salt is None else digest_salt(client_salt)
        with self._lock:
            self._forget(key)
            self._views[key] = (view, tenant)
            own = self._by_tenant.setdefault(tenant, OrderedDict())
            own[key] = None
            while len(own) > self.max_per_tenant:
                self._forget(next(iter(own)))
            while len(self._views) > self.max_entries:
                self._forget(next(iter(self._views)))

    def _forget(self, key: bytes) -> None:
        held = self._views.pop(key, None)
        if held is None:
            return
        own = self._by_tenant[held[1]]
        del own[key]
        if not own:
            del self._by_tenant[held[1]]

    def client_view(self, event: KVEvent) -> KVEvent:
        """``event`` with a first block's engine salt replaced by the client's (unknown
        salts stay as they are: a router cannot match them, which costs nothing)."""
        if not isinstance(event, BlockStored) or event.parent_block_hash is not None:
            return event
        extra = event.extra_keys
        if not extra:
            return event
        first = extra[0]
        if not (isinstance(first, list) and len(first) == 2 and first[0] == SALT_DIGEST_KEY):
            return event
        with self._lock:
            if first[1] not in self._views:
                return event
            view = self._views[first[1]][0]
        keys = [None if view is None else [SALT_DIGEST_KEY, view], *extra[1:]]
        return dataclasses.replace(event, extra_keys=keys)


class KVEventPublisher:
    """Publishes an engine's KV event buffer on ``endpoint`` (bound, e.g. ``tcp://*:5557``)
    with replay on ``replay_endpoint`` (None: no replay)."""

    def __init__(
        self,
        buffer: KVEventBuffer,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = DEFAULT_TOPIC,
        replay_batches: int = DEFAULT_REPLAY_BATCHES,
        salt_views: SaltViews | None = None,
    ) -> None:
        zmq = require("zmq", "pyzmq", "events")
        self.buffer = buffer
        self.salt_views = salt_views
        self.topic = topic.encode()
        self.published = 0  # batches
        self.skipped = 0  # seq numbers skipped for events the engine dropped
        self._zmq = zmq
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay_sock: Any = None
        if replay_endpoint is not None:
            self._replay_sock = self._context.socket(zmq.ROUTER)
            self._replay_sock.setsockopt(zmq.LINGER, 0)
            # A replay answers up to replay_batches messages in a row; past the default
            # high-water mark (1,000) a ROUTER drops the rest silently, end marker included.
            self._replay_sock.setsockopt(zmq.SNDHWM, replay_batches + 2)
            self._replay_sock.bind(replay_endpoint)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._kept_lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def endpoint(self) -> str:
        """The bound address (a ``tcp://...:*`` endpoint resolved to its port)."""
        return self._pub.getsockopt(self._zmq.LAST_ENDPOINT).decode()

    @property
    def replay_address(self) -> str | None:
        if self._replay_sock is None:
            return None
        return self._replay_sock.getsockopt(self._zmq.LAST_ENDPOINT).decode()

    def start(self) -> KVEventPublisher:
        """Start publishing (a thread) and answering replays (another)."""
        self._spawn(self._publish_loop)
        return self.serve_replay()

    def serve_replay(self) -> KVEventPublisher:
        """Answer replay requests on a thread (``start`` does; alone, batches are published
        only by calling :meth:`publish_pending`)."""
        if self._replay_sock is not None:
            self._spawn(self._replay_loop)
        return self

    def _spawn(self, target: Any) -> None:
        thread = threading.Thread(target=target, name="ragkv-kv-events", daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        """Publish what is buffered, stop both threads, close the sockets."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._pub.close()
        if self._replay_sock is not None:
            self._replay_sock.close()
        self._context.term()

    def _publish_loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                self.publish_pending(0 if stopping else 0.05)
            except Exception:  # never take the server down; subscribers will see a gap
                logger.exception("KV events: publishing failed")
                self._seq += 1
            if stopping:
                return

    def publish_pending(self, timeout_s: float = 0) -> None:
        """Publish what the buffer holds now as batches (the publisher thread's step)."""
        events, lost = self.buffer.take(timeout_s)
        if lost:
            self._seq += 1
            self.skipped += 1
        if self.salt_views is not None:
            events = [self.salt_views.client_view(e) for e in events]
        for start in range(0, len(events), MAX_BATCH_EVENTS):
            batch = KVEventBatch(time.time(), events[start : start + MAX_BATCH_EVENTS])
            payload = encode_batch(batch)
            seq = self._seq.to_bytes(8, "big", signed=True)
            self._pub.send_multipart((self.topic, seq, payload))
            with self._kept_lock:
                self._kept.append((self._seq, payload))
            self._seq += 1
            self.published += 1

    def _replay_loop(self) -> None:
        sock = self._replay_sock
        zmq = self._zmq
        while not self._stop.is_set():
            if not sock.poll(100, zmq.POLLIN):
                continue
            try:
                frames = sock.recv_multipart()
                self._answer_replay(frames)
            except Exception:
                logger.exception("KV events: a replay request failed")

    def _answer_replay(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or len(frames[-1]) != 8:
            logger.warning("KV events: ignoring a malformed replay request")
            return
        client = frames[0]
        start = int.from_bytes(frames[-1], "big", signed=True)
        with self._kept_lock:
            kept = [(seq, payload) for seq, payload in self._kept if seq >= start]
        for seq, payload in kept:
            self._replay_sock.send_multipart(
                (client, b"", self.topic, seq.to_bytes(8, "big", signed=True), payload)
            )
        self._replay_sock.send_multipart((client, b"", b"", END_SEQ, b""))


__all__ = [
    "DEFAULT_REPLAY_BATCHES",
    "DEFAULT_TOPIC",
    "SALT_VIEWS_PER_TENANT",
    "KVEventPublisher",
    "SaltViews",
]
