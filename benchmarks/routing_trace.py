"""Write a RAG trace for ``ragkv bench --workload trace`` (used for the routing figures).

Topics with Zipf popularity, each a fixed set of passages that its requests retrieve (a
seeded subset, in retrieval order); one shared system prompt; a unique question per request;
a share of follow-ups that carry their session's history. Deterministic for a seed.

    python benchmarks/routing_trace.py --out /tmp/rt   # writes /tmp/rt.jsonl, /tmp/rt.lengths.json
    ragkv bench --workload trace --trace /tmp/rt.jsonl --lengths /tmp/rt.lengths.json --replicas 3
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def build(
    requests: int, topics: int, passages: int, passage_tokens: int, seed: int
) -> tuple[list[dict], dict[str, int]]:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(topics)]
    lengths: dict[str, int] = {"sys": 120}
    lines: list[dict] = []
    sessions: list[tuple[str, int, list[str]]] = []  # (session id, topic, history ids)
    for i in range(requests):
        q = f"q{i}"
        lengths[q] = rng.randint(12, 30)
        if sessions and rng.random() < 0.25:
            sid, topic, history = rng.choice(sessions[-8:])
        else:
            topic = rng.choices(range(topics), weights)[0]
            sid, history = f"s{i}", []
            sessions.append((sid, topic, history))
        pool = [f"t{topic}p{k}" for k in range(passages)]
        chosen = rng.sample(pool, rng.randint(passages - 1, passages))
        for p in chosen:
            lengths[p] = passage_tokens
        line = {"session_id": sid, "system": ["sys"], "passages": chosen, "user": [q]}
        if history:
            line["history"] = list(history)
        lines.append(line)
        a = f"a{i}"
        lengths[a] = 24
        history += [q, a]
    return lines, lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path prefix of the two files")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--topics", type=int, default=10)
    p.add_argument("--passages", type=int, default=3, help="passages per topic")
    p.add_argument("--passage-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lines, lengths = build(
        args.requests, args.topics, args.passages, args.passage_tokens, args.seed
    )
    out = Path(args.out)
    out.with_suffix(".jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out.with_suffix(".lengths.json").write_text(json.dumps(lengths))


if __name__ == "__main__":
    main()
