"""Model-free: how much can N replicas reuse on a bench workload, routed with hindsight?

The replica lanes of ``ragkv bench --replicas N`` compare a router against one replica with
the whole pool. Whether a shortfall is the router's or the workload's is a question about
placements: this script searches for one. It assembles the ``ragkv`` lane's prompts on a
simulated engine with the whole pool (tokenizer only, one request at a time; the same
prompts the lanes replay), then models each replica as an LRU pool of its share of blocks,
freed blocks evicted tail first as the engine's block manager does, requests one at a
time, and runs a beam search over which replica serves each request, keeping only
placements whose request imbalance (max / mean requests per replica) stays within
``--max-imbalance``.

The answer is a placement that exists, found with hindsight: a router that knew the future
could do at least this well under the model (no concurrency: what requests in flight pin is
not modelled). It is not a ceiling: the beam is greedy, and over hundreds of requests it can
find less than a router does (RAGPulse 1-300: 0.923x, where the router reaches 0.963x). The model's own whole-pool figure is printed beside the engine's, so its
error is in view. Usage::

    python benchmarks/routing_reach.py                       # ragkv bench's synthetic lane
    python benchmarks/routing_reach.py --workload ragpulse --trace-dir ../shared/data/ragpulse \\
        --limit 100 --scale 0.25
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_serve import add_workload_args, bench_workload  # noqa: E402

from ragkv.bench.cli import bench_tokenizer  # noqa: E402
from ragkv.bench.lanes import lane_specs, run_lane  # noqa: E402
from ragkv.bench.replicas import pool_sizes  # noqa: E402
from ragkv.bench.runner import BenchConfig  # noqa: E402
from ragkv.bench.simulated import SimulatedEngine  # noqa: E402
from ragkv.cache_engine import SamplingParams, block_hashes  # noqa: E402
from ragkv.errors import ConfigError  # noqa: E402

Pool = OrderedDict  # block hash -> None, least recently used first


@dataclass(frozen=True, slots=True)
class Placement:
    """Blocks reused in all, and which replica served each request."""

    reused_blocks: int
    replicas: tuple[int, ...]

    def counts(self, num_replicas: int) -> list[int]:
        return [self.replicas.count(r) for r in range(num_replicas)]


def serve(pool: Pool, hashes: Sequence[bytes], reusable: int, capacity: int) -> int:
    """Blocks of a prompt ``pool`` holds as a prefix (at most ``reusable``), then the prompt's
    blocks stored there, its head the most recently used: a pool frees a finished request's
    blocks tail first, so its tail is evicted first."""
    hit = 0
    while hit < min(len(hashes), reusable) and hashes[hit] in pool:
        hit += 1
    for h in reversed(hashes):
        pool[h] = None
        pool.move_to_end(h)
    while len(pool) > capacity:
        pool.popitem(last=False)
    return hit


def whole_pool(prompts: Sequence[Sequence[bytes]], reusable: Sequence[int], capacity: int) -> int:
    """Blocks one pool of ``capacity`` reuses over the prompts (the model's reference)."""
    pool: Pool = OrderedDict()
    return sum(serve(pool, h, n, capacity) for h, n in zip(prompts, reusable, strict=True))


def best_placement(
    prompts: Sequence[Sequence[bytes]],
    reusable: Sequence[int],
    *,
    replicas: int,
    capacity: int,
    max_imbalance: float,
    width: int,
) -> Placement:
    """The placement a beam search of ``width`` finds: at most ``max_imbalance`` x the mean
    requests on any replica, each replica an LRU pool of ``capacity`` blocks."""
    if replicas < 1 or capacity < 1 or width < 1 or max_imbalance < 1:
        raise ConfigError("need replicas, capacity and width >= 1 and max_imbalance >= 1")
    most = int(max_imbalance * len(prompts) / replicas + 1e-9)
    beam: list[tuple[int, tuple[int, ...], tuple[Pool, ...]]]
    beam = [(0, (), tuple(OrderedDict() for _ in range(replicas)))]
    for hashes, n in zip(prompts, reusable, strict=True):
        seen: dict[Any, tuple[int, tuple[int, ...], tuple[Pool, ...]]] = {}
        for score, placed, pools in beam:
            for r in range(replicas):
                if placed.count(r) >= most:
                    continue
                pool = OrderedDict(pools[r])
                gained = score + serve(pool, hashes, n, capacity)
                new = (*pools[:r], pool, *pools[r + 1 :])
                # Replicas are interchangeable: states equal up to a permutation are one.
                key = tuple(
                    sorted((placed.count(i) + (i == r), frozenset(p)) for i, p in enumerate(new))
                )
                if key not in seen or seen[key][0] < gained:
                    seen[key] = (gained, (*placed, r), new)
        beam = sorted(seen.values(), key=lambda s: -s[0])[:width]
    score, placed, _ = beam[0]
    return Placement(score, placed)


def lane_prompts(workload: Any, config: BenchConfig, tokenizer: Any, kv_tokens: int) -> Any:
    """The ``ragkv`` lane's prompts (token ids) and cached tokens, on a simulated engine with
    ``kv_tokens``, one request at a time."""

    def make_engine(spec: Any) -> SimulatedEngine:
        return SimulatedEngine(tokenizer, kv_tokens, block_size=config.block_size)

    spec = lane_specs(["ragkv"], config.order)[0]
    params = SamplingParams(max_tokens=config.max_tokens)
    result = run_lane(spec, workload, make_engine, params, concurrency=1)
    return [r.prompt_token_ids for r in result.records], sum(
        r.cached_tokens for r in result.records
    )


def reach(args: argparse.Namespace) -> dict[str, Any]:
    workload = bench_workload(args)
    config = BenchConfig(
        max_tokens=args.max_tokens, block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens
    )
    tokenizer = bench_tokenizer(args.model)
    whole, per_replica = pool_sizes(workload, config, args.replicas)
    prompts, engine_cached = lane_prompts(workload, config, tokenizer, whole)
    bs = config.block_size
    hashes = [block_hashes(ids, bs) for ids in prompts]
    reusable = [max(len(ids) - 1, 0) // bs for ids in prompts]
    model_whole = whole_pool(hashes, reusable, whole // bs)
    found = best_placement(
        hashes,
        reusable,
        replicas=args.replicas,
        capacity=per_replica // bs,
        max_imbalance=args.max_imbalance,
        width=args.width,
    )
    counts = found.counts(args.replicas)
    return {
        "workload": workload.params,
        "requests": len(prompts),
        "block_size": bs,
        "whole_pool_tokens": whole,
        "replica_pool_tokens": per_replica,
        "whole_pool_cached_tokens": {"engine": engine_cached, "model": model_whole * bs},
        "placement": {
            "cached_tokens": found.reused_blocks * bs,
            "vs_whole_pool_engine": found.reused_blocks * bs / engine_cached
            if engine_cached
            else 0,
            "vs_whole_pool_model": found.reused_blocks / model_whole if model_whole else 0,
            "requests_per_replica": counts,
            "imbalance": max(counts) / (sum(counts) / len(counts)),
            "max_imbalance": args.max_imbalance,
            "beam_width": args.width,
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--model", help="tokenizer (default: the embedded model's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-tokens", type=int, help="the whole pool (default: as ragkv bench)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--max-imbalance", type=float, default=1.5)
    p.add_argument("--width", type=int, default=300, help="beam width (default 300)")
    p.add_argument("--json", metavar="FILE", help="write the report here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = reach(args)
    placement = report["placement"]
    cached = report["whole_pool_cached_tokens"]
    print(
        f"{report['requests']} requests, {args.replicas} replicas of "
        f"{report['replica_pool_tokens']} tokens (whole pool {report['whole_pool_tokens']})\n"
        f"whole pool: {cached['engine']:,} cached tokens (engine), {cached['model']:,} (model)\n"
        f"placement found (beam {args.width}, imbalance <= {args.max_imbalance}): "
        f"{placement['cached_tokens']:,} cached tokens = "
        f"{placement['vs_whole_pool_engine']:.3f}x the engine's whole pool, "
        f"{placement['vs_whole_pool_model']:.3f}x the model's; requests per replica "
        f"{placement['requests_per_replica']}, imbalance {placement['imbalance']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
