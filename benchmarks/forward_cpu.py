"""CPU time of one model forward on the engine's step shapes, per forward variant, side by side.

Issue 31's serving shape in single steps: a decode of 1 and of 4 requests (580 tokens of
context each), a prefill of 64 new tokens over 512 cached, and that prefill batched with 3
decodes. Each variant is a ``ModelRunner`` of the embedded model (``blas``: eager, BLAS
linears; ``packed``: eager, linears packed for oneDNN, the default; ``compiled``:
TorchInductor, ``EngineConfig.compile``); ``VARIANT@REV`` is that variant with the torch
attention path (``kernels/attention_plan.py`` and ``kernels/paged_attention_torch.py``) of
git revision ``REV``, so an attention change is timed against its parent in one process
(``--variants packed@HEAD~1,packed``). Rounds alternate the variants on the same inputs.
Reported: the median CPU time of the calling thread per forward and its ratio to the first
variant. With one torch thread (the default here) all the work is on that thread, so the
figure barely moves when other processes share the machine, unlike wall time; with more
threads the figure is wall time. The KV pool holds zeros: timing only, the outputs are not
looked at.

``--layout split`` places each sequence as the engine does after a prefix-cache hit: its
cached context in one run of blocks, the blocks of its new tokens in another run further
on (``contiguous``, the default: one run per sequence).

    python benchmarks/forward_cpu.py [--variants blas,packed,compiled] [--rounds 5]
        [--threads 1] [--layout contiguous|split]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

import ragkv.kernels.paged_attention  # noqa: F401  (the module, for attention_at's swap)
from ragkv.cache_engine import model_runner
from ragkv.cache_engine.config import EngineConfig
from ragkv.cache_engine.model_runner import ModelInput, ModelRunner

VARIANTS = {"blas": {"prepack_linear": False}, "packed": {}, "compiled": {"compile": True}}
SHAPES = {  # per sequence: (cached context, new tokens)
    "decode x1": [(580, 1)],
    "decode x4": [(580, 1)] * 4,
    "prefill 64/512": [(512, 64)],
    "prefill + decode x3": [(512, 64)] + [(580, 1)] * 3,
}
SPLIT_GAP = 3  # blocks left free between a context's run and its new tokens' run


def step(seqs: list[tuple[int, int]], block_size: int, layout: str = "contiguous") -> ModelInput:
    """A step over ``seqs`` in ``layout`` (see the module docstring); samples each last row."""
    batch, next_block = ModelInput(), 0
    for context, new in seqs:
        blocks = -(-(context + new) // block_size)
        table = list(range(next_block, next_block + blocks))
        if layout == "split":
            cached = context // block_size  # the full blocks of the context stay in place
            tail = blocks - cached
            table[cached:] = range(next_block + cached + SPLIT_GAP, next_block + blocks + SPLIT_GAP)
            blocks += SPLIT_GAP + tail
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


def attention_at(rev: str) -> dict[str, object]:
    """The torch attention path of git revision ``rev``: its ``plan_attention`` and
    ``paged_attention_torch``, loaded from ``git show`` as modules of their own."""
    root = Path(__file__).resolve().parent.parent
    modules = {}
    for name in ("attention_plan", "paged_attention_torch"):
        source = subprocess.run(
            ["git", "show", f"{rev}:kernels/{name}.py"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        module_name = f"_ragkv_at_{rev}_{name}".replace("~", "_").replace("^", "_")
        source = source.replace("ragkv.kernels.attention_plan", modules.get("attention_plan", ""))
        module = types.ModuleType(module_name)
        sys.modules[module_name] = module
        exec(compile(source, f"{rev}:kernels/{name}.py", "exec"), module.__dict__)
        modules[name] = module_name
    plan = sys.modules[modules["attention_plan"]]
    attention = sys.modules[modules["paged_attention_torch"]]
    return {
        "plan_attention": plan.plan_attention,
        "paged_attention_torch": attention.paged_attention_torch,
    }


@contextlib.contextmanager
def swapped(attention: dict[str, object] | None) -> Iterator[None]:
    """Run the runner with ``attention`` (an :func:`attention_at`) in place of the tree's."""
    if attention is None:
        yield
        return
    targets = [
        (model_runner, "plan_attention"),
        (sys.modules["ragkv.kernels.paged_attention"], "paged_attention_torch"),
    ]
    saved = [getattr(module, name) for module, name in targets]
    for module, name in targets:
        setattr(module, name, attention[name])
    try:
        yield
    finally:
        for (module, name), value in zip(targets, saved, strict=True):
            setattr(module, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="blas,packed,compiled")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--layout", choices=["contiguous", "split"], default="contiguous")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    names = args.variants.split(",")
    runners, attention = {}, {}
    for name in names:
        started = time.perf_counter()
        base, _, rev = name.partition("@")
        config = EngineConfig(device="cpu", kv_cache_tokens=8192, **VARIANTS[base])
        runners[name] = ModelRunner.from_config(config)
        attention[name] = attention_at(rev) if rev else None
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for shape, seqs in SHAPES.items():
            for name, runner in runners.items():
                batch = step(seqs, runner.block_size, args.layout)
                with swapped(attention[name]):
                    for _ in range(3):
                        started = clock()
                        runner.forward(batch)
                        times.setdefault((name, shape), []).append(clock() - started)
    for shape in SHAPES:
        base = statistics.median(times[names[0], shape])
        cells = []
        for name in names:
            median = statistics.median(times[name, shape])
            cells.append(f"{name} {median * 1000:.1f} ms ({median / base:.2f}x)")
        print(f"{shape:>20}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
