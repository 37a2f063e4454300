"""ReplicaRouter policies, index, failover and streaming, over scripted in-memory replicas.

A ``ScriptedReplica`` is an EngineLike with a real (tiny) LRU prefix cache of block hashes,
so ``usage.cached_tokens`` is what a replica with that pool would report; failures are
switched on per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict

import pytest

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.outputs import Output, StreamDelta, Timings, Usage
from ragkv.errors import ConfigError, EngineClosedError, InvalidInputError, RemoteEngineError
from ragkv.integrations.routing import ReplicaRouter
from ragkv.integrations.routing.policies import Candidate, rank
from ragkv.integrations.routing.prefix_index import PrefixIndex

BS = 4


class ScriptedReplica:
    """An EngineLike whose prefix cache is an LRU set of ``pool_blocks`` block hashes."""

    tokenizer = None
    block_size = BS
    knows_residency = False
    model_name = "scripted"

    def __init__(self, name: str, pool_blocks: int = 1000) -> None:
        self.name = name
        self.pool_blocks = pool_blocks
        self.held: OrderedDict[bytes, None] = OrderedDict()
        self.calls = 0
        self.fail: BaseException | None = None
        self.fail_after_deltas: int | None = None  # streams: raise after this many deltas
        self.healthy_probe = True

    def _run(self, prompt, cache_salt) -> Output:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        salt = digest_salt(cache_salt) if cache_salt is not None else None
        hashes = BlockHasher(BS, salt_digest=salt).extend(list(prompt))
        cap = (len(prompt) - 1) // BS
        hit = 0
        while hit < min(len(hashes), cap) and hashes[hit] in self.held:
            hit += 1
        for h in hashes:
            self.held[h] = None
            self.held.move_to_end(h)
        while len(self.held) > self.pool_blocks:
            self.held.popitem(last=False)
        usage = Usage(len(prompt), 2, hit * BS)
        return Output(self.name, list(prompt), [1, 2], "ok", "stop", usage, Timings(0, 0, 0))

    def generate(self, prompt, params=None, *, cache_salt=None):
        return self._run(prompt, cache_salt)

    async def agenerate(self, prompt, params=None, *, cache_salt=None):
        return self._run(prompt, cache_salt)

    def stream(self, prompt, params=None, *, cache_salt=None):
        if self.fail is not None and self.fail_after_deltas is None:
            self.calls += 1
            raise self.fail
        output = self._run(prompt, cache_salt)
        for i in range(3):
            if self.fail_after_deltas is not None and i == self.fail_after_deltas:
                raise RemoteEngineError(f"{self.name} broke mid-stream")
            yield StreamDelta(self.name, "x", [i])
        yield StreamDelta(self.name, "", [], "stop", output)

    async def astream(self, prompt, params=None, *, cache_salt=None):
        for delta in self.stream(prompt, params, cache_salt=cache_salt):
            yield delta

    def check_health(self, timeout_s: float = 2.0) -> bool:
        return self.healthy_probe


def doc(seed: int, blocks: int = 6) -> list[int]:
    return [1000 * seed + i for i in range(blocks * BS)]


def ask(router, document, question: int, **kwargs) -> Output:
    return router.generate(document + [question, question + 1, question + 2], **kwargs)


def served_by(output: Output) -> str:
    return output.request_id


# -- policies (pure) ---------------------------------------------------------------------


def test_prefix_policy_prefers_longest_match_then_falls_back_to_load():
    cands = [Candidate(0, load=0, matched=0), Candidate(1, load=3, matched=5)]
    assert rank("prefix", cands, turn=0, num_replicas=2, balance_threshold=4)[0] == 1
    assert rank("prefix", cands, turn=0, num_replicas=2, balance_threshold=2)[0] == 0


def test_round_robin_and_least_loaded_rotate_ties():
    cands = [Candidate(i, load=0) for i in range(3)]
    assert [rank("round-robin", cands, turn=t, num_replicas=3)[0] for t in range(4)] == [
        0,
        1,
        2,
        0,
    ]
    loaded = [Candidate(0, 2), Candidate(1, 0), Candidate(2, 1)]
    assert rank("least-loaded", loaded, turn=0, num_replicas=3) == [1, 2, 0]


# -- prefix affinity, balance, sessions ----------------------------------------------------


def test_shared_prefix_requests_land_on_one_replica_and_reuse_it():
    replicas = [ScriptedReplica(f"r{i}") for i in range(3)]
    router = ReplicaRouter(replicas)
    first = {d: served_by(ask(router, doc(d), 1)) for d in range(3)}
    assert len(set(first.values())) == 3  # cold documents spread (least loaded, rotated)
    for q in range(2, 8):
        for d in range(3):
            out = ask(router, doc(d), q)
            assert served_by(out) == first[d]
            assert out.usage.cached_tokens == 6 * BS
    s = router.stats()
    assert [r.succeeded for r in s.replicas] == [7, 7, 7]
    assert s.replicas[0].predicted_cached_tokens == s.replicas[0].reported_cached_tokens > 0


def test_round_robin_spreads_a_document_over_every_replica():
    replicas = [ScriptedReplica(f"r{i}") for i in range(3)]
    router = ReplicaRouter(replicas, policy="round-robin")
    assert {served_by(ask(router, doc(0), q)) for q in range(3)} == {"r0", "r1", "r2"}


def test_balance_threshold_overrides_affinity():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, balance_threshold=1)
    home = served_by(ask(router, doc(0), 1))
    other = ({"r0", "r1"} - {home}).pop()
    # Requests "in flight" on the document's home replica (simulated): one more than the
    # other replica is within the threshold, two is past it.
    router._replicas[int(home[1])].stats.in_flight = 1
    assert served_by(ask(router, doc(0), 2)) == home
    # The prompt is nearly all held there (6 of 6 blocks): the guard is twice as wide.
    router._replicas[int(home[1])].stats.in_flight = 2
    assert served_by(ask(router, doc(0), 3)) == home
    router._replicas[int(home[1])].stats.in_flight = 3
    assert served_by(ask(router, doc(0), 4)) == other


def test_a_nearly_held_prompt_tolerates_twice_the_balance_threshold():
    kw = dict(turn=0, num_replicas=3, total_blocks=50, balance_threshold=4)
    idle = [Candidate(1, 0, 2), Candidate(2, 0, 2)]
    # 40 of 50 blocks beyond what every replica holds (2): nearly held, worth 8 in flight.
    assert rank("prefix", [Candidate(0, 6, 42), *idle], **kw)[0] == 0
    assert rank("prefix", [Candidate(0, 8, 42), *idle], **kw)[0] == 0
    assert rank("prefix", [Candidate(0, 9, 42), *idle], **kw)[0] != 0
    # 35 of 50 beyond it is a long match but not nearly the prompt: the plain guard.
    assert rank("prefix", [Candidate(0, 4, 37), *idle], **kw)[0] == 0
    assert rank("prefix", [Candidate(0, 6, 37), *idle], **kw)[0] != 0


def test_a_spread_request_avoids_a_replica_over_its_share_of_recent_requests():
    # A short match (4 of 40 blocks) would pick replica 0 (the most room once it took the
    # request); but replica 0 took 1.5x the mean of recent requests (over SHARE_CAP), so the
    # request starts its prefix on a replica that hot prefixes do not keep busy.
    kw = dict(turn=0, num_replicas=3, total_blocks=40)
    busy = [Candidate(0, 0, 4, size=100, recent=15.0), Candidate(1, 0, 0, size=100, recent=8.0),
            Candidate(2, 0, 0, size=100, recent=7.0)]  # fmt: skip
    assert rank("prefix", busy, **kw)[0] == 1
    # Within its share, the match decides again.
    even = [Candidate(0, 0, 4, size=100, recent=10.0), *busy[1:]]
    assert rank("prefix", even, **kw)[0] == 0
    # Among replicas within their share, load still comes before the match.
    loaded = [Candidate(0, 1, 4, size=100, recent=10.0), *busy[1:]]
    assert rank("prefix", loaded, **kw)[0] == 1
    # A match worth following (30 of 40 blocks) ignores the share.
    assert rank("prefix", [Candidate(0, 0, 30, recent=30.0), *busy[1:]], **kw)[0] == 0


def test_a_spread_request_goes_where_it_fits_beside_the_requests_in_flight():
    # Replica 1 is the least loaded and within its share, but the prompts in flight there
    # and this one would not fit its pool together: writing it would evict everything the
    # pool holds unpinned (a revisit routed there included). Replica 2, over its share,
    # has room, and the request goes there; room decides before the share and the load.
    kw = dict(turn=0, num_replicas=3, total_blocks=40)
    crowded = [Candidate(0, 3, 0, recent=8.0, room=False), Candidate(1, 1, 0, recent=8.0, room=False),
               Candidate(2, 2, 0, recent=15.0)]  # fmt: skip
    assert rank("prefix", crowded, **kw)[0] == 2
    # With room everywhere, or nowhere, the order is as before: share, then load.
    assert rank("prefix", [dataclasses.replace(c, room=True) for c in crowded], **kw)[0] == 1
    assert rank("prefix", [dataclasses.replace(c, room=False) for c in crowded], **kw)[0] == 1
    # A match worth following is followed whatever the room (the pool protects a queued
    # request's prefix; a follow writes few blocks).
    follow = [Candidate(0, 0, 30, room=False), *crowded[1:]]
    assert rank("prefix", follow, **kw)[0] == 0


def test_the_blocks_in_flight_on_a_replica_are_counted_until_each_attempt_ends():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin", index_blocks=10)
    seen = []
    real_run = replicas[0]._run

    def run_and_look(prompt, cache_salt):
        seen.append([r.in_flight_blocks for r in router.stats().replicas])
        return real_run(prompt, cache_salt)

    replicas[0]._run = run_and_look
    ask(router, doc(0), 1)  # 27 tokens: 6 full blocks on r0 while it runs
    assert seen == [[6, 0]]
    replicas[1].fail = RemoteEngineError("refused", unreachable=True)
    assert served_by(ask(router, doc(1), 1)) == "r0"  # r1 failed: r0 answered
    assert seen[1] == [6, 0]  # r1's blocks were released before the request moved on
    stream = router.stream(doc(2) + [1])
    next(stream)
    stream.close()  # a stream dropped early
    assert [r.in_flight_blocks for r in router.stats().replicas] == [0, 0]


def test_a_short_match_is_not_followed_to_a_replica_over_its_share_of_recent_requests():
    # Replica 0 alone holds 12 blocks of a 40-block prompt (a system prompt the others never
    # got: past the 1/8 threshold, under half the prompt). It is followed while replica 0
    # took at most 1.4x the mean of recent requests; past that the request is spread, and
    # seeds a second copy instead of herding every such request onto replica 0.
    kw = dict(turn=0, num_replicas=3, total_blocks=40)
    others = [Candidate(1, 0, 0, recent=8.0), Candidate(2, 0, 0, recent=8.0)]
    assert rank("prefix", [Candidate(0, 0, 12, recent=12.0), *others], **kw)[0] == 0
    assert rank("prefix", [Candidate(0, 0, 12, recent=16.0), *others], **kw)[0] != 0
    # A long match (half the prompt) is worth the share; a session keeps its replica.
    assert rank("prefix", [Candidate(0, 0, 20, recent=16.0), *others], **kw)[0] == 0
    hot = [Candidate(0, 0, 12, recent=16.0), *others]
    assert rank("prefix", hot, session_position=0, **kw)[0] == 0


def test_new_documents_start_where_recent_traffic_is_light():
    replicas = [ScriptedReplica(f"r{i}") for i in range(3)]
    router = ReplicaRouter(replicas)
    big = {served_by(router.generate(doc(d, blocks=20) + [1])) for d in (1, 2)}
    home = served_by(ask(router, doc(0), 1))
    assert home not in big and len(big) == 2
    for q in range(2, 8):  # a hot document: every request follows it home
        assert served_by(ask(router, doc(0), q)) == home
    # A new document that starts with the hot one's first block (1 of 7: a short match) is
    # spread. Home holds 6 blocks, the others 20: by room alone it would go home, which
    # took 7 of the 9 requests so far; it goes where traffic was light.
    fresh = doc(0, blocks=1) + doc(9, blocks=6) + [1, 2, 3]
    assert served_by(router.generate(fresh)) in big


def test_bounded_loads_keep_a_short_match_from_herding_onto_one_replica():
    # Replica 0 alone holds a 16-block system prompt (the others never got it), with two
    # requests in flight: the absolute guard (4) follows the match and piles on; bounded
    # loads at 1.5x the mean (3 in flight with this one: a cap of 2) send it where it
    # seeds a second copy.
    cands = [Candidate(0, 2, 16, size=500), Candidate(1, 0, 0, size=30), Candidate(2, 0, 0)]
    kw = dict(turn=0, num_replicas=3, total_blocks=50)
    assert rank("prefix", cands, balance_threshold=4, **kw)[0] == 0
    assert rank("prefix", cands, max_load_ratio=1.5, **kw)[0] == 2
    # Within the cap a short match is followed, whatever the absolute gap.
    busy = [Candidate(0, 3, 16), Candidate(1, 2, 0), Candidate(2, 1, 0)]
    assert rank("prefix", busy, balance_threshold=0, max_load_ratio=1.5, **kw)[0] == 0
    assert rank("prefix", busy, balance_threshold=0, **kw)[0] == 2


def test_a_long_match_keeps_the_absolute_guard_under_bounded_loads():
    # Half the prompt or more beyond what all hold: worth the load, up to balance_threshold.
    kw = dict(turn=0, num_replicas=3, total_blocks=50, max_load_ratio=1.5)
    held = [Candidate(0, 2, 25), Candidate(1, 0, 0), Candidate(2, 0, 0)]
    assert rank("prefix", held, balance_threshold=4, **kw)[0] == 0
    assert rank("prefix", held, balance_threshold=1, **kw)[0] != 0
    # 24 of 50 blocks is short: bounded loads spread it.
    assert rank("prefix", [Candidate(0, 2, 24), *held[1:]], balance_threshold=4, **kw)[0] != 0


def test_max_load_ratio_is_checked_and_reaches_the_policy():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    for bad in (0.5, float("nan"), float("inf")):  # inf would overflow the guard's ceil()
        with pytest.raises(ConfigError, match="max_load_ratio"):
            ReplicaRouter(replicas, max_load_ratio=bad)
    router = ReplicaRouter(replicas, max_load_ratio=1.0, balance_threshold=100)

    def short(question: int) -> list[int]:  # 2 document blocks of 7: a short match
        return doc(0, blocks=2) + [10_000 * question + i for i in range(5 * BS)]

    home = served_by(router.generate(short(1)))
    other = ({"r0", "r1"} - {home}).pop()
    # An unrelated document evens the replicas' shares of recent requests (else the home
    # replica, with all of them, would be over FOLLOW_SHARE_CAP for a short match).
    assert served_by(router.generate(doc(5, blocks=7))) == other
    assert served_by(router.generate(short(2))) == home
    # One request in flight on the home replica: with this one, 2 in flight over 2 replicas
    # caps each at 1, so the home replica (which would have 2) is passed over.
    router._replicas[int(home[1])].stats.in_flight = 1
    assert served_by(router.generate(short(3))) == other


def test_a_session_follow_up_prefers_its_previous_replica():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas)
    # The document is on both replicas (equal match): without a session, load/rotation picks.
    ask(router, doc(0), 1)
    ask(router, doc(0) + [0] * 0, 1)
    for r in router._replicas:
        r.index.insert(BlockHasher(BS).extend(doc(0)), confirmed=True)
    with router.session("alice"):
        home = served_by(ask(router, doc(0), 2))
        assert {served_by(ask(router, doc(0), q)) for q in range(3, 9)} == {home}
    # The same calls without the session do not follow it: between the tied replicas they
    # go to the one that took fewer requests lately (the session kept the other busy).
    assert served_by(ask(router, doc(0), 9)) != home
    # A session whose prefix no longer agrees (another document) routes by prefix.
    other = served_by(ask(router, doc(5), 1))
    assert served_by(ask(router, doc(5), 2, session_id="alice")) == other


def test_salted_prefixes_never_steer_another_salts_routing():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas)
    home = served_by(ask(router, doc(0), 1, cache_salt="tenant-a"))
    for q in range(2, 5):
        assert served_by(ask(router, doc(0), q, cache_salt="tenant-a")) == home
    assert router.cached_prefix_length(doc(0) + [1], cache_salt="tenant-a") == 6 * BS
    assert router.cached_prefix_length(doc(0) + [1], cache_salt="tenant-b") == 0
    assert router.cached_prefix_length(doc(0) + [1]) == 0
    # tenant-b's first request is placed by load, not by tenant-a's prefix.
    router._replicas[int(home[1])].stats.in_flight = 1
    out = ask(router, doc(0), 9, cache_salt="tenant-b")
    assert served_by(out) != home and out.usage.cached_tokens == 0


# -- the index: bounded and self-correcting ----------------------------------------------------


def test_index_is_bounded_lru():
    index = PrefixIndex(capacity=8)
    for d in range(5):
        index.insert(BlockHasher(BS).extend(doc(d)), confirmed=True)
    assert len(index) == 8
    assert index.match(BlockHasher(BS).extend(doc(4))) == 6
    assert index.match(BlockHasher(BS).extend(doc(0))) == 0


def test_router_index_follows_the_replica_pool_bound():
    replicas = [ScriptedReplica("r0", pool_blocks=12)]
    router = ReplicaRouter(replicas, index_blocks=12)
    for d in range(10):
        ask(router, doc(d), 1)
    assert router.stats().replicas[0].index_blocks <= 12


def test_index_corrects_itself_when_the_replica_held_less():
    replica = ScriptedReplica("r0", pool_blocks=1000)
    router = ReplicaRouter([replica], index_blocks=1000)  # the index thinks the pool is big
    for d in range(3):
        ask(router, doc(d), 1)
    replica.held.clear()  # the replica evicted everything (restart, other clients, ...)
    out = ask(router, doc(2), 2)
    assert out.usage.cached_tokens == 0
    s = router.stats().replicas[0]
    assert s.corrections == 1
    assert s.predicted_cached_tokens - s.reported_cached_tokens == 6 * BS
    # Documents 0 and 1 were used before the evicted document 2: dropped with it.
    assert router.cached_prefix_length(doc(0) + [1]) == 0
    assert router.cached_prefix_length(doc(1) + [1]) == 0
    # What the replica holds after the request is recorded again.
    assert router.cached_prefix_length(doc(2) + [1]) == 6 * BS


def test_a_race_on_a_tentative_entry_is_not_taken_for_eviction():
    index = PrefixIndex(capacity=100)
    old = BlockHasher(BS).extend(doc(0))
    new = BlockHasher(BS).extend(doc(1))
    index.insert(old, confirmed=True)
    index.insert(new, confirmed=False)  # sent, not answered yet
    assert index.correct(new, 0, 6) == 0
    assert index.match(old) == 6 and index.match(new) == 6


# -- failover and recovery ---------------------------------------------------------------------


def test_failover_moves_the_request_and_backoff_brings_the_replica_back():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, backoff_s=0.05, max_backoff_s=0.05)
    home = served_by(ask(router, doc(0), 1))
    down = replicas[int(home[1])]
    down.fail = RemoteEngineError("connection refused", unreachable=True)
    out = ask(router, doc(0), 2)
    assert served_by(out) != home
    s = router.stats()
    assert s.replicas[int(home[1])].healthy is False
    assert s.replicas[int(home[1])].failovers == 1 and s.failovers == 1
    calls = down.calls
    ask(router, doc(0), 3)  # within the backoff: not tried
    assert down.calls == calls
    down.fail = None
    down.healthy_probe = False
    time.sleep(0.06)
    ask(router, doc(7), 1)  # the probe fails: still down
    assert router.stats().replicas[int(home[1])].healthy is False
    down.healthy_probe = True
    time.sleep(0.06)
    assert router.check_health()[int(home[1])] is True
    # It came back empty (index forgotten): new documents reach it again.
    assert {served_by(ask(router, doc(d), 1)) for d in range(10, 14)} == {"r0", "r1"}


def test_5xx_fails_over_but_4xx_is_the_requests_own_error():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin")
    replicas[0].fail = RemoteEngineError("bad request", status_code=400)
    with pytest.raises(RemoteEngineError) as info:
        ask(router, doc(0), 1)
    assert info.value.status_code == 400 and replicas[1].calls == 0
    assert router.stats().replicas[0].healthy is True
    replicas[0].fail = RemoteEngineError("overloaded", status_code=503)
    assert served_by(ask(router, doc(0), 2)) == "r1"


def test_in_process_engine_failures_count_as_replica_failures():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin")
    replicas[0].fail = EngineClosedError("closed")
    assert served_by(ask(router, doc(0), 1)) == "r1"


def test_all_replicas_down_raises_with_the_last_error():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, backoff_s=30, max_backoff_s=30)
    for r in replicas:
        r.fail = RemoteEngineError("down", status_code=502)
    with pytest.raises(RemoteEngineError, match="no replica could answer") as info:
        ask(router, doc(0), 1)
    assert info.value.status_code == 502
    assert sum(r.calls for r in replicas) == 2
    # The first went into backoff; the last healthy one is never taken out.
    assert [r.healthy for r in router.stats().replicas].count(True) == 1
    with pytest.raises(RemoteEngineError, match="no replica"):
        ask(router, doc(0), 2)
    assert sum(r.calls for r in replicas) == 3  # only the one still in service was tried


def test_async_generate_fails_over_too():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin")
    replicas[0].fail = RemoteEngineError("down", unreachable=True)
    out = asyncio.run(router.agenerate(doc(0) + [1]))
    assert served_by(out) == "r1"


# -- streaming ---------------------------------------------------------------------------------


def test_a_stream_fails_over_before_its_first_delta():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin")
    replicas[0].fail = RemoteEngineError("refused", unreachable=True)
    deltas = list(router.stream(doc(0) + [1]))
    assert deltas[-1].output is not None and deltas[-1].output.request_id == "r1"
    assert router.stats().replicas[1].succeeded == 1


def test_a_stream_is_never_resent_after_its_first_delta():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin")
    replicas[0].fail_after_deltas = 1
    seen = []
    with pytest.raises(RemoteEngineError, match="mid-stream"):
        for delta in router.stream(doc(0) + [1]):
            seen.append(delta)
    assert len(seen) == 1
    assert replicas[1].calls == 0
    s = router.stats()
    # A broken stream may be the request's own doing: no replica is marked down for it.
    assert s.replicas[0].healthy is True and s.replicas[0].in_flight == 0
    assert s.failovers == 0


def test_async_stream_never_resent_after_its_first_delta():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin")
    replicas[0].fail_after_deltas = 2

    async def consume():
        seen = []
        with pytest.raises(RemoteEngineError):
            async for delta in router.astream(doc(0) + [1]):
                seen.append(delta)
        return seen

    assert len(asyncio.run(consume())) == 2
    assert replicas[1].calls == 0


def test_closing_a_stream_early_releases_its_replica():
    replicas = [ScriptedReplica("r0")]
    router = ReplicaRouter(replicas)
    stream = router.stream(doc(0) + [1])
    next(stream)
    stream.close()
    assert router.stats().replicas[0].in_flight == 0


def test_inputs_are_checked_in_the_callers_thread():
    router = ReplicaRouter([ScriptedReplica("r0")])
    with pytest.raises(InvalidInputError):
        router.stream([])
    with pytest.raises(InvalidInputError):
        router.generate([1, 2, 3], cache_salt=123)
    assert router._replicas[0].engine.calls == 0


def test_a_prefix_shared_by_every_request_does_not_pull_new_documents():
    replicas = [ScriptedReplica(f"r{i}") for i in range(3)]
    router = ReplicaRouter(replicas)
    system = [7] * BS  # a block every prompt starts with (1/7 of it); a document adds 6
    first = {d: served_by(ask(router, system + doc(d), 1)) for d in range(3)}
    assert len(set(first.values())) == 3  # the system prompt on r0 did not steer
    for d in range(3):
        out = ask(router, system + doc(d), 2)
        assert served_by(out) == first[d] and out.usage.cached_tokens == 7 * BS
    # Below match_threshold (an eighth of the prompt) a longer match does not outweigh room:
    # r0 holds 7 blocks, one of them the prompt's; r1 holds nothing.
    assert rank("prefix", [Candidate(0, 0, 1, size=7), Candidate(1, 0, 0, size=0)], turn=0,
                num_replicas=2, total_blocks=10)[0] == 1  # fmt: skip


def test_a_spread_request_goes_where_it_matches_among_equally_loaded_and_full_replicas():
    # Below match_threshold (at most 4 of 40 blocks past the common one): the request is spread:
    # load first, then room after taking it (size - matched), so the match decides between
    # two equally loaded, equally full replicas, whatever the rotation says; a busier
    # replica is never chosen for it.
    full = [
        Candidate(0, 1, 1, size=100),
        Candidate(1, 1, 4, size=100),
        Candidate(2, 2, 5, size=100),
    ]
    for turn in range(3):
        assert rank("prefix", full, turn=turn, num_replicas=3, total_blocks=40)[0] == 1
    # The same match is no reason to fill an already fuller replica.
    fuller = [Candidate(0, 1, 1, size=90), Candidate(1, 1, 4, size=100)]
    assert rank("prefix", fuller, turn=1, num_replicas=2, total_blocks=40)[0] == 0


def test_a_request_that_times_out_is_resent_once_and_marks_no_replica():
    """A timeout, a 500 or a 504 may be the request's own (too long a generation): it must
    not walk through every replica marking each one down."""
    replicas = [ScriptedReplica(f"r{i}") for i in range(4)]
    router = ReplicaRouter(replicas, policy="round-robin", max_attempts=4)
    for r in replicas:
        r.fail = RemoteEngineError("request timed out", status_code=504)
    with pytest.raises(RemoteEngineError, match="timed out"):
        ask(router, doc(0), 1)
    assert sum(r.calls for r in replicas) == 2  # sent, then re-sent once
    assert all(r.healthy for r in router.stats().replicas)
    for r in replicas:
        r.fail = RemoteEngineError("read timed out")  # a transport error after connecting
    with pytest.raises(RemoteEngineError):
        ask(router, doc(1), 1)
    assert all(r.healthy for r in router.stats().replicas)
    for r in replicas[1:]:
        r.fail = None
    for question in range(4):  # whichever replica comes first, a re-send that works
        assert served_by(ask(router, doc(2), question)) in ("r1", "r2", "r3")
    assert router.stats().replicas[0].healthy is True


def test_the_last_healthy_replica_is_never_marked_down():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas, policy="round-robin", backoff_s=30, max_backoff_s=30)
    replicas[0].fail = RemoteEngineError("refused", unreachable=True)
    ask(router, doc(0), 1)
    replicas[1].fail = RemoteEngineError("refused", unreachable=True)
    with pytest.raises(RemoteEngineError):
        ask(router, doc(0), 2)
    assert [r.healthy for r in router.stats().replicas] == [False, True]
    replicas[1].fail = None
    assert served_by(ask(router, doc(0), 3)) == "r1"  # still in service: it answers again


def test_session_ids_are_kept_as_fixed_size_digests():
    replicas = [ScriptedReplica(f"r{i}") for i in range(2)]
    router = ReplicaRouter(replicas)
    huge = "s" * 1_000_000  # a client controls its session id: any length
    router.generate(doc(0) + [1], session_id=huge)
    router.generate(doc(1) + [1], session_id=huge)
    ((salt, key),) = router._selector.sessions  # one session, remembered by a 32-hex digest
    assert len(key) == 32
