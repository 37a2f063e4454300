"""Set up and run the lanes of one benchmark: dtype, KV pool size, engines, report."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragkv.bench.lanes import (
    BLEND_LANE,
    LANES,
    RESTART_LANE,
    TIERS_LANE,
    UNBOUNDED_LANE,
    LaneResult,
    LaneSpec,
    lane_specs,
    run_blend_lane,
    run_lane,
)
from ragkv.bench.report import build_report, machine_info
from ragkv.bench.workload import Workload
from ragkv.cache_engine.config import DEFAULTS, SchedulePolicy
from ragkv.errors import ConfigError, PromptTooLongError

if TYPE_CHECKING:
    from ragkv.cache_engine.chunk_reuse import BlendConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchConfig:
    """Engine-side settings shared by every lane (the workload is separate)."""

    model: str | None = None  # None: the embedded default model
    device: str = DEFAULTS.device
    dtype: str = DEFAULTS.dtype  # the engine's rule: see cache_engine.config.resolve_dtype
    kv_cache_tokens: int | None = None  # None: half the workload's unique tokens (see below)
    block_size: int = DEFAULTS.block_size
    schedule_policy: SchedulePolicy = (
        DEFAULTS.schedule_policy
    )  # the waiting queue's admission order
    prepack_linear: bool = DEFAULTS.prepack_linear  # CPU fp32: linears packed for oneDNN
    compile: bool = DEFAULTS.compile  # TorchInductor-compiled decoder layers
    max_tokens: int = 8
    concurrency: int = 8
    order: str = "cache-aware"
    lanes: Sequence[str] = LANES
    progress: bool = False
    keep_answers: bool = False
    # The ragkv+tiers lane: host tier bytes (None: room for every distinct block of the
    # workload), disk tier directory (None: host only, or a temporary one with restart),
    # disk tier bytes; restart: run the lane again on a new engine over the same store.
    host_cache_bytes: int | None = None
    kv_store_dir: str | None = None
    kv_store_bytes: int = DEFAULTS.kv_store_bytes
    kv_tier_write_policy: str = DEFAULTS.kv_tier_write_policy
    restart: bool = False
    blend: BlendConfig | None = None  # the ragkv+blend lane's settings (None: BlendConfig())


def model_path(model: str | None) -> Path:
    if model is not None:
        return Path(model).expanduser()
    from ragkv.cache_engine import default_model_path

    return Path(default_model_path())


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype name an engine of ``dtype`` on ``device`` loads (the engine's one rule)."""
    from ragkv.cache_engine.config import resolve_device
    from ragkv.cache_engine.config import resolve_dtype as engine_dtype

    return str(engine_dtype(dtype, resolve_device(device))).removeprefix("torch.")


