"""In-process engine throughput under concurrency: the shape of issue 31's aiperf runs.

Every request is a shared system prompt (``--system-tokens``, 512) plus ``--new-tokens``
(64) fresh prompt tokens, answering ``--output-tokens`` (8) tokens greedily; ``N`` caller
threads keep ``N`` requests in flight against one ``Engine`` for ``--requests`` requests at
each concurrency of ``--concurrency`` (``1,4,8``). One warm-up request first. Reports
req/s, TTFT p50/p95 and inter-token latency p50 per concurrency, and each concurrency's
throughput as a ratio of concurrency 1 (the figure to compare with vLLM's 1.94x and 2.48x).
``--torch-threads N[,M]`` sets the stepping thread's torch threads (vLLM serves with one).

``--variants`` builds several engines in this one process and runs them alternately on
the same prompts, ``--rounds`` times per level, reporting medians and each variant's ratio
to the first: ``blas`` (eager, BLAS linears), ``packed`` (eager, linears packed for
oneDNN: the default engine), ``compiled`` (TorchInductor, ``EngineConfig.compile``).
On a shared machine compare these ratios, not absolute figures.

    python benchmarks/engine_load.py [--model DIR] [--concurrency 1,4,8] [--json out.json]
    python benchmarks/engine_load.py --variants blas,packed --torch-threads 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import torch

from ragkv.cache_engine import Engine, SamplingParams


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def run_level(engine: Engine, prompts: list[list[int]], params: SamplingParams, conc: int):
    """Send ``prompts`` with ``conc`` threads; req/s, TTFT and inter-token latency."""
    todo = list(prompts)
    lock = threading.Lock()
    ttft: list[float] = []
    itl: list[float] = []

    def caller() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            started = time.perf_counter()
            last, first = started, None
            for delta in engine.stream(prompt, params):
                now = time.perf_counter()
                if first is None:
                    first = now
                    ttft.append(now - started)
                elif delta.token_ids:
                    itl.append(now - last)
                last = now

    threads = [threading.Thread(target=caller) for _ in range(conc)]
    started, cpu_started = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    return {
        "concurrency": conc,
        "requests": len(prompts),
        "req_per_s": len(prompts) / wall,
        # CPU seconds of this process per request: the work, less sensitive than req/s to
        # other processes on the machine (idle torch threads spinning count too).
        "cpu_s_per_req": cpu / len(prompts),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "itl_p50_s": statistics.median(itl) if itl else 0.0,
    }


# Engine settings per --variants name.
VARIANTS: dict[str, dict[str, bool]] = {
    "blas": {"prepack_linear": False},  # eager, BLAS linears (before issue 31)
    "packed": {},  # eager, linears packed for oneDNN (the default)
    "compiled": {"compile": True},  # TorchInductor, BLAS linears
}


def pin_threads(engine: Engine, threads: list[int]) -> None:
    """Run each step with ``threads[0]`` torch threads, set in the stepping thread itself
    (an existing thread keeps its own count, so a main-thread setting would not reach it);
    the caller changes ``threads[0]`` between runs."""
    execute = engine.runner.execute

    def pinned(batch):  # type: ignore[no-untyped-def]
        if torch.get_num_threads() != threads[0]:
            torch.set_num_threads(threads[0])
        return execute(batch)

    engine.runner.execute = pinned  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local checkpoint (default: SmolLM2)")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=24, help="per concurrency level")
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument(
        "--torch-threads", default=None, help="torch threads of the stepping thread: N or N,M"
    )
    parser.add_argument(
        "--variants",
        default="packed",
        help="engines run alternately in this process, comma-separated: "
        f"{', '.join(VARIANTS)} (default packed: the engine's defaults)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs per level and variant")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    modes = args.variants.split(",")
    thread_counts = [
        int(t) for t in (args.torch_threads or str(torch.get_num_threads())).split(",")
    ]
    pinned = [thread_counts[0]]
    engines = {}
    for name in modes:
        started = time.perf_counter()
        engine = Engine.from_pretrained(
            args.model, device="cpu", kv_cache_tokens=args.kv_cache_tokens, **VARIANTS[name]
        )
        print(f"{name} engine ready in {time.perf_counter() - started:.1f} s")
        pin_threads(engine, pinned)
        engines[name] = engine
    vocab = engines[modes[0]].runner.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    warm = system + tokens(args.new_tokens)
    for engine in engines.values():
        engine.generate(warm, params)  # warm-up: the shared system prompt is cached
    variants = [(c, t) for c in modes for t in thread_counts]
    runs: dict[tuple[int, str, int], list[dict]] = {}
    for conc in (int(c) for c in args.concurrency.split(",")):
        for _ in range(args.rounds):
            prompts = [system + tokens(args.new_tokens) for _ in range(args.requests)]
            for name, threads in variants:
                pinned[0] = threads
                level = run_level(engines[name], prompts, params, conc)
                runs.setdefault((conc, name, threads), []).append(level)
    for engine in engines.values():
        engine.close()
    levels = []
    for (conc, name, threads), found in runs.items():
        level = {
            key: statistics.median(run[key] for run in found)
            for key in ("req_per_s", "cpu_s_per_req", "ttft_p50_s", "ttft_p95_s", "itl_p50_s")
        }
        level.update(concurrency=conc, variant=name, torch_threads=threads, runs=len(found))
        level["req_per_s_runs"] = [run["req_per_s"] for run in found]
        levels.append(level)
    first = {(lv["variant"], lv["torch_threads"]): lv["req_per_s"] for lv in levels[::-1]}
    baseline = {lv["concurrency"]: lv["req_per_s"] for lv in levels[::-1]}
    for level in levels:
        level["vs_first_level"] = (
            level["req_per_s"] / first[level["variant"], level["torch_threads"]]
        )
        level["vs_first_variant"] = level["req_per_s"] / baseline[level["concurrency"]]
        print(
            f"{level['variant']:>8} threads {level['torch_threads']} "
            f"concurrency {level['concurrency']:>2}: {level['req_per_s']:.2f} req/s "
            f"({level['vs_first_level']:.2f}x c1, {level['vs_first_variant']:.2f}x first variant), "
            f"TTFT p50 {level['ttft_p50_s'] * 1000:.0f} ms p95 {level['ttft_p95_s'] * 1000:.0f} ms, "
            f"ITL p50 {level['itl_p50_s'] * 1000:.0f} ms, "
            f"CPU {level['cpu_s_per_req']:.2f} s/req, runs "
            + " ".join(f"{r:.2f}" for r in level["req_per_s_runs"])
        )
    report = {"levels": levels}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
