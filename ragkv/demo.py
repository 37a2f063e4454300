"""``ragkv demo``: a few real questions through the whole pipeline, then the lane table.

Runs on the embedded default model (SmolLM2-135M-Instruct; its answers are short and
often imperfect: they are shown as they come) or any local checkpoint (``--model``).
Same dtype rule as the engine and the bench (``cache_engine.config.resolve_dtype``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ragkv.cache_engine.engine_flags import add_engine_flags, engine_settings

ENGINE_FLAGS = ("model", "dtype")  # the engine settings the demo takes from flags

SHOW_CHARS = 60


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="answer a few questions over the bundled Python docs and compare the lanes",
        description="Retrieve (BM25, 3 query variants), deduplicate, assemble, generate; "
        "then replay a small workload through the four benchmark lanes.",
    )
    add_engine_flags(p, ENGINE_FLAGS)
    p.add_argument("--requests", type=int, default=16, help="requests in the lane comparison")
    p.add_argument("--topics", type=int, default=5)
    p.add_argument("--show", type=int, default=3, help="questions shown with chunks and answers")
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="smoke run (3 requests, 2 shown, 8 answer tokens)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragkv.bench.cli import quiet_invalidator_warning

    with quiet_invalidator_warning():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ragkv.bench.report import format_table
    from ragkv.bench.runner import BenchConfig, run_bench
    from ragkv.bench.workload import SyntheticConfig, synthetic_workload

    requests, show = (3, min(args.show, 2)) if args.quick else (args.requests, args.show)
    answer_tokens = min(args.answer_tokens, 8) if args.quick else args.answer_tokens
    workload = synthetic_workload(
        SyntheticConfig(requests=requests, topics=args.topics, seed=args.seed)
    )
    config = BenchConfig(
        **engine_settings(args, ENGINE_FLAGS),
        max_tokens=2 if args.quick else 8,
        concurrency=4,
        progress=not (args.no_progress or args.json),
        lanes=DEMO_LANES,
    )
    examples = answer_examples(workload, config, show, answer_tokens)
    if not args.json:
        for example in examples:
            print(format_example(example))
        print("Replaying the workload through the four lanes ...")
    report, _ = run_bench(workload, config)
    if args.json:
        print(json.dumps({"examples": examples, "report": report}, indent=2))
    else:
        print(format_table(report))
    return 0


# The demo's table: the savings stack; the batch lane is `ragkv bench`'s (docs/benchmarks.md).
DEMO_LANES = ("no-cache", "apc", "apc+assembler", "ragkv")


def answer_examples(workload: Any, config: Any, count: int, max_tokens: int) -> list[dict]:
    """Answer the first ``count`` requests of distinct topics through ``ragkv.Pipeline``."""
    from ragkv.bench.runner import model_path
    from ragkv.cache_engine import Engine, EngineConfig, SamplingParams
    from ragkv.pipeline import Pipeline

    picked: list[Any] = []
    topics: set[str] = set()
    for request in workload.requests:
        if len(picked) < count and request.topic not in topics:
            picked.append(request)
            topics.add(request.topic)
    if not picked:
        return []
    examples = []
    engine_config = EngineConfig(
        model=model_path(config.model), device=config.device, dtype=config.dtype
    )
    with Engine(engine_config) as engine:
        pipeline = Pipeline(engine, default_params=SamplingParams(max_tokens=max_tokens))
        for request in picked:
            answer = pipeline.answer(request.question, request.chunks, system=request.system)
            examples.append(_example(request, answer))
    return examples


def _example(request: Any, answer: Any) -> dict:
    seen: set[str] = set()
    chunks = []
    for chunk in request.chunks:
        text = chunk.text
        chunks.append(
            {
                "topic": chunk.source_id,
                "preview": " ".join(text.split())[:SHOW_CHARS],
                "duplicate": text in seen,
            }
        )
        seen.add(text)
    usage = answer.usage
    return {
        "question": request.question,
        "chunks": chunks,
        "answer": answer.text.strip(),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "chunks_in": answer.dedup.chunks_in,
        "chunks_out": answer.dedup.chunks_out,
        "ttft_s": answer.timings["ttft_s"],
    }


def format_example(example: dict) -> str:
    lines = [f"Q: {example['question']}"]
    lines.append(
        f"   retrieved {example['chunks_in']} chunks, {example['chunks_out']} after dedup:"
    )
    for chunk in example["chunks"]:
        mark = "dup " if chunk["duplicate"] else "kept"
        lines.append(f"   [{mark}] {chunk['topic']:<20} {chunk['preview']}")
    lines.append(f"A: {example['answer'] or '(empty answer)'}")
    lines.append(
        f"   prompt {example['prompt_tokens']} tokens, {example['cached_tokens']} from cache, "
        f"TTFT {example['ttft_s']:.2f}s\n"
    )
    return "\n".join(lines)
