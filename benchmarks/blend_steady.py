"""Does chunk reuse hold up under steady traffic of novel chunk orders? (issue 25, part 3)

LMCache issue #4663: under steady novel RAG traffic, CacheBlend's reuse decayed from 4.48x
to ~1.07x within 60-90 queries. Here every request draws ``--chunks-per-request`` chunks
from a fixed pool of ``--pool`` chunks in a fresh random order, after a shared system
prefix, with a new question; each opts into chunk reuse. Reported: the share of prompt
tokens not computed (exact prefix, copied chunks, shared approximate prefix) over the first
and the last ``--window`` requests, and their ratio (target >= 0.8).

    python benchmarks/blend_steady.py [CHECKPOINT] --requests 500 --json steady.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.chunk_reuse import BlendConfig


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(
    checkpoint: str | None,
    *,
    requests: int = 500,
    pool: int = 12,
    chunks_per_request: int = 4,
    chunk_tokens: int = 48,
    window: int = 100,
    kv_cache_tokens: int = 4096,
    k: int = 16,
    seed: int = 0,
) -> dict:
    """Replay the steady workload; the reuse share per request and the summary."""
    rng = random.Random(seed)
    with Engine.from_pretrained(checkpoint, device="cpu", kv_cache_tokens=kv_cache_tokens) as eng:
        vocab = min(eng.runner.vocab_size, 30_000)
        system = _tokens(rng, 40, vocab)
        chunks = [_tokens(rng, chunk_tokens, vocab) for _ in range(pool)]
        blend = BlendConfig("first-k", k)
        greedy = SamplingParams(max_tokens=1, ignore_eos=True)
        shares = []
        for _ in range(requests):
            tokens, spans = list(system), []
            for c in rng.sample(range(pool), chunks_per_request):
                spans.append((len(tokens), len(tokens) + chunk_tokens))
                tokens += chunks[c]
            tokens += _tokens(rng, 12, vocab)
            before = eng.stats().prefill_tokens_computed
            eng.generate(tokens, greedy, chunk_spans=spans, reuse=blend)
            computed = eng.stats().prefill_tokens_computed - before
            shares.append(1 - computed / len(tokens))
    first = sum(shares[:window]) / window
    last = sum(shares[-window:]) / window
    return {
        "requests": requests,
        "pool": pool,
        "chunks_per_request": chunks_per_request,
        "kv_cache_tokens": kv_cache_tokens,
        "k": k,
        "reuse_first": first,
        "reuse_last": last,
        "last_vs_first": last / first if first else None,
        "shares": shares,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", default=None, help="default: SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--pool", type=int, default=12)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--kv-cache-tokens", type=int, default=4096)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = run(
        args.checkpoint,
        requests=args.requests,
        pool=args.pool,
        window=args.window,
        kv_cache_tokens=args.kv_cache_tokens,
        k=args.k,
    )
    summary = {key: value for key, value in result.items() if key != "shares"}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    if result["last_vs_first"] is not None and result["last_vs_first"] < 0.8:
        sys.exit(1)


if __name__ == "__main__":
    main()
