"""RAGPulse replay: the trace reader, the model-free replay and its agreement with the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import tiny_tokenizer

from ragkv.bench.model_free import run_model_free
from ragkv.bench.ragpulse import parse_days, ragpulse_workload
from ragkv.bench.runner import BenchConfig, run_bench
from ragkv.cli import main
from ragkv.errors import ConfigError, InvalidInputError

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ragpulse"
needs_shared = pytest.mark.skipif(
    not (SHARED / "0_trace.jsonl").is_file(),
    reason=f"the shared RAGPulse trace is not at {SHARED} (see docs/benchmarks.md, 'Replaying a "
    "public trace')",
)


def _write_trace(root: Path, requests: list[dict], lengths: dict[str, dict[int, int]]) -> Path:
    keys = {
        "1_sys_prompt.jsonl": "sys_prompt_id",
        "2_passages.jsonl": "passage_id",
        "3_history.jsonl": "history_id",
        "4_user_input.jsonl": "user_input_id",
        "5_web_search.jsonl": "web_search_id",
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, key in keys.items():
        rows = [{key: i, "token_length": n} for i, n in lengths.get(name, {}).items()]
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    for i, r in enumerate(requests):
        ids = {"sys_prompt": [], "passages_ids": [], "history": [], "web_search": []}
        ids.update(r["ids"])
        lines.append({"timestamp": str(r.get("t", i)), "session_id": r.get("s", f"s{i}"),
                      "input_length": 0, "output_length": 4, "hash_ids": ids})  # fmt: skip
    (root / "0_trace.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def _small_trace(root: Path) -> Path:
    """Two interleaved system templates, six passages per request from a small pool."""
    requests = []
    for i in range(24):
        template = i % 4 == 3
        system = [2, 100 + i, 3] if template else [1, 10, 200 + i]
        passages = [300 + (i + j) % 9 for j in range(6)][:: 1 if i % 2 else -1]
        requests.append(
            {
                "ids": {
                    "sys_prompt": system,
                    "passages_ids": passages,
                    "history": [400] if i % 5 == 0 else [],
                    "user_input": [500 + i],
                    "web_search": [600] if i == 7 else [],
                },
                "t": i * 9000,  # ten requests a day
                "s": f"s{i // 3}",
            }
        )
    lengths = {
        "1_sys_prompt.jsonl": {1: 40, 10: 24, 2: 36, 3: 20}
        | {100 + i: 8 for i in range(24)}
        | {200 + i: 12 for i in range(24)},
        "2_passages.jsonl": {300 + j: 30 + j for j in range(9)},
        "3_history.jsonl": {400: 6},
        "4_user_input.jsonl": {500 + i: 3 for i in range(24)},
        "5_web_search.jsonl": {600: 20},
    }
    return _write_trace(root, requests, lengths)


def test_roles_map_onto_a_rag_request(tmp_path):
    tokenizer = tiny_tokenizer()
    workload = ragpulse_workload(_small_trace(tmp_path / "t"), tokenizer)
    assert len(workload.requests) == 24 and workload.params["kind"] == "ragpulse"
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, web = workload.requests[0], workload.requests[7]
    assert [len(encode(p)) for p in first.system] == [40, 24, 12]  # one part per segment id
    assert [len(encode(c.text)) for c in first.chunks] == [30 + (5 - j) for j in range(6)]
    assert [c.source_id for c in web.chunks][-1] == "web:600"  # web search after passages
    assert first.history == [{"role": "user", "content": first.history[0]["content"]}]
    assert len(encode(first.history[0]["content"])) == 6 and len(encode(first.question)) == 3
    # The same id is the same text in every request; different roles never collide.
    assert workload.requests[1].system[0] == first.system[0]
    texts = {c.text for r in workload.requests for c in r.chunks if c.source_id == "passage:305"}
    assert len(texts) == 1
    assert first.session_id == "s0" and workload.requests[3].session_id == "s1"


def test_days_skip_limit_and_scale_select_and_shrink(tmp_path):
    tokenizer = tiny_tokenizer()
    root = _small_trace(tmp_path / "t")
    day2 = ragpulse_workload(root, tokenizer, days=(2, 2))
    assert len(day2.requests) == 10  # requests 10..19 (t = 90,000 .. 171,000 s)
    sliced = ragpulse_workload(root, tokenizer, days=(2, 3), skip=3, limit=5, scale=0.5)
    assert len(sliced.requests) == 5
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert len(encode(sliced.requests[0].system[0])) == 20  # 40 x 0.5
    assert len(encode(sliced.requests[0].question)) == 2  # round(3 x 0.5), at least 1
    assert parse_days("2") == (2, 2) and parse_days("1-3") == (1, 3) and parse_days(None) is None


@pytest.mark.parametrize("days", ["0", "3-1", "x"])
def test_bad_day_ranges_are_config_errors(days):
    with pytest.raises(ConfigError, match="--days"):
        parse_days(days)


def test_a_directory_that_is_not_a_trace_says_so(tmp_path):
    with pytest.raises(InvalidInputError, match="not a RAGPulse trace directory"):
        ragpulse_workload(tmp_path, tiny_tokenizer())
    root = _small_trace(tmp_path / "t")
    (root / "2_passages.jsonl").write_text('{"passage_id": 300, "token_length": 30}\n')
    with pytest.raises(InvalidInputError, match=r"passages_ids id \d+ has no token length"):
        ragpulse_workload(root, tiny_tokenizer())
    with pytest.raises(ConfigError, match="scale"):
        ragpulse_workload(root, tiny_tokenizer(), scale=2.0)


def test_model_free_replay_agrees_with_the_engine(tmp_path, tiny_bench):
    """Same pipelines, same pool, one request at a time: the simulated engine reports the
    real engine's cached tokens request by request (pool large enough that generated tokens,
    which the stand-in does not reproduce, never decide an eviction)."""
    tokenizer = tiny_tokenizer()
    workload = ragpulse_workload(_small_trace(tmp_path / "t"), tokenizer)
    config = tiny_bench(kv_cache_tokens=16_384, concurrency=1, lanes=("apc", "ragkv"))
    engine_report, engine_results = run_bench(workload, config)
    free_report, free_results = run_model_free(workload, config, tokenizer)
    for real, free in zip(engine_results, free_results, strict=True):
        assert [r.cached_tokens for r in real.records] == [r.cached_tokens for r in free.records]
        assert [r.prompt_tokens for r in real.records] == [r.prompt_tokens for r in free.records]
    for lane in ("apc", "ragkv"):
        for key in ("hit_rate", "prefill_tokens_computed", "cached_tokens"):
            assert free_report["lanes"][lane][key] == engine_report["lanes"][lane][key]
    assert free_report["ratios"]["never_worse_than_apc"] == {"ragkv": True}
    # The interleaved templates are learned apart: ragkv reuses more than the app's order.
    assert free_report["lanes"]["ragkv"]["hit_rate"] > free_report["lanes"]["apc"]["hit_rate"]
    bound = free_report["bounds"]["position_independent_hit_rate"]
    assert free_report["lanes"]["ragkv"]["hit_rate"] <= bound <= 1.0


def test_model_free_refuses_lanes_that_need_a_model(tmp_path):
    workload = ragpulse_workload(_small_trace(tmp_path / "t"), tiny_tokenizer())
    with pytest.raises(ConfigError, match="need a model"):
        run_model_free(workload, BenchConfig(lanes=("ragkv", "ragkv+tiers")), tiny_tokenizer())


@needs_shared
def test_cli_replays_a_slice_of_the_shared_trace_model_free(capsys):
    """The shared trace's first 200 requests at a tenth of their length: the assembler learns
    the interleaved templates and beats the app's order, never worse."""
    code = main(
        ["bench", "--workload", "ragpulse", "--trace-dir", str(SHARED), "--limit", "200",
         "--scale", "0.1", "--kv-cache-tokens", "40000", "--model-free", "--no-progress",
         "--lanes", "apc,ragkv", "--json", "-"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    lanes = report["lanes"]
    assert report["workload"]["requests"] == 200
    assert report["ratios"]["never_worse_than_apc"] == {"ragkv": True}
    assert lanes["ragkv"]["hit_rate"] > lanes["apc"]["hit_rate"] + 0.05
    assert report["bounds"]["position_independent_hit_rate"] > lanes["ragkv"]["hit_rate"]