@dataclass(slots=True)
class WorkloadProfile:
    """Token counts of a workload, computed without a model (dedup + assembler only).

    ``sent_tokens``: what the baseline lanes send (duplicates included); ``ragkv_tokens``:
    what the ragkv lane sends; ``distinct_tokens``: the distinct full blocks of the ragkv
    lane's prompts (what an unbounded prefix cache would compute); ``largest``: the longest
    request with its duplicates and output.
    """

    requests: int
    sent_tokens: int
    ragkv_tokens: int
    distinct_tokens: int
    largest: int

    def kv_tokens(self, block_size: int, share: float = 0.5) -> int:
        """``share`` of the distinct tokens, at least two largest requests, whole blocks."""
        tokens = max(int(self.distinct_tokens * share), 2 * self.largest)
        return -(-tokens // block_size) * block_size


def profile_workload(
    workload: Workload,
    tokenizer: Any,
    block_size: int,
    max_tokens: int,
    order: str = "cache-aware",
) -> WorkloadProfile:
    """Assemble the ragkv lane's prompts without a model and count their tokens.

    A follow-up's earlier answers stand in as ``max_tokens`` filler tokens.
    """
    from types import SimpleNamespace

    from ragkv.bench.lanes import build_pipeline, lane_specs, removed_tokens
    from ragkv.cache_engine import block_hashes

    spec = lane_specs(["ragkv"], order)[0]
    # The lane's own pipeline, without a model: only prepare() is used.
    stand_in = SimpleNamespace(tokenizer=tokenizer, block_size=block_size, knows_residency=False)
    pipeline = build_pipeline(spec, stand_in)
    filler = " ".join(["answer"] * max_tokens)
    turns: dict[str, list[dict[str, str]]] = defaultdict(list)
    blocks: set[bytes] = set()
    sent = ragkv = largest = 0
    for r in workload.requests:
        history = r.history if r.history is not None else turns[r.session_id]
        prepared = pipeline.prepare(r.question, r.chunks, system=r.system, history=history)
        ids = prepared.plan.token_ids
        blocks.update(block_hashes(ids, block_size))
        removed = removed_tokens(pipeline, r, prepared.plan)
        ragkv += len(ids)
        sent += len(ids) + removed
        largest = max(largest, len(ids) + removed + max_tokens)
        turns[r.session_id] += [
            {"role": "user", "content": r.question},
            {"role": "assistant", "content": filler},
        ]
    return WorkloadProfile(len(workload.requests), sent, ragkv, len(blocks) * block_size, largest)


def default_kv_tokens(
    workload: Workload,
    tokenizer: Any,
    block_size: int,
    max_tokens: int,
    order: str = "cache-aware",
    share: float = 0.5,
) -> int:
    """``share`` of the unique tokens of the ragkv lane's prompts; at least 2 largest requests.

    The floor keeps the pool able to run the biggest no-cache request next to another one,
    so the baselines are not starved into preemption by a tiny pool.
    """
    profile = profile_workload(workload, tokenizer, block_size, max_tokens, order)
    return profile.kv_tokens(block_size, share)


def calibrate(engine: Any, tokens: int = 256, steps: int = 4) -> tuple[float, float]:
    """(seconds per prefill token, seconds per decode step) of ``engine`` on this machine."""
    from ragkv.cache_engine import SamplingParams

    vocab = len(engine.tokenizer)
    ids = [(i * 7919) % (vocab - 1) + 1 for i in range(tokens)]
    engine.generate(ids[:32], SamplingParams(max_tokens=1, ignore_eos=True))  # warm up
    out = engine.generate(ids, SamplingParams(max_tokens=steps, ignore_eos=True))
    t = out.timings
    return t.ttft_s / tokens, max(t.total_s - t.ttft_s, 0.0) / max(steps - 1, 1)


def estimate_seconds(
    profile: WorkloadProfile,
    per_token_s: float,
    per_step_s: float,
    lanes: Sequence[str],
    max_tokens: int,
    concurrency: int,
) -> float:
    """A rough wall-time estimate of all lanes (prefill tokens + batched decode steps)."""
    computed = {
        "no-cache": profile.sent_tokens,
        "apc": profile.sent_tokens,
        "apc+assembler": (profile.sent_tokens + profile.distinct_tokens) / 2,
        "ragkv": profile.distinct_tokens,
        "ragkv+tiers": profile.distinct_tokens,
        "ragkv+tiers/restart": profile.distinct_tokens,
        "ragkv/unbounded": profile.distinct_tokens,
        BLEND_LANE: profile.distinct_tokens / 2,
    }
    prefill = sum(computed.get(name, profile.sent_tokens) for name in lanes) * per_token_s
    steps = profile.requests * max_tokens / max(1, min(concurrency, profile.requests))
    return prefill + len(lanes) * steps * per_step_s


def run_bench(
    workload: Workload,
    config: BenchConfig,
    on_estimate: Callable[[float], None] | None = None,
) -> tuple[dict[str, Any], list[LaneResult]]:
    """Every lane on a fresh engine of the same configuration; returns (report, results).

    ``on_estimate``, if given, receives an estimate of the run's wall time in seconds
    before the first lane starts (calibrated by one short prefill on this machine).
    """
    from transformers import AutoTokenizer

    from ragkv.cache_engine import Engine, EngineConfig, SamplingParams

    path = model_path(config.model)
    dtype = resolve_dtype(config.dtype, config.device)
    kv_tokens = config.kv_cache_tokens
    names = with_restart(config.lanes, config.restart)
    needs_profile = TIERS_LANE in names and config.host_cache_bytes is None
    needs_profile = needs_profile or UNBOUNDED_LANE in names
    profile = None
    if kv_tokens is None or on_estimate is not None or needs_profile:
        tokenizer = AutoTokenizer.from_pretrained(path)
        profile = profile_workload(
            workload, tokenizer, config.block_size, config.max_tokens, config.order
        )
        kv_tokens = kv_tokens or profile.kv_tokens(config.block_size)
    logger.info("bench: dtype %s, KV pool %d tokens", dtype, kv_tokens)
    model_name = [""]
    engine_config = EngineConfig(
        model=path,
        device=config.device,
        dtype=dtype,
        kv_cache_tokens=kv_tokens,
        block_size=config.block_size,
        max_num_seqs=max(config.concurrency, 1),
        schedule_policy=config.schedule_policy,
        prepack_linear=config.prepack_linear,
        compile=config.compile,
    )

    store = _store_dir(config, names)
    tier_settings = {}
    if TIERS_LANE in names:
        host = config.host_cache_bytes
        if host is None:  # room for every distinct block (a quarter more for headroom)
            assert profile is not None  # needs_profile
            host = int(profile.distinct_tokens * 1.25) * kv_bytes_per_token(path, dtype)
        tier_settings = {
            "host_cache_bytes": host,
            "kv_store_dir": store.name if store is not None else None,
            "kv_store_bytes": config.kv_store_bytes,
            "kv_tier_write_policy": config.kv_tier_write_policy,
        }

    def make_engine(spec: LaneSpec) -> Any:
        changes: dict[str, Any] = {"enable_prefix_caching": spec.prefix_caching}
        if spec.tiers:
            changes.update(tier_settings)
        if spec.unbounded_pool:
            assert profile is not None  # needs_profile: the unbounded lane is in names
            changes["kv_cache_tokens"] = max(kv_tokens, profile.kv_tokens(config.block_size, 1.25))
        engine = Engine(engine_config.replace(**changes))
        model_name[0] = engine.model_name
        return engine

    lanes = lane_specs(names, config.order)
    if on_estimate is not None and profile is not None:
        t0 = time.perf_counter()
        probe = make_engine(lanes[0])
        load_s = time.perf_counter() - t0
        try:
            mean = profile.sent_tokens // max(profile.requests, 1)
            room = probe.max_model_len - 8  # the calibration prompt must fit the context
            per_token, per_step = calibrate(probe, tokens=max(16, min(mean, 2048, room)))
        finally:
            probe.close()
        names = [spec.name for spec in lanes]
        on_estimate(
            estimate_seconds(
                profile, per_token, per_step, names, config.max_tokens, config.concurrency
            )
            + len(names) * load_s
        )
    params = SamplingParams(max_tokens=config.max_tokens)
    blend = any(spec.reuse for spec in lanes)
    if blend and "ragkv" not in config.lanes:
        raise ConfigError(f"the {BLEND_LANE} lane replays the ragkv lane's prompts: add ragkv")
    try:
        results: list[LaneResult] = []
        for spec in lanes:
            if spec.reuse:
                exact = next(r for r in results if r.spec.name == "ragkv")
                results.append(
                    run_blend_lane(
                        spec,
                        exact,
                        make_engine,
                        params,
                        concurrency=config.concurrency,
                        blend=config.blend,
                    )
                )
                continue
            results.append(
                run_lane(
                    spec,
                    workload,
                    make_engine,
                    params,
                    concurrency=config.concurrency,
                    progress=config.progress,
                    keep_answers=config.keep_answers or (blend and spec.name == "ragkv"),
                )
            )
    except PromptTooLongError as exc:
        raise PromptTooLongError(
            f"{exc}. For the bench: lower --chunk-size or --top-k, or use a longer-context model"
        ) from exc
    finally:
        if store is not None:
            store.cleanup()
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
            "schedule_policy": config.schedule_policy,
            "prepack_linear": config.prepack_linear,
            "compile": config.compile,
            **{k: v for k, v in tier_settings.items() if k != "kv_store_dir"},
        }
    )
    return build_report(results, workload, machine), results


