"""Following one replica's KV events: in order, gaps replayed, else a fallback.

A feed (:class:`EventFeed`) hands over ``(seq, batch)`` as the publisher numbered them (+1
per batch). :class:`ReplicaEvents` keeps the replica's :class:`~.event_index.EventIndex`
and whether it is *synced*: every batch since a known start applied in order. Only a synced
index steers the ranking; otherwise the router predicts for that replica as it does for one
without events (:class:`~.prefix_index.PrefixIndex`, corrected by ``cached_tokens``).

- the first batch is seq 0 (the publisher's start), or the batches before it come back from
  the feed's replay: synced;
- seq jumps ahead (lost messages, or the publisher dropped events past its bound and
  skipped a number): the missing batches are asked for by replay; all of them back, they
  are applied in order; any missing, the index is cleared and unsynced (a fallback, never
  a wrong belief);
- seq goes back: a message replay already brought is skipped; any other means the publisher
  restarted (its cache is new): cleared, and synced again if it restarted from 0;
- a follower starting asks the replay socket for everything from 0 at once, so it is synced
  before the replica publishes again.
- ``AllBlocksCleared`` (an engine starting, a reset) makes an index exact again: synced.

One thread per replica reads its feed; replays run on it without the router's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from ragkv.cache_engine.kv_events import AllBlocksCleared, KVEventBatch
from ragkv.integrations.routing.event_index import DEFAULT_EVENT_INDEX_BLOCKS, EventIndex

logger = logging.getLogger(__name__)

# Replayed batches remembered to skip their live copies (a replay answers at most the
# publisher's buffer: 10,000 batches by default).
MAX_REMEMBERED = 20_000

Message = tuple[int, KVEventBatch | None]  # (seq, batch); None: the payload did not decode


class EventFeed(Protocol):
    """Where one replica's event batches come from (a ZMQ subscriber, an in-process engine)."""

    def next(self, timeout_s: float) -> Message | None:
        """The next message, or None after ``timeout_s`` without one."""
        ...

    def replay(self, start_seq: int) -> list[Message] | None:
        """Buffered messages from ``start_seq`` on, or None when the feed cannot replay."""
        ...

    def close(self) -> None: ...


class ReplicaEvents:
    """One replica's event index, its sync state and counters, and the thread that feeds
    them. ``lock`` is the router's: the index is read and written under it."""

    def __init__(
        self,
        feed: EventFeed,
        block_size: int,
        lock: threading.Lock,
        *,
        name: str = "replica",
        capacity: int = DEFAULT_EVENT_INDEX_BLOCKS,
    ) -> None:
        self.feed = feed
        self.index = EventIndex(block_size, capacity)
        self.lock = lock
        self.name = name
        self.synced = False
        self.batches = 0  # applied
        self.applied = 0  # events applied
        self.replayed = 0  # batches recovered by replay
        self.gaps = 0  # holes replay could not fill (the index was cleared)
        self.undecodable = 0
        self._next_seq: int | None = None  # the follower thread's own
        self._replayed: dict[int, float] = {}  # seq -> ts of batches replay brought
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the follower thread --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._follow, name=f"ragkv-kv-events-{self.name}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.feed.close()

    def _follow(self) -> None:
        try:
            self.catch_up()
        except Exception:
            logger.exception("KV events of %s: the first replay failed", self.name)
        while not self._stop.is_set():
            try:
                message = self.feed.next(0.2)
                if message is not None:
                    self.receive(*message)
            except Exception:  # a broken feed costs the replica its exact index, no more
                logger.exception("KV events of %s: the feed failed", self.name)
                with self.lock:
                    self._lose()
                self._stop.wait(1.0)

    def catch_up(self) -> None:
        """Apply everything the feed's replay holds from seq 0 (a follower's start)."""
        messages = self.feed.replay(0)
        if not messages or messages[0][0] != 0:
            return
        seqs = [seq for seq, _ in messages]
        if seqs != list(range(len(seqs))):
            return
        self._remember(messages)
        self._next_seq = len(messages)
        with self.lock:
            self.synced = True
            for _, batch in messages:
                self._apply(batch)

    def receive(self, seq: int, batch: KVEventBatch | None) -> None:
        """Take one message: replay what is missing before it (without the lock), then apply
        in order (under it)."""
        expected = self._next_seq
        if expected is not None and seq < expected:
            seen = self._replayed.get(seq)
            if seen is not None and batch is not None and seen == batch.ts:
                return  # replay brought it already
        self._next_seq = seq + 1
        restart = expected is not None and seq < expected
        todo: list[KVEventBatch | None] = [batch]
        lost = False
        start = 0 if expected is None or restart else expected
        if seq > start:
            filled = self._replay(start, seq)
            lost = filled is None
            if filled is not None:
                todo = [*filled, batch]
        with self.lock:
            if restart:
                self.index.clear()
                self.synced = True
            if lost:
                self._lose()
            elif expected is None:
                self.synced = True  # every batch since the publisher's start is here
            for b in todo:
                self._apply(b)

    def _replay(self, start: int, stop: int) -> list[KVEventBatch | None] | None:
        """Batches ``start .. stop - 1`` from the feed's replay, or None if any is missing."""
        try:
            messages = self.feed.replay(start)
        except Exception:
            logger.exception("KV events of %s: replay from %d failed", self.name, start)
            return None
        if messages is None:
            return None
        by_seq = dict(messages)
        if any(s not in by_seq for s in range(start, stop)):
            return None
        self._remember(messages)
        self.replayed += stop - start
        return [by_seq[s] for s in range(start, stop)]

    def _remember(self, messages: list[Message]) -> None:
        """Note replayed batches, so their live copies arriving late are skipped."""
        if len(self._replayed) > MAX_REMEMBERED:
            self._replayed.clear()
        for seq, batch in messages:
            if batch is not None:
                self._replayed[seq] = batch.ts

    # -- under the lock -------------------------------------------------------------------
    def _apply(self, batch: KVEventBatch | None) -> None:
        if batch is None:  # undecodable: a hole as good as a lost message
            self.undecodable += 1
            self._lose()
            return
        self.batches += 1
        self.applied += len(batch.events)
        for event in batch.events:
            if not self.index.apply(event):
                logger.warning("KV events of %s outgrew the index; predicting", self.name)
                self._lose()
            elif isinstance(event, AllBlocksCleared):
                self.synced = True

    def _lose(self) -> None:
        if self.synced:
            logger.warning("KV events of %s lost; predicting until it clears", self.name)
        self.gaps += 1
        self.index.clear()
        self.synced = False


class EngineFeed:
    """The events of an in-process :class:`~ragkv.cache_engine.Engine` (its
    :meth:`~ragkv.cache_engine.Engine.kv_events` buffer), numbered as a publisher would:
    events the engine dropped past its bound leave a hole in ``seq`` that no replay fills."""

    def __init__(self, engine: Any) -> None:
        self._buffer = engine.kv_events()
        self._seq = -1

    def next(self, timeout_s: float) -> Message | None:
        events, lost = self._buffer.take(timeout_s)
        if lost:
            self._seq += 1
        if not events:
            return None
        self._seq += 1
        return self._seq, KVEventBatch(time.time(), events)

    def replay(self, start_seq: int) -> list[Message] | None:
        return None

    def close(self) -> None:
        pass


__all__ = ["EngineFeed", "EventFeed", "ReplicaEvents"]
