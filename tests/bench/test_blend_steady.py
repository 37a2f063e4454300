"""``benchmarks/blend_steady.py``: chunk reuse does not decay under steady traffic of novel
chunk orders (issue 25 part 3; LMCache #4663 saw 4.48x fall to ~1.07x in 60-90 queries)."""

from __future__ import annotations

from support import benchmark_script


def test_reuse_of_the_last_requests_holds_against_the_first(tiny_model):
    with benchmark_script("blend_steady") as steady:
        # A pool of 64 blocks: each request needs 16, so chunk sources are evicted all along.
        result = steady.run(tiny_model, requests=160, window=40, kv_cache_tokens=1024)
    assert result["reuse_first"] > 0.3  # reuse really happens (the exact prefix is ~16 %)
    assert result["last_vs_first"] >= 0.8
