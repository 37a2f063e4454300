"""KV tiers benchmark: what a block costs to bring back, against computing it (ratios on CPU).

1. Host round trip: a 2,048-token prompt computed cold, pushed out of a small pool by other
   prompts, then asked again: it comes back from host memory. Per block, the engine's own
   counters give the copy out of the pool (after the forward that wrote it), the verified
   load and the copy back in; against the prefill time of the block's 16 tokens.
2. Restart: a 2,048-token prompt computed by one engine with a store directory; the engine
   is closed, a new one opens the same directory and serves a prompt whose first 1,984
   tokens are that prompt's: TTFT against a cold prompt of the same length on the same
   engine, and the disk load bandwidth beside ``dd``'s sequential read of a file as large.

Usage: ``python benchmarks/tiers.py [--model PATH] [--dtype float32] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.defaults import DEFAULT_BLOCK_SIZE

ONE = SamplingParams(max_tokens=1)
PROMPT, SHARED, BLOCK = 2048, 1984, DEFAULT_BLOCK_SIZE


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def warm_up(engine: Engine, rng: random.Random) -> None:
    engine.generate(random_ids(rng, 64, engine.runner.vocab_size), ONE)


def host_round_trip(args: argparse.Namespace, rng: random.Random) -> dict:
    pool = PROMPT + 4 * BLOCK  # one long prompt (and its output) at a time
    with Engine.from_pretrained(
        args.model, dtype=args.dtype, kv_cache_tokens=pool, host_cache_bytes=args.host_bytes
    ) as engine:
        vocab = engine.runner.vocab_size
        warm_up(engine, rng)
        base = random_ids(rng, PROMPT, vocab)
        cold = engine.generate(base, ONE)
        engine.generate(random_ids(rng, PROMPT, vocab), ONE)  # pushes base out of the pool
        engine.core.offload.flush()
        before = engine.stats()
        warm = engine.generate(base, ONE)
        stats = engine.stats()
    # The pool may keep the prompt's first blocks (the other prompt's last block fits beside
    # them); everything after comes from host memory.
    assert warm.usage.cached_tokens == PROMPT - BLOCK, warm.usage
    assert warm.usage.cached_tokens_by_tier.get("host", 0) >= PROMPT // 2, warm.usage
    blocks = stats.tier_loaded_blocks["host"] - before.tier_loaded_blocks.get("host", 0)
    save_per_block = stats.tier_save_s / stats.tier_offered_blocks
    load_per_block = (stats.tier_load_s["host"] - before.tier_load_s.get("host", 0.0)) / blocks
    install_per_block = (stats.tier_install_s - before.tier_install_s) / blocks
    compute_per_block = cold.timings.ttft_s / (PROMPT / BLOCK)
    round_trip = save_per_block + load_per_block + install_per_block
    return {
        "cold_ttft_s": cold.timings.ttft_s,
        "host_ttft_s": warm.timings.ttft_s,
        "compute_per_block_s": compute_per_block,
        "save_per_block_s": save_per_block,
        "load_per_block_s": load_per_block,
        "install_per_block_s": install_per_block,
        "round_trip_vs_compute": round_trip / compute_per_block,
        "save_share_of_step": stats.tier_save_s / stats.step_s,
        "block_bytes": engine.runner.bytes_per_block(),
    }


def restart(args: argparse.Namespace, rng: random.Random, store: Path) -> dict:
    # Disk only: every block the first engine computes is written to the store.
    settings = dict(dtype=args.dtype, kv_cache_tokens=2 * PROMPT + 8 * BLOCK, kv_store_dir=store)
    with Engine.from_pretrained(args.model, **settings) as first:
        vocab = first.runner.vocab_size
        base = random_ids(rng, PROMPT, vocab)
        first.generate(base, ONE)
    with Engine.from_pretrained(args.model, **settings) as engine:
        warm_up(engine, rng)
        cold = engine.generate(random_ids(rng, PROMPT, vocab), ONE)
        prompt = base[:SHARED] + random_ids(rng, PROMPT - SHARED, vocab)
        warm = engine.generate(prompt, ONE)
        stats = engine.stats()
    disk = warm.usage.cached_tokens_by_tier.get("disk", 0)
    loaded = stats.tier_loaded_bytes.get("disk", 0)
    load_s = stats.tier_load_s.get("disk", 0.0)
    return {
        "cold_ttft_s": cold.timings.ttft_s,
        "restart_ttft_s": warm.timings.ttft_s,
        "ttft_restart_vs_cold": warm.timings.ttft_s / cold.timings.ttft_s,
        "disk_tokens": disk,
        "cached_tokens_by_tier": warm.usage.cached_tokens_by_tier,
        "loaded_mb": loaded / 1e6,
        "load_mb_per_s": loaded / load_s / 1e6 if load_s else 0.0,
        "dd_mb_per_s": dd_read(store, loaded or 1 << 26),
    }


def dd_read(directory: Path, size: int) -> dict:
    """Sequential read bandwidth (MB/s) of a file of ``size`` bytes: page cache and direct."""
    path = directory / "dd-probe.bin"
    count = max(1, size >> 20)
    subprocess.run(
        ["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    out = {}
    for name, flags in (("cached", []), ("direct", ["iflag=direct"])):
        started = time.perf_counter()
        done = subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=1M", *flags], capture_output=True
        )
        elapsed = time.perf_counter() - started
        out[name] = count * (1 << 20) / elapsed / 1e6 if done.returncode == 0 else None
    path.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--host-bytes", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report = {"host_round_trip": host_round_trip(args, rng)}
    with tempfile.TemporaryDirectory(prefix="ragkv-tiers-bench-") as store:
        report["restart"] = restart(args, rng, Path(store))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
