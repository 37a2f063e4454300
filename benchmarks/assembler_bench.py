"""Assembler benchmark: shared-prefix fraction per order policy, and assembly cost.

Workload (generated here, seeded): a synthetic RAG stream over CPython's ``pydoc_data``
topics cut into ~800-character windows. Each request runs 2-3 retrieval queries, each
drawing Zipf-popular chunks, and sends the union (5-10 chunks) in retrieval-score order;
its system prompt carries a per-request timestamp (a silent invalidator).

1. Shared-prefix fraction: the share of prompt tokens in full 16-token blocks whose whole
   prefix an earlier prompt already had (an infinite prefix cache), for each policy.
2. Assembly cost: µs per ``assemble`` with a warm registry, 10 chunks of 300 tokens, vs
   tokenizing the rendered prompt text from scratch with the fast tokenizer.

Usage: ``python benchmarks/assembler_bench.py [--requests 2000] [--json]``
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import random
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from ragkv.assembler import Assembler
from ragkv.defaults import DEFAULT_BLOCK_SIZE

WINDOW = 800
BLOCK = DEFAULT_BLOCK_SIZE


def load_tokenizer():
    """The shipped SmolLM2 tokenizer if installed, else a byte-level BPE trained here."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from ragkv.cache_engine import default_model_path

        return "shipped SmolLM2-135M-Instruct", AutoTokenizer.from_pretrained(default_model_path())
    except Exception as exc:  # noqa: BLE001 - any failure means "fall back to the local one"
        print(f"shipped tokenizer unavailable ({exc}); training a local byte-level BPE")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import CHATML, train_byte_level_bpe

    tok = train_byte_level_bpe(pydoc_data.topics.topics.values(), vocab_size=4096)
    return "local byte-level BPE (4096)", PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=CHATML
    )


def text_pool() -> list[str]:
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return [text[i : i + WINDOW] for i in range(0, len(text) - WINDOW, WINDOW)]


def rag_stream(pool: Sequence[str], n: int, seed: int, zipf_s: float = 1.1) -> list[dict]:
    """Requests: timestamped system prompt, 5-10 chunks from 2-3 Zipf queries, a question."""
    rng = random.Random(seed)
    popularity = list(range(len(pool)))
    rng.shuffle(popularity)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(pool))]
    start = datetime(2025, 1, 1, tzinfo=UTC)
    requests = []
    for i in range(n):
        scored: dict[int, float] = {}
        while len(scored) < 5:
            scored.clear()
            for _ in range(rng.randint(2, 3)):  # multi-query retrieval
                for idx in rng.choices(popularity, weights, k=rng.randint(2, 4)):
                    scored[idx] = max(scored.get(idx, 0.0), rng.random())
        ranked = sorted(scored, key=scored.__getitem__, reverse=True)[:10]
        now = start + timedelta(seconds=37 * i)
        requests.append(
            {
                "system": "You are a helpful assistant for the Python documentation. Answer "
                f"only from the context. Current time: {now.isoformat()}.",
                "chunks": [pool[idx] for idx in ranked],
                "question": f"Question {i}: how does this work in practice?",
            }
        )
    return requests


class PrefixCache:
    """An infinite block-level prefix cache: (parent block id, block tokens) -> block id."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, tuple[int, ...]], int] = {}

    def add(self, token_ids: Sequence[int]) -> int:
        """Insert the prompt's full blocks; return how many leading tokens were cached."""
        parent, cached, hit = -1, 0, True
        for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
            key = (parent, tuple(token_ids[start : start + BLOCK]))
            block = self.blocks.get(key)
            if block is None:
                hit = False
                block = self.blocks[key] = len(self.blocks)
            elif hit:
                cached += BLOCK
            parent = block
        return cached


def shared_prefix(tokenizer, requests: list[dict], order: str, demote: bool) -> dict:
    asm = Assembler(tokenizer, block_size=BLOCK, order=order, demote_invalidators=demote)
    cache = PrefixCache()
    total = shared = 0
    start = time.perf_counter()
    for request in requests:
        plan = asm.assemble(**request)
        total += len(plan.token_ids)
        shared += cache.add(plan.token_ids)
    seconds = time.perf_counter() - start
    return {
        "order": order,
        "demote_invalidators": demote,
        "shared_prefix_fraction": shared / total,
        "prompt_tokens": total,
        "us_per_request_incl_first_tokenization": 1e6 * seconds / len(requests),
    }


def assembly_cost(tokenizer, pool: Sequence[str], repeats: int, seed: int) -> dict:
    """µs per warm assemble (10 chunks x 300 tokens) vs tokenizing the rendered text."""
    rng = random.Random(seed)
    asm = Assembler(tokenizer)
    encode = asm.tokenizer.encode
    chunks = [asm.decode(encode(text * 3)[:300]) for text in pool[:10]]
    system = "You are a helpful assistant for the Python documentation."
    for _ in range(3):  # warm: registry, stable ranks, template pieces
        plan = asm.assemble(system=system, chunks=chunks, question="warm up?")
    orders = [rng.sample(chunks, len(chunks)) for _ in range(repeats)]
    start = time.perf_counter()
    for i, order in enumerate(orders):
        plan = asm.assemble(system=system, chunks=order, question=f"Question {i}?")
    assemble_us = 1e6 * (time.perf_counter() - start) / repeats
    backend = tokenizer.backend_tokenizer
    start = time.perf_counter()
    for _ in range(repeats):
        backend.encode(plan.text, add_special_tokens=False)
    tokenize_us = 1e6 * (time.perf_counter() - start) / repeats
    chunk_tokens = [s.end - s.start for s in plan.spans("chunk")]
    return {
        "chunks": len(chunk_tokens),
        "tokens_per_chunk": sum(chunk_tokens) / len(chunk_tokens),
        "prompt_tokens": len(plan.token_ids),
        "assemble_us": assemble_us,
        "tokenize_rendered_us": tokenize_us,
        "speedup": tokenize_us / assemble_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    name, tokenizer = load_tokenizer()
    pool = text_pool()
    requests = rag_stream(pool, args.requests, args.seed)
    lanes = [("retrieval", False), ("retrieval", True), ("stable-first", True)]
    lanes += [("cache-aware", True), ("stable-first", False)]
    results = [shared_prefix(tokenizer, requests, order, demote) for order, demote in lanes]
    cost = assembly_cost(tokenizer, pool, args.repeats, args.seed)
    report = {
        "tokenizer": name,
        "requests": args.requests,
        "pool_chunks": len(pool),
        "shared_prefix": results,
        "assembly": cost,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"tokenizer: {name}; {args.requests} requests over {len(pool)} chunks")
    for r in results:
        print(
            f"  {r['order']:<13} demote={r['demote_invalidators']!s:<5} "
            f"shared prefix {r['shared_prefix_fraction']:6.1%} of {r['prompt_tokens']} tokens "
            f"({r['us_per_request_incl_first_tokenization']:.0f} us/request)"
        )
    print(
        f"  assemble {cost['assemble_us']:.0f} us ({cost['chunks']} chunks x "
        f"{cost['tokens_per_chunk']:.0f} tokens) vs tokenize rendered "
        f"{cost['tokenize_rendered_us']:.0f} us: {cost['speedup']:.1f}x"
    )


if __name__ == "__main__":
    main()
