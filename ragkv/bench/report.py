"""Benchmark report: per-lane summary, determinism check, terminal table, JSON and plot.

JSON keys (stable): ``{"lanes": {lane: {...}}, "workload": {...}, "machine": {...},
"determinism": {...}, "ratios": {...}}``; see docs/benchmarks.md for each lane's keys.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ragkv.bench.lanes import LaneResult
from ragkv.bench.workload import Workload
from ragkv.errors import MissingDependencyError

# The issues' targets per workload kind (ratios of prefill tokens computed).
TARGETS = {
    "synthetic": {"prefill_ragkv_vs_apc": 0.5, "prefill_ragkv_vs_no_cache": 0.25},
    "production": {"prefill_ragkv_vs_apc": 0.85},
    "ragpulse": {"prefill_ragkv_vs_apc": 0.9},
}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def lane_summary(result: LaneResult) -> dict[str, Any]:
    """The documented per-lane numbers."""
    records, stats = result.records, result.stats
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    output = sum(r.completion_tokens for r in records)
    ttft = [r.ttft_s for r in records]
    e2e = [r.e2e_s for r in records]
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "dedup_removed_tokens": sum(r.dedup_removed_tokens for r in records),
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "cached_tokens": cached,
        "reused_nonprefix_tokens": sum(r.reused_nonprefix_tokens for r in records),
        "reused_approximate_prefix_tokens": sum(
            r.reused_approximate_prefix_tokens for r in records
        ),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "output_tokens": output,
        "output_tokens_per_s": output / result.wall_s if result.wall_s else 0.0,
        "peak_kv_blocks": stats.peak_used_blocks,
        "kv_blocks": stats.num_blocks,
        "evictions": stats.evictions,
        "preemptions": stats.preemptions,
        "wall_s": result.wall_s,
        "load_s": result.load_s,
        "prefix_caching": result.spec.prefix_caching,
        "order": result.spec.order,
        "dedup": result.spec.dedup,
        "tiers": result.spec.tiers,
        "tier_hit_tokens": dict(stats.tier_hit_tokens),  # reused tokens by tier (tiers lanes)
    }


def determinism(
    results: Sequence[LaneResult], *, strict: bool = True, max_examples: int = 5
) -> dict[str, Any]:
    """Compare greedy outputs of every pair of lanes that sent identical prompt ids.

    ``strict`` says whether a mismatch is a bug (the bench then exits non-zero). It is not
    in bf16 with batching: CPU/GPU GEMMs round differently for different batch shapes, and
    lanes batch different requests together, so a near-tie can flip a greedy token.
    """
    seen: dict[tuple[int, ...], list[tuple[str, int, list[int]]]] = {}
    for result in results:
        if result.spec.reuse:  # approximate by design: see blend_agreement
            continue
        for r in result.records:
            seen.setdefault(tuple(r.prompt_token_ids), []).append(
                (result.spec.name, r.index, r.token_ids)
            )
    pairs = mismatches = 0
    examples: list[dict[str, list[Any]]] = []
    for entries in seen.values():
        for i, (lane_a, index_a, out_a) in enumerate(entries):
            for lane_b, index_b, out_b in entries[i + 1 :]:
                if lane_a == lane_b:
                    continue
                pairs += 1
                if out_a != out_b:
                    mismatches += 1
                    if len(examples) < max_examples:
                        examples.append({"lanes": [lane_a, lane_b], "requests": [index_a, index_b]})
    by_lanes: dict[str, int] = {}
    for entries in seen.values():
        lanes = sorted({e[0] for e in entries})
        if len(lanes) > 1:
            key = " = ".join(lanes)
            by_lanes[key] = by_lanes.get(key, 0) + 1
    return {
        "identical_prompt_pairs": pairs,
        "mismatches": mismatches,
        "ok": mismatches == 0,
        "strict": strict,
        "shared_prompts_by_lanes": by_lanes,
        "examples": examples,
    }


def ratios(lanes: dict[str, dict[str, Any]], kind: str = "synthetic") -> dict[str, Any]:
    """ragkv against the baselines: prefill tokens computed and TTFT p50.

    ``never_worse_than_apc`` holds, per assembler lane, whether it computed no more
    prefill tokens than the ``apc`` lane (the app's own order with prefix caching).
    """
    out: dict[str, Any] = {}
    ragkv = lanes.get("ragkv")
    for base, tag in (("apc", "apc"), ("no-cache", "no_cache")):
        if ragkv is None or base not in lanes:
            continue
        b = lanes[base]
        if b["prefill_tokens_computed"]:
            out[f"prefill_ragkv_vs_{tag}"] = (
                ragkv["prefill_tokens_computed"] / b["prefill_tokens_computed"]
            )
        if b["ttft_p50_s"]:
            out[f"ttft_p50_ragkv_vs_{tag}"] = ragkv["ttft_p50_s"] / b["ttft_p50_s"]
    out.update(tier_ratios(lanes))
    batch = lanes.get("ragkv-batch")
    if ragkv is not None and batch is not None and ragkv["prefill_tokens_computed"]:
        out["prefill_batch_vs_ragkv"] = (
            batch["prefill_tokens_computed"] / ragkv["prefill_tokens_computed"]
        )
    apc = lanes.get("apc")
    if apc is not None:
        out["never_worse_than_apc"] = {
            name: lanes[name]["prefill_tokens_computed"] <= apc["prefill_tokens_computed"]
            for name in ("apc+assembler", "ragkv", "ragkv-batch")
            if name in lanes
        }
    targets = TARGETS.get(kind, {})
    out["targets_met"] = {key: out[key] <= limit for key, limit in targets.items() if key in out}
    return out


def blend_ratios(results: Sequence[LaneResult]) -> dict[str, float]:
    """The chunk reuse lane against the exact ragkv lane whose prompts it replayed:
    prefill tokens computed, and the share of requests with the same greedy output."""
    by_name = {r.spec.name: r for r in results}
    blend = next((r for r in results if r.spec.reuse), None)
    exact = by_name.get("ragkv")
    if blend is None or exact is None:
        return {}
    out: dict[str, float] = {}
    if exact.stats.prefill_tokens_computed:
        out["prefill_blend_vs_ragkv"] = (
            blend.stats.prefill_tokens_computed / exact.stats.prefill_tokens_computed
        )
    pairs = list(zip(exact.records, blend.records, strict=True))
    same = sum(a.token_ids == b.token_ids for a, b in pairs)
    out["greedy_agreement_blend_vs_ragkv"] = same / len(pairs) if pairs else 1.0
    return out


def tier_ratios(lanes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The KV tiers lane against ragkv (same pool), the unbounded pool, and its restart."""
    out: dict[str, float] = {}
    tiers = lanes.get("ragkv+tiers")
    if tiers is None:
        return out
    computed = tiers["prefill_tokens_computed"]
    for base, tag in (("ragkv", "ragkv"), ("ragkv/unbounded", "unbounded")):
        if base in lanes and lanes[base]["prefill_tokens_computed"]:
            out[f"prefill_tiers_vs_{tag}"] = computed / lanes[base]["prefill_tokens_computed"]
    restart = lanes.get("ragkv+tiers/restart")
    if restart is not None:
        if computed:
            out["prefill_restart_vs_first"] = restart["prefill_tokens_computed"] / computed
        if tiers["ttft_p50_s"]:
            out["ttft_p50_restart_vs_first"] = restart["ttft_p50_s"] / tiers["ttft_p50_s"]
    return out


def machine_info(engine_info: dict[str, Any]) -> dict[str, Any]:
    """Where and when the run happened (CPU model, cores, versions, dtype, model)."""
    import torch

    from ragkv._version import __version__

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ragkv": __version__,
        **engine_info,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_report(
    results: Sequence[LaneResult], workload: Workload, machine: dict[str, Any]
) -> dict[str, Any]:
    """The whole JSON document. Determinism is strict in fp32 or without batching."""
    lanes = {r.spec.name: lane_summary(r) for r in results}
    strict = machine.get("dtype") in ("float32", "fp32") or machine.get("concurrency") == 1
    return {
        "lanes": lanes,
        "workload": workload.params,
        "machine": machine,
        "determinism": determinism(results, strict=strict),
        "ratios": {
            **ratios(lanes, workload.params.get("kind", "synthetic")),
            **blend_ratios(results),
        },
    }


# Every table's columns, in the one order tables show them: (title, format, the lane's key).
# A table names the keys it shows.
COLUMNS = (
    ("prompt tok", "{:,}", "prompt_tokens"),
    ("dedup -tok", "{:,}", "dedup_removed_tokens"),
    ("prefill tok", "{:,}", "prefill_tokens_computed"),
    ("cached tok", "{:,}", "cached_tokens"),
    ("hit", "{:.0%}", "hit_rate"),
    ("requests/replica", "{}", "replica_requests"),
    ("imbalance", "{:.2f}", "imbalance"),
    ("TTFT p50", "{:.3f}s", "ttft_p50_s"),
    ("TTFT p95", "{:.3f}s", "ttft_p95_s"),
    ("e2e p50", "{:.3f}s", "e2e_p50_s"),
    ("out tok/s", "{:.1f}", "output_tokens_per_s"),
    ("peak blk", "{}", "peak_kv_blocks"),
    ("evict", "{}", "evictions"),
    ("wall", "{:.1f}s", "wall_s"),
)
_SHOWN = {key for _, _, key in COLUMNS} - {"replica_requests", "imbalance"}  # one engine


def format_table(report: dict[str, Any]) -> str:
    """The per-lane table plus ratio and determinism lines, for the terminal."""
    lines = table_lines(report["lanes"], _SHOWN)
    lines.append(
        "prefill tok: prompt tokens computed; cached tok: served from the prefix cache; "
        "hit: cached / prompt tok; dedup -tok: tokens of dropped duplicate chunks"
    )
    parts = ratio_parts(report["ratios"])
    if parts:
        lines.append("ragkv vs baselines  " + "; ".join(parts))
    d = report["determinism"]
    verdict = "ok" if d["ok"] else "MISMATCH" if d["strict"] else "bf16 batch-shape noise"
    lines.append(determinism_line(d, verdict))
    return "\n".join(lines)


def table_lines(lanes: dict[str, dict[str, Any]], keys: Collection[str]) -> list[str]:
    """One row per lane (its name, then those of :data:`COLUMNS` whose key is in ``keys``)
    under the titles and a rule, aligned (names left, figures right); a list value (one
    figure per replica) prints as ``a/b/c``."""
    columns = [column for column in COLUMNS if column[2] in keys]
    rows = [["lane", *(title for title, _, _ in columns)]]
    for name, lane in lanes.items():
        rows.append([name, *(_cell(fmt, lane[key]) for _, fmt, key in columns)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def _cell(fmt: str, value: Any) -> str:
    return "/".join(map(str, value)) if isinstance(value, list) else fmt.format(value)


def ratio_parts(ratios: dict[str, Any]) -> list[str]:
    """``name: 1.23x`` for each ratio that is a number (not the targets it is checked by)."""
    return [f"{k.replace('_', ' ')}: {v:.2f}x" for k, v in ratios.items() if isinstance(v, float)]


def determinism_line(d: dict[str, Any], verdict: str) -> str:
    """How many identical-prompt pairs the lanes had, how many answered differently."""
    return (
        f"determinism: {d['identical_prompt_pairs']} identical-prompt pairs across lanes, "
        f"{d['mismatches']} mismatches ({verdict})"
    )


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def plot(report: dict[str, Any], results: Sequence[LaneResult], path: str | Path) -> None:
    """Prefill tokens computed vs cached per lane, and TTFT distributions (PNG)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError("matplotlib", "bench") from exc
    names = list(report["lanes"])
    lanes = report["lanes"]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    bars, box = fig.subplots(1, 2)
    computed = [lanes[n]["prefill_tokens_computed"] for n in names]
    cached = [lanes[n]["cached_tokens"] for n in names]
    removed = [lanes[n]["dedup_removed_tokens"] for n in names]
    bars.bar(names, computed, label="prefill computed")
    bars.bar(names, cached, bottom=computed, label="served from cache")
    bottom = [a + b for a, b in zip(computed, cached, strict=True)]
    bars.bar(names, removed, bottom=bottom, label="removed by dedup", hatch="//", alpha=0.5)
    bars.set_ylabel("prompt tokens")
    bars.tick_params(axis="x", labelrotation=15)
    bars.set_title("Where the prompt tokens went")
    bars.legend(loc="upper left", bbox_to_anchor=(0.0, -0.12), ncols=3, fontsize="small")
    box.boxplot([[r.ttft_s for r in res.records] for res in results], tick_labels=names)
    box.set_ylabel("seconds")
    box.set_title("Time to first token")
    fig.suptitle(
        f"ragkv bench: {report['workload'].get('kind')} workload, "
        f"{report['machine'].get('model')} ({report['machine'].get('dtype')})"
    )
    fig.savefig(path, dpi=110)
