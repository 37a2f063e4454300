"""Dedup throughput against the floor any dedup must pay: hashing every chunk once.

Workload: ``--n`` chunks of ~``--size`` bytes, ``--dup`` of them exact repeats of earlier
ones, shuffled. For each hash the two lanes run in one process, interleaved, best of
``--repeat``: a bare loop that only hashes every chunk with the same function dedupe
uses, and ``Deduplicator.dedupe`` (which also builds survivors, merged metadata and the
input -> survivor map). Target: dedupe >= 50 % of the bare loop's chunks/s.

    .venv/bin/python benchmarks/dedup_bench.py [--n 200000] [--input str|bytes|chunk] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from typing import Any

from ragkv.dedup import HASH_ALGOS, Chunk, Deduplicator
from ragkv.dedup.hashing import hasher


def make_workload(n: int, size: int, dup: float, kind: str, seed: int = 0) -> list[Any]:
    """``n`` chunks of ``size`` bytes of ASCII text, a ``dup`` fraction repeating earlier ones."""
    rnd = random.Random(seed)
    unique = max(1, round(n * (1 - dup)))
    texts = [rnd.randbytes(size // 2).hex() for _ in range(unique)]
    chunks = texts + [texts[rnd.randrange(unique)] for _ in range(n - unique)]
    rnd.shuffle(chunks)
    if kind == "bytes":
        return [t.encode() for t in chunks]
    if kind == "chunk":
        return [
            Chunk(t, source_id=f"doc{i % 97}", score=rnd.random()) for i, t in enumerate(chunks)
        ]
    return chunks


def bare_hash_loop(chunks: list[Any], algo: str) -> None:
    """The floor: hash every chunk once, with the tightest loop for the input type."""
    digest = hasher(algo)
    if type(chunks[0]) is str:
        for c in chunks:
            digest(c.encode())
    elif type(chunks[0]) is bytes:
        for c in chunks:
            digest(c)
    else:
        for c in chunks:
            digest(c.data)


def best_time(
    fn: Callable[[], object], fresh: Callable[[], None], clock: Callable[[], float]
) -> float:
    fresh()
    gc.collect()
    start = clock()
    fn()  # the result (survivors included) is built inside the timed region
    return clock() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=1024, help="bytes per chunk")
    ap.add_argument("--dup", type=float, default=0.5, help="fraction of duplicates")
    ap.add_argument("--input", choices=("str", "bytes", "chunk"), default="str")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--contained", action="store_true", help="add a drop_contained+merge_overlaps lane"
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: process_time (steadier on a shared machine)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    state: dict[str, list[Any]] = {}

    def fresh() -> None:  # Chunk caches its bytes: every timed run starts from new objects
        if args.input == "chunk" or "chunks" not in state:
            state["chunks"] = make_workload(args.n, args.size, args.dup, args.input)

    fresh()
    total_bytes = sum(
        len(c.encode()) if isinstance(c, str) else len(c if isinstance(c, bytes) else c.data)
        for c in state["chunks"]
    )
    rows = []
    for algo in HASH_ALGOS:
        lanes: dict[str, Callable[[], object]] = {
            "bare_hash": lambda a=algo: bare_hash_loop(state["chunks"], a),
            "dedupe": lambda a=algo: Deduplicator(hash=a).dedupe(state["chunks"]),
        }
        if args.contained:
            dd = Deduplicator(hash=algo, drop_contained=True, merge_overlaps=True)
            lanes["dedupe+spans"] = lambda d=dd: d.dedupe(state["chunks"])
        best = {name: float("inf") for name in lanes}
        for _ in range(args.repeat):
            for name, fn in lanes.items():
                best[name] = min(best[name], best_time(fn, fresh, clock))
        for name, seconds in best.items():
            rows.append(
                {
                    "hash": algo,
                    "lane": name,
                    "seconds": seconds,
                    "chunks_per_s": args.n / seconds,
                    "mb_per_s": total_bytes / seconds / 1e6,
                    "ratio_vs_bare": best["bare_hash"] / seconds,
                }
            )
    report = {
        "clock": args.clock,
        "n": args.n,
        "size": args.size,
        "dup": args.dup,
        "input": args.input,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"n={args.n} size={args.size}B dup={args.dup:.0%} input={args.input} clock={args.clock} (best of {args.repeat})"
        )
        print(f"{'hash':<9} {'lane':<13} {'chunks/s':>12} {'MB/s':>9} {'vs bare':>8}")
        for r in rows:
            print(
                f"{r['hash']:<9} {r['lane']:<13} {r['chunks_per_s']:>12,.0f} "
                f"{r['mb_per_s']:>9,.1f} {r['ratio_vs_bare']:>7.0%}"
            )
    return report


if __name__ == "__main__":
    main()
