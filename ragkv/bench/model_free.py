"""``ragkv bench --model-free``: the lanes' prompts against a simulated engine, in seconds.

Each lane is the real :class:`ragkv.Pipeline` (dedup, the lane's assembler) on a fresh
:class:`~ragkv.bench.simulated.SimulatedEngine` holding the same KV pool, replayed one
request at a time. The report has the engine-backed bench's lane keys (``hit_rate``,
``prefill_tokens_computed``, ...; times are zero) and ratios, plus ``bounds``: the
position-independent bound, the share of prompt tokens in segments (chunks, system parts,
history turns, questions) that an earlier request already sent, wherever they stood and
with an unbounded cache. That bound is what off-prefix reuse could reach at best; the exact
prefix path cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ragkv.bench.lanes import LANES, LaneResult, lane_specs, run_lane
from ragkv.bench.report import lane_summary, ratios
from ragkv.bench.runner import BenchConfig, profile_workload
from ragkv.bench.simulated import SimulatedEngine
from ragkv.bench.workload import Workload
from ragkv.errors import ConfigError


def run_model_free(
    workload: Workload, config: BenchConfig, tokenizer: Any
) -> tuple[dict[str, Any], list[LaneResult]]:
    """Every lane of ``config.lanes`` on a simulated engine; returns (report, results).

    The replay is sequential (``config.concurrency`` is not used): what a pool of
    ``config.kv_cache_tokens`` holds when requests arrive one after another.
    """
    names = list(config.lanes)
    exact = set(LANES)
    unsupported = [n for n in names if n not in exact]
    if unsupported:
        raise ConfigError(
            f"--model-free runs the lanes {', '.join(LANES)}; {', '.join(unsupported)} need "
            "a model (tiers and chunk reuse move real K/V)"
        )
    kv_tokens = config.kv_cache_tokens
    if kv_tokens is None:
        profile = profile_workload(
            workload, tokenizer, config.block_size, config.max_tokens, config.order
        )
        kv_tokens = profile.kv_tokens(config.block_size)

    def make_engine(spec: Any) -> SimulatedEngine:
        return SimulatedEngine(
            tokenizer,
            kv_tokens,
            block_size=config.block_size,
            enable_prefix_caching=spec.prefix_caching,
        )

    from ragkv.cache_engine import SamplingParams

    params = SamplingParams(max_tokens=config.max_tokens)
    results, bound = [], None
    for spec in lane_specs(names, config.order):
        result = run_lane(
            spec,
            workload,
            make_engine,
            params,
            concurrency=1,
            progress=config.progress,
            keep_answers=bound is None and spec.name == "ragkv",
        )
        if result.answers:
            bound = position_independent_bound(result.answers)
            result.answers = []
        for record in result.records:
            record.prompt_token_ids = []  # a model-free replay has no outputs to compare
        results.append(result)
    lanes = {r.spec.name: lane_summary(r) for r in results}
    report = {
        "lanes": lanes,
        "workload": workload.params,
        "machine": {
            "engine": "simulated (model-free)",
            "model": "no model (simulated engine)",
            "dtype": "-",
            "kv_cache_tokens": kv_tokens,
            "block_size": config.block_size,
            "max_tokens": config.max_tokens,
            "concurrency": 1,
            "order": config.order,
        },
        "determinism": {
            "identical_prompt_pairs": 0,
            "mismatches": 0,
            "ok": True,
            "strict": False,
            "note": "model-free: no outputs to compare",
        },
        "ratios": ratios(lanes, workload.params.get("kind", "synthetic")),
        "bounds": {} if bound is None else bound,
    }
    return report, results


def position_independent_bound(answers: Sequence[Any]) -> dict[str, float | int]:
    """Per request, the larger of its exact cached prefix and its tokens in segments an
    earlier request sent (any position); summed over the requests, over the prompt tokens."""
    seen: set[bytes] = set()
    prompt = reusable = 0
    for answer in answers:
        segments = answer.plan.segments
        again = sum(s.end - s.start for s in segments if s.content_hash in seen)
        seen.update(s.content_hash for s in segments)
        prompt += answer.usage.prompt_tokens
        reusable += max(again, answer.usage.cached_tokens)
    return {
        "position_independent_tokens": reusable,
        "position_independent_hit_rate": reusable / prompt if prompt else 0.0,
    }
