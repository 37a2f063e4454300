"""In-process engine throughput under concurrency: the shape of issue 31's aiperf runs.

Every request is a shared system prompt (``--system-tokens``, 512) plus ``--new-tokens``
(64) fresh prompt tokens, answering ``--output-tokens`` (8) tokens greedily; ``N`` caller
threads keep ``N`` requests in flight against one ``Engine`` for ``--requests`` requests at
each concurrency of ``--concurrency`` (``1,4,8``). One warm-up request first. Reports
req/s, TTFT p50/p95 and inter-token latency p50 per concurrency, and each concurrency's
throughput as a ratio of concurrency 1 (the figure to compare with vLLM's 1.94x and 2.48x).
``--torch-threads`` sets ``torch.set_num_threads`` first (vLLM serves with one).

    python benchmarks/engine_load.py [--model DIR] [--concurrency 1,4,8] [--json out.json]
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
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {
        "concurrency": conc,
        "requests": len(prompts),
        "req_per_s": len(prompts) / wall,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "itl_p50_s": statistics.median(itl) if itl else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local checkpoint (default: SmolLM2)")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=24, help="per concurrency level")
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    with Engine.from_pretrained(args.model, device="cpu") as engine:
        vocab = engine.runner.vocab_size

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(n)]

        system = tokens(args.system_tokens)
        engine.generate(system + tokens(args.new_tokens), params)  # warm-up
        levels = []
        for conc in (int(c) for c in args.concurrency.split(",")):
            prompts = [system + tokens(args.new_tokens) for _ in range(args.requests)]
            levels.append(run_level(engine, prompts, params, conc))
    base = levels[0]["req_per_s"]
    for level in levels:
        level["vs_first_level"] = level["req_per_s"] / base
        print(
            f"concurrency {level['concurrency']:>2}: {level['req_per_s']:.2f} req/s "
            f"({level['vs_first_level']:.2f}x), TTFT p50 {level['ttft_p50_s'] * 1000:.0f} ms "
            f"p95 {level['ttft_p95_s'] * 1000:.0f} ms, ITL p50 {level['itl_p50_s'] * 1000:.0f} ms"
        )
    report = {"torch_threads": torch.get_num_threads(), "levels": levels}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
