"""``ragkv bench --reuse blend``: the ragkv+blend lane replays the ragkv lane's prompts with
chunk reuse, reports what it reused, and is compared with ragkv instead of checked for
determinism (its answers are approximate)."""

from __future__ import annotations

import json

import pytest

from ragkv.bench.lanes import BLEND_LANE
from ragkv.bench.runner import BenchConfig, run_bench
from ragkv.bench.workload import synthetic_workload
from ragkv.cli import main
from ragkv.errors import ConfigError


@pytest.fixture(scope="module")
def bench(tiny_bench, small_config):
    workload = synthetic_workload(small_config(requests=8, follow_up_rate=0.25, topics=2))
    return run_bench(workload, tiny_bench(lanes=["ragkv", BLEND_LANE]))


def test_blend_lane_replays_ragkv_prompts_and_accounts_for_every_token(bench):
    report, results = bench
    exact, blend = results
    assert [r.prompt_token_ids for r in blend.records] == [
        r.prompt_token_ids for r in exact.records
    ]
    lanes = report["lanes"]
    blended = lanes[BLEND_LANE]
    assert blended["reused_nonprefix_tokens"] > 0
    assert lanes["ragkv"]["reused_nonprefix_tokens"] == 0
    # Every prompt token is cached (exact prefix), copied (chunk reuse), shared from an
    # earlier blended request's approximate blocks, or computed.
    assert blended["preemptions"] == 0
    assert blended["reused_approximate_prefix_tokens"] > 0  # the follow-ups
    assert lanes["ragkv"]["reused_approximate_prefix_tokens"] == 0
    assert blended["prefill_tokens_computed"] == (
        blended["prompt_tokens"]
        - blended["cached_tokens"]
        - blended["reused_nonprefix_tokens"]
        - blended["reused_approximate_prefix_tokens"]
    )
    ratios = report["ratios"]
    assert ratios["prefill_blend_vs_ragkv"] == (
        blended["prefill_tokens_computed"] / lanes["ragkv"]["prefill_tokens_computed"]
    )
    # The share of requests whose greedy answers agree, recomputed from the records (a range
    # check here held for any share, a wrong one included).
    agree = [a.token_ids == b.token_ids for a, b in zip(exact.records, blend.records, strict=True)]
    assert agree and ratios["greedy_agreement_blend_vs_ragkv"] == sum(agree) / len(agree)
    assert report["determinism"]["identical_prompt_pairs"] == 0  # blend is not compared


def test_blend_lane_needs_the_ragkv_lane(tiny_model, small_config):
    workload = synthetic_workload(small_config(requests=2))
    config = BenchConfig(model=tiny_model, device="cpu", lanes=["apc", BLEND_LANE])
    with pytest.raises(ConfigError):
        run_bench(workload, config)


def test_cli_reuse_blend_adds_the_lane(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        ["bench", "--model", tiny_model, "--requests", "3", "--topics", "1", "--max-tokens",
         "1", "--chunk-size", "200", "--lanes", "ragkv", "--reuse", "blend", "--json",
         str(out), "--no-progress"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert list(report["lanes"]) == ["ragkv", BLEND_LANE]
    assert "prefill_blend_vs_ragkv" in report["ratios"]


def test_blend_flags_make_the_lanes_settings():
    import argparse

    from ragkv.bench import cli
    from ragkv.cache_engine.chunk_reuse import BlendConfig

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())

    def settings(*flags: str):
        return cli._blend_config(parser.parse_args(["bench", *flags]))

    assert settings() is None  # BlendConfig()'s defaults
    assert settings("--blend-k", "0") == BlendConfig(k=0)
    assert settings("--blend-k", "0") == BlendConfig("deviation", k=0, ratio=0.15)
    assert settings("--blend-strategy", "first-k") == BlendConfig("first-k", k=16, ratio=0)
    deviation = settings("--blend-strategy", "deviation", "--blend-ratio", "0.15")
    assert deviation == BlendConfig("deviation", k=16, ratio=0.15)
    with pytest.raises(ConfigError):
        settings("--blend-strategy", "none", "--blend-ratio", "0.2")
