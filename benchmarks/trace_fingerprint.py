"""A fixed engine trace as JSON: greedy tokens, cached counts and engine counters.

For refactors that must not change behaviour: run it on the tree before and after (same
machine, same checkpoint) and compare the two files byte for byte. The trace is built to
reach every admission path: prefix hits, a pool small enough to preempt, opted-in chunk
reuse (blended prefills and their fallbacks), and a host KV tier (prefixes evicted from the
pool come back from it, their requests waiting for the loads).

    python benchmarks/trace_fingerprint.py CHECKPOINT_DIR > after.json
"""

from __future__ import annotations

import json
import random
import sys

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.chunk_reuse import BlendConfig

BLOCK = 16


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _trace(vocab: int) -> list[tuple[list[int], tuple[tuple[int, int], ...]]]:
    """Prompts of a shared head + 3 of 6 chunks + a question, with their chunk spans."""
    head = _tokens(1, 40, vocab)
    chunks = [_tokens(100 + i, 24, vocab) for i in range(6)]
    rng = random.Random(7)
    prompts = []
    for i in range(24):
        picked = rng.sample(range(6), 3)
        tokens, spans = list(head), []
        for c in picked:
            spans.append((len(tokens), len(tokens) + len(chunks[c])))
            tokens += chunks[c]
        tokens += _tokens(1000 + i, 12, vocab)
        prompts.append((tokens, tuple(spans)))
    return prompts


STAT_NAMES = (
    "prompt_tokens",
    "prefill_tokens_computed",
    "prefill_tokens_reused",
    "prefill_tokens_reused_nonprefix",
    "decode_tokens",
    "preemptions",
    "evictions",
    "blend_fallbacks",
    "blend_probe_fallbacks",
    "tier_hit_tokens",
    "tier_loaded_blocks",
)


def _rows(outs) -> list:
    return [[o.token_ids, o.usage.cached_tokens, o.usage.cached_tokens_by_tier] for o in outs]


def fingerprint(checkpoint: str) -> dict:
    """Two engines, each deterministic: batching (no tiers: nothing runs in another thread)
    and the tiers (one request at a time: a request waiting for its loads is alone)."""
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    out: dict = {}
    with Engine.from_pretrained(checkpoint, device="cpu", kv_cache_tokens=16 * BLOCK) as engine:
        trace = _trace(engine.runner.vocab_size)
        rows = []
        for wave in range(3):  # waves of 8 in flight: preemption in a 16-block pool
            batch = trace[wave * 8 : wave * 8 + 8]
            blend = BlendConfig() if wave == 2 else None
            rows += _rows(
                engine.generate(
                    [p for p, _ in batch],
                    greedy,
                    chunk_spans=[s for _, s in batch] if blend else None,
                    reuse=blend,
                )
            )
        stats = engine.stats()
        out["batching"] = {"requests": rows, "stats": {n: getattr(stats, n) for n in STAT_NAMES}}
    with Engine.from_pretrained(
        checkpoint, device="cpu", kv_cache_tokens=16 * BLOCK, host_cache_bytes=1 << 26
    ) as engine:
        rows = []
        for prompt, _ in trace[:12] + trace[:4]:  # the last four were evicted: from the tier
            rows += _rows([engine.generate(prompt, greedy)])
        stats = engine.stats()
        out["tiers"] = {"requests": rows, "stats": {n: getattr(stats, n) for n in STAT_NAMES}}
    return out


if __name__ == "__main__":
    json.dump(fingerprint(sys.argv[1]), sys.stdout, indent=1, sort_keys=True)
    print()
