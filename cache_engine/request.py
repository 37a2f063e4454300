"""One generation request as the scheduler and the KV cache manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ragkv.cache_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from ragkv.cache_engine.block_hash import BlockHasher
    from ragkv.cache_engine.chunk_reuse import BlendConfig, BlendPlan


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # out of the queue while a KV source loads its K/V
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """Prompt, generated tokens and progress of one request.

    ``token_ids`` is prompt + generated tokens and only grows. ``num_computed_tokens`` counts
    the leading tokens whose K/V are in the cache; a step computes the next slice, and the
    request samples when that slice reaches the end of ``token_ids``. Preemption resets
    ``num_computed_tokens`` to 0: the request is recomputed (mostly from cached blocks).
    ``stop_token_ids`` (the model's EOS unless ``ignore_eos``, plus ``params.stop_token_ids``)
    end it as soon as one is sampled. What its caller receives (text, logprobs, logits)
    is kept by the output processor, not here.

    ``block_hasher`` holds the chained hashes of its full blocks (Invariant 2), computed
    once: the prompt's in the caller's thread, each later block as tokens are appended. The
    KV manager, the tiers and the chunk index read them; preemption keeps them.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    salt_digest: bytes | None = None  # block_hash.digest_salt(cache_salt); the salt is not kept
    keep_logits: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None  # seeded per request (sampler.make_generator)
    arrival_time: float = field(default_factory=time.perf_counter)
    # Chunk reuse (opt-in): the prompt's chunk spans, and the strategy when reuse is asked.
    chunk_spans: tuple[tuple[int, int], ...] = ()
    reuse: BlendConfig | None = None
    block_hasher: BlockHasher | None = None

    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission
    cached_tokens_by_tier: dict[str, int] | None = None  # the same by tier, when tiers are on
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_skipped: int = 0  # times a smaller request was admitted past it (bounded)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    blend: BlendPlan | None = None  # set when admitted with reused chunks (approximate)
    pinned_blocks: list[int] = field(default_factory=list)  # read by its next step, not owned
    blend_tried: bool = False  # planned once, at first admission; a recompute is exact
    chunks_recorded: bool = False
    reused_nonprefix_tokens: int = 0
    reused_approximate_prefix_tokens: int = 0  # prefix blocks of approximate K/V shared
    exact_until: int | None = None  # its K/V is approximate from this token on (chunk reuse)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
