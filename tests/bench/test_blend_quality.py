"""``benchmarks/blend_quality.py --quick``: the harness runs, recomputing every reused token
matches the exact path (KL 0), and naive reuse computes fewer prompt tokens; a small run on
the default model stays within loose quality bounds."""

from __future__ import annotations

import json

import pytest
from support import benchmark_script


@pytest.fixture(scope="module")
def harness():
    with benchmark_script("blend_quality") as module:
        yield module


def test_quick_run_on_a_tiny_model_is_exact_when_everything_is_recomputed(
    harness, tiny_model, tmp_path
):
    out = tmp_path / "quality.json"
    harness.main(
        ["--quick", "--recompute-all", "--model", tiny_model, "--answer-tokens", "8",
         "--json", str(out), "--plot", str(tmp_path / "pareto.png")]
    )  # fmt: skip
    report = json.loads(out.read_text())
    rows = {row["setting"]: row for row in report["settings"]}
    assert set(rows) == {"naive", "first-k=16", "recompute-all"}
    assert rows["recompute-all"]["mean_kl"] < 1e-8
    assert rows["recompute-all"]["reused_nonprefix_tokens"] == 0
    naive = rows["naive"]
    assert naive["reused_nonprefix_tokens"] > 0 and naive["recompute_share"] == 0
    assert naive["computed_prompt_tokens"] < report["exact"]["computed_prompt_tokens"]
    assert rows["first-k=16"]["computed_prompt_tokens"] > naive["computed_prompt_tokens"]
    assert naive["positions"] == 8
    assert (tmp_path / "pareto.png").stat().st_size > 0


def test_quick_run_on_the_default_model_stays_close_to_exact(harness):
    report = harness.run(harness.parse_args(["--quick"]))
    # Named first: with no rows the bounds below would hold vacuously.
    assert {row["setting"] for row in report["settings"]} == {"naive", "first-k=16"}
    for row in report["settings"]:
        assert row["mean_kl"] < 0.2, row
        assert row["top1_agreement"] >= 0.8, row
        assert row["recompute_share"] <= 0.25, row
