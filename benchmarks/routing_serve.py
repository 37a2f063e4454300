"""The routing figures end to end (issue 29): ``ragkv serve`` replicas on loopback behind
``ReplicaRouter.from_urls``, the events lane following each server's KV events over ZMQ.

``ragkv bench --replicas 3 --routing prefix,prefix-events`` runs its replicas as in-process
engines and follows their events in process. This script runs the same lanes, pipeline
and pool sizes (:mod:`ragkv.bench.replicas`) over real servers, each lane on FRESH ones:

- ``1x whole pool``: one ``ragkv serve`` with the whole pool, behind a one-replica router;
- ``prefix xN``: N servers with 1/N of the pool each, the router predicting what they hold;
- ``prefix-events xN``: the same, each server publishing its KV events
  (``--kv-events-endpoint`` / ``--kv-events-replay-endpoint``) and the router following them.

Every server runs in its own process with ``--torch-threads`` (default 1) torch threads, so
N servers share a small machine. Per lane: cached tokens (the answers' ``usage``), prompt
tokens, prefill tokens the servers computed (their ``/metrics``), requests per replica,
imbalance, the router's predicted / reported cached tokens and event gaps; then the events
lane against the whole pool, its prediction error and imbalance (targets: >= 0.95x, <= 2 %,
<= 1.5). ``--repeat N`` runs every lane N times and checks the targets on the medians.

    python benchmarks/routing_trace.py --out /tmp/rt
    python benchmarks/routing_serve.py --workload trace --trace /tmp/rt.jsonl \\
        --lengths /tmp/rt.lengths.json --json /tmp/serve_trace.json
    python benchmarks/routing_serve.py --workload ragpulse --trace-dir ../shared/data/ragpulse \\
        --limit 100 --scale 0.25 --max-load-ratio 1.5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ragkv.bench.lanes import LaneResult, LaneSpec
from ragkv.bench.replicas import (
    EVENTS,
    REFERENCE,
    RouterLane,
    format_replica_table,
    pool_sizes,
    repeat_summary,
    replica_report,
    routing_lanes,
    run_router_lanes,
)
from ragkv.bench.report import machine_info, write_json
from ragkv.bench.runner import BenchConfig, model_path, resolve_dtype
from ragkv.bench.workload import Workload
from ragkv.cache_engine.engine_flags import add_engine_flags, engine_settings

# The engine settings taken from the command line, declared (flag, help) by EngineConfig.
ENGINE_FLAGS = ("model", "device", "dtype", "kv_cache_tokens", "block_size")
API_KEY_ENV = "RAGKV_API_KEY"  # ragkv serve's --api-key default; kept out of the process list


@dataclass(slots=True)
class Server:
    """One running server as a lane needs it: its ``.../v1`` URL, pool, KV event endpoints
    (``(PUB, replay)`` when it publishes) and ``stop`` (idempotent)."""

    url: str
    kv_cache_tokens: int
    kv_events: tuple[str, str] | None
    stop: Callable[[], None]


# start(count, kv_cache_tokens, events): a context that runs `count` servers with that pool
# each (publishing KV events when `events`) and stops every one of them on exit.
StartServers = Callable[[int, int, bool], AbstractContextManager[list[Server]]]


@dataclass(slots=True)
class ServerStats:
    """The engine counters the bench's lane summary reads, from one server's ``/metrics``."""

    prefill_tokens_computed: int
    prefill_tokens_reused: int
    evictions: int
    preemptions: int
    num_blocks: int
    peak_used_blocks: int
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # the servers run no tiers


# ServerStats field -> (metric, is a counter): ragkv serve's names (its server/metrics.py).
_METRICS = {
    "prefill_tokens_computed": ("ragkv_prompt_tokens_computed", True),
    "prefill_tokens_reused": ("ragkv_prompt_tokens_cached", True),
    "evictions": ("ragkv_evictions", True),
    "preemptions": ("ragkv_preemptions", True),
    "num_blocks": ("ragkv_kv_blocks", False),
    "peak_used_blocks": ("ragkv_kv_blocks_peak_used", False),
}


class ServedReplica:
    """A server as one of :class:`RouterLane`'s engines: counters from its ``/metrics``,
    ``close`` stops it."""

    def __init__(self, server: Server, api_key: str | None) -> None:
        self.server = server
        self.kv_cache_tokens = server.kv_cache_tokens
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def stats(self) -> ServerStats:
        from prometheus_client.parser import text_string_to_metric_families

        base = self.server.url.removesuffix("/v1")
        response = httpx.get(f"{base}/metrics", headers=self._headers, timeout=30)
        response.raise_for_status()
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples
        }
        return ServerStats(**{
            key: int(samples[f"{name}_total" if counter else name])
            for key, (name, counter) in _METRICS.items()
        })  # fmt: skip

    def close(self) -> None:
        self.server.stop()


def served_lanes(
    workload: Workload,
    config: BenchConfig,
    start: StartServers,
    *,
    replicas: int = 3,
    balance_threshold: int = 4,
    max_load_ratio: float | None = None,
    api_key: str | None = None,
) -> tuple[dict[str, Any], list[LaneResult]]:
    """The whole-pool lane, ``prefix xN`` and ``prefix-events xN``, each on fresh servers
    from ``start``; returns ``(report, results)`` as ``ragkv bench --replicas`` does."""
    from ragkv.integrations.routing import ReplicaRouter

    names = routing_lanes(["prefix", EVENTS], replicas, max_load_ratio)
    whole, per_replica = pool_sizes(workload, config, replicas)
    tokenizer = str(model_path(config.model))
    model_name = [""]

    def make_engine(spec: LaneSpec) -> RouterLane:
        count, pool = (1, whole) if spec.name == REFERENCE else (replicas, per_replica)
        events = spec.name.startswith(EVENTS)
        servers = running.enter_context(start(count, pool, events))
        router = ReplicaRouter.from_urls(
            [s.url for s in servers],
            tokenizer=tokenizer,
            api_key=api_key,
            block_size=config.block_size,
            timeout_s=600,  # 3 servers on 2 cores are slow; a timeout would fail over
            kv_events={s.url: s.kv_events for s in servers} if events else None,
            balance_threshold=balance_threshold,
            max_load_ratio=max_load_ratio,
            index_blocks=[s.kv_cache_tokens // config.block_size for s in servers],
        )
        try:
            model_name[0] = router.model_name  # the first request to the servers
        except BaseException:
            router.close()  # its event feeds and clients; `running` stops the servers
            raise
        return RouterLane(router, [ServedReplica(s, api_key) for s in servers])

    # Each lane stops its servers when it closes; `running` stops any left on the way out
    # (a lane that failed to start, an exception, Ctrl-C).
    with ExitStack() as running:
        results = run_router_lanes(names, workload, config, make_engine)
    machine = machine_info(
        {
            "model": model_name[0],
            "device": config.device,
            "dtype": resolve_dtype(config.dtype, config.device),
            "kv_cache_tokens": whole,
            "kv_cache_tokens_per_replica": per_replica,
            "replicas": replicas,
            "balance_threshold": balance_threshold,
            "max_load_ratio": max_load_ratio,
            "block_size": config.block_size,
            "max_tokens": config.max_tokens,
            "concurrency": config.concurrency,
            "order": config.order,
        }
    )
    return replica_report(results, workload, machine, replicas), results


def repeated_lanes(
    workload: Workload, config: BenchConfig, start: StartServers, repeat: int, **kwargs: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:func:`served_lanes` ``repeat`` times (fresh servers every lane of every run):
    ``(report, each run's report)``. Over several runs the report is the last run's with
    every run's ratios and their medians and ranges (:func:`repeat_summary`): which replica
    a request lands on depends on when the others answered, so one run moves by several
    per cent with timing alone."""
    reports = [served_lanes(workload, config, start, **kwargs)[0] for _ in range(repeat)]
    return (reports[0] if repeat == 1 else repeat_summary(reports)), reports


