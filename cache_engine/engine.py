"""The in-process engine: prompts in, exact generations out, every cached prefix block reused.

``Engine`` is the public face: it loads a model from an :class:`EngineConfig`, validates
and converts every request in the caller's thread (token ids, the salt's digest, the
prompt's block hashes, the stop matcher), so a bad value fails its caller and is never
queued (Invariant 9), and hands it to the
:class:`~ragkv.cache_engine.engine_core.EngineCore`, whose thread steps the model.
``generate``, ``stream``, ``agenerate`` and ``astream`` (sync or asyncio, from any number
of threads; :mod:`ragkv.cache_engine.engine_calls`) share one submission path, ``_start``,
and differ only in how they wait for events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ragkv.cache_engine import offload
from ragkv.cache_engine.block_hash import digest_salt
from ragkv.cache_engine.chunk_reuse import BlendConfig, ChunkIndex
from ragkv.cache_engine.chunk_reuse.source import ChunkReuseSource
from ragkv.cache_engine.config import EngineConfig
from ragkv.cache_engine.engine_calls import EngineCalls
from ragkv.cache_engine.engine_core import EngineCore
from ragkv.cache_engine.input_processor import (
    ChunkSpans,
    InputProcessor,
    Prompt,
    PromptHashes,
)
from ragkv.cache_engine.kv_cache_manager import KVCacheManager
from ragkv.cache_engine.kv_events import (
    DEFAULT_MAX_EVENTS,
    KVEventBuffer,
    start_events,
)
from ragkv.cache_engine.kv_source import KVSource
from ragkv.cache_engine.model_runner import ModelRunner
from ragkv.cache_engine.offload import KVOffload
from ragkv.cache_engine.output_processor import OutputProcessor, RequestState, Sink
from ragkv.cache_engine.outputs import EngineHealth, EngineStats
from ragkv.cache_engine.prefix_probe import PrefixProbe, nothing_cached
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.cache_engine.scheduler import Scheduler
from ragkv.cache_engine.tier_source import TierSource


class Engine(EngineCalls):
    """Paged-KV inference engine with automatic prefix caching.

    Build with ``Engine(EngineConfig(...))``, :meth:`from_config` or :meth:`from_pretrained`.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config = config or EngineConfig()
        self.runner = ModelRunner.from_config(config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.runner.path)
        self.model_name = self.runner.model_name
        self.block_size = config.block_size
        self.max_model_len = self.runner.max_model_len
        self.enable_prefix_caching = config.enable_prefix_caching
        self._kv_events: KVEventBuffer | None = None
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            algo=config.hash_algo,
            extra_keys=[("model", self.runner.identity)],
        )
        self.chunk_index = ChunkIndex(
            self.runner.identity, algo=config.hash_algo, pool=self.kv.pool
        )
        tiers = self._open_tiers(config)
        # K/V from outside the pool's prefix cache, asked in this order (kv_source.py): the
        # tiers continue the exact prefix, chunk reuse plans the rest from the chunk index.
        sources: list[KVSource] = [] if tiers is None else [TierSource(tiers, self.kv)]
        sources.append(ChunkReuseSource(self.chunk_index, self.kv, config.max_num_batched_tokens))
        self.scheduler = Scheduler(self.kv, config, self.max_model_len, sources)
        self.eos_token_ids = self.runner.eos_token_ids(self.tokenizer)
        outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.core = EngineCore(self.scheduler, self.runner, outputs, tiers)
        self.inputs = InputProcessor(
            self.tokenizer,
            vocab_size=self.runner.vocab_size,
            max_model_len=self.max_model_len,
            model_name=self.model_name,
            scheduler=self.scheduler,
            outputs=outputs,
        )

    def _open_tiers(self, config: EngineConfig) -> KVOffload | None:
        """The KV tiers below the pool, when configured (see ``cache_engine/offload.py``)."""
        if not config.tiers_enabled:
            return None
        return KVOffload(
            offload.open_tiers(config, self.runner),
            self.runner,
            max_staged_blocks=self.runner.num_blocks,
            load_timeout_s=config.kv_load_timeout_s,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        return cls(config)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, **kwargs: Any) -> Engine:
        """Load a local Hugging Face checkpoint directory (``None``: the embedded default model).

        Keyword arguments are :class:`EngineConfig` fields (``hash`` is accepted for
        ``hash_algo``), e.g. ``host_cache_bytes=``, ``kv_store_dir=`` and ``kv_store_bytes=``
        for the KV tiers. Unsupported architectures raise
        :class:`~ragkv.errors.UnsupportedModelError`.
        """
        if "hash" in kwargs:
            kwargs["hash_algo"] = kwargs.pop("hash")
        return cls(EngineConfig(model=path, **kwargs))

    # -- public API (EngineLike) --------------------------------------------------------
    knows_residency = True
    supports_chunk_reuse = True  # generate(..., chunk_spans=, reuse=BlendConfig())

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV pool holds in all (prompt + output of every request in flight)."""
        return self.runner.num_blocks * self.block_size

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its caller receives ``finish_reason="abort"``."""
        self.core.abort(request_id)

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` are cached now (what a request would reuse).

        With KV tiers this includes the blocks the tiers hold after the pool's prefix (their
        load is verified when a request asks for them, so the figure is an upper bound)."""
        return self.prefix_probe(cache_salt)(token_ids)[0]

    def prefix_probe(
        self, cache_salt: str | None = None
    ) -> Callable[[Sequence[int]], tuple[int, PromptHashes | None]]:
        """A residency probe for one request's candidate prompts (the assembler's).

        The salt is checked and digested once, here. Each call hashes a candidate in the
        caller's thread, outside the engine's lock, and answers ``(cached tokens, hashes)``
        (cached tokens as :meth:`cached_prefix_length`); the hashes of the candidate that is
        sent go with it (``generate(..., prompt_hashes=)``), so its prompt is not hashed
        again. ``(0, None)`` when prefix caching is off (the request then digests the salt)."""
        if not self.enable_prefix_caching:
            return nothing_cached
        salt_digest = None if cache_salt is None else digest_salt(cache_salt)
        return PrefixProbe(self.kv, self.core.cached_prefix, cache_salt, salt_digest)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (prefill computed vs reused, evictions, pool)."""
        return self.core.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no running request holds; False if some are in use."""
        with self.core.lock:
            return self.kv.reset_prefix_cache()

    def kv_events(self, max_events: int = DEFAULT_MAX_EVENTS) -> KVEventBuffer:
        """The engine's KV cache events (vLLM's schema, :mod:`~ragkv.cache_engine.kv_events`)
        from now on, for one consumer: ``ragkv serve``'s publisher, or a
        :class:`~ragkv.integrations.routing.ReplicaRouter` in process. The first call starts
        them with the blocks cached so far; with KV tiers, their blocks come too (medium
        ``"CPU"``, ``"DISK"``). Bounded by ``max_events`` (raised to hold the pool's
        snapshot): past it events are dropped and counted, never waited for. Later calls
        return the same buffer, whatever ``max_events``; see
        :func:`~ragkv.cache_engine.kv_events.start_events`."""
        with self.core.lock:
            if self._kv_events is None:
                tiers = None if self.core.offload is None else self.core.offload.tiers
                self._kv_events = start_events(self.kv, tiers, max_events)
            return self._kv_events

    def health(self) -> EngineHealth:
        """Whether the engine can serve: its stepping thread runs and steps keep succeeding.

        ``ok`` is False once the engine is closed, its stepping thread died, or
        ``MAX_CONSECUTIVE_STEP_FAILURES`` steps in a row failed for no single request.
        ``thread_alive`` is False before the first request (or :meth:`start`) starts the
        thread.
        ``last_step_age_s`` (seconds since the last step finished, None before the first)
        tells a stuck step apart from an idle engine when ``busy`` is True.
        """
        return self.core.health()

    def start(self) -> None:
        """Start the stepping thread now rather than at the first request (a server does, so
        its health probe sees a live engine before any traffic). Idempotent."""
        self.core.start()

    def close(self) -> None:
        """Stop the stepping thread; in-flight requests fail with :class:`EngineClosedError`.

        With KV tiers, waits for them to store what they were offered, then closes them (a
        ``kv_store_dir`` then serves the next engine on it)."""
        self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request intake (caller's thread) ------------------------------------------------
    def _start(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        cache_salt: str | None,
        return_logits: bool,
        sink: Sink,
        chunk_spans: Sequence[ChunkSpans | None] | None = None,
        reuse: BlendConfig | None = None,
        prompt_hashes: Sequence[PromptHashes | None] | None = None,
    ) -> list[str]:
        """The one submission path: validate every request, then queue them; their ids."""
        spans = chunk_spans or [None] * len(prompts)
        hashes = prompt_hashes or [None] * len(prompts)
        states = [
            self._make_request(prompt, sp, cache_salt, return_logits, prompt_spans, reuse, h)
            for prompt, sp, prompt_spans, h in zip(prompts, params, spans, hashes, strict=True)
        ]
        for state in states:
            self._submit(state, sink)
        return [state.request.request_id for state in states]

    def _make_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        cache_salt: str | None,
        keep_logits: bool,
        chunk_spans: ChunkSpans | None = None,
        reuse: BlendConfig | None = None,
        prompt_hashes: PromptHashes | None = None,
    ) -> RequestState:
        self.core.check_open()
        return self.inputs.process(
            prompt, params, cache_salt, keep_logits, chunk_spans, reuse, prompt_hashes
        )

    def _submit(self, state: RequestState, sink: Sink) -> None:
        self.core.submit(state, sink)
