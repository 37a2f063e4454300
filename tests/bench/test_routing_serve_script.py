"""``benchmarks/routing_serve.py``: the replica lanes over live servers (in-thread here, tiny
model) keep their books from the answers, the router and the servers' own counters, and
stop every server they started."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import benchmark_script, serve_in_thread

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("prometheus_client")

from ragkv.bench.workload import synthetic_workload  # noqa: E402

API_KEY = "routing-serve-test-key"


class InThreadServers:
    """A ``start`` for ``served_lanes``: ``ragkv serve``'s app on in-thread uvicorn over the
    tiny model, publishing KV events like ``--kv-events-endpoint`` does; counts starts/stops."""

    def __init__(self, script, model: str, bench) -> None:
        self.script, self.model, self.bench = script, model, bench
        self.started = self.stopped = self.most_running = 0
        self.lock = threading.Lock()

    @contextmanager
    def __call__(self, count: int, kv_cache_tokens: int, events: bool):
        servers = []
        try:
            for _ in range(count):
                servers.append(self._one(kv_cache_tokens, events))
            yield servers
        finally:
            for server in servers:
                server.stop()

    def _one(self, kv_cache_tokens: int, events: bool):
        from ragkv.cache_engine import Engine

        engine = Engine.from_pretrained(
            self.model,
            device="cpu",
            dtype="float32",
            kv_cache_tokens=kv_cache_tokens,
            max_num_seqs=self.bench.concurrency,
        )
        url, thread, publisher = serve_in_thread(engine, API_KEY, events=events)
        done = []

        def stop() -> None:
            with self.lock:
                if done:
                    return
                done.append(True)
                self.stopped += 1
            thread.stop()
            if publisher is not None:
                publisher.close()
            engine.close()

        with self.lock:
            self.started += 1
            self.most_running = max(self.most_running, self.started - self.stopped)
        endpoints = None if publisher is None else (publisher.endpoint, publisher.replay_address)
        return self.script.Server(url, kv_cache_tokens, endpoints, stop)


@pytest.fixture
def serve_script():
    with benchmark_script("routing_serve") as module:
        yield module


def test_lanes_count_cached_tokens_from_answers_router_and_servers(
    serve_script, tiny_model, tiny_bench, small_config
):
    config = tiny_bench(keep_answers=True)
    workload = synthetic_workload(small_config())
    start = InThreadServers(serve_script, tiny_model, config)
    report, results = serve_script.served_lanes(
        workload, config, start, replicas=3, api_key=API_KEY
    )
    assert list(report["lanes"]) == ["1x whole pool", "prefix x3", "prefix-events x3"]
    assert start.started == start.stopped == 1 + 3 + 3  # fresh servers per lane, all stopped
    assert start.most_running == 3  # each lane's servers stopped before the next lane's start
    for result in results:
        lane = report["lanes"][result.spec.name]
        answers = result.answers
        assert len(answers) == len(workload.requests)
        cached = sum(a.usage.cached_tokens for a in answers)
        assert lane["cached_tokens"] == cached
        assert lane["prompt_tokens"] == sum(a.usage.prompt_tokens for a in answers)
        # The router counted every answer's cached tokens on the replica that gave it.
        assert lane["reported_cached_tokens"] == cached
        assert sum(lane["replica_requests"]) == len(answers)
        # The servers' own counters (scraped from /metrics) agree with their answers.
        assert result.stats.prefill_tokens_reused == cached
        assert lane["prefill_tokens_computed"] == lane["prompt_tokens"] - cached
        assert lane["kv_blocks"] * config.block_size == result.kv_cache_tokens
    whole, prefix, events = report["lanes"].values()
    assert len(whole["replica_requests"]) == 1 and len(prefix["replica_requests"]) == 3
    assert whole["cached_tokens"] > 0  # the workload repeats topics: something to predict
    assert prefix["predicted_cached_tokens"] > 0 and "events" not in prefix
    assert events["events"] == ["synced"] * 3 and events["event_gaps"] == 0
    assert events["predicted_cached_tokens"] > 0
    ratios = report["ratios"]
    assert ratios["events_vs_whole_pool"] == events["cached_tokens"] / whole["cached_tokens"]
    lines = serve_script.router_lines(report)
    assert len(lines) == 3 and "gaps 0" in lines[2]


def test_a_failing_lane_still_stops_its_servers(serve_script, tiny_model, tiny_bench, small_config):
    from ragkv.errors import RemoteEngineError

    config = tiny_bench()
    workload = synthetic_workload(small_config(requests=2))
    start = InThreadServers(serve_script, tiny_model, config)
    with pytest.raises(RemoteEngineError, match="401"):  # the servers refuse the key
        serve_script.served_lanes(workload, config, start, replicas=3, api_key="wrong-key")
    assert start.started == start.stopped == 1  # the lane failed before it ran: stopped anyway


def test_the_server_command_is_one_ragkv_serve_accepts(serve_script, tiny_bench, tmp_path):
    from ragkv.cli import build_parser

    config = tiny_bench(concurrency=8, block_size=16)
    settings = serve_script.ServeSettings(config, api_key="k", log_dir=tmp_path)
    events = ("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002")
    cmd = serve_script.serve_command(settings, 8123, 4672, events)
    args = build_parser().parse_args(cmd[cmd.index("serve") :])
    assert (args.command, args.port, args.model) == ("serve", 8123, config.model)
    assert (args.kv_cache_tokens, args.block_size, args.max_num_seqs) == (4672, 16, 8)
    assert (args.dtype, args.torch_threads, args.access_log) == ("float32", 1, False)
    assert (args.kv_events_endpoint, args.kv_events_replay_endpoint) == events
    no_events = serve_script.serve_command(settings, 8123, 4672, None)
    assert (
        build_parser().parse_args(no_events[no_events.index("serve") :]).kv_events_endpoint is None
    )


SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ragpulse"


@pytest.mark.skipif(
    not (SHARED / "0_trace.jsonl").is_file(), reason=f"the shared RAGPulse trace is not at {SHARED}"
)
def test_the_script_replays_a_ragpulse_slice_as_ragkv_bench_does(serve_script, tiny_model):
    from transformers import AutoTokenizer

    from ragkv.bench.ragpulse import ragpulse_workload

    args = serve_script.parse_args(
        ["--workload", "ragpulse", "--trace-dir", str(SHARED), "--skip", "5", "--limit", "3",
         "--scale", "0.1", "--model", tiny_model]
    )  # fmt: skip
    got = serve_script.bench_workload(args).requests
    want = ragpulse_workload(
        SHARED, AutoTokenizer.from_pretrained(tiny_model), skip=5, limit=3, scale=0.1
    ).requests
    assert len(got) == 3
    assert [(r.system, r.question, [c.text for c in r.chunks]) for r in got] == [
        (r.system, r.question, [c.text for c in r.chunks]) for r in want
    ]


def test_repeated_lanes_report_every_run_and_check_the_targets_on_the_medians(
    serve_script, tiny_model, tiny_bench, small_config
):
    config = tiny_bench()
    workload = synthetic_workload(small_config(requests=4))
    start = InThreadServers(serve_script, tiny_model, config)
    report, runs = serve_script.repeated_lanes(
        workload, config, start, 2, replicas=3, api_key=API_KEY
    )
    assert len(runs) == 2 and start.started == start.stopped == 2 * (1 + 3 + 3)
    assert [r["cached_tokens"] for r in report["repeats"]] == [
        {name: lane["cached_tokens"] for name, lane in run["lanes"].items()} for run in runs
    ]
    spread = report["ratio_spread"]["events_vs_whole_pool"]
    values = [run["ratios"]["events_vs_whole_pool"] for run in runs]
    assert spread["min"] == min(values) and spread["max"] == max(values)
    assert "targets_met_median" in report
    assert "over 2 runs" in serve_script.format_replica_table(report)
