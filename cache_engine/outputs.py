"""What the engine returns: outputs, usage, timings, stream deltas and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Usage:
    """Token accounting in the OpenAI shape.

    ``cached_tokens`` is always an int (0 included) from the in-process engine; it is ``None``
    only when a remote server did not say (OpenAI-compatible servers may omit
    ``prompt_tokens_details``): unknown, not 0. It counts every reused prompt token, from
    the KV pool or from a KV tier. ``cached_tokens_by_tier`` splits it by where the tokens
    came from (``{"pool": .., "host": .., "disk": ..}``, tiers that served none may be
    absent) on an engine with KV tiers, and is None otherwise; it appears in the OpenAI
    usage as the extension field ``prompt_tokens_details.cached_tokens_by_tier``.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    cached_tokens_by_tier: dict[str, int] | None = None
    # Prompt tokens whose K/V was copied from another position (opt-in chunk reuse:
    # approximate); never part of ``cached_tokens``, which is exact prefix reuse only.
    reused_nonprefix_tokens: int = 0
    # Prompt tokens whose approximate K/V (left by earlier opted-in requests with the same
    # prefix, salt and reuse settings) was shared as a prefix: also never in ``cached_tokens``.
    reused_approximate_prefix_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict[str, Any]:
        """``usage`` object of an OpenAI completion response (no ``prompt_tokens_details``
        when ``cached_tokens`` is unknown)."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
            if self.cached_tokens_by_tier is not None:
                by_tier = dict(self.cached_tokens_by_tier)
                usage["prompt_tokens_details"]["cached_tokens_by_tier"] = by_tier
        if self.reused_nonprefix_tokens:  # a ragkv extension, only on approximate answers
            usage["reused_nonprefix_tokens"] = self.reused_nonprefix_tokens
        if self.reused_approximate_prefix_tokens:  # the same
            usage["reused_approximate_prefix_tokens"] = self.reused_approximate_prefix_tokens
        return usage


@dataclass(slots=True)
class Timings:
    """Seconds from arrival: waiting in the queue, to the first token, to the end."""

    queue_s: float
    ttft_s: float
    total_s: float


@dataclass(slots=True)
class Output:
    """The finished result of one request.

    ``logits`` is only filled when the request asked for it (``return_logits=True``): one
    fp32 row per position the engine computed, for positions
    ``logits_start .. len(prompt) + len(token_ids) - 2`` in order. ``logits_start`` is
    ``usage.cached_tokens`` unless the request was preempted and recomputed; a request
    that reused chunks computes only some prompt positions, and its prompt rows are those.

    ``approximate`` is True when chunk reuse gave the request K/V computed after another
    context (copied chunks, ``usage.reused_nonprefix_tokens``, or a prefix of approximate
    K/V, ``usage.reused_approximate_prefix_tokens``): the answer may differ from the exact one.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: list[Any] | None = None
    num_preemptions: int = 0
    logits: Any = None
    logits_start: int = 0
    approximate: bool = False


@dataclass(slots=True)
class StreamDelta:
    """One streamed increment; the last one has ``finish_reason`` and the full ``output``."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: Output | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started; cheap to read."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_reused: int = 0
    prefill_tokens_reused_nonprefix: int = 0  # opt-in chunk reuse (approximate)
    prefill_tokens_reused_approximate_prefix: int = 0  # the same, shared as a prefix
    blend_fallbacks: int = 0  # opted-in requests run exactly (too big for one step)
    blend_probe_fallbacks: int = 0  # deviation requests run as first-k (probe too big)
    blend_waits: int = 0  # opted-in requests that waited for a chunk being computed
    decode_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    steps: int = 0
    step_s: float = 0.0  # wall time inside engine steps
    model_s: float = 0.0  # of which the model forward (the rest is engine overhead)
    num_blocks: int = 0
    num_free_blocks: int = 0
    peak_used_blocks: int = 0
    # KV tiers (empty without them): reused prefix tokens by tier ("pool", "host", "disk"),
    # blocks and bytes loaded back and the loader's seconds per tier, blocks and bytes
    # offered to the tiers, stepping-thread seconds copying blocks out of / into the pool,
    # and the stores' own counters (entries, bytes, misses: ``KVTiers.stats()``).
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    tier_loaded_blocks: dict[str, int] = field(default_factory=dict)
    tier_loaded_bytes: dict[str, int] = field(default_factory=dict)
    tier_load_s: dict[str, float] = field(default_factory=dict)
    tier_load_misses: int = 0
    tier_stale_loads: int = 0  # staged loads dropped: the pool lost blocks before them
    tier_offered_blocks: int = 0
    tier_offered_bytes: int = 0
    tier_save_s: float = 0.0
    tier_install_s: float = 0.0
    tier_load_timeouts: int = 0  # parked requests that stopped waiting (kv_load_timeout_s)
    tier_stalled_skips: int = 0  # lookups skipped while the loader was stuck in one read
    tier_save_errors: int = 0  # saves that failed (the tiers are a cache: hits lost, no request)
    tiers: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.prefill_tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, hashing, sampling)."""
        return 1.0 - self.model_s / self.step_s if self.step_s else 0.0

    def tier_load_latency_s(self, tier: str) -> float:
        """Mean seconds to load (read and verify) one block from ``tier``; 0 before any."""
        blocks = self.tier_loaded_blocks.get(tier, 0)
        return self.tier_load_s.get(tier, 0.0) / blocks if blocks else 0.0

    @property
    def pool_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What :meth:`Engine.health` reports; ``reason`` says why ``ok`` is False."""

    ok: bool
    thread_alive: bool
    last_step_age_s: float | None  # since the last finished step; None before the first
    busy: bool  # requests queued or in flight
    consecutive_failures: int  # steps in a row that failed for no single request
    reason: str | None
    # With KV tiers: the loader's progress (KVOffload.loader_health); None without tiers.
    kv_loader: dict[str, Any] | None = None
