"""``ragkv bench --replicas``: the replica lanes run (synthetic and trace workloads), report
the documented keys, and prefix routing reuses more than round-robin on a workload where
documents recur (tiny random-weight model, in-process replicas)."""

from __future__ import annotations

import json

import pytest
from support import save_tiny_checkpoint

from ragkv.cli import main


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("route-llama"), "llama", seed=3))


def _cli(tiny_model, *extra):
    return [
        "bench", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
        "--max-tokens", "2", "--concurrency", "2", "--no-progress", "--replicas", "3", *extra,
    ]  # fmt: skip


def _run_trace(tiny_model, tmp_path, documents, *extra):
    """The bench's JSON report over a trace: request i asks ``documents[i]`` (96 tokens
    each) after a shared 16-token system prompt, in its own session."""
    trace, lengths, out = tmp_path / "t.jsonl", tmp_path / "l.json", tmp_path / "r.json"
    lines = [
        {"session_id": f"s{i}", "system": ["sys"], "passages": [d], "user": [f"q{i}"]}
        for i, d in enumerate(documents)
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines))
    table = {"sys": 16, **{d: 96 for d in documents}, **{f"q{i}": 5 for i in range(len(lines))}}
    lengths.write_text(json.dumps(table))
    args = _cli(tiny_model, "--workload", "trace", "--trace", str(trace), "--lengths",
                str(lengths), "--kv-cache-tokens", "1536", "--json", str(out), *extra)  # fmt: skip
    assert main(args) == 0
    return json.loads(out.read_text())


def test_replica_lanes_on_a_trace(tiny_model, tmp_path, capsys):
    report = _run_trace(tiny_model, tmp_path, [f"d{i % 3}" for i in range(12)])
    lanes = report["lanes"]
    assert list(lanes) == ["1x whole pool", "round-robin x3", "least-loaded x3", "prefix x3"]
    assert report["machine"]["kv_cache_tokens_per_replica"] == 512
    for name, lane in lanes.items():
        assert lane["requests"] == 12 and sum(lane["replica_requests"]) == 12
        assert len(lane["replica_requests"]) == (1 if name.startswith("1x") else 3)
        assert lane["prefill_tokens_computed"] + lane["cached_tokens"] == lane["prompt_tokens"]
    prefix, rr = lanes["prefix x3"], lanes["round-robin x3"]
    # Each document recurs every third request: round-robin sends it to the same replica
    # by accident only, prefix routing by design; both spread evenly.
    assert prefix["cached_tokens"] >= rr["cached_tokens"]
    assert prefix["imbalance"] <= 1.5
    assert prefix["reported_cached_tokens"] == prefix["cached_tokens"]
    assert report["determinism"]["ok"]
    assert set(report["ratios"]["targets_met"]) == {
        "prefix_vs_round_robin",
        "prefix_vs_whole_pool",
        "imbalance",
    }
    assert "prefix x3" in capsys.readouterr().out


def test_interleaved_documents_defeat_round_robin_not_prefix(tiny_model, tmp_path):
    # Two documents, each asked twice in a row: round-robin splits every pair.
    order = ["d0", "d0", "d1", "d1", "d0", "d0", "d1", "d1"]
    lanes = _run_trace(tiny_model, tmp_path, order, "--routing", "round-robin,prefix",
                       "--concurrency", "1")["lanes"]  # fmt: skip
    assert lanes["prefix x3"]["cached_tokens"] > lanes["round-robin x3"]["cached_tokens"]
    # Only the shared system block is lost: the second document starts on an empty replica.
    whole = lanes["1x whole pool"]["cached_tokens"]
    assert whole - 16 <= lanes["prefix x3"]["cached_tokens"] <= whole


def test_unknown_policy_is_a_clear_error(tiny_model, capsys):
    assert main(_cli(tiny_model, "--routing", "random")) == 1
    assert "random" in capsys.readouterr().err


def test_prefix_events_lane_routes_on_the_engines_events(tiny_model, tmp_path):
    order = ["d0", "d0", "d1", "d1", "d2", "d0", "d1", "d2"]
    report = _run_trace(tiny_model, tmp_path, order, "--routing", "prefix,prefix-events",
                        "--concurrency", "1")  # fmt: skip
    events = report["lanes"]["prefix-events x3"]
    assert events["events"] == ["synced"] * 3 and events["event_gaps"] == 0
    assert events["cached_tokens"] >= report["lanes"]["prefix x3"]["cached_tokens"]
    assert {"events_vs_whole_pool", "events_imbalance", "events_prediction_error"} <= set(
        report["ratios"]["targets_met"]
    )


def test_repeat_reports_each_runs_ratios_and_their_median_and_range(tiny_model, tmp_path, capsys):
    order = ["d0", "d0", "d1", "d1", "d2", "d0"]
    report = _run_trace(tiny_model, tmp_path, order, "--routing", "prefix-events",
                        "--concurrency", "1", "--repeat", "2")  # fmt: skip
    assert len(report["repeats"]) == 2
    for run in report["repeats"]:
        assert set(run["cached_tokens"]) == {"1x whole pool", "prefix-events x3"}
        assert run["determinism_ok"]
    # The table is the last run's, and so are the top-level ratios.
    assert report["repeats"][-1]["ratios"] == report["ratios"]
    spread = report["ratio_spread"]["events_vs_whole_pool"]
    runs = [run["ratios"]["events_vs_whole_pool"] for run in report["repeats"]]
    assert (spread["min"], spread["max"]) == (min(runs), max(runs))
    assert spread["median"] == pytest.approx(sum(runs) / 2)
    assert set(report["targets_met_median"]) == {
        "events_vs_whole_pool",
        "events_imbalance",
        "events_prediction_error",
    }
    assert "over 2 runs" in capsys.readouterr().out


def test_repeat_must_be_positive_and_goes_with_replicas(tiny_model, capsys):
    assert main(_cli(tiny_model, "--repeat", "0")) == 1
    assert "--repeat" in capsys.readouterr().err
    # Without --replicas nothing would repeat: refused, not silently run once.
    assert main(["bench", "--model", tiny_model, "--repeat", "2"]) == 1
    assert "--replicas" in capsys.readouterr().err


def test_a_bad_max_load_ratio_is_refused_before_any_engine_loads(tiny_model, capsys, monkeypatch):
    import ragkv.cache_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the settings were checked")

    monkeypatch.setattr(ragkv.cache_engine, "Engine", no_engine)
    assert main(_cli(tiny_model, "--max-load-ratio", "0.5")) == 1
    assert "max_load_ratio" in capsys.readouterr().err
