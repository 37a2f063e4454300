"""The four lanes on a tiny model: accounting, cache behaviour, determinism, CLI outputs."""

from __future__ import annotations

import gc
import json

import pytest

from ragkv.bench.lanes import LANES
from ragkv.bench.runner import BenchConfig, run_bench
from ragkv.bench.workload import synthetic_workload
from ragkv.cli import main

LANE_KEYS = {
    "prompt_tokens",
    "dedup_removed_tokens",
    "prefill_tokens_computed",
    "cached_tokens",
    "hit_rate",
    "ttft_p50_s",
    "ttft_p95_s",
    "output_tokens_per_s",
    "peak_kv_blocks",
    "evictions",
    "wall_s",
}


@pytest.fixture(scope="module")
def bench(tiny_bench, small_config):
    # No follow-ups: every lane sends the same segments, so token counts line up exactly.
    workload = synthetic_workload(small_config(requests=10, follow_up_rate=0.0, topics=2))
    return run_bench(workload, tiny_bench())


def test_every_lane_reports_the_documented_keys(bench):
    report, _ = bench
    assert list(report["lanes"]) == list(LANES)
    for lane in report["lanes"].values():
        assert set(lane) >= LANE_KEYS
    assert {"lanes", "workload", "machine", "determinism", "ratios"} <= set(report)
    assert report["machine"]["dtype"] == "float32"


def test_no_cache_lane_reuses_nothing_and_computes_every_prompt_token(bench):
    lane = bench[0]["lanes"]["no-cache"]
    assert lane["cached_tokens"] == 0 and lane["hit_rate"] == 0.0
    assert lane["prefill_tokens_computed"] >= lane["prompt_tokens"]


def test_baselines_send_the_same_tokens_and_dedup_accounts_for_the_difference(bench):
    lanes = bench[0]["lanes"]
    assert lanes["no-cache"]["prompt_tokens"] == lanes["apc"]["prompt_tokens"]
    # The assembler only reorders; moving a changing system-prompt part after the chunks
    # adds one separator ("\n\n", at most 2 tokens) to a request.
    added = lanes["apc+assembler"]["prompt_tokens"] - lanes["apc"]["prompt_tokens"]
    assert 0 <= added <= 2 * len(bench[1][0].records)
    removed = lanes["ragkv"]["dedup_removed_tokens"]
    assert removed > 0
    assert lanes["ragkv"]["prompt_tokens"] + removed == lanes["apc+assembler"]["prompt_tokens"]


def test_the_savings_stack(bench):
    lanes = bench[0]["lanes"]
    computed = {name: lane["prefill_tokens_computed"] for name, lane in lanes.items()}
    assert computed["ragkv"] < computed["apc+assembler"] <= computed["apc"] <= computed["no-cache"]
    assert lanes["apc+assembler"]["cached_tokens"] > lanes["apc"]["cached_tokens"]


def test_identical_prompts_give_identical_greedy_outputs_across_lanes(bench):
    report, results = bench
    d = report["determinism"]
    # no-cache and apc send byte-identical prompts for every request.
    assert d["identical_prompt_pairs"] >= len(results[0].records)
    assert d["strict"] and d["mismatches"] == 0 and d["ok"]


def test_determinism_check_catches_a_changed_output(bench):
    from ragkv.bench.report import determinism

    _, results = bench
    record = results[1].records[0]
    original = record.token_ids
    record.token_ids = [t + 1 for t in original]
    try:
        assert determinism(results)["mismatches"] >= 1
    finally:
        record.token_ids = original


def _cli(tiny_model, *extra):
    return [
        "bench", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
        "--max-tokens", "2", "--concurrency", "2", "--no-progress", *extra,
    ]  # fmt: skip


def test_cli_synthetic_writes_json_and_plot(tiny_model, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = _cli(tiny_model, "--requests", "4", "--topics", "2", "--chunk-size", "200",
                "--chunk-overlap", "50", "--lanes", "apc,ragkv", "--json", str(out), "--plot", str(png))  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert list(report["lanes"]) == ["apc", "ragkv"]
    assert report["workload"]["kind"] == "synthetic" and report["workload"]["requests"] == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "ragkv" in capsys.readouterr().out


def test_cli_trace_replays_to_json(tiny_model, tmp_path):
    trace, lengths, out = tmp_path / "t.jsonl", tmp_path / "l.json", tmp_path / "r.json"
    lines = [
        {"session_id": "a", "system": ["sys"], "passages": ["p1", "p2", "p1"], "user": ["q1"]},
        {"session_id": "b", "system": ["sys"], "passages": ["p2", "p1"], "user": ["q2"]},
        {"session_id": "a", "system": ["sys"], "passages": ["p1"], "history": ["q1", "a1"], "user": ["q3"]},
    ]  # fmt: skip
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    lengths.write_text(
        json.dumps({"sys": 20, "p1": 64, "p2": 48, "q1": 6, "q2": 5, "q3": 7, "a1": 9})
    )
    args = _cli(tiny_model, "--workload", "trace", "--trace", str(trace), "--lengths", str(lengths),
                "--json", str(out))  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["workload"]["kind"] == "trace" and report["lanes"]["ragkv"]["requests"] == 3
    assert report["lanes"]["ragkv"]["dedup_removed_tokens"] >= 64


def test_cli_trace_without_files_is_a_clear_error(tiny_model, capsys):
    assert main(_cli(tiny_model, "--workload", "trace")) == 1
    assert "--trace" in capsys.readouterr().err


def test_a_prompt_over_the_model_context_is_a_clear_error_and_no_stray_task(
    tiny_model, caplog, capsys
):
    # 2,000-character windows tokenize past the tiny model's 2,048-token context; a follow-up
    # then stops the dispatch loop while other requests are in flight.
    args = _cli(tiny_model, "--requests", "8", "--topics", "2", "--follow-up-rate", "0.5",
                "--chunk-size", "2000", "--chunk-overlap", "0", "--lanes", "no-cache")  # fmt: skip
    assert main(args) == 1
    assert "--chunk-size" in capsys.readouterr().err
    gc.collect()  # asyncio reports an unawaited task's exception when the task is collected
    assert "never retrieved" not in caplog.text


async def test_run_bench_works_inside_a_running_event_loop(tiny_model, small_config):
    """Notebooks run an event loop; the bench must not call asyncio.run on it."""
    workload = synthetic_workload(small_config(requests=3, follow_up_rate=0.0))
    config = BenchConfig(
        model=tiny_model, device="cpu", dtype="float32", max_tokens=2, lanes=["ragkv"]
    )
    report, _ = run_bench(workload, config)
    assert report["lanes"]["ragkv"]["requests"] == 3


def test_quick_is_a_small_run_and_refuses_full(capsys, tiny_model):
    from ragkv.bench.cli import QUICK_REQUESTS

    parser_args = ["bench", "--quick", "--model", tiny_model, "--model-free", "--json", "-",
                   "--no-progress"]  # fmt: skip
    assert main(parser_args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["requests"] == QUICK_REQUESTS
    assert report["machine"]["max_tokens"] == 2
    assert main(["bench", "--quick", "--full", "--model", tiny_model, "--model-free"]) == 1
    assert "pick one" in capsys.readouterr().err
