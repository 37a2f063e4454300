"""The in-process engine: prompts in, exact generations out, every cached prefix block reused.

One background thread steps the scheduler and the model; callers (sync, streaming or
asyncio, from any number of threads) submit requests and receive events through a
per-request sink.

No request can hurt another (Invariant 9):

- every per-request input is validated *and converted* in the caller's thread, before it is
  queued (token ids, the salt's digest, the stop matcher), so a bad value fails its caller;
- in the stepping thread, work done for one request (its hashing and admission, its
  detokenization and stop check, the delivery to its caller) is wrapped so that an error
  fails that request alone, waiting or running;
- a step that fails for no single request (the forward pass, the batched sampler) fails the
  requests it ran; after ``MAX_CONSECUTIVE_STEP_FAILURES`` such steps in a row the engine
  declares itself unhealthy, fails everything queued with
  :class:`~ragkv.errors.EngineUnhealthyError` and refuses new requests. :meth:`Engine.health`
  reports it (and a stepping thread that died).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ragkv.cache_engine.block_hash import digest_salt
from ragkv.cache_engine.detokenizer import IncrementalDetokenizer
from ragkv.cache_engine.kv_cache_manager import KVCacheManager
from ragkv.cache_engine.model_runner import ModelInput, ModelRunner
from ragkv.cache_engine.model_support import check_supported, model_identity, read_config
from ragkv.cache_engine.outputs import (
    EngineHealth,
    EngineStats,
    Output,
    StreamDelta,
    Timings,
    Usage,
)
from ragkv.cache_engine.request import Request
from ragkv.cache_engine.sampler import Sampler, make_generator
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.cache_engine.scheduler import ScheduledChunk, SchedulePolicy, Scheduler
from ragkv.errors import (
    ConfigError,
    EngineClosedError,
    EngineUnhealthyError,
    InvalidInputError,
    PromptTooLongError,
    RagkvError,
    RequestAbortedError,
)

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Sink = Callable[[StreamDelta | BaseException], None]

DEFAULT_CPU_KV_BYTES = 1 << 30
# Steps that fail for no single request, in a row, before the engine gives up: one can be
# a transient fault (an allocation spike), three in a row is a broken device or model.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class Engine:
    """Paged-KV inference engine with automatic prefix caching. Build with :meth:`from_pretrained`."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        *,
        model_name: str,
        identity: bytes,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        schedule_policy: SchedulePolicy = "fcfs",
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.block_size = runner.block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.kv = KVCacheManager(
            runner.num_blocks,
            runner.block_size,
            enable_caching=enable_prefix_caching,
            algo=hash_algo,
            extra_keys=[("model", identity)],
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            policy=schedule_policy,
            max_model_len=max_model_len,
        )
        self.sampler = Sampler()
        self.eos_token_ids = _eos_ids(runner.model, tokenizer)
        self._stats = EngineStats(num_blocks=runner.num_blocks)
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards scheduler + KV manager across threads
        # Orders submissions against close(): an "add" is never queued behind "close".
        self._intake = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        # Health, written by the stepping thread only (read without the lock: plain values).
        self._consecutive_failures = 0
        self._last_step_end: float | None = None
        self._unhealthy: str | None = None  # why the engine gave up; None while healthy

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        kv_cache_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        hash: str = "xxh3_128",
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        schedule_policy: SchedulePolicy = "fcfs",
        backend: str = "auto",
    ) -> Engine:
        """Load a local Hugging Face checkpoint directory (``None``: the embedded default model).

        The KV pool is allocated once: ``kv_cache_tokens`` tokens, or ``kv_cache_bytes``
        bytes (default 1 GiB on CPU, 40 % of free memory on CUDA). ``dtype`` follows the
        model: fp32 on CPU, bf16 (fp16 where unsupported) on CUDA unless given.
        Unsupported architectures raise :class:`~ragkv.errors.UnsupportedModelError`.
        """
        from transformers import AutoTokenizer

        if path is None:
            from ragkv.cache_engine.default_model import default_model_path

            path = default_model_path()
        path = Path(path).expanduser()
        config = read_config(path)
        check_supported(config)
        if block_size < 1 or block_size % 8:
            raise ConfigError(f"block_size must be a positive multiple of 8, got {block_size}")
        torch_device = _resolve_device(device)
        torch_dtype = _resolve_dtype(dtype, torch_device)
        if kv_cache_tokens is not None and kv_cache_tokens < block_size:
            raise ConfigError(f"kv_cache_tokens must be at least block_size ({block_size})")
        if kv_cache_tokens is None and kv_cache_bytes is None:
            kv_cache_bytes = _default_kv_bytes(torch_device)
        runner = ModelRunner(
            path,
            device=torch_device,
            dtype=torch_dtype,
            block_size=block_size,
            num_blocks=None if kv_cache_tokens is None else kv_cache_tokens // block_size,
            kv_cache_bytes=kv_cache_bytes,
            backend=backend,
        )
        tokenizer = AutoTokenizer.from_pretrained(path)
        context = int(config.get("max_position_embeddings") or 2048)
        if max_model_len is not None and not 2 <= max_model_len <= context:
            raise ConfigError(
                f"max_model_len must be between 2 and the model context ({context} tokens), "
                f"got {max_model_len}"
            )
        return cls(
            runner,
            tokenizer,
            model_name=config.get("_name_or_path") or path.name,
            identity=model_identity(path, config, str(torch_dtype)),
            max_model_len=max_model_len or context,
            enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            schedule_policy=schedule_policy,
        )

    # -- public API -------------------------------------------------------------------
    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV pool holds in all (prompt + output of every request in flight)."""
        return self.runner.num_blocks * self.block_size

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        return_logits: bool = False,
    ) -> Output | list[Output]:
        """Generate for one prompt (returns an :class:`Output`) or many (a list, in order).

        Prompts are token-id lists or strings (tokenized with the model's tokenizer).
        """
        single = _is_single_prompt(prompts)
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise InvalidInputError("generate() needs at least one prompt", param="prompt")
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
            if len(params_list) != len(batch):
                raise InvalidInputError(
                    f"got {len(params_list)} SamplingParams for {len(batch)} prompts; pass one "
                    "SamplingParams for all or one per prompt",
                    param="params",
                )
        events: queue.SimpleQueue[StreamDelta | BaseException] = queue.SimpleQueue()
        requests = [
            self._make_request(p, sp, cache_salt, return_logits)
            for p, sp in zip(batch, params_list, strict=True)
        ]
        for request in requests:
            self._submit(request, events.put)
        results: dict[str, Output] = {}
        try:
            while len(results) < len(requests):
                event = events.get()
                if isinstance(event, BaseException):
                    raise event
                if event.output is not None:
                    results[event.request_id] = event.output
        except BaseException:
            for request in requests:
                self.abort(request.request_id)
            raise
        outputs = [results[r.request_id] for r in requests]
        return outputs[0] if single else outputs

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield text deltas as tokens are generated; the last delta carries the ``output``."""
        request = self._make_request(prompt, params or SamplingParams(), cache_salt, False)
        events: queue.SimpleQueue[StreamDelta | BaseException] = queue.SimpleQueue()
        self._submit(request, events.put)
        done = False
        try:
            while not done:
                event = events.get()
                if isinstance(event, BaseException):
                    raise event
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.abort(request.request_id)

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Output:
        """Asyncio form of :meth:`generate` for one prompt; cancellation aborts the request."""
        async for delta in self.astream(prompt, params, cache_salt=cache_salt):
            if delta.output is not None:
                return delta.output
        raise RagkvError("stream ended without a final output")  # pragma: no cover

    async def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Asyncio form of :meth:`stream`; many coroutines can stream concurrently."""
        request = self._make_request(prompt, params or SamplingParams(), cache_salt, False)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._submit(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        done = False
        try:
            while not done:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its caller receives ``finish_reason="abort"``."""
        self._inbox.put(("abort", request_id))

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` are cached now (what a request would reuse)."""
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return 0
        salt_digest = None if cache_salt is None else digest_salt(cache_salt)
        probe = Request(f"probe-{next(self._ids)}", list(token_ids), SamplingParams())
        probe.salt_digest = salt_digest
        with self._lock:
            try:
                return self.kv.get_computed_blocks(probe, record=False)[1]
            finally:
                self.kv.free(probe)  # drop the manager's per-request hasher state

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (prefill computed vs reused, evictions, pool)."""
        with self._lock:
            cache = self.kv.stats()
            snapshot = dataclasses.replace(self._stats)
        snapshot.evictions = cache.evictions
        snapshot.num_free_blocks = cache.num_free_blocks
        snapshot.preemptions = self.scheduler.num_preemptions
        snapshot.extra = {"cache": cache}
        return snapshot

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no running request holds; False if some are in use."""
        with self._lock:
            return self.kv.reset_prefix_cache()

    def health(self) -> EngineHealth:
        """Whether the engine can serve: its stepping thread runs and steps keep succeeding.

        ``ok`` is False once the engine is closed, its stepping thread died, or
        ``MAX_CONSECUTIVE_STEP_FAILURES`` steps in a row failed for no single request.
        ``thread_alive`` is False before the first request starts the thread.
        ``last_step_age_s`` (seconds since the last step finished, None before the first)
        tells a stuck step apart from an idle engine when ``busy`` is True.
        """
        thread = self._thread
        alive = thread is not None and thread.is_alive()
        reason = self._unhealthy
        if reason is None and self._closed:
            reason = "the engine is closed"
        elif reason is None and thread is not None and not alive:
            reason = "the stepping thread stopped"
        last = self._last_step_end
        return EngineHealth(
            ok=reason is None,
            thread_alive=alive,
            last_step_age_s=None if last is None else time.monotonic() - last,
            busy=bool(self._requests) or not self._inbox.empty(),
            consecutive_failures=self._consecutive_failures,
            reason=reason,
        )

    def close(self) -> None:
        """Stop the stepping thread; in-flight requests fail with :class:`EngineClosedError`."""
        with self._intake:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(("close", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request intake (caller's thread) ------------------------------------------------
    def _make_request(
        self, prompt: Prompt, params: SamplingParams, cache_salt: str | None, keep_logits: bool
    ) -> Request:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new Engine")
        self._check_healthy()
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(
                f"params must be SamplingParams, got {type(params).__name__}", param="params"
            )
        params.validate(vocab_size=self.runner.vocab_size)
        # Everything the stepping thread will use is converted here, so a bad value fails
        # its caller and never a step: the salt's digest (hashing), the prompt's ids.
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidInputError("cache_salt must be a string or None", param="cache_salt")
        salt_digest = None if cache_salt is None else digest_salt(cache_salt)
        token_ids = self._prompt_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; the model context is {self.max_model_len} "
                "and at least one token must be generated. Shorten the prompt (e.g. "
                "Assembler(max_prompt_tokens=...)) or use a model with a longer context",
                param="prompt",
            )
        request = Request(
            f"req-{next(self._ids)}",
            token_ids,
            params,
            salt_digest=salt_digest,
            keep_logits=keep_logits,
        )
        self.scheduler.check_fits(request)
        request.generator = make_generator(params)
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, token_ids, params, eos_token_ids=self.eos_token_ids
        )
        return request

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty", param="prompt")
            if not prompt.isascii():
                _check_utf8(prompt, "prompt")
            # Checked below like caller ids: a tokenizer may know more ids than the model has
            # embeddings for, or none for this text; either would fail a shared step.
            prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not prompt:
                raise InvalidInputError("prompt has no tokens once tokenized", param="prompt")
        elif isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
            raise InvalidInputError(
                f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}",
                param="prompt",
            )
        ids = list(prompt)
        if not ids:
            raise InvalidInputError("prompt is empty: pass at least one token id", param="prompt")
        vocab = self.runner.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidInputError(
                    f"token id {t!r} is outside the vocabulary [0, {vocab}) of {self.model_name}",
                    param="prompt",
                )
        return ids

    def _submit(self, request: Request, sink: Sink) -> None:
        request.sink = sink
        with self._intake:
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new Engine")
            self._check_healthy()
            self._ensure_thread()
            self._inbox.put(("add", request))

    def _check_healthy(self) -> None:
        if self._unhealthy is not None:
            raise EngineUnhealthyError(self._unhealthy_message())

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="ragkv-engine", daemon=True
                    )
                    self._thread.start()

    # -- the stepping thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the thread is ending: nobody may wait forever
            logger.exception("engine stepping thread died")
            error = self._give_up(f"the stepping thread died: {exc!r}", exc)
            while True:  # submissions queued but never taken in
                try:
                    command, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if command == "add":
                    self._deliver(arg, error)
            raise

    def _serve(self) -> None:
        while True:
            block = not self.scheduler.has_unfinished()
            try:
                while True:
                    command, arg = self._inbox.get(block=block)
                    block = False
                    if command == "close":
                        self._fail_all(EngineClosedError("the engine was closed"))
                        return
                    try:
                        self._handle(command, arg)
                    except Exception:  # a bad command must not stop the engine
                        logger.exception("engine could not handle %s", command)
            except queue.Empty:
                pass
            if self.scheduler.has_unfinished():
                try:
                    self._step()
                except Exception as exc:  # pinned on no request: fail those in flight
                    logger.exception("engine step failed")
                    self._step_failed(exc)
                else:
                    self._consecutive_failures = 0
                self._last_step_end = time.monotonic()

    def _handle(self, command: str, arg: Any) -> None:
        with self._lock:
            if command == "add":
                if self._unhealthy is not None:
                    self._deliver(arg, EngineUnhealthyError(self._unhealthy_message()))
                    return
                try:
                    self.scheduler.add(arg)
                except Exception as exc:  # e.g. it cannot fit: its caller must hear of it
                    self._deliver(arg, exc)
                    return
                self._requests[arg.request_id] = arg
            elif command == "abort":
                request = self._requests.get(arg)
                if request is not None:
                    self.scheduler.finish(request, "abort")
                    with self._failing_alone(request):
                        self._emit_final(request, request.detokenizer.flush(), [])

    def _step(self) -> None:
        started = time.perf_counter()
        with self._lock:
            scheduled = self.scheduler.schedule()
            for request, exc in scheduled.failed:
                self._fail_request(request, exc)
            if not scheduled.chunks:
                if not scheduled.failed:
                    self._fail_unschedulable()
                return
            batch, sample_rows, logit_rows = self._build_input(scheduled.chunks)
        model_start = time.perf_counter()
        logits = self.runner.execute(batch)
        model_end = time.perf_counter()
        with self._lock:
            self._update(scheduled.chunks, logits, sample_rows, logit_rows)
            stats = self._stats
            stats.steps += 1
            stats.peak_used_blocks = max(
                stats.peak_used_blocks, self.kv.pool.num_blocks - self.kv.num_free_blocks
            )
            stats.model_s += model_end - model_start
            stats.step_s += time.perf_counter() - started

    def _build_input(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[ModelInput, list[int], list[range | None]]:
        batch = ModelInput()
        sample_rows: list[int] = []  # index into the logits rows, per sampling chunk
        logit_rows: list[range | None] = []  # rows kept for return_logits, per chunk
        now = time.perf_counter()
        for chunk in chunks:
            request = chunk.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                self._stats.prompt_tokens += request.num_prompt_tokens
                self._stats.prefill_tokens_reused += request.num_cached_tokens or 0
            first_row = batch.cu_seqlens_q[-1]
            batch.input_ids.extend(request.token_ids[chunk.start : chunk.end])
            batch.positions.extend(range(chunk.start, chunk.end))
            batch.slot_mapping.extend(self.kv.slot_mapping(request, chunk.start, chunk.end))
            batch.block_tables.append(self.kv.block_table(request))
            batch.cu_seqlens_q.append(first_row + chunk.num_tokens)
            batch.seq_lens.append(chunk.end)
            if request.keep_logits:
                start = len(batch.logits_rows)
                batch.logits_rows.extend(range(first_row, first_row + chunk.num_tokens))
                logit_rows.append(range(start, len(batch.logits_rows)))
                if chunk.samples:
                    sample_rows.append(len(batch.logits_rows) - 1)
            else:
                logit_rows.append(None)
                if chunk.samples:
                    batch.logits_rows.append(first_row + chunk.num_tokens - 1)
                    sample_rows.append(len(batch.logits_rows) - 1)
            if chunk.num_tokens == 1 and chunk.start >= request.num_prompt_tokens:
                self._stats.decode_tokens += 1
            else:
                self._stats.prefill_tokens_computed += chunk.num_tokens
        return batch, sample_rows, logit_rows

    def _update(
        self,
        chunks: list[ScheduledChunk],
        logits: torch.Tensor,
        sample_rows: list[int],
        logit_rows: list[range | None],
    ) -> None:
        sampling = [c for c in chunks if c.samples]
        sampled = None
        if sampling:
            sampled = self.sampler(
                logits[sample_rows],
                [c.request.params for c in sampling],
                [c.request.generator for c in sampling],
            )
        for chunk, rows in zip(chunks, logit_rows, strict=True):
            chunk.request.num_computed_tokens = chunk.end
            if rows is not None:
                if not chunk.request.logits:
                    chunk.request.logits_start = chunk.start
                chunk.request.logits.append(logits[rows.start : rows.stop].clone())
        now = time.perf_counter()
        for i, chunk in enumerate(sampling):
            request = chunk.request
            token = sampled.token_ids[i]
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_ids.append(token)
            if request.params.logprobs is not None:
                request.logprobs.append(sampled.logprobs[i])
            with self._failing_alone(request):
                self._advance(request, token)

    def _advance(self, request: Request, token: int) -> None:
        detok = request.detokenizer
        delta = detok.add(token)  # decides EOS, stop ids, stop strings and max_tokens
        if detok.finished:
            self._finish(request, detok.finish_reason, delta, [token])
        elif request.num_tokens >= self.max_model_len:
            self._finish(request, "length", delta + detok.flush(), [token])
        else:
            self._deliver(request, StreamDelta(request.request_id, delta, [token]))

    def _finish(self, request: Request, reason: str, delta: str, tokens: list[int]) -> None:
        self.scheduler.finish(request, reason)
        self._emit_final(request, delta, tokens)

    def _emit_final(self, request: Request, delta: str, tokens: list[int]) -> None:
        self._requests.pop(request.request_id, None)
        request.finish_time = time.perf_counter()
        self._stats.requests_finished += 1
        arrival = request.arrival_time
        first_token = request.first_token_time or request.finish_time
        output = Output(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=request.detokenizer.text,
            finish_reason=request.finish_reason or "abort",
            usage=Usage(
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=request.num_output_tokens,
                cached_tokens=request.num_cached_tokens or 0,
            ),
            timings=Timings(
                queue_s=(request.first_scheduled_time or request.finish_time) - arrival,
                ttft_s=first_token - arrival,
                total_s=request.finish_time - arrival,
            ),
            logprobs=request.logprobs if request.params.logprobs is not None else None,
            num_preemptions=request.num_preemptions,
            logits=torch.cat(request.logits) if request.logits else None,
            logits_start=request.logits_start,
        )
        self._deliver(
            request, StreamDelta(request.request_id, delta, tokens, output.finish_reason, output)
        )

    def _fail_unschedulable(self) -> None:
        # Only reachable if the head request cannot fit even with the pool to itself,
        # which check_fits rules out; fail loudly rather than spin.
        request = self.scheduler.waiting[0]
        self.scheduler.finish(request, "abort")
        self._requests.pop(request.request_id, None)
        self._deliver(
            request, RequestAbortedError(f"request {request.request_id} could not be scheduled")
        )

    def _deliver(self, request: Request, event: StreamDelta | BaseException) -> None:
        """Hand an event to the request's caller; a caller that is gone (its event loop
        closed, say) gets its request aborted instead of taking the engine down."""
        try:
            request.sink(event)
        except Exception:
            logger.warning("dropping request %s: its caller is gone", request.request_id)
            if not request.finished:
                self.scheduler.finish(request, "abort")
            self._requests.pop(request.request_id, None)

    @contextlib.contextmanager
    def _failing_alone(self, request: Request) -> Iterator[None]:
        """Run work done for ``request`` alone: an error in it fails that request only."""
        try:
            yield
        except Exception as exc:
            logger.exception("request %s failed", request.request_id)
            if not request.finished:
                self.scheduler.finish(request, "abort")
            self._fail_request(request, exc)

    def _fail_request(self, request: Request, exc: Exception) -> None:
        """Deliver a request's own failure (it is already finished and freed)."""
        self._requests.pop(request.request_id, None)
        self._deliver(request, exc)

    def _step_failed(self, exc: Exception) -> None:
        """A step failed for no single request: fail the ones that ran, count it, maybe give up."""
        self._consecutive_failures += 1
        with self._lock:
            for request in list(self.scheduler.running):
                self.scheduler.finish(request, "abort")
                self._requests.pop(request.request_id, None)
                self._deliver(request, exc)
            # The failed step registered its full blocks in the prefix cache before their
            # K/V were written; no request holds a block now, so this forgets all of them
            # and no later request can hit one.
            self.kv.reset_prefix_cache()
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._give_up(
                f"{self._consecutive_failures} engine steps in a row failed, the last with "
                f"{type(exc).__name__}: {exc}",
                exc,
            )

    def _give_up(self, reason: str, cause: BaseException) -> EngineUnhealthyError:
        """Mark the engine unhealthy and fail every request it holds.

        From now on submissions are refused in the caller's thread, and any already in the
        inbox are failed when the stepping thread takes them in.
        """
        with self._intake:  # orders the mark against submissions (see _submit)
            self._unhealthy = reason
        error = EngineUnhealthyError(self._unhealthy_message())
        error.__cause__ = cause
        self._fail_all(error)
        return error

    def _unhealthy_message(self) -> str:
        return (
            f"the engine is unhealthy ({self._unhealthy}); create a new Engine (restart the server)"
        )

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request taken in; each caller hears of it even if freeing one fails."""
        with self._lock:
            for request in list(self._requests.values()):
                try:
                    self.scheduler.finish(request, "abort")
                except Exception:  # shutting down or giving up: delivery matters more
                    logger.exception("could not free request %s", request.request_id)
                self._deliver(request, exc)
            self._requests.clear()


def _check_utf8(text: str, param: str) -> None:
    """Refuse text that has no UTF-8 form (lone surrogates, e.g. from a bad JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{param} is not valid Unicode: {exc.reason} at index {exc.start} "
            f"({text[exc.start : exc.end]!r}); send UTF-8 text without lone surrogates",
            param=param,
        ) from None


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, Sequence) and prompts and not isinstance(prompts[0], str | Sequence):
        return True
    return isinstance(prompts, Sequence) and not prompts


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' requested but CUDA is not available; use device='cpu'")
    return resolved


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}; use 'float32', 'bfloat16' or 'float16'")
        return resolved
    return dtype


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.4)
    return DEFAULT_CPU_KV_BYTES
