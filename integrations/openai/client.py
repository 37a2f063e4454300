"""``RemoteEngine``: drive any OpenAI-compatible server (vLLM, SGLang, ``ragkv serve``) with
the Engine surface :class:`ragkv.Pipeline` uses.

The Pipeline assembles token ids locally, so the client needs **the server's tokenizer**
(pass the same checkpoint directory, hub id or tokenizer object the server loads): ids from
another tokenizer would be a different prompt. Ids go out as the ``prompt`` of
``/v1/completions``, which vLLM, SGLang and ``ragkv serve`` accept; a server that refuses
them (400/422) gets the decoded text instead, from then on. Text prompts are re-tokenized by
the server, so block-aligned prefix reuse is then only as good as its tokenization.

Only httpx is needed (a core dependency). One ``httpx.Client`` serves all sync calls and one
``httpx.AsyncClient`` per event loop serves the async ones, so connections are reused. 408,
429, 500, 502, 503 and 504 answers and transport errors are retried with exponential backoff and jitter
(``Retry-After`` honoured); other HTTP errors raise :class:`~ragkv.errors.RemoteEngineError`
with the ``status_code``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx

from ragkv.cache_engine.outputs import Output, StreamDelta, Timings, Usage
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import InvalidInputError, RemoteEngineError

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class RemoteEngine:
    """An OpenAI-compatible ``/v1/completions`` endpoint behind the Engine API.

    ``base_url`` ends in ``/v1`` (as for the ``openai`` client). ``model`` defaults to the
    first id ``GET /v1/models`` lists. ``block_size`` is the server's KV block size (vLLM's
    default is 16), which the assembler aligns stable segments to. ``cache_salt`` is the
    default salt for calls that pass none. ``timeout_s`` bounds each HTTP attempt (connect,
    and each read of a stream); ``max_retries`` attempts follow a retryable failure.
    """

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: Any,
        model: str | None = None,
        api_key: str | None = None,
        block_size: int = 16,
        cache_salt: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        send_token_ids: bool = True,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise InvalidInputError("max_retries and backoff_s must be >= 0, timeout_s > 0")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = _load_tokenizer(tokenizer)
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.send_token_ids = send_token_ids
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout_s)
        self._transport = transport
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=self._headers,
            timeout=self._timeout,
            transport=transport,
        )
        self._aclient: httpx.AsyncClient | None = None
        self._aclient_loop: asyncio.AbstractEventLoop | None = None

    # -- the Engine surface (EngineLike) ------------------------------------------------------
    knows_residency = False

    @property
    def model_name(self) -> str:
        """The model id sent with every request (asked from ``/v1/models`` once if not given)."""
        if self._model is None:
            response = self._request_with_retries("GET", "/models", None)
            try:
                self._model = response.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise RemoteEngineError(
                    f"{self.base_url}/models lists no model; pass model=...",
                    status_code=response.status_code,
                ) from exc
        return self._model

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Output | list[Output]:
        """One prompt → an :class:`Output`; a list of prompts → a list, sent one by one."""
        if _is_single(prompts):
            return self._generate_one(prompts, params, cache_salt)
        return [self._generate_one(p, params, cache_salt) for p in prompts]

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Iterator[StreamDelta]:
        """Text deltas as the server streams them; the last one carries ``finish_reason`` and
        the ``output``. Closing the iterator closes the connection, which a server like
        ``ragkv serve`` or vLLM treats as an abort."""
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, params, cache_salt, stream=True)
        response = self._send(payload, stream=True)
        state = _StreamState(ids, start)
        try:
            for line in response.iter_lines():
                delta = state.feed_line(line)
                if delta is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise RemoteEngineError(f"stream from {self.base_url} broke: {exc}") from exc
        finally:
            response.close()
        yield state.finish()

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Output:
        """Asyncio form of :meth:`generate` for one prompt."""
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, params, cache_salt, stream=False)
        response = await self._asend(payload, stream=False)
        return _output(response.json(), ids, start)

    async def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Asyncio form of :meth:`stream`; cancelling it closes the connection."""
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, params, cache_salt, stream=True)
        response = await self._asend(payload, stream=True)
        state = _StreamState(ids, start)
        try:
            async for line in response.aiter_lines():
                delta = state.feed_line(line)
                if delta is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise RemoteEngineError(f"stream from {self.base_url} broke: {exc}") from exc
        finally:
            await response.aclose()
        yield state.finish()

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Always 0: an OpenAI-compatible server does not say what it holds before a request
        (``knows_residency`` is False, so the assembler uses its own record instead)."""
        return 0

    def close(self) -> None:
        """Close the sync client (the async one is closed by :meth:`aclose`)."""
        self._client.close()

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- requests ---------------------------------------------------------------------------
    def _generate_one(
        self, prompt: Prompt, params: SamplingParams | None, cache_salt: str | None
    ) -> Output:
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, params, cache_salt, stream=False)
        response = self._send(payload, stream=False)
        return _output(response.json(), ids, start)

    def _payload(
        self, prompt: Prompt, params: SamplingParams | None, cache_salt: str | None, stream: bool
    ) -> dict[str, Any]:
        params = params or SamplingParams()
        params.validate()
        if params.logprobs is not None:
            raise InvalidInputError("RemoteEngine does not return logprobs; drop logprobs=")
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            **params.to_openai(),
        }
        salt = cache_salt if cache_salt is not None else self.cache_salt
        if salt is not None:  # a vLLM-style extension, sent only when set
            body["cache_salt"] = salt
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty")
            return []  # the server tokenizes; its ids come back with return_token_ids
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidInputError("prompt must be a non-empty string or list of token ids")
        return ids

    def _for_wire(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.send_token_ids:  # vLLM-style server: ids in, ids back
            return {**payload, "return_token_ids": True}
        if isinstance(payload["prompt"], str):
            return payload
        text = self.tokenizer.decode(payload["prompt"], skip_special_tokens=False)
        return {**payload, "prompt": text}

    def _send(self, payload: dict[str, Any], *, stream: bool) -> httpx.Response:
        try:
            return self._request_with_retries(
                "POST", "/completions", self._for_wire(payload), stream
            )
        except RemoteEngineError as exc:
            if not self._should_fall_back(payload, exc):
                raise
        return self._request_with_retries("POST", "/completions", self._for_wire(payload), stream)

    async def _asend(self, payload: dict[str, Any], *, stream: bool) -> httpx.Response:
        try:
            return await self._arequest_with_retries(self._for_wire(payload), stream)
        except RemoteEngineError as exc:
            if not self._should_fall_back(payload, exc):
                raise
        return await self._arequest_with_retries(self._for_wire(payload), stream)

    def _should_fall_back(self, payload: dict[str, Any], exc: RemoteEngineError) -> bool:
        """A refused token-id prompt switches this client to text prompts for good."""
        if isinstance(payload["prompt"], str) or not self.send_token_ids:
            return False
        if exc.status_code not in (400, 422):
            return False
        logger.warning(
            "%s refused a token-id prompt (%s); sending text from now on", self.base_url, exc
        )
        self.send_token_ids = False
        return True

    def _request_with_retries(
        self, method: str, path: str, payload: dict[str, Any] | None, stream: bool = False
    ) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                request = self._client.build_request(method, path, json=payload)
                response = self._client.send(request, stream=stream)
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise _transport_error(self.base_url, exc) from exc
            else:
                if response.status_code < 400:
                    return response
                response.read()
                response.close()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise _http_error(response)
            time.sleep(self._delay(attempt, response))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _arequest_with_retries(self, payload: dict[str, Any], stream: bool) -> httpx.Response:
        client = self._async_client()
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                request = client.build_request("POST", "/completions", json=payload)
                response = await client.send(request, stream=stream)
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise _transport_error(self.base_url, exc) from exc
            else:
                if response.status_code < 400:
                    return response
                await response.aread()
                await response.aclose()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise _http_error(response)
            await asyncio.sleep(self._delay(attempt, response))
        raise AssertionError("unreachable")  # pragma: no cover

    def _async_client(self) -> httpx.AsyncClient:
        # An AsyncClient's pooled connections belong to the loop that opened them.
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aclient_loop is not loop:
            self._aclient = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=self._timeout,
                transport=self._transport,
            )
            self._aclient_loop = loop
        return self._aclient

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Exponential backoff with "equal jitter"; a numeric Retry-After is a lower bound."""
        cap = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        delay = cap / 2 + random.uniform(0, cap / 2)
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP date: keep the backoff
                delay = max(delay, min(float(retry_after), self.max_backoff_s))
        return delay


