"""Model-free bound: how much prefill can chunk reuse save on a bench workload at best?

Assembles the ``ragkv`` lane's prompts (tokenizer only, no model) and counts, per request,
the prompt tokens an exact prefix cache computes (everything after the longest run of
full blocks seen before) and what chunk reuse would compute on top: chunks after that
prefix that appeared in any earlier prompt are copied, except ``k`` tokens each. It is
optimistic on purpose: an unbounded pool (nothing evicted), every earlier block cacheable
for every request (the engine keeps a blended request's blocks for opted-in requests only),
every earlier chunk recorded. ``blend_kK_standalone`` is the same when each new chunk is
first computed alone (CacheBlend, EPIC), then reused with its ``k`` first tokens
recomputed, instead of taken from the prompt's own prefill. A follow-up's earlier answers
stand in as 8 filler words.

Usage: ``python benchmarks/blend_bound.py [--workload synthetic|production] [--ks 0,16]``, or
``--workload ragpulse --trace-dir ../shared/data/ragpulse --limit 300 --scale 0.25``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from types import SimpleNamespace

from transformers import AutoTokenizer

from ragkv.bench.lanes import build_pipeline, lane_specs
from ragkv.bench.production import ProductionConfig, production_workload
from ragkv.bench.ragpulse import ragpulse_workload
from ragkv.bench.workload import SyntheticConfig, synthetic_workload
from ragkv.cache_engine import block_hashes, default_model_path
from ragkv.defaults import DEFAULT_BLOCK_SIZE


def bound(
    workload, tokenizer, ks: list[int], block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, float]:
    stand_in = SimpleNamespace(tokenizer=tokenizer, block_size=block_size, knows_residency=False)
    pipe = build_pipeline(lane_specs(["ragkv"])[0], stand_in)
    turns: dict[str, list[dict[str, str]]] = defaultdict(list)
    blocks: set[bytes] = set()
    chunks: set[tuple[int, ...]] = set()
    prompt = exact = 0
    blended = dict.fromkeys(ks, 0)
    standalone = dict.fromkeys(ks, 0)  # what computing each new chunk alone first adds
    for r in workload.requests:
        history = r.history if r.history is not None else turns[r.session_id]
        plan = pipe.prepare(r.question, r.chunks, system=r.system, history=history).plan
        ids = plan.token_ids
        hashes = block_hashes(ids, block_size)
        hit = 0
        for h in hashes[: (len(ids) - 1) // block_size]:
            if h not in blocks:
                break
            hit += block_size
        blocks.update(hashes)
        prompt += len(ids)
        exact += len(ids) - hit
        saved = dict.fromkeys(ks, 0)
        for span in plan.spans("chunk"):
            key = tuple(ids[span.start : span.end])
            if span.start >= hit and key in chunks:
                for k in ks:
                    saved[k] += max(0, span.end - span.start - k)
            elif span.start >= hit:  # alone first, then reused here like any: k more tokens
                for k in ks:
                    standalone[k] += min(k, span.end - span.start)
            chunks.add(key)
        for k in ks:
            blended[k] += len(ids) - hit - saved[k]
        turns[r.session_id] += [
            {"role": "user", "content": r.question},
            {"role": "assistant", "content": " ".join(["answer"] * 8)},
        ]
    out = {"prompt_tokens": prompt, "exact_prefix_cache": exact}
    for k in ks:
        out[f"blend_k{k}"] = blended[k]
        out[f"blend_k{k}_vs_exact"] = blended[k] / exact
        out[f"blend_k{k}_standalone"] = blended[k] + standalone[k]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workload", choices=("synthetic", "production", "ragpulse"), default="synthetic"
    )
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--ks", default="0,16")
    p.add_argument("--trace-dir", default="../shared/data/ragpulse")
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--scale", type=float, default=0.25)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    if args.workload == "ragpulse":
        workload = ragpulse_workload(args.trace_dir, tokenizer, limit=args.limit, scale=args.scale)
    elif args.workload == "synthetic":
        workload = synthetic_workload(
            SyntheticConfig(requests=args.requests, topics=max(1, args.requests // 4))
        )
    else:
        workload = production_workload(
            ProductionConfig(requests=args.requests, passages=2 * args.requests)
        )
    ks = [int(k) for k in args.ks.split(",")]
    for key, value in bound(workload, tokenizer, ks).items():
        print(f"{key:>24}: {value:,.2f}" if isinstance(value, float) else f"{key:>24}: {value:,}")


if __name__ == "__main__":
    main()
