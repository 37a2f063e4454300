"""Prefix-cache core speed: block hashing throughput and manager overhead per request.

    python benchmarks/cache_core_bench.py [--tokens 100000] [--block-size 16] [--repeat 20]

Lane 1 hashes one long prompt three ways: a vLLM-style baseline (sha256 over the pickle of
``(parent, tuple(tokens), None)`` per block, written here), ragkv with xxh3_128 (default) and
ragkv with blake3. Lane 2 times lookup + allocate + free of a 4k-token prompt with 90 % of
its blocks cached, per request. Best of ``--repeat`` runs (min filters scheduler noise).
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import sys
import time
from pathlib import Path

from ragkv.cache_engine import KVCacheManager, block_hashes

# The test suite's request double: the one copy of the surface the manager reads.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import CacheReq  # noqa: E402


def baseline_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    parent, out = None, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = (parent, tuple(token_ids[start : start + block_size]), None)
        parent = hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def best_seconds(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def manager_us_per_request(
    num_tokens: int, block_size: int, hit: float, repeat: int
) -> tuple[float, float]:
    """(µs per request, measured hit fraction) for get_computed_blocks + allocate_slots + free."""
    rng = random.Random(1)
    manager = KVCacheManager(num_blocks=4 * num_tokens // block_size, block_size=block_size)
    shared = [
        rng.randrange(50_000) for _ in range(int(num_tokens * hit) // block_size * block_size)
    ]
    warm = CacheReq(-1, shared + [rng.randrange(50_000) for _ in range(num_tokens - len(shared))])
    blocks, n = manager.get_computed_blocks(warm)
    manager.allocate_slots(warm, len(warm.token_ids) - n, blocks)
    manager.free(warm)
    reqs = [
        CacheReq(i, shared + [rng.randrange(50_000) for _ in range(num_tokens - len(shared))])
        for i in range(repeat)
    ]
    hits = []

    def serve(req: CacheReq) -> None:
        blocks, n = manager.get_computed_blocks(req)
        manager.allocate_slots(req, len(req.token_ids) - n, blocks)
        manager.free(req)
        hits.append(n / len(req.token_ids))

    times = []
    for req in reqs:
        start = time.perf_counter()
        serve(req)
        times.append(time.perf_counter() - start)
    return min(times) * 1e6, sum(hits) / len(hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    bs = args.block_size

    lanes = {
        "baseline sha256+pickle": lambda: baseline_block_hashes(tokens, bs),
        "ragkv xxh3_128": lambda: block_hashes(tokens, bs),
        "ragkv blake3": lambda: block_hashes(tokens, bs, algo="blake3"),
    }
    base = None
    print(f"block hashing: {args.tokens} tokens, block size {bs}, best of {args.repeat}")
    print(f"{'lane':<24}{'ms':>9}{'Mtok/s':>9}{'x base':>8}")
    for name, fn in lanes.items():
        sec = best_seconds(fn, args.repeat)
        base = base or sec
        print(f"{name:<24}{sec * 1e3:>9.2f}{args.tokens / sec / 1e6:>9.1f}{base / sec:>8.2f}")

    us, hit = manager_us_per_request(4096, bs, 0.9, max(args.repeat, 50))
    print(f"\nmanager: 4096-token prompt, {hit:.0%} cached, block size {bs}")
    print(f"lookup + allocate + free: {us:.1f} µs/request (best of {max(args.repeat, 50)})")


if __name__ == "__main__":
    main()
