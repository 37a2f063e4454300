"""``ragkv bench``: replay a workload through the lanes and report the savings stack."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ragkv.bench.lanes import ALL_LANES, BLEND_LANE, LANES, TIERS_LANE
from ragkv.cache_engine.engine_flags import add_engine_flags, engine_settings

# The default run fits ~10 minutes on a slow 2-core CPU; --full is the workload at full size.
# Topics scale with requests, so each topic recurs about as often in both.
DEFAULT_REQUESTS, DEFAULT_TOPICS = 40, 10
FULL_REQUESTS, FULL_TOPICS = 200, 50
# --quick: a first look in under 2 minutes on 2 cores; each topic still recurs about 3 times.
QUICK_REQUESTS, QUICK_TOPICS, QUICK_MAX_TOKENS = 10, 3, 2
BENCH_MAX_TOKENS = 8
# The EngineConfig settings the bench takes from the command line (EngineConfig declares
# their flags); the tier settings only shape the ragkv+tiers lane.
ENGINE_FLAGS = (
    "model",
    "device",
    "dtype",
    "kv_cache_tokens",
    "block_size",
    "schedule_policy",
    "prepack_linear",
    "compile",
)
TIER_FLAGS = ("host_cache_bytes", "kv_store_dir", "kv_store_bytes", "kv_tier_write_policy")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="compare no-cache / apc / apc+assembler / ragkv / ragkv-batch lanes on one workload",
        description="Replay the same requests through several lanes side by side "
        "(see docs/benchmarks.md). Exits 1 when greedy outputs of identical prompts differ.",
    )
    p.add_argument(
        "--workload",
        choices=("synthetic", "production", "trace", "ragpulse"),
        default="synthetic",
        help="synthetic (short system prompt, timestamp at its end), production (long system "
        "prompt changing in the middle, Zipf passages, sessions), a trace file, or a RAGPulse "
        "trace directory (a real production RAG service's requests)",
    )
    p.add_argument(
        "--model-free",
        action="store_true",
        help="no model: the lanes' real pipelines against a simulated engine (the same prefix "
        "cache and pool, one request at a time); seconds instead of hours, plus the "
        "position-independent bound",
    )
    add_engine_flags(
        p,
        ENGINE_FLAGS,
        overrides={"kv_cache_tokens": {"help": "KV pool (default: half the unique tokens)"}},
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=BENCH_MAX_TOKENS,
        help=f"generated tokens per request (default {BENCH_MAX_TOKENS}; the bench measures "
        "prefill)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per lane")
    p.add_argument("--order", choices=("stable-first", "cache-aware"), default="cache-aware")
    p.add_argument(
        "--lanes",
        default=",".join(LANES),
        help=f"comma-separated lanes (default {','.join(LANES)}; also: "
        f"{', '.join(n for n in ALL_LANES if n not in LANES)})",
    )
    p.add_argument(
        "--reuse",
        choices=("blend",),
        help=f"add the {BLEND_LANE} lane: the ragkv lane's prompts with opt-in position-"
        "independent chunk reuse (approximate; compared with ragkv's greedy outputs)",
    )
    p.add_argument(
        "--blend-k",
        type=int,
        help="tokens recomputed per reused chunk in the ragkv+blend lane (default: "
        "BlendConfig's, 16; 0 with first-k is naive reuse; with a ratio, its floor)",
    )
    p.add_argument(
        "--blend-strategy",
        choices=("first-k", "deviation", "none"),
        help="which tokens of a reused chunk the ragkv+blend lane recomputes (default: "
        "BlendConfig's, deviation)",
    )
    p.add_argument(
        "--blend-ratio",
        type=float,
        help="recompute this share of each reused chunk (ceil(ratio x tokens), at least "
        "--blend-k) in the ragkv+blend lane (default: the strategy's, 0.15 with deviation, 0 with "
        "first-k: --blend-k alone)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a first look: {QUICK_REQUESTS} requests on {QUICK_TOPICS} topics, "
        f"{QUICK_MAX_TOKENS} output tokens (under 2 minutes on 2 cores)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the full-size workload ({FULL_REQUESTS} requests, about 4x longer than the default)",
    )
    g = p.add_argument_group("synthetic workload")
    g.add_argument(
        "--requests", type=int, help=f"default {DEFAULT_REQUESTS} ({FULL_REQUESTS} with --full)"
    )
    g.add_argument(
        "--topics", type=int, help=f"default {DEFAULT_TOPICS} ({FULL_TOPICS} with --full)"
    )
    g.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of topic popularity")
    g.add_argument(
        "--query-variants", type=int, default=3, help="retrieval phrasings per question (3)"
    )
    g.add_argument("--top-k", type=int, default=4, help="chunks retrieved per phrasing (4)")
    g.add_argument("--follow-up-rate", type=float, help="synthetic 0.2, production 0.3")
    g.add_argument("--questions-per-topic", type=int, default=4, help="distinct questions (4)")
    g.add_argument("--no-timestamp", action="store_true", help="no timestamp in the system prompt")
    g.add_argument("--chunk-size", type=int, default=400, help="characters per corpus window")
    g.add_argument("--chunk-overlap", type=int, default=100, help="characters (100)")
    w = p.add_argument_group("production workload (--requests, --top-k, --seed also apply)")
    w.add_argument("--passages", type=int, help="distinct passages in the pool (2 per request)")
    w.add_argument(
        "--duplicate-rate", type=float, default=0.05, help="requests retrieving a passage twice"
    )
    r = p.add_argument_group(
        "replica lanes (cache-aware routing, see docs/benchmarks.md, 'Replica lanes')"
    )
    r.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="N >= 2: instead of the lanes, run N in-process replicas (1/N of the pool "
        "each) behind the router, one lane per --routing policy, plus one engine holding "
        "the whole pool",
    )
    r.add_argument(
        "--routing",
        default="round-robin,least-loaded,prefix",
        help="comma-separated routing policies for --replicas (prefix-events: prefix "
        "routing on the replicas' KV events)",
    )
    r.add_argument(
        "--balance-threshold",
        type=int,
        default=4,
        help="prefix routing yields to least-loaded past this many extra requests in flight",
    )
    r.add_argument(
        "--max-load-ratio",
        type=float,
        default=None,
        help="bounded loads for short matches (under half the prompt) instead of "
        "--balance-threshold: the prefix choice may have at most this multiple of the mean "
        "requests in flight (e.g. 1.5)",
    )
    r.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the replica lanes N times (fresh engines each time) and report each "
        "ratio's median and range: one run moves by several per cent with timing alone",
    )
    t = p.add_argument_group("trace workload")
    t.add_argument("--trace", help="JSONL file, one request per line (segment ids by role)")
    t.add_argument("--lengths", help="JSON object {segment id: token length}")
    t = p.add_argument_group("RAGPulse trace (--workload ragpulse)")
    t.add_argument("--trace-dir", help="directory with 0_trace.jsonl and the length tables")
    t.add_argument("--days", help="days to replay, 1-based: 2 or 1-3 (default: all)")
    t.add_argument("--skip", type=int, default=0, help="requests to skip first")
    t.add_argument("--limit", type=int, help="requests to replay at most")
    t.add_argument("--scale", type=float, default=1.0, help="segment lengths x F (0 < F <= 1)")
    k = p.add_argument_group(f"KV tiers (the {TIERS_LANE} lane; a tier flag adds the lane)")
    add_engine_flags(
        k,
        TIER_FLAGS,
        overrides={
            "host_cache_bytes": {  # None (not the engine's 0): sized to the workload
                "default": None,
                "help": "host-memory tier (default: room for every distinct block of the "
                "workload)",
            },
            "kv_store_dir": {"help": "disk tier directory (default: none; with --restart a "
                             "temporary one)"},
        },
    )  # fmt: skip
    k.add_argument(
        "--restart",
        action="store_true",
        help=f"run {TIERS_LANE} twice, the second time on a new engine over the same store",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout)")
    o.add_argument("--plot", metavar="FILE.png", help="plot tokens and TTFT (needs ragkv[bench])")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def build_workload(args: argparse.Namespace) -> Any:
    from ragkv.bench.production import ProductionConfig, production_workload
    from ragkv.bench.workload import SyntheticConfig, synthetic_workload, trace_workload
    from ragkv.errors import ConfigError

    if args.workload == "ragpulse":
        from ragkv.bench.ragpulse import parse_days, ragpulse_workload

        if not args.trace_dir:
            raise ConfigError("--workload ragpulse needs --trace-dir DIR")
        return ragpulse_workload(
            args.trace_dir,
            bench_tokenizer(args.model),
            days=parse_days(args.days),
            skip=args.skip,
            limit=args.limit,
            scale=args.scale,
            seed=args.seed,
        )
    if args.workload == "trace":
        if not args.trace or not args.lengths:
            raise ConfigError("--workload trace needs --trace FILE.jsonl and --lengths FILE.json")
        return trace_workload(args.trace, args.lengths, bench_tokenizer(args.model), seed=args.seed)
    size = (QUICK_REQUESTS, QUICK_TOPICS) if args.quick else (DEFAULT_REQUESTS, DEFAULT_TOPICS)
    requests = args.requests or (FULL_REQUESTS if args.full else size[0])
    topics = args.topics or (FULL_TOPICS if args.full else size[1])
    if args.workload == "production":
        return production_workload(
            ProductionConfig(
                requests=requests,
                passages=args.passages or 2 * requests,
                top_k=args.top_k,
                duplicate_rate=args.duplicate_rate,
                follow_up_rate=0.3 if args.follow_up_rate is None else args.follow_up_rate,
                chunk_size=args.chunk_size,
                chunk_overlap=args.chunk_overlap,
                seed=args.seed,
            )
        )
    return synthetic_workload(
        SyntheticConfig(
            requests=requests,
            topics=topics,
            zipf_s=args.zipf,
            query_variants=args.query_variants,
            top_k=args.top_k,
            follow_up_rate=0.2 if args.follow_up_rate is None else args.follow_up_rate,
            timestamp=not args.no_timestamp,
            questions_per_topic=args.questions_per_topic,
            chunk_size=args.chunk_size,
            chunk_overlap=args.chunk_overlap,
            seed=args.seed,
        )
    )


def bench_tokenizer(model: str | None) -> Any:
    """The tokenizer of ``--model`` (default: the embedded model's), loaded once per run."""
    if model not in _TOKENIZERS:
        from transformers import AutoTokenizer

        from ragkv.bench.runner import model_path

        _TOKENIZERS[model] = AutoTokenizer.from_pretrained(model_path(model))
    return _TOKENIZERS[model]


_TOKENIZERS: dict[str | None, Any] = {}


def run(args: argparse.Namespace) -> int:
    with quiet_invalidator_warning():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ragkv.errors import ConfigError

    if args.quick and args.full:
        raise ConfigError("--quick and --full ask for different sizes; pick one")
    if args.repeat < 1 or (args.repeat > 1 and not args.replicas):
        raise ConfigError(f"--repeat N (>= 1) repeats the --replicas lanes; got {args.repeat}")
    if args.quick and args.max_tokens == BENCH_MAX_TOKENS:
        args.max_tokens = QUICK_MAX_TOKENS
    from ragkv.bench.report import format_table, plot
    from ragkv.bench.runner import run_bench

    workload = build_workload(args)
    if args.replicas:
        return _run_replicas(args, workload)
    if args.model_free:
        return _run_model_free(args, workload)
    config = _bench_config(
        args,
        lanes=bench_lanes(args),
        blend=_blend_config(args),
        restart=args.restart,
        **engine_settings(args, TIER_FLAGS),
    )
    report, results = run_bench(workload, config, on_estimate=_print_estimate(args, workload))
    _print_report(args, report, format_table)
    if args.plot:
        plot(report, results, args.plot)
    return 0 if report["determinism"]["ok"] or not report["determinism"]["strict"] else 1


def _run_model_free(args: argparse.Namespace, workload: Any) -> int:
    from ragkv.bench.model_free import run_model_free
    from ragkv.bench.report import format_table

    config = _bench_config(args, lanes=bench_lanes(args))
    report, results = run_model_free(workload, config, bench_tokenizer(args.model))

    def table(report: dict[str, Any]) -> str:
        bound = report["bounds"].get("position_independent_hit_rate")
        if bound is None:
            return format_table(report)
        return (
            f"{format_table(report)}\nposition-independent bound (any position, unbounded "
            f"cache): {bound:.1%} hit"
        )

    _print_report(args, report, table)
    if args.plot:
        from ragkv.bench.report import plot

        plot(report, results, args.plot)
    return 0


def _blend_config(args: argparse.Namespace) -> Any:
    """The ragkv+blend lane's settings from ``--blend-*`` (None: ``BlendConfig()``); a bad
    combination raises ``ConfigError`` naming the field."""
    if args.blend_k is None and args.blend_strategy is None and args.blend_ratio is None:
        return None
    from ragkv.cache_engine.chunk_reuse import BlendConfig

    default = BlendConfig()
    return BlendConfig(
        args.blend_strategy or default.strategy,
        k=default.k if args.blend_k is None else args.blend_k,
        ratio=args.blend_ratio,  # None: the strategy's (0.15 deviation, 0 first-k)
    )


def _bench_config(args: argparse.Namespace, **fields: Any) -> Any:
    """The engine-side settings every kind of run takes from the flags, plus ``fields``."""
    from ragkv.bench.runner import BenchConfig

    return BenchConfig(
        **engine_settings(args, ENGINE_FLAGS),
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        order=args.order,
        progress=not args.no_progress,
        **fields,
    )


def _print_report(args: argparse.Namespace, report: dict[str, Any], table: Any) -> None:
    """The report as JSON on stdout (``--json -``), else the table (and ``--json FILE``)."""
    from ragkv.bench.report import write_json

    if args.json == "-":
        print(json.dumps(report, indent=2))
        return
    print(table(report))
    if args.json:
        write_json(report, args.json)


def _run_replicas(args: argparse.Namespace, workload: Any) -> int:
    from ragkv.bench.replicas import format_replica_table, repeat_summary, run_replica_bench

    config = _bench_config(args)
    policies = [name.strip() for name in args.routing.split(",") if name.strip()]
    reports = [
        run_replica_bench(
            workload, config, args.replicas, policies, args.balance_threshold, args.max_load_ratio
        )[0]
        for _ in range(args.repeat)
    ]
    report = reports[0] if len(reports) == 1 else repeat_summary(reports)
    _print_report(args, report, format_replica_table)
    strict = report["determinism"]["strict"]
    return 0 if all(r["determinism"]["ok"] for r in reports) or not strict else 1


def bench_lanes(args: argparse.Namespace) -> list[str]:
    """``--lanes``, plus the tiers lane when a tier flag asks for it, and the chunk reuse
    lane with ``--reuse blend``."""
    lanes = [name.strip() for name in args.lanes.split(",") if name.strip()]
    wants_tiers = args.host_cache_bytes is not None or args.kv_store_dir is not None
    if wants_tiers and TIERS_LANE not in lanes:
        lanes.append(TIERS_LANE)
    if args.reuse == "blend" and BLEND_LANE not in lanes:
        lanes.append(BLEND_LANE)
    return lanes


def _print_estimate(args: argparse.Namespace, workload: Any) -> Any:
    """Print the ETA (to stderr, so ``--json -`` stays clean) before the lanes start."""

    def show(seconds: float) -> None:
        lanes = len(bench_lanes(args))
        print(
            f"ragkv bench: {lanes} lanes x {len(workload.requests)} {workload.name} requests, "
            f"estimated {seconds / 60:.1f} min on this machine (calibrated by one prefill)",
            file=sys.stderr,
            flush=True,
        )

    return show


@contextmanager
def quiet_invalidator_warning() -> Iterator[None]:
    """The synthetic workload's timestamp is an invalidator on purpose; the lanes show its cost."""
    logger = logging.getLogger("ragkv.assembler.slots")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
