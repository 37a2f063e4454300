"""``benchmarks/routing_reach.py``: the hindsight placement search is exact where a brute
force can check it, keeps the imbalance limit, and runs on a bench workload."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
from support import benchmark_script


@pytest.fixture(scope="module")
def reach():
    with benchmark_script("routing_reach") as module:
        yield module


def topic(name: str, blocks: int = 4) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(blocks)]


def brute_force(reach, prompts, reusable, replicas, capacity, most) -> int:
    best = 0
    for placed in itertools.product(range(replicas), repeat=len(prompts)):
        if max(placed.count(r) for r in range(replicas)) > most:
            continue
        pools = [OrderedDict() for _ in range(replicas)]
        score = sum(
            reach.serve(pools[r], h, n, capacity)
            for r, h, n in zip(placed, prompts, reusable, strict=True)
        )
        best = max(best, score)
    return best


def test_alternating_topics_each_get_a_replica_where_one_pool_thrashes(reach):
    prompts = [topic("a"), topic("b")] * 4
    reusable = [4] * len(prompts)
    # One pool of one topic's size reuses nothing: each prompt evicts the other topic.
    assert reach.whole_pool(prompts, reusable, capacity=4) == 0
    found = reach.best_placement(
        prompts, reusable, replicas=2, capacity=4, max_imbalance=1.5, width=8
    )
    assert found.reused_blocks == 2 * 3 * 4  # every repeat of each topic hits all 4 blocks
    assert len({found.replicas[i] for i in range(0, 8, 2)}) == 1
    assert found.replicas[0] != found.replicas[1]


def test_the_search_matches_a_brute_force_and_keeps_the_imbalance_limit(reach):
    # A hot topic (5 of 8 requests) and two cold ones: the limit (1.0: 4 per replica)
    # forces the hot topic onto both replicas; the search pays for it as little as can be.
    prompts = [topic("h"), topic("h"), topic("c"), topic("h"), topic("d"), topic("h"),
               topic("c"), topic("h")]  # fmt: skip
    reusable = [3] * len(prompts)  # a prompt's last token is computed: 3 of 4 blocks reusable
    for limit, most in ((1.0, 4), (1.5, 6)):
        found = reach.best_placement(
            prompts, reusable, replicas=2, capacity=8, max_imbalance=limit, width=64
        )
        assert max(found.counts(2)) <= most
        assert found.reused_blocks == brute_force(reach, prompts, reusable, 2, 8, most)
        # The placement it reports earns what it says when replayed.
        pools = [OrderedDict(), OrderedDict()]
        replayed = sum(
            reach.serve(pools[r], h, n, 8)
            for r, h, n in zip(found.replicas, prompts, reusable, strict=True)
        )
        assert replayed == found.reused_blocks
    assert (
        reach.best_placement(
            prompts, reusable, replicas=2, capacity=8, max_imbalance=1.0, width=64
        ).reused_blocks
        < reach.best_placement(
            prompts, reusable, replicas=2, capacity=8, max_imbalance=1.5, width=64
        ).reused_blocks
    )


def test_the_script_reports_a_placement_on_the_bench_workload(reach, tmp_path):
    args = reach.parse_args(["--requests", "8", "--topics", "2", "--width", "8"])
    report = reach.reach(args)
    placement = report["placement"]
    assert report["requests"] == 8 and sum(placement["requests_per_replica"]) == 8
    assert placement["imbalance"] <= 1.5
    # The model of a pool agrees with the engine's block manager on the whole pool (the
    # figure every ratio divides by); on this small workload, exactly.
    whole = report["whole_pool_cached_tokens"]
    assert whole["engine"] > 0 and whole["model"] == whole["engine"]
    assert placement["cached_tokens"] > 0
