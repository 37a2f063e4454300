"""Set up and run the lanes of one benchmark: dtype, KV pool size, engines, report."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragkv.bench.lanes import LANES, LaneResult, LaneSpec, lane_specs, run_lane
from ragkv.bench.report import build_report, machine_info
from ragkv.bench.workload import Workload
from ragkv.errors import PromptTooLongError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchConfig:
    """Engine-side settings shared by every lane (the workload is separate)."""

    model: str | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"  # "auto": bf16 where the CPU/GPU runs it natively, else fp32
    kv_cache_tokens: int | None = None  # None: half the workload's unique tokens (see below)
    block_size: int = 16
    max_tokens: int = 8
    concurrency: int = 8
    order: str = "cache-aware"
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
    workload: Workload,
    tokenizer: Any,
    block_size: int,
    max_tokens: int,
    order: str = "cache-aware",
    share: float = 0.5,
) -> int:
    """``share`` of the unique tokens of the ragkv lane's prompts; at least 2 largest requests.

    The ragkv lane's prompts are assembled here without a model (dedup + assembler; a
    follow-up's earlier answers stand in as ``max_tokens`` filler tokens) and their distinct
    full blocks counted: the working set an unbounded prefix cache would hold. The floor
    keeps the pool able to run the biggest no-cache request next to another one, so the
    baselines are not starved into preemption by a tiny pool.
    """
    from types import SimpleNamespace

    from ragkv.bench.lanes import build_pipeline, lane_specs
    from ragkv.cache_engine import block_hashes

    spec = lane_specs(["ragkv"], order)[0]
    # The lane's own pipeline, without a model: only prepare() is used.
    pipeline = build_pipeline(spec, SimpleNamespace(tokenizer=tokenizer, block_size=block_size))
    filler = " ".join(["answer"] * max_tokens)
    turns: dict[str, list[dict[str, str]]] = defaultdict(list)
    blocks: set[bytes] = set()
    largest = 0
    for r in workload.requests:
        history = r.history if r.history is not None else turns[r.session_id]
        prepared = pipeline.prepare(r.question, r.chunks, system=r.system, history=history)
        ids = prepared.plan.token_ids
        blocks.update(block_hashes(ids, block_size))
        removed = sum(len(c.text) for c in r.chunks) - sum(
            len(c.text) for c in prepared.dedup.chunks
        )
        # Duplicates the baselines also send: ~4 characters per token is plenty here.
        largest = max(largest, len(ids) + removed // 3 + max_tokens)
        turns[r.session_id] += [
            {"role": "user", "content": r.question},
            {"role": "assistant", "content": filler},
        ]
    tokens = max(int(len(blocks) * block_size * share), 2 * largest)
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
        kv_tokens = default_kv_tokens(
            workload, tokenizer, config.block_size, config.max_tokens, config.order
        )
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
    try:
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
    except PromptTooLongError as exc:
        raise PromptTooLongError(
            f"{exc}. For the bench: lower --chunk-size or --top-k, or use a longer-context model"
        ) from exc
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