# -- responses ------------------------------------------------------------------------------


class _StreamState:
    """Turns SSE lines into StreamDeltas; the final delta waits for the usage chunk."""

    def __init__(self, prompt_ids: list[int], start: float) -> None:
        self.prompt_ids = prompt_ids
        self.start = start
        self.first_token_time: float | None = None
        self.request_id = ""
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.last = StreamDelta("", "", [])
        self.done = False

    def feed_line(self, line: str) -> StreamDelta | None:
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
        output = _output(body, self.prompt_ids, self.start, self.first_token_time)
        last = self.last
        return StreamDelta(last.request_id, last.text, last.token_ids, self.finish_reason, output)


def _output(
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
        ),
        # The queue time is the server's secret; first-token and total are seen from here.
        timings=Timings(queue_s=math.nan, ttft_s=(first_token or end) - start, total_s=end - start),
    )


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return ((choice.get("delta") or choice.get("message") or {}).get("content")) or ""


def _http_error(response: httpx.Response) -> RemoteEngineError:
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text[:500] or response.reason_phrase
    return RemoteEngineError(
        f"{response.request.url} answered {response.status_code}: {message}",
        status_code=response.status_code,
    )


def _transport_error(base_url: str, exc: httpx.TransportError) -> RemoteEngineError:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "failed"
    return RemoteEngineError(f"request to {base_url} {kind}: {exc!r}")


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)[:500]


def _error_status(body: dict[str, Any]) -> int | None:
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) else None


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, Sequence) and (
        not prompts or not isinstance(prompts[0], str | Sequence)
    )


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str | os.PathLike):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    if tokenizer is None:
        raise InvalidInputError(
            "RemoteEngine needs the server's tokenizer (a path, hub id or tokenizer object)"
        )
    return tokenizer


__all__ = ["RemoteEngine"]
