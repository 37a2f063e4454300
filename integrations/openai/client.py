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
import logging
import random
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

import httpx

from ragkv.cache_engine.config import DEFAULTS
from ragkv.cache_engine.engine_like import ForwardingEngine, Prompt
from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams, resolve_params
from ragkv.errors import InvalidInputError, RemoteEngineError
from ragkv.integrations.openai.client_reader import (
    StreamState,
    aanswer_json,
    answer_json,
    http_error,
    output_of,
    transport_error,
)
from ragkv.integrations.openai.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Idle pooled connections are dropped after this long: below the 5 s after which uvicorn
# (ragkv serve, vLLM, SGLang) closes an idle keep-alive connection. At httpx's default (also
# 5 s) a request can go out on a connection the server is closing that instant; it fails
# with a ReadError after it was sent, which nobody can safely resend.
KEEPALIVE_EXPIRY_S = 2.0


class RemoteEngine(ForwardingEngine):
    """An OpenAI-compatible ``/v1/completions`` endpoint behind the Engine API.

    ``base_url`` ends in ``/v1`` (as for the ``openai`` client). ``tokenizer`` is the server
    model's, as :func:`~ragkv.integrations.openai.tokenizer.load_tokenizer` takes it
    (``"embedded"``, a local directory, a cached hub id or a tokenizer object). ``model``
    defaults to the first id ``GET /v1/models`` lists. ``block_size`` is the server's KV
    block size, which the assembler aligns stable segments to (default: ragkv's own,
    ``DEFAULTS.block_size``; vLLM's is 16 too). ``cache_salt`` is the default salt for calls
    that pass none. ``timeout_s`` bounds each read of an attempt (connect, and each read of
    a stream), ``deadline_s`` the whole answer (a server that trickles bytes cannot hold a
    call longer); answers are read up to 16 MiB and SSE lines up to 1 Mi characters.
    ``max_retries`` attempts follow a retryable failure. ``transport`` replaces httpx's own
    (tests): both the sync and the asyncio client use it, so for calls of both kinds it must
    be both kinds of transport, as ``httpx.MockTransport`` is.
    """

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: Any,
        model: str | None = None,
        api_key: str | None = None,
        block_size: int = DEFAULTS.block_size,
        cache_salt: str | None = None,
        timeout_s: float = 120.0,
        deadline_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        send_token_ids: bool = True,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_retries < 0 or backoff_s < 0 or timeout_s <= 0 or deadline_s <= 0:
            raise InvalidInputError(
                "max_retries and backoff_s must be >= 0, timeout_s and deadline_s > 0"
            )
        self.deadline_s = deadline_s
        self.base_url = base_url.rstrip("/")
        self.tokenizer = load_tokenizer(tokenizer)
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.send_token_ids = send_token_ids
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout_s)
        self._limits = httpx.Limits(  # httpx's default pool sizes, a shorter idle expiry
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S
        )
        self._transport = transport
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=self._headers,
            timeout=self._timeout,
            limits=self._limits,
            # The ignores here and in _async_client: typing cannot say "both kinds of
            # transport" (no intersection types); each client gets the one object.
            transport=transport,  # type: ignore[arg-type]
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

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Generator[StreamDelta, None, None]:
        """Text deltas as the server streams them; the last one carries ``finish_reason`` and
        the ``output``. Closing the iterator closes the connection, which a server like
        ``ragkv serve`` or vLLM treats as an abort."""
        payload, state = self._stream_request(prompt, resolve_params(params, sampling), cache_salt)
        response = self._send(payload, stream=True)
        try:
            for line in response.iter_lines():
                delta = state.feed_line(line)
                if delta is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise self._broke("stream", exc) from exc
        finally:
            response.close()
        yield state.finish()

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Output:
        """Asyncio form of :meth:`generate` for one prompt."""
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, resolve_params(params, sampling), cache_salt, stream=False)
        response = await self._asend(payload, stream=True)
        try:
            body = await aanswer_json(response.aiter_bytes(), start + self.deadline_s)
        except httpx.TransportError as exc:
            raise self._broke("answer", exc) from exc
        finally:
            await response.aclose()
        return output_of(body, ids, start)

    async def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Asyncio form of :meth:`stream`; cancelling it closes the connection."""
        payload, state = self._stream_request(prompt, resolve_params(params, sampling), cache_salt)
        response = await self._asend(payload, stream=True)
        try:
            async for line in response.aiter_lines():
                delta = state.feed_line(line)
                if delta is not None:
                    yield delta
        except httpx.TransportError as exc:
            raise self._broke("stream", exc) from exc
        finally:
            await response.aclose()
        yield state.finish()

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Always 0: an OpenAI-compatible server does not say what it holds before a request
        (``knows_residency`` is False, so the assembler uses its own record instead)."""
        return 0

    def check_health(self, timeout_s: float = 2.0) -> bool:
        """Whether the server answers ``GET /health`` (next to ``/v1``, as vLLM, SGLang and
        ``ragkv serve`` serve it) or, where that route is missing, ``GET /v1/models``, with a
        2xx within ``timeout_s``. Never raises; no retries."""
        root = self.base_url.removesuffix("/v1")
        for url in (f"{root}/health", f"{self.base_url}/models"):
            try:
                response = self._client.get(url, timeout=timeout_s)
            except httpx.HTTPError:
                return False
            if response.status_code != 404:
                return response.status_code < 300
        return False

    def close(self) -> None:
        """Close the sync client (the async one is closed by :meth:`aclose`)."""
        self._client.close()

    async def aclose(self) -> None:
        if self._aclient is not None:
            await self._aclient.aclose()
            self._aclient = None
        self._client.close()

    # -- requests ---------------------------------------------------------------------------
    def _generate_one(
        self, prompt: Prompt, params: SamplingParams | None, cache_salt: str | None, **sampling: Any
    ) -> Output:
        """:meth:`generate` for one prompt; keyword settings change ``params`` as in
        ``Engine.generate``."""
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, resolve_params(params, sampling), cache_salt, stream=False)
        response = self._send(payload, stream=True)
        try:
            body = answer_json(response.iter_bytes(), start + self.deadline_s)
        except httpx.TransportError as exc:
            raise self._broke("answer", exc) from exc
        finally:
            response.close()
        return output_of(body, ids, start)

    def _payload(
        self, prompt: Prompt, params: SamplingParams | None, cache_salt: str | None, stream: bool
    ) -> dict[str, Any]:
        params = params or SamplingParams()  # validated when it was built (frozen)
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

    def _stream_request(
        self, prompt: Prompt, params: SamplingParams, cache_salt: str | None
    ) -> tuple[dict[str, Any], StreamState]:
        """A streamed request's body, and the state its SSE lines feed (the clock starts now)."""
        ids, start = self._prompt_ids(prompt), time.perf_counter()
        payload = self._payload(prompt, params, cache_salt, stream=True)
        return payload, StreamState(ids, start, start + self.deadline_s)

    def _broke(self, what: str, exc: httpx.TransportError) -> RemoteEngineError:
        """A connection that broke while the ``what`` (answer or stream) was being read."""
        return RemoteEngineError(f"{what} from {self.base_url} broke: {exc}")

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
        """A server that does not take token-id prompts switches this client to text prompts
        for good; any other 400 (a bad max_tokens, a prompt too long) is the request's own."""
        if isinstance(payload["prompt"], str) or not self.send_token_ids:
            return False
        if exc.status_code not in (400, 422) or not _refuses_token_ids(str(exc)):
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
                    raise transport_error(self.base_url, exc) from exc
            else:
                if response.status_code < 400:
                    return response
                response.read()
                response.close()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise http_error(response)
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
                    raise transport_error(self.base_url, exc) from exc
            else:
                if response.status_code < 400:
                    return response
                await response.aread()
                await response.aclose()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise http_error(response)
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
                limits=self._limits,
                transport=self._transport,  # type: ignore[arg-type]
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


def _refuses_token_ids(message: str) -> bool:
    """Whether a 400's message says the prompt's type was refused (a list of ints where the
    server wants a string), as servers without token-id prompts word it."""
    text = message.lower()
    return "prompt" in text and any(
        word in text for word in ("string", "str", "type", "token id", "integer", "list")
    )


__all__ = ["RemoteEngine"]