# -- ragkv serve subprocesses ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """What every ``ragkv serve`` of a run shares."""

    config: BenchConfig
    api_key: str
    torch_threads: int = 1
    startup_timeout_s: float = 600.0
    log_dir: Path = Path(tempfile.gettempdir())


@contextmanager
def serve_subprocesses(
    settings: ServeSettings, count: int, kv_cache_tokens: int, events: bool
) -> Iterator[list[Server]]:
    """``count`` fresh ``ragkv serve`` processes, each on free loopback ports, yielded once
    every one answers ``/health``; all terminated (killed if they linger) on exit."""
    procs: list[subprocess.Popen[bytes]] = []

    def stopper(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
        return lambda: _stop([proc])

    try:
        servers, logs = [], []
        for _ in range(count):
            port, pub, replay = free_ports(3)
            endpoints = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
            log = settings.log_dir / f"ragkv-serve-{port}.log"
            with log.open("wb") as out:  # the child keeps its own descriptor
                proc = subprocess.Popen(
                    serve_command(settings, port, kv_cache_tokens, endpoints if events else None),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=_server_env(settings),
                )
            procs.append(proc)
            logs.append(log)
            url = f"http://127.0.0.1:{port}/v1"
            servers.append(
                Server(url, kv_cache_tokens, endpoints if events else None, stopper(proc))
            )
        for server, proc, log in zip(servers, procs, logs, strict=True):
            _wait_healthy(server.url, proc, log, settings.startup_timeout_s)
        yield servers
    finally:
        _stop(procs)


def serve_command(
    settings: ServeSettings, port: int, kv_cache_tokens: int, events: tuple[str, str] | None
) -> list[str]:
    """The ``ragkv serve`` command line of one replica."""
    c = settings.config
    script = Path(sys.executable).with_name("ragkv")  # .venv/bin/ragkv next to this python
    ragkv = [str(script)] if script.exists() else [sys.executable, "-m", "ragkv.cli"]
    cmd = [*ragkv, "serve", "--port", str(port), "--no-access-log"]
    if c.model is not None:
        cmd += ["--model", str(c.model)]
    cmd += [
        "--device", c.device,
        "--dtype", resolve_dtype(c.dtype, c.device),
        "--block-size", str(c.block_size),
        "--kv-cache-tokens", str(kv_cache_tokens),
        "--max-num-seqs", str(max(c.concurrency, 1)),
        "--torch-threads", str(settings.torch_threads),
    ]  # fmt: skip
    if not c.prepack_linear:
        cmd.append("--no-prepack-linear")
    if c.compile:
        cmd.append("--compile")
    if events is not None:
        cmd += ["--kv-events-endpoint", events[0], "--kv-events-replay-endpoint", events[1]]
    return cmd


def _server_env(settings: ServeSettings) -> dict[str, str]:
    threads = str(settings.torch_threads)
    return {
        **os.environ,
        API_KEY_ENV: settings.api_key,
        "OMP_NUM_THREADS": threads,  # also the threads torch starts with, before the flag
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
    }


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback (held together while picked)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    health = url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ragkv serve exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(health, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet (loading the model)
        if time.monotonic() > deadline:
            raise RuntimeError(f"ragkv serve not healthy after {timeout_s:.0f} s:\n{_tail(log)}")
        time.sleep(0.5)


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """Terminate every process still running, then wait for each (kill one that lingers)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- report and command line -------------------------------------------------------------------


def router_lines(report: dict[str, Any]) -> list[str]:
    """Per lane: the router's predicted vs reported cached tokens, and its event gaps."""
    lines = []
    for name, lane in report["lanes"].items():
        predicted, reported = lane["predicted_cached_tokens"], lane["reported_cached_tokens"]
        error = f"{abs(predicted - reported) / reported:.1%}" if reported else "n/a"
        line = f"router  {name}: predicted {predicted:,} / reported {reported:,} cached tok"
        line += f" (error {error})"
        if "events" in lane:
            line += f"; events {'/'.join(lane['events'])}, gaps {lane['event_gaps']}"
        lines.append(line)
    return lines


def bench_workload(args: argparse.Namespace) -> Workload:
    """The workload ``ragkv bench`` builds from the same flags (its defaults for the rest),
    cut to the first ``--limit`` requests."""
    from ragkv.bench.cli import add_parser, build_workload

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    bench_args = parser.parse_args(["bench"])
    for key in (
        "workload", "trace", "lengths", "requests", "topics", "seed", "model",
        "trace_dir", "days", "skip", "limit", "scale",
    ):  # fmt: skip
        setattr(bench_args, key, getattr(args, key))
    workload = build_workload(bench_args)
    if args.limit is not None:
        workload = dataclasses.replace(
            workload,
            requests=workload.requests[: args.limit],
            params={**workload.params, "limit": args.limit},
        )
    return workload


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The flags :func:`bench_workload` reads (``--model`` aside)."""
    p.add_argument(
        "--workload", choices=("synthetic", "production", "trace", "ragpulse"), default="synthetic"
    )
    p.add_argument("--trace", help="JSONL trace (--workload trace)")
    p.add_argument("--trace-dir", help="RAGPulse trace directory (--workload ragpulse)")
    p.add_argument("--days", help="RAGPulse days to replay, 1-based: 2 or 1-3 (default: all)")
    p.add_argument("--skip", type=int, default=0, help="RAGPulse requests to skip first")
    p.add_argument("--scale", type=float, default=1.0, help="RAGPulse segment lengths x F")
    p.add_argument("--lengths", help="JSON {segment id: token length} (--workload trace)")
    p.add_argument("--requests", type=int, help="synthetic/production (ragkv bench's default)")
    p.add_argument("--topics", type=int, help="synthetic (ragkv bench's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="replay only the first N requests")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    add_engine_flags(
        p,
        ENGINE_FLAGS,
        overrides={
            "dtype": {"default": "float32", "help": "float32 (default), bfloat16, float16, auto"},
            "device": {"default": "cpu", "help": "cpu (default) or cuda[:N]"},
            "kv_cache_tokens": {"help": "the whole pool (default: as ragkv bench)"},
        },
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--order", choices=("stable-first", "cache-aware"), default="cache-aware")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--balance-threshold", type=int, default=4)
    p.add_argument("--max-load-ratio", type=float, help="bounded loads (e.g. 1.5)")
    p.add_argument("--torch-threads", type=int, default=1, help="per server (default 1)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per lane")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every lane N times on fresh servers; the targets are checked on the medians",
    )
    p.add_argument("--json", metavar="FILE", help="write the report here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from ragkv.bench.cli import quiet_invalidator_warning

    args = parse_args(argv)
    if args.repeat < 1:
        raise SystemExit(f"--repeat N needs N >= 1; got {args.repeat}")
    config = BenchConfig(
        **engine_settings(args, ENGINE_FLAGS),
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        order=args.order,
        progress=not args.no_progress,
    )
    # SIGTERM unwinds like Ctrl-C, so the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="routing-serve-") as tmp, quiet_invalidator_warning():
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        settings = ServeSettings(
            config,
            api_key=secrets.token_urlsafe(16),
            torch_threads=args.torch_threads,
            startup_timeout_s=args.startup_timeout,
            log_dir=log_dir,
        )

        def start(count: int, kv_cache_tokens: int, events: bool) -> Any:
            return serve_subprocesses(settings, count, kv_cache_tokens, events)

        report, reports = repeated_lanes(
            bench_workload(args),
            config,
            start,
            args.repeat,
            replicas=args.replicas,
            balance_threshold=args.balance_threshold,
            max_load_ratio=args.max_load_ratio,
            api_key=settings.api_key,
        )
    report["machine"].update(
        servers="ragkv serve processes on loopback", torch_threads_per_server=args.torch_threads
    )
    print(format_replica_table(report))
    for i, run in enumerate(reports, 1):
        prefix = f"run {i}: " if len(reports) > 1 else ""
        print("\n".join(prefix + line for line in router_lines(run)))
    if args.json:
        write_json(report, args.json)
    strict = report["determinism"]["strict"]
    return 0 if all(r["determinism"]["ok"] for r in reports) or not strict else 1


if __name__ == "__main__":
    sys.exit(main())
