"""How callers wait for an engine's events: blocking, streamed, or asyncio.

:class:`EngineCalls` is the calling side of :class:`~ragkv.cache_engine.Engine`: every
form goes through the engine's one submission path (``_start``: validate and convert in the
caller's thread, then queue) and differs only in how it waits for the request's events
(a thread-safe queue, or an asyncio queue fed from the stepping thread). Leaving early
(an exception, a closed generator, a cancelled task) aborts the request.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, overload

from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.cache_engine.input_processor import (
    ChunkSpans,
    Prompt,
    PromptHashes,
    pair_prompts,
    per_prompt,
)
from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams, resolve_params
from ragkv.errors import RagkvError


class EngineCalls:
    """``generate``, ``stream``, ``agenerate`` and ``astream`` over ``_start`` and ``abort``."""

    # Provided by the engine: the one submission path (validate, convert, queue; the ids)
    # and abort.
    _start: Callable[..., list[str]]
    abort: Callable[[str], None]

    @overload
    def generate(
        self,
        prompts: Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        return_logits: bool = False,
        chunk_spans: ChunkSpans | Sequence[ChunkSpans | None] | None = None,
        reuse: BlendConfig | None = None,
        **sampling: Any,
    ) -> Output: ...
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        return_logits: bool = False,
        chunk_spans: ChunkSpans | Sequence[ChunkSpans | None] | None = None,
        reuse: BlendConfig | None = None,
        **sampling: Any,
    ) -> list[Output]: ...
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        return_logits: bool = False,
        chunk_spans: ChunkSpans | Sequence[ChunkSpans | None] | None = None,
        reuse: BlendConfig | None = None,
        prompt_hashes: PromptHashes | Sequence[PromptHashes | None] | None = None,
        **sampling: Any,
    ) -> Output | list[Output]:
        """Generate for one prompt (returns an :class:`Output`) or many (a list, in order).

        Prompts are token-id lists or strings (tokenized with the model's tokenizer).
        ``params`` is a :class:`SamplingParams` (default: greedy, 256 new tokens); keyword
        settings (``max_tokens=64``, ``temperature=0.7``, ...) change it, for every prompt.

        ``chunk_spans``: the ``(start, end)`` token offsets of the prompt's retrieved chunks
        (``[(s.start, s.end) for s in plan.spans("chunk")]``; for many prompts, one list or
        None each). Once such a prompt is computed exactly, its chunks' K/V can serve
        requests that opt in with ``reuse=BlendConfig(...)``: those reuse a chunk found
        anywhere, at another position, re-rotated and partly recomputed. Their answers are
        approximate (``Output.approximate``, ``usage.reused_nonprefix_tokens``).

        ``prompt_hashes``: what a residency probe (``prefix_probe``) handed back for the
        prompt (for many prompts, one or None each); the prompt is then not hashed again.
        """
        single, batch, params_list = pair_prompts(prompts, params)
        if sampling:
            params_list = [resolve_params(p, sampling) for p in params_list]
        spans = per_prompt(chunk_spans, single, len(batch), "chunk_spans", "span lists")
        hashes = per_prompt(prompt_hashes, single, len(batch), "prompt_hashes", "PromptHashes")
        events: queue.SimpleQueue[StreamDelta | BaseException] = queue.SimpleQueue()
        ids = self._start(
            batch, params_list, cache_salt, return_logits, events.put, spans, reuse, hashes
        )
        results: dict[str, Output] = {}
        try:
            while len(results) < len(ids):
                delta = _delta(events.get())
                if delta.output is not None:
                    results[delta.request_id] = delta.output
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        outputs = [results[request_id] for request_id in ids]
        return outputs[0] if single else outputs

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        chunk_spans: ChunkSpans | None = None,
        reuse: BlendConfig | None = None,
        prompt_hashes: PromptHashes | None = None,
        **sampling: Any,
    ) -> Generator[StreamDelta, None, None]:
        """Yield text deltas as tokens are generated; the last delta carries the ``output``.

        ``params``, keyword settings, ``chunk_spans``, ``reuse`` and ``prompt_hashes`` as in
        :meth:`generate`."""
        events: queue.SimpleQueue[StreamDelta | BaseException] = queue.SimpleQueue()
        request_id = self._start_one(
            prompt, params, sampling, cache_salt, chunk_spans, reuse, prompt_hashes, events.put
        )
        done = False
        try:
            while not done:
                delta = _delta(events.get())
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(request_id)

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        chunk_spans: ChunkSpans | None = None,
        reuse: BlendConfig | None = None,
        prompt_hashes: PromptHashes | None = None,
        **sampling: Any,
    ) -> Output:
        """Asyncio form of :meth:`generate` for one prompt; cancellation aborts the request."""
        async for delta in self.astream(
            prompt,
            params,
            cache_salt=cache_salt,
            chunk_spans=chunk_spans,
            reuse=reuse,
            prompt_hashes=prompt_hashes,
            **sampling,
        ):
            if delta.output is not None:
                return delta.output
        raise RagkvError("stream ended without a final output")  # pragma: no cover

    async def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        chunk_spans: ChunkSpans | None = None,
        reuse: BlendConfig | None = None,
        prompt_hashes: PromptHashes | None = None,
        **sampling: Any,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Asyncio form of :meth:`stream`; many coroutines can stream concurrently."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()

        def sink(event: StreamDelta | BaseException) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        request_id = self._start_one(
            prompt, params, sampling, cache_salt, chunk_spans, reuse, prompt_hashes, sink
        )
        done = False
        try:
            while not done:
                delta = _delta(await events.get())
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(request_id)

    def _start_one(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        sampling: dict[str, Any],
        cache_salt: str | None,
        chunk_spans: ChunkSpans | None,
        reuse: BlendConfig | None,
        prompt_hashes: PromptHashes | None,
        sink: Callable[[StreamDelta | BaseException], None],
    ) -> str:
        """Submit one prompt (no logits) whose events go to ``sink``; its request id."""
        [request_id] = self._start(
            [prompt], [resolve_params(params, sampling)], cache_salt, False, sink, [chunk_spans],
            reuse, [prompt_hashes],
        )  # fmt: skip
        return request_id


def _delta(event: StreamDelta | BaseException) -> StreamDelta:
    if isinstance(event, BaseException):
        raise event
    return event
