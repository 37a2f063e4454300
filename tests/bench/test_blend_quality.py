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


ROW_KEYS = {"setting", "default", "recompute_ratio", "kl", "top1", "answer_f1", "ttft_ratio"}


def tiny_musique(path):
    """A MuSiQue-format file (two examples, four short passages each) for the tiny model."""
    words = ["river", "castle", "author", "college", "library", "museum", "bridge", "tower"]
    examples = []
    for e in range(2):
        ctxs = [
            {"title": "", "text": " ".join(f"the {words[(e + p + i) % len(words)]} of {p}{i}." for i in range(12))}
            for p in range(4)
        ]  # fmt: skip
        examples.append({"question": f"Where is the {words[e]}?", "answers": ["x"], "ctxs": ctxs})
    path.write_text(json.dumps(examples))
    return path


def test_dataset_rows_have_the_schema_and_the_exact_row_agrees_with_the_reference(
    harness, tiny_model, tmp_path
):
    out = tmp_path / "musique.json"
    data = tiny_musique(tmp_path / "musique_dev.json")
    harness.main(
        ["--dataset", str(data), "--examples", "2", "--passages", "4", "--model", tiny_model,
         "--ks", "4", "--deviation-ks", "4", "--answer-tokens", "6", "--recompute-all",
         "--json", str(out)]
    )  # fmt: skip
    rows = {row["setting"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["exact", "naive", "deviation k=4", "first-k k=4", "recompute-all"]
    for row in rows.values():
        assert set(row) >= ROW_KEYS, row
        assert isinstance(row["default"], bool) and row["examples"] == 2
        assert 0 <= row["recompute_ratio"] <= 1 and 0 <= row["top1"] <= 1, row
    exact = rows["exact"]
    assert exact["kl"] < 1e-8 and exact["top1"] == 1 and exact["answer_f1"] == 1
    assert exact["recompute_ratio"] == 1 and exact["ttft_ratio"] == 1
    assert rows["recompute-all"]["kl"] < 1e-8 and rows["recompute-all"]["answer_f1"] == 1
    assert rows["naive"]["recompute_ratio"] < 0.05  # every passage found, none recomputed
    # same budget: deviation recomputes as many tokens as first-k
    assert rows["deviation k=4"]["recompute_ratio"] == rows["first-k k=4"]["recompute_ratio"] > 0
    # BlendConfig() is deviation k=16 ratio=0.15: no row here (k=4, ratio 0) is it
    assert not any(row["default"] for row in rows.values())
