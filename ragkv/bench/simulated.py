"""A model-free stand-in for :class:`~ragkv.cache_engine.Engine`: the same prefix cache, no model.

``ragkv bench --model-free`` replays a workload through the real pipeline (dedup, assembler)
against this engine. It keeps the engine's cache core as it is (the
:class:`~ragkv.cache_engine.KVCacheManager`: chained 16-token block keys, the LRU pool of
``kv_cache_tokens``, a request's tail blocks freed first) and answers the assembler's
residency probe from it, so hit rates and prefill counts are what the engine would report for
the same prompts served one at a time. Generation is a stand-in: ``max_tokens`` copies of one
token (their blocks occupy the pool as real output would), and the text is that many words.

What it cannot model: batching (concurrent requests sharing blocks mid-flight), preemption,
and time (``timings`` are zero). Sizing a deployment from a trace is what it is for.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.kv_cache_manager import KVCacheManager
from ragkv.cache_engine.outputs import EngineStats, Output, StreamDelta, Timings, Usage
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.defaults import DEFAULT_BLOCK_SIZE
from ragkv.errors import ConfigError, PromptTooLongError

_FILLER = " answer"


class _Request:
    """What the cache manager reads from a request (``CacheRequest``)."""

    __slots__ = ("block_hasher", "num_prompt_tokens", "request_id", "salt_digest", "token_ids")

    def __init__(self, request_id: str, token_ids: list[int], salt_digest: bytes | None) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.salt_digest = salt_digest
        self.block_hasher: BlockHasher | None = None


class SimulatedEngine:
    """An :class:`~ragkv.cache_engine.engine_like.EngineLike` with a real prefix cache and no
    model. ``enable_prefix_caching=False`` is the no-cache baseline."""

    knows_residency = True
    supports_chunk_reuse = False

    def __init__(
        self,
        tokenizer: Any,
        kv_cache_tokens: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        model_name: str = "model-free",
    ) -> None:
        if kv_cache_tokens < block_size:
            raise ConfigError(f"kv_cache_tokens must hold one block, got {kv_cache_tokens}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self._model_name = model_name
        num_blocks = kv_cache_tokens // block_size
        self.kv_cache_tokens = num_blocks * block_size
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            enable_caching=enable_prefix_caching,
            extra_keys=[("model", model_name.encode())],
        )
        self._filler = tokenizer.encode(_FILLER, add_special_tokens=False)[-1]
        self._ids = itertools.count()
        self._stats = EngineStats(num_blocks=num_blocks, num_free_blocks=num_blocks)

    @property
    def model_name(self) -> str:
        return self._model_name

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens of ``token_ids`` the pool holds now (what a request would reuse)."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return 0
        probe = self._request(token_ids, cache_salt)
        try:
            return self.kv.get_computed_blocks(probe, record=False)[1]
        finally:
            self.kv.free(probe)

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Output:
        """Look the prompt up, hold its blocks and ``max_tokens`` output tokens, free them."""
        params = params or SamplingParams()
        token_ids = list(prompt)
        if not token_ids:
            raise PromptTooLongError("empty prompt")
        request = self._request(token_ids, cache_salt)
        kv = self.kv
        blocks, cached = kv.get_computed_blocks(request)
        output = [self._filler] * params.max_tokens
        total = len(token_ids) + len(output)
        if kv.blocks_needed(total) > kv.num_blocks:
            kv.free(request)
            raise PromptTooLongError(
                f"prompt of {len(token_ids)} tokens plus {len(output)} to generate needs "
                f"{kv.blocks_needed(total)} blocks; the pool has {kv.num_blocks}"
            )
        if kv.allocate_slots(request, len(token_ids) - cached, blocks) is None:
            raise RuntimeError("the simulated pool is full with one request in flight")
        request.token_ids.extend(output)
        if output and kv.allocate_slots(request, len(output)) is None:
            raise RuntimeError("the simulated pool is full with one request in flight")
        self._account(request, len(token_ids), cached, len(output))
        kv.free(request)
        usage = Usage(len(token_ids), len(output), cached)
        text = _FILLER * len(output)
        return Output(
            request.request_id,
            token_ids,
            output,
            text,
            "length",
            usage,
            Timings(0.0, 0.0, 0.0),
        )

    async def agenerate(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Output:
        return self.generate(prompt, params, cache_salt=cache_salt)

    async def astream(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """The whole output as one delta (nothing is generated step by step here)."""
        output = self.generate(prompt, params, cache_salt=cache_salt)
        yield StreamDelta(
            output.request_id, output.text, list(output.token_ids), output.finish_reason, output
        )

    def stats(self) -> EngineStats:
        """Counters as the engine keeps them (prefill computed and reused, evictions, pool)."""
        stats = self._stats
        stats.evictions = self.kv.num_evictions
        stats.num_free_blocks = self.kv.num_free_blocks
        return stats

    def close(self) -> None:
        """Nothing to release (the engine protocol's shape)."""

    def _request(self, token_ids: Sequence[int], cache_salt: str | None) -> _Request:
        salt = None if cache_salt is None else digest_salt(cache_salt)
        return _Request(f"sim-{next(self._ids)}", list(token_ids), salt)

    def _account(self, request: _Request, prompt: int, cached: int, generated: int) -> None:
        stats = self._stats
        stats.requests_finished += 1
        stats.prompt_tokens += prompt
        stats.prefill_tokens_computed += prompt - cached
        stats.prefill_tokens_reused += cached
        stats.decode_tokens += generated
        used = len(self.kv.block_table(request))
        stats.peak_used_blocks = max(stats.peak_used_blocks, used)
