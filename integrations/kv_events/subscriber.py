"""One replica's KV events from its ZMQ publisher (``ragkv serve`` or vLLM), with replay.

:class:`ZmqFeed` is an :class:`~ragkv.integrations.routing.replica_events.EventFeed`: a SUB
socket connected to the publisher's ``endpoint`` (filtered by ``topic``) and, when given,
a DEALER socket on its ``replay_endpoint``. Used by one thread (the router's follower).
"""

from __future__ import annotations

import logging
from typing import Any

from ragkv.cache_engine.kv_events import KVEventBatch
from ragkv.errors import InvalidInputError
from ragkv.integrations._extras import require
from ragkv.integrations.kv_events.codec import decode_batch

logger = logging.getLogger(__name__)

# How long a replay may take before the follower gives up on it (and falls back).
REPLAY_TIMEOUT_S = 2.0


class ZmqFeed:
    """KV event batches from one publisher: ``(seq, batch)``; ``batch`` None when the
    payload did not decode (the router treats it as a hole)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> None:
        self._zmq = zmq = require("zmq", "pyzmq", "events")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(endpoint)
        self._replay: Any = None

    def next(self, timeout_s: float) -> tuple[int, KVEventBatch | None] | None:
        if not self._sub.poll(int(timeout_s * 1000), self._zmq.POLLIN):
            return None
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            logger.warning("KV events from %s: a message of %d frames", self.endpoint, len(frames))
            return None
        return int.from_bytes(frames[1], "big", signed=True), _decode(frames[2], self.endpoint)

    def replay(self, start_seq: int) -> list[tuple[int, KVEventBatch | None]] | None:
        """Batches from ``start_seq`` on, as the publisher kept them; None without a replay
        endpoint, or when the answer did not end in time."""
        if self.replay_endpoint is None:
            return None
        zmq = self._zmq
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.replay_endpoint)
        sock = self._replay
        sock.send_multipart((b"", start_seq.to_bytes(8, "big", signed=True)))
        out: list[tuple[int, KVEventBatch | None]] = []
        while True:
            if not sock.poll(int(self.replay_timeout_s * 1000), zmq.POLLIN):
                # An answer cut short would interleave with the next one: start afresh.
                sock.close()
                self._replay = None
                return None
            frames = sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, _decode(frames[3], self.replay_endpoint)))

    def close(self) -> None:
        self._sub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()


def _decode(payload: bytes, origin: str) -> KVEventBatch | None:
    try:
        return decode_batch(payload)
    except InvalidInputError as exc:
        logger.warning("KV events from %s: %s", origin, exc)
        return None


__all__ = ["ZmqFeed"]
