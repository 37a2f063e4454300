"""Set up and run the lanes of one benchmark: dtype, KV pool size, engines, report."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragkv.bench.lanes import LANES, LaneResult, LaneSpec, lane_specs, run_lane
from ragkv.bench.report import build_report, machine_info
from ragkv.bench.workload import Workload

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchConfig:
    """Engine-side settings shared by every lane (the workload is separate)."""

    model: str | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"  # "auto": bf16 where the CPU/GPU runs it natively, else fp32
    kv_cache_tokens: int | None = None  # None: half the workload's unique tokens (see below)
    block_size: int = 16
    max_tokens: int = 16
    concurrency: int = 8
    order: str = "stable-first"
    lanes: Sequence[str] = LANES
    progress: bool = False
    keep_answers: bool = False


def model_path(model: str | None) -> Path:
    if model is not None:
        return Path(model).expanduser()
    from ragkv.cache_engine import default_model_path

    return Path(default_model_path())


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` → ``bfloat16`` on CUDA or a CPU with native bf16 (AMX/AVX512-BF16), else fp32."""
    if dtype != "auto":
        return dtype
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return "bfloat16"
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def default_kv_tokens(
    workload: Workload, tokenizer: Any, block_size: int, max_tokens: int, share: float = 0.5
) -> int:
    """``share`` of the workload's unique prompt tokens, and at least two largest requests.

    Unique tokens: every distinct chunk, system prompt and question once (what the ragkv
    lane's prompts hold). The floor keeps the pool able to run the biggest no-cache request
    next to another one, so baselines are not starved into preemption by a tiny pool.
    """
    texts = {c.text for r in workload.requests for c in r.chunks}
    texts |= {r.system for r in workload.requests} | {r.question for r in workload.requests}
    texts |= {t["content"] for r in workload.requests for t in r.history or ()}
    ordered = sorted(texts)
    lengths = dict(
        zip(
            ordered,
            map(len, tokenizer(ordered, add_special_tokens=False)["input_ids"]),
            strict=True,
        )
    )
    unique = sum(lengths.values())
    turns: dict[str, int] = {}
    largest = 0
    for r in workload.requests:
        history = sum(lengths[t["content"]] + 8 for t in r.history or ())
        if r.history is None:  # the lane's own turns: questions and answers so far
            history = turns.get(r.session_id, 0)
            turns[r.session_id] = history + lengths[r.question] + max_tokens + 16
        size = sum(lengths[c.text] + 4 for c in r.chunks) + lengths[r.system]
        largest = max(largest, size + lengths[r.question] + history + 64 + max_tokens)
    tokens = max(int(unique * share), 2 * largest)
    return -(-tokens // block_size) * block_size


def run_bench(workload: Workload, config: BenchConfig) -> tuple[dict[str, Any], list[LaneResult]]:
    """Every lane on a fresh engine of the same configuration; returns (report, results)."""
    from transformers import AutoTokenizer

    from ragkv.cache_engine import Engine, SamplingParams

    path = model_path(config.model)
    dtype = resolve_dtype(config.dtype, config.device)
    kv_tokens = config.kv_cache_tokens
    if kv_tokens is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        kv_tokens = default_kv_tokens(workload, tokenizer, config.block_size, config.max_tokens)
    logger.info("bench: dtype %s, KV pool %d tokens", dtype, kv_tokens)
    model_name = [""]

    def make_engine(spec: LaneSpec) -> Any:
        engine = Engine.from_pretrained(
            path,
            device=config.device,
            dtype=dtype,
            kv_cache_tokens=kv_tokens,
            block_size=config.block_size,
            enable_prefix_caching=spec.prefix_caching,
            max_num_seqs=max(config.concurrency, 1),
        )
        model_name[0] = engine.model_name
        return engine

    params = SamplingParams(max_tokens=config.max_tokens)
    results = [
        run_lane(
            spec,
            workload,
            make_engine,
            params,
            concurrency=config.concurrency,
            progress=config.progress,
            keep_answers=config.keep_answers,
        )
        for spec in lane_specs(config.lanes, config.order)
    ]
    machine = machine_info(
        {
            "model": model_name[0],
            "device": config.device,
            "dtype": dtype,
            "kv_cache_tokens": results[0].kv_cache_tokens,
            "block_size": config.block_size,
            "max_tokens": config.max_tokens,
            "concurrency": config.concurrency,
            "order": config.order,
        }
    )
    return build_report(results, workload, machine), results
