"""How far the ``ragkv-batch`` lane is from what any exact-prefix order could compute.

Replays a bench workload's ``ragkv-batch`` lane model-free (``ragkv bench --model-free``'s
simulated engine, default pool) and prints, for its prompts in the order they ran:

- ``computed``: the prefill tokens the lane computed;
- ``unbounded``: the same prompts in the same order with a pool that never evicts;
- ``token_exact``: the same, if a prefix were reused to the token (blocks are 16 tokens:
  where two prompts part inside a block, that block is computed again);
- ``lower_bound``: the fewest tokens any order of the requests and of each request's chunks
  could compute, with this layout (what precedes the chunks, the chunk sets, what follows
  them) and an unbounded pool. A request reuses at most its head plus the chunks it shares
  with the ONE earlier request its longest cached prefix came from; these "came from" links
  form a forest, so the reuse of all requests is at most a maximum spanning forest of the
  requests' shared-chunk weights (edges only within one head), each edge rounded down to
  whole blocks. Chunk weights count the delimiter after the chunk, and two requests with
  the same chunks also share what their tails share, so the bound stays below.

Usage: ``python benchmarks/batch_bound.py [ragkv bench workload flags]``, e.g.
``--no-timestamp`` or ``--workload ragpulse --trace-dir ../shared/data/ragpulse --limit 300
--scale 0.25``.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

from ragkv.assembler.segments import SegmentKind
from ragkv.bench import cli
from ragkv.bench.lanes import BATCH_LANE, lane_specs, run_lane
from ragkv.bench.runner import profile_workload
from ragkv.bench.simulated import SimulatedEngine
from ragkv.cache_engine import SamplingParams

BLOCK = 16


def replay(answers: list[Any], order: list[int], kv_tokens: int, tokenizer: Any) -> int:
    engine = SimulatedEngine(tokenizer, kv_tokens, block_size=BLOCK)
    params = SamplingParams(max_tokens=8)
    return sum(engine.generate(answers[i].output.prompt_token_ids, params).usage.cached_tokens
               for i in order)  # fmt: skip


def token_exact_reuse(answers: list[Any], order: list[int]) -> int:
    """Tokens each prompt shares with the longest prefix of any earlier one (a token trie)."""
    trie: dict[int, Any] = {}
    reused = 0
    for i in order:
        ids = answers[i].output.prompt_token_ids
        node, match = trie, 0
        for token in ids:
            if token not in node:
                break
            node, match = node[token], match + 1
        reused += min(match, len(ids) - 1)
        node = trie
        for token in ids:
            node = node.setdefault(token, {})
    return reused


def spanning_forest_reuse(answers: list[Any]) -> int:
    """The most any order could reuse (see the module docstring); Prim's algorithm per head."""
    weight: dict[bytes, int] = {}
    requests = []
    for answer in answers:
        plan = answer.plan
        spans = plan.segments
        ends = [s.start for s in spans[1:]] + [len(plan.token_ids)]
        chunks = [
            (s, end) for s, end in zip(spans, ends, strict=True) if s.kind == SegmentKind.CHUNK
        ]
        start = (
            chunks[0][0].start
            if chunks
            else min((s.start for s in spans if s.stability.value == "volatile"), default=0)
        )
        for span, end in chunks:
            weight[span.content_hash] = max(weight.get(span.content_hash, 0), end - span.start)
        tail_start = chunks[-1][1] if chunks else start
        requests.append(
            (
                tuple(plan.token_ids[:start]),
                frozenset(s.content_hash for s, _ in chunks),
                tuple(plan.token_ids[tail_start:]),
            )
        )
    groups: dict[tuple[int, ...], list[tuple[frozenset[bytes], tuple[int, ...]]]]
    groups = defaultdict(list)
    for head, chunks, tail in requests:
        groups[head].append((chunks, tail))
    reused = 0
    for head, sets in groups.items():

        def edge(a: Any, b: Any, h: int = len(head)) -> int:
            shared = h + sum(weight[k] for k in a[0] & b[0])
            if a[0] == b[0]:  # the same chunks: the tails' common start too (a history)
                shared += min(_common(a[1], b[1]), len(a[1]) - 1, len(b[1]) - 1)
            return shared // BLOCK * BLOCK

        reused += len(head) // BLOCK * BLOCK  # generous: the group's first request too
        best = {n: edge(sets[0], s) for n, s in enumerate(sets) if n}
        while best:
            n = max(best, key=best.__getitem__)
            reused += best.pop(n)
            for m in best:
                best[m] = max(best[m], edge(sets[n], sets[m]))
    return reused


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    workload = cli.build_workload(args)
    tokenizer = cli.bench_tokenizer(args.model)
    kv = args.kv_cache_tokens or profile_workload(workload, tokenizer, BLOCK, 8).kv_tokens(BLOCK)
    engines: list[SimulatedEngine] = []

    def make_engine(spec: Any) -> SimulatedEngine:
        engines.append(SimulatedEngine(tokenizer, kv, block_size=BLOCK))
        return engines[-1]

    spec = lane_specs([BATCH_LANE])[0]
    result = run_lane(spec, workload, make_engine, SamplingParams(max_tokens=8), keep_answers=True)
    answers = result.answers
    # The simulated engine numbers its requests (and residency probes) in the order they ran.
    order = sorted(range(len(answers)), key=lambda i: int(answers[i].output.request_id[4:]))
    prompt = sum(len(a.output.prompt_token_ids) for a in answers)
    figures = {
        "computed": result.stats.prefill_tokens_computed,
        "unbounded": prompt - replay(answers, order, 1 << 30, tokenizer),
        "token_exact": prompt - token_exact_reuse(answers, order),
        "lower_bound": prompt - spanning_forest_reuse(answers),
    }
    print(f"{BATCH_LANE}, {len(answers)} requests, {prompt:,} prompt tokens, pool {kv:,}:")
    for name, value in figures.items():
        print(f"  {name:>12} {value:>9,}")


if __name__ == "__main__":
    main(sys.argv[1:])
