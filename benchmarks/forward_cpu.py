"""CPU time of one model forward on the engine's step shapes, per forward variant, side by side.

Issue 31's serving shape in single steps: a decode of 1 and of 4 requests (580 tokens of
context each), a prefill of 64 new tokens over 512 cached, and that prefill batched with 3
decodes. Each variant is a ``ModelRunner`` of the embedded model (``blas``: eager, BLAS
linears; ``packed``: eager, linears packed for oneDNN, the default; ``compiled``:
TorchInductor, ``EngineConfig.compile``); rounds alternate the variants on the same
inputs. Reported: the median CPU time of the calling thread per forward and its ratio to
the first variant. With one torch thread (the default here) all the work is on that
thread, so the figure barely moves when other processes share the machine, unlike wall
time. The KV pool holds zeros: timing only, the outputs are not looked at.

    python benchmarks/forward_cpu.py [--variants blas,packed,compiled] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragkv.cache_engine.config import EngineConfig
from ragkv.cache_engine.model_runner import ModelInput, ModelRunner

VARIANTS = {"blas": {"prepack_linear": False}, "packed": {}, "compiled": {"compile": True}}
SHAPES = {  # per sequence: (cached context, new tokens)
    "decode x1": [(580, 1)],
    "decode x4": [(580, 1)] * 4,
    "prefill 64/512": [(512, 64)],
    "prefill + decode x3": [(512, 64)] + [(580, 1)] * 3,
}


def step(seqs: list[tuple[int, int]], block_size: int) -> ModelInput:
    """A step over ``seqs``, each in its own consecutive blocks; samples each last row."""
    batch, next_block = ModelInput(), 0
    for context, new in seqs:
        blocks = -(-(context + new) // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        first = batch.cu_seqlens_q[-1]
        batch.input_ids += [100] * new
        batch.positions += range(context, context + new)
        batch.slot_mapping += [
            table[p // block_size] * block_size + p % block_size
            for p in range(context, context + new)
        ]
        batch.block_tables.append(table)
        batch.cu_seqlens_q.append(first + new)
        batch.seq_lens.append(context + new)
        batch.logits_rows.append(first + new - 1)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="blas,packed,compiled")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    runners = {}
    for name in names:
        started = time.perf_counter()
        config = EngineConfig(device="cpu", kv_cache_tokens=8192, **VARIANTS[name])
        runners[name] = ModelRunner.from_config(config)
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for shape, seqs in SHAPES.items():
            for name, runner in runners.items():
                batch = step(seqs, runner.block_size)
                for _ in range(3):
                    started = time.thread_time()
                    runner.forward(batch)
                    times.setdefault((name, shape), []).append(time.thread_time() - started)
    for shape in SHAPES:
        base = statistics.median(times[names[0], shape])
        cells = []
        for name in names:
            median = statistics.median(times[name, shape])
            cells.append(f"{name} {median * 1000:.1f} ms ({median / base:.2f}x)")
        print(f"{shape:>20}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
