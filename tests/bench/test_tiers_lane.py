"""The ragkv+tiers lane and its restart run on a tiny model: same outputs, fewer prefills."""

from __future__ import annotations

import json

from ragkv.bench.runner import run_bench
from ragkv.bench.workload import synthetic_workload
from ragkv.cli import main


def test_tiers_lane_recovers_what_a_small_pool_evicts_and_restart_reads_the_store(
    tiny_bench, small_config, tmp_path
):
    workload = synthetic_workload(small_config(requests=8, follow_up_rate=0.0, topics=2))
    config = tiny_bench(
        kv_cache_tokens=1536,  # one prompt fits; well below the workload's distinct blocks
        lanes=["ragkv", "ragkv+tiers"],
        kv_store_dir=str(tmp_path / "store"),
        restart=True,
    )
    report, _ = run_bench(workload, config)
    lanes = report["lanes"]
    assert list(lanes) == ["ragkv", "ragkv+tiers", "ragkv+tiers/restart"]
    assert report["determinism"]["ok"] and report["determinism"]["identical_prompt_pairs"] > 0
    computed = {name: lane["prefill_tokens_computed"] for name, lane in lanes.items()}
    assert computed["ragkv+tiers"] <= computed["ragkv"]
    assert computed["ragkv+tiers/restart"] < computed["ragkv+tiers"]
    restart = lanes["ragkv+tiers/restart"]
    assert restart["tier_hit_tokens"].get("disk", 0) > 0
    assert sum(restart["tier_hit_tokens"].values()) == restart["cached_tokens"]
    assert report["ratios"]["prefill_restart_vs_first"] < 1.0


def test_a_tier_flag_adds_the_tiers_lane(tiny_model, tmp_path):
    out = tmp_path / "r.json"
    args = [
        "bench", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
        "--max-tokens", "2", "--concurrency", "2", "--no-progress", "--requests", "3",
        "--topics", "2", "--chunk-size", "200", "--chunk-overlap", "50", "--lanes", "ragkv",
        "--host-cache-bytes", str(1 << 22), "--json", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert list(report["lanes"]) == ["ragkv", "ragkv+tiers"]
    assert report["machine"]["host_cache_bytes"] == 1 << 22
