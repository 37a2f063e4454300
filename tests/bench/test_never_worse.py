"""Bench invariant: the assembler lanes never compute more prefill than apc, on every workload."""

from __future__ import annotations

import json

import pytest

from ragkv.bench.production import INSTRUCTIONS, POLICIES, ProductionConfig, production_workload
from ragkv.bench.runner import estimate_seconds, profile_workload, run_bench
from ragkv.bench.workload import synthetic_workload, trace_workload
from ragkv.cli import main

LANES = ["apc", "apc+assembler", "ragkv"]


def _trace(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    lines, lengths = [], {"sysA": 60, "sysB": 50, "q": 6, "a": 5}
    for i in range(10):
        lengths[f"now{i}"] = 8
        passages = [f"p{(i * 3 + j) % 7}" for j in range(3)]
        lines.append(
            {"session_id": f"s{i % 4}", "system": ["sysA", f"now{i}", "sysB"],
             "passages": passages, "history": ["q", "a"] if i % 3 else [], "user": ["q"]}
        )  # fmt: skip
    lengths.update({f"p{j}": 40 + j for j in range(7)})
    trace, table = tmp_path / "t.jsonl", tmp_path / "l.json"
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    table.write_text(json.dumps(lengths))
    return trace_workload(trace, table, AutoTokenizer.from_pretrained(tiny_model))


@pytest.mark.parametrize("kind", ["synthetic", "production", "trace"])
def test_assembler_lanes_never_compute_more_prefill_than_apc(
    tiny_model, tiny_bench, small_config, tmp_path, kind
):
    if kind == "synthetic":
        workload = synthetic_workload(small_config(requests=12))
    elif kind == "production":
        workload = production_workload(
            ProductionConfig(requests=12, passages=10, chunk_size=200, chunk_overlap=50)
        )
    else:
        workload = _trace(tmp_path, tiny_model)
    report, _ = run_bench(workload, tiny_bench(lanes=LANES))
    computed = {name: lane["prefill_tokens_computed"] for name, lane in report["lanes"].items()}
    assert computed["apc+assembler"] <= computed["apc"], computed
    assert computed["ragkv"] <= computed["apc"], computed
    assert report["ratios"]["never_worse_than_apc"] == {"apc+assembler": True, "ragkv": True}
    if kind != "synthetic":  # the changing part sits in the middle: the assembler must gain
        assert computed["ragkv"] < computed["apc"]


def test_production_workload_shape():
    workload = production_workload(ProductionConfig(requests=40, passages=30, seed=3))
    systems = [r.system for r in workload.requests]
    assert len(set(systems)) == len(systems)  # the middle part changes on every request
    assert all(s.startswith(INSTRUCTIONS) and s.endswith(POLICIES) for s in systems)
    assert sum(r.follow_up for r in workload.requests) > 0
    assert all(len({c.text for c in r.chunks}) == 4 for r in workload.requests)
    orders = {tuple(c.text for c in r.chunks) for r in workload.requests}
    sets = {frozenset(c.text for c in r.chunks) for r in workload.requests}
    assert len(orders) >= len(sets)  # the same passages come in varying orders
    again = production_workload(ProductionConfig(requests=40, passages=30, seed=3))
    assert [r.system for r in again.requests] == systems


def test_the_estimate_grows_with_the_work(tiny_model, small_config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    small = profile_workload(synthetic_workload(small_config(requests=4)), tokenizer, 16, 2)
    large = profile_workload(synthetic_workload(small_config(requests=12)), tokenizer, 16, 2)
    assert small.sent_tokens >= small.ragkv_tokens >= small.distinct_tokens > 0
    lanes = ["no-cache", "apc", "apc+assembler", "ragkv"]
    assert estimate_seconds(large, 1e-3, 1e-2, lanes, 2, 2) > estimate_seconds(
        small, 1e-3, 1e-2, lanes, 2, 2
    )


def test_cli_prints_an_estimate_before_the_production_lanes(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = [
        "bench", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
        "--max-tokens", "2", "--concurrency", "2", "--no-progress", "--workload", "production",
        "--requests", "4", "--chunk-size", "200", "--chunk-overlap", "50", "--lanes", "apc,ragkv",
        "--json", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "estimated" in err and "min" in err and "production" in err
    report = json.loads(out.read_text())
    assert report["workload"]["kind"] == "production" and report["workload"]["passages"] == 8