def with_restart(lanes: Sequence[str], restart: bool) -> list[str]:
    """The lanes to run: with ``restart``, the tiers lane is followed by its restart run."""
    names = list(lanes)
    if restart:
        if TIERS_LANE not in names:
            names.append(TIERS_LANE)
        if RESTART_LANE not in names:
            names.insert(names.index(TIERS_LANE) + 1, RESTART_LANE)
    return names


class _Store:
    """The tiers lane's store directory: the given one, or a temporary one (removed after)."""

    def __init__(self, name: str, temporary: Any = None) -> None:
        self.name, self._temporary = name, temporary

    def cleanup(self) -> None:
        if self._temporary is not None:
            self._temporary.cleanup()


def _store_dir(config: BenchConfig, names: Sequence[str]) -> _Store | None:
    if config.kv_store_dir is not None:
        return _Store(str(Path(config.kv_store_dir).expanduser()))
    if RESTART_LANE in names:  # a restart needs a disk tier
        import tempfile

        temporary = tempfile.TemporaryDirectory(prefix="ragkv-bench-store-")
        return _Store(temporary.name, temporary)
    return None


def kv_bytes_per_token(path: Path, dtype: str) -> int:
    """Bytes of K/V one token takes in the pool, from the checkpoint's config.json."""
    import torch

    from ragkv.cache_engine.model_support import read_config

    config = read_config(path)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * element
