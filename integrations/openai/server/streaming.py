"""Generation for one request: the engine stream under a deadline and the client's
disconnect, answered as one JSON body or as server-sent events that always end with an error
event or ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import (
    RagkvError,
    RequestAbortedError,
)
from ragkv.integrations.openai import responses
from ragkv.integrations.openai.protocol import GenerationRequest
from ragkv.integrations.openai.server.errors import (
    ClientGone,
    api_error,
    internal_error,
    timeout_error,
)
from ragkv.integrations.openai.server.state import Served

logger = logging.getLogger(__name__)

# -- generation -------------------------------------------------------------------------------


async def generate(
    request: Request,
    served: Served,
    parsed: GenerationRequest,
    token_ids: list[int],
    *,
    chat: bool,
    extra: dict | None,
    reuse: dict[str, Any] | None = None,
) -> Response:
    engine, local = served.engine, served.local
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # chat default: the server's, within the context and the KV pool
        max_tokens = served.default_max_tokens
        if local is not None:
            room = min(local.max_model_len, local.kv_cache_tokens) - len(token_ids)
            max_tokens = max(1, min(max_tokens, room))
    params = (
        parsed.params.with_max_tokens(max_tokens)
        if parsed.params is not None
        else SamplingParams(max_tokens=max_tokens, **parsed.sampling)
    )
    arrival = request.scope.get("state", {}).get("ragkv_arrival")
    now = asyncio.get_running_loop().time()
    deadline = (now if arrival is None else arrival) + served.request_timeout_s
    request_id = responses.new_request_id("chatcmpl" if chat else "cmpl")
    # ``reuse``: chunk_spans / reuse for the engine (opt-in chunk reuse; see chat_prompt.chat_prompt)
    tenant = parsed.tenant or ""
    served.admit(tenant)  # 429 past the tenant's (or the server's) share, before queueing
    stream = engine.astream(token_ids, params, cache_salt=parsed.cache_salt, **(reuse or {}))
    served.metrics.in_flight.inc()

    def done() -> None:
        served.metrics.in_flight.dec()
        served.release(tenant)

    try:
        # The first delta comes before any header, so a bad request still gets a 4xx.
        first = await _guarded(request, anext(stream), deadline)
    except BaseException:
        done()
        await stream.aclose()
        raise
    if parsed.stream:
        events = _sse(
            served, parsed, request_id, token_ids, stream, first, deadline, chat=chat,
            state=request.state,
        )  # fmt: skip

        async def cleanup() -> None:
            done()
            await events.aclose()
            await stream.aclose()

        return _ClosingStream(events, cleanup)
    try:
        output = first.output or await _guarded(request, _last_output(stream), deadline)
    finally:
        done()
        await stream.aclose()
    request.state.ragkv_usage = output.usage  # for the access log
    build = responses.chat_body if chat else responses.completion_body
    body = build(request_id, served.model_name, output, return_token_ids=parsed.return_token_ids)
    if extra is not None:
        body["ragkv"] = extra
    return JSONResponse(body)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _sse(
    served: Served,
    parsed: GenerationRequest,
    request_id: str,
    prompt_ids: list[int],
    stream: AsyncGenerator[Any, None],
    first: Any,
    deadline: float,
    *,
    chat: bool,
    state: Any,
) -> AsyncGenerator[bytes, None]:
    """SSE events of one streamed request. Starlette cancels this generator when the client
    disconnects; closing ``stream`` then aborts the request and frees its blocks."""
    model = served.model_name
    ids = parsed.return_token_ids
    try:
        async with contextlib.aclosing(stream):
            if chat:
                opening = {"role": "assistant", "content": ""}
                yield _event(responses.stream_chunk(request_id, model, opening, None, chat=True))
            delta = first
            while True:
                if delta.text or delta.finish_reason or ids:  # else text is held back
                    chunk = _stream_chunk(request_id, model, delta, chat=chat, ids=ids)
                    if ids and delta is first:
                        chunk["choices"][0]["prompt_token_ids"] = prompt_ids
                    yield _event(chunk)
                if delta.output is not None:
                    state.ragkv_usage = delta.output.usage  # for the access log
                    break
                async with asyncio.timeout_at(deadline):
                    delta = await anext(stream)
            if parsed.include_usage:
                usage = delta.output.usage.to_openai()
                yield _event(responses.usage_chunk(request_id, model, usage, chat=chat))
    except TimeoutError:
        yield _event(timeout_error(served).body())
    except RagkvError as exc:
        yield _event(api_error(exc).body())
    except Exception:  # the headers are sent: the error can only travel as an event
        logger.exception("stream %s failed", request_id)
        yield _event(internal_error().body())
    # Every stream ends with [DONE], after an error event too (as vLLM does), so clients
    # that wait for it never hang.
    yield b"data: [DONE]\n\n"


class _ClosingStream(StreamingResponse):
    """An SSE response that runs ``cleanup`` however it ends: finished, failed, or cancelled
    by a disconnect before its body iterator ever started (then no ``finally`` inside it runs)."""

    def __init__(self, events: AsyncIterator[bytes], cleanup: Any) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()


def _stream_chunk(
    request_id: str, model: str, delta: Any, *, chat: bool, ids: bool
) -> dict[str, Any]:
    tokens = delta.token_ids if ids else None
    piece: str | dict[str, Any] = delta.text
    if chat:
        piece = {"content": delta.text} if delta.text else {}
    return responses.stream_chunk(request_id, model, piece, delta.finish_reason, tokens, chat=chat)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _last_output(stream: AsyncIterator[Any]) -> Any:
    async for delta in stream:
        if delta.output is not None:
            return delta.output
    raise RequestAbortedError("the request ended without an output")  # pragma: no cover


async def _guarded(request: Request, step: Awaitable[Any], deadline: float) -> Any:
    """Await ``step`` unless the client disconnects first (raises ClientGone) or the
    deadline passes (504). Either way ``step`` is cancelled, which aborts its request."""
    task = asyncio.ensure_future(step)
    watcher = asyncio.ensure_future(_disconnected(request))
    remaining = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        done, _ = await asyncio.wait(
            {task, watcher}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if watcher in done:
        raise ClientGone
    raise timeout_error(request.app.state.ragkv)


async def _disconnected(request: Request) -> None:
    # The body is fully read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
