"""``benchmarks/engine_load.py`` runs and reports every level (issue 31's load shape)."""

from __future__ import annotations

import json

from support import benchmark_script


def test_a_small_run_reports_each_concurrency_level(tiny_model, tmp_path):
    out = tmp_path / "load.json"
    with benchmark_script("engine_load") as load:
        load.main(
            ["--model", tiny_model, "--requests", "3", "--concurrency", "1,2",
             "--system-tokens", "40", "--new-tokens", "8", "--output-tokens", "3",
             "--json", str(out)]
        )  # fmt: skip
    levels = json.loads(out.read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]
    assert levels[0]["vs_first_level"] == 1.0
    assert all(level["req_per_s"] > 0 and level["ttft_p50_s"] > 0 for level in levels)
    assert all(level["itl_p50_s"] > 0 for level in levels)  # 3 tokens: 2 gaps each
