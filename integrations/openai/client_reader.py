"""What :class:`~ragkv.integrations.openai.client.RemoteEngine` reads back from a server:
completion bodies and server-sent events as ``Output`` / ``StreamDelta``, error bodies and
transport failures as :class:`~ragkv.errors.RemoteEngineError`."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx

from ragkv.cache_engine.outputs import Output, StreamDelta, Timings, Usage
from ragkv.errors import RemoteEngineError

# What a server may send back, bounded: an answer body, one SSE line, and the time an
# attempt may take in all (a per-read timeout alone lets a 1 byte/s server hang a call).
MAX_ANSWER_BYTES = 16 << 20
MAX_SSE_LINE_CHARS = 1 << 20


class StreamState:
    """Turns SSE lines into StreamDeltas; the final delta waits for the usage chunk.

    ``deadline`` (a ``time.perf_counter()`` value) ends the attempt with a
    :class:`RemoteEngineError` however slowly the server keeps sending."""

    def __init__(self, prompt_ids: list[int], start: float, deadline: float = math.inf) -> None:
        self.prompt_ids = prompt_ids
        self.start = start
        self.deadline = deadline
        self.first_token_time: float | None = None
        self.request_id = ""
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.last = StreamDelta("", "", [])
        self.done = False

    def feed_line(self, line: str) -> StreamDelta | None:
        check_deadline(self.deadline)
        if len(line) > MAX_SSE_LINE_CHARS:
            raise RemoteEngineError(f"the server streamed a line of {len(line)} characters")
        if not line.startswith("data:") or self.done:
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise RemoteEngineError(f"the server streamed invalid JSON: {data[:200]!r}") from exc
        if "error" in chunk:
            raise RemoteEngineError(_error_message(chunk), status_code=_error_status(chunk))
        self.request_id = chunk.get("id") or self.request_id
        self.usage = chunk.get("usage") or self.usage
        if not chunk.get("choices"):
            return None
        choice = chunk["choices"][0]
        self.prompt_ids = choice.get("prompt_token_ids") or self.prompt_ids
        text, ids = _choice_text(choice), list(choice.get("token_ids") or [])
        if self.first_token_time is None and (text or ids):
            self.first_token_time = time.perf_counter()
        self.text.append(text)
        self.token_ids.extend(ids)
        if choice.get("finish_reason") is not None:
            # Held back: the final delta must carry the output, whose usage comes next.
            self.finish_reason = choice["finish_reason"]
            self.last = StreamDelta(self.request_id, text, ids)
            return None
        return StreamDelta(self.request_id, text, ids) if text or ids else None

    def finish(self) -> StreamDelta:
        if self.finish_reason is None:
            raise RemoteEngineError("the stream ended before a finish_reason")
        body = {
            "id": self.request_id,
            "choices": [
                {
                    "text": "".join(self.text),
                    "finish_reason": self.finish_reason,
                    "token_ids": self.token_ids,
                    "prompt_token_ids": self.prompt_ids,
                }
            ],
            "usage": self.usage,
        }
        output = output_of(body, self.prompt_ids, self.start, self.first_token_time)
        last = self.last
        return StreamDelta(last.request_id, last.text, last.token_ids, self.finish_reason, output)


def output_of(
    body: dict[str, Any], prompt_ids: list[int], start: float, first_token: float | None = None
) -> Output:
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise RemoteEngineError(f"the server answered without choices: {str(body)[:200]}") from exc
    end = time.perf_counter()
    prompt_ids = list(choice.get("prompt_token_ids") or prompt_ids)
    token_ids = list(choice.get("token_ids") or [])
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Output(
        request_id=body.get("id") or "",
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        text=_choice_text(choice),
        finish_reason=choice.get("finish_reason") or "stop",
        usage=Usage(
            prompt_tokens=usage.get("prompt_tokens", len(prompt_ids)),
            completion_tokens=usage.get("completion_tokens", len(token_ids)),
            cached_tokens=details.get("cached_tokens"),
            cached_tokens_by_tier=_tokens_by_tier(details.get("cached_tokens_by_tier")),
            reused_nonprefix_tokens=_count(usage.get("reused_nonprefix_tokens")),
            reused_approximate_prefix_tokens=_count(usage.get("reused_approximate_prefix_tokens")),
        ),
        approximate=bool(
            _count(usage.get("reused_nonprefix_tokens"))
            or _count(usage.get("reused_approximate_prefix_tokens"))
        ),
        # The queue time is the server's secret; first-token and total are seen from here.
        timings=Timings(queue_s=math.nan, ttft_s=(first_token or end) - start, total_s=end - start),
    )


def _count(value: Any) -> int:
    """A ragkv usage extension's token count, 0 unless a non-negative int (other servers
    send none; a malformed one is not trusted)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return ((choice.get("delta") or choice.get("message") or {}).get("content")) or ""


def http_error(response: httpx.Response) -> RemoteEngineError:
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text[:500] or response.reason_phrase
    return RemoteEngineError(
        f"{response.request.url} answered {response.status_code}: {message}",
        status_code=response.status_code,
    )


def check_deadline(deadline: float) -> None:
    if time.perf_counter() > deadline:
        raise RemoteEngineError("the server did not finish its answer within deadline_s")


def answer_json(chunks: Any, deadline: float) -> Any:
    """The JSON body of a completion answer read from ``chunks`` (its byte parts), at most
    ``MAX_ANSWER_BYTES`` and within ``deadline``; a RemoteEngineError otherwise."""
    data = bytearray()
    for part in chunks:
        _take(data, part, deadline)
    return _parse(data)


async def aanswer_json(chunks: Any, deadline: float) -> Any:
    """Asyncio form of :func:`answer_json` (``chunks`` an async iterator)."""
    data = bytearray()
    async for part in chunks:
        _take(data, part, deadline)
    return _parse(data)


def _take(data: bytearray, part: bytes, deadline: float) -> None:
    data += part
    if len(data) > MAX_ANSWER_BYTES:
        raise RemoteEngineError(f"the server's answer is over {MAX_ANSWER_BYTES} bytes")
    check_deadline(deadline)


def _parse(data: bytearray) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise RemoteEngineError(f"the server answered invalid JSON: {bytes(data[:200])!r}") from exc


def transport_error(base_url: str, exc: httpx.TransportError) -> RemoteEngineError:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    unreachable = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    return RemoteEngineError(f"request to {base_url} {kind}: {exc!r}", unreachable=unreachable)


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)[:500]


def _error_status(body: dict[str, Any]) -> int | None:
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) else None


def _tokens_by_tier(value: Any) -> dict[str, int] | None:
    """ragkv's ``prompt_tokens_details.cached_tokens_by_tier`` extension, if well formed."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(k, str) and type(v) is int for k, v in value.items()):
        return None
    return dict(value)
