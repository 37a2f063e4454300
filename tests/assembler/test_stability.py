"""StabilityTracker hysteresis and ChunkPrefixTree bounds."""

from __future__ import annotations

import pytest

from ragkv.assembler import ChunkPrefixTree, StabilityTracker
from ragkv.errors import ConfigError


def test_chunk_becomes_stable_after_repeat_sightings_within_the_window():
    tracker = StabilityTracker(promote_after=2, window=4, demote_after=8)
    tracker.observe([b"hot"])
    assert not tracker.is_stable(b"hot")
    tracker.observe([b"hot"])
    assert tracker.is_stable(b"hot")
    tracker.observe([b"slow"])
    for _ in range(4):
        tracker.observe([])
    tracker.observe([b"slow"])  # second sighting, but 5 requests apart: outside the window
    assert not tracker.is_stable(b"slow")


def test_stable_chunk_survives_short_absences_and_is_demoted_after_long_ones():
    tracker = StabilityTracker(promote_after=2, window=4, demote_after=8)
    tracker.observe([b"hot"])
    tracker.observe([b"hot"])
    rank = tracker.rank(b"hot")
    for _ in range(8):
        tracker.observe([b"other"])
    assert tracker.rank(b"hot") == rank  # absent 8 requests: still stable, same place
    tracker.observe([b"other"])
    assert not tracker.is_stable(b"hot")  # absent 9 > demote_after
    tracker.observe([b"hot"])
    assert not tracker.is_stable(b"hot")  # must earn promotion again
    tracker.observe([b"hot"])
    assert tracker.rank(b"hot") > rank  # back, at the end of the stable order


def test_chunks_promoted_together_tie_and_earlier_promotions_rank_first():
    tracker = StabilityTracker(promote_after=2, window=8, demote_after=16)
    tracker.observe([b"a"])
    tracker.observe([b"a", b"c", b"b"])
    tracker.observe([b"b", b"c"])
    assert tracker.rank(b"a") < tracker.rank(b"b") == tracker.rank(b"c")


def test_tracker_state_is_bounded():
    tracker = StabilityTracker(max_tracked=10)
    for i in range(100):
        tracker.observe([i.to_bytes(4, "little")])
    assert len(tracker) == 10


def test_tracker_rejects_missing_hysteresis():
    with pytest.raises(ConfigError, match="hysteresis"):
        StabilityTracker(window=64, demote_after=64)


def test_tree_walk_follows_the_most_used_matching_path():
    tree = ChunkPrefixTree()
    tree.insert(b"head", [b"a", b"b", b"c"])
    tree.insert(b"head", [b"a", b"b", b"c"])
    tree.insert(b"head", [b"a", b"c"])
    assert tree.walk(b"head", {b"c", b"b", b"a", b"z"}) == [b"a", b"b", b"c"]
    assert tree.walk(b"head", {b"c", b"a"}) == [b"a", b"c"]
    assert tree.walk(b"head", {b"b", b"c"}) == []  # no sent order starts with b or c
    assert tree.walk(b"other head", {b"a"}) == []


def test_tree_is_bounded_and_evicts_least_recent_leaves_first():
    tree = ChunkPrefixTree(max_nodes=5)
    tree.insert(b"h", [b"a", b"b", b"c"])  # 4 nodes: h, a, b, c
    tree.insert(b"h", [b"x", b"y"])  # 6 nodes > 5: evict the oldest leaf, c
    assert len(tree) == 5
    assert tree.walk(b"h", {b"a", b"b", b"c"}) == [b"a", b"b"]
    for i in range(50):
        tree.insert(b"h", [bytes([i]), b"tail"])
        assert len(tree) <= 5
    assert tree.walk(b"h", {bytes([49]), b"tail"}) == [bytes([49]), b"tail"]
