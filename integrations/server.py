"""``ragkv serve``: one engine behind an OpenAI-compatible HTTP API (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (with the optional
``ragkv`` extension: retrieved chunks are deduplicated and assembled by a
:class:`ragkv.Pipeline` on the server), ``GET /v1/models``, ``GET /health`` and
``GET /metrics``. Every concurrent request goes to the one engine, whose continuous batching
serves them together and whose prefix cache they all share.

Safety rules (no request can hurt another):

- Tenants: each API key names a tenant (one ``api_key``: tenant ``default``; none: one
  anonymous tenant). Keys are compared in constant time, against every key, on every route
  but ``/health``. A request's cache namespace is a digest of its tenant and the client's
  ``cache_salt`` (which can only subdivide it), so tenants never share a KV block or the
  RAG pipeline's learned chunk order.
- Only configured ``Host`` names are answered (421 otherwise: DNS rebinding), and a POST body
  must be ``application/json`` (415 otherwise: a browser's cross-site form cannot send that).
- Bodies over ``max_body_bytes`` get 413 before they are parsed; large bodies are decoded
  and validated on a worker thread, so the event loop keeps serving. Everything is
  validated before anything is queued: a bad value is a 400 naming its field, RAG chunks
  are bounded by :class:`~ragkv.integrations.openai_protocol.RequestLimits`.
- A request that outlives ``request_timeout_s`` is aborted (504); a client that disconnects
  aborts its request, which frees its KV blocks; every error is an OpenAI-style JSON body,
  never a traceback, and every stream ends with an error event or ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

from ragkv.errors import MissingDependencyError

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
except ImportError as exc:  # pragma: no cover - exercised through server_cli
    raise MissingDependencyError("fastapi", "server") from exc

from ragkv.assembler.template import render_chat
from ragkv.cache_engine import Engine
from ragkv.cache_engine.engine_like import EngineLike
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import (
    CacheCapacityError,
    ConfigError,
    EngineClosedError,
    InvalidInputError,
    PromptTooLongError,
    RagkvError,
    RequestAbortedError,
)
from ragkv.integrations import openai_protocol as proto
from ragkv.integrations.openai_protocol import APIError, GenerationRequest, RequestLimits
from ragkv.integrations.server_cli import (
    ANONYMOUS_TENANT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    LOOPBACK_HOSTS,
    SINGLE_TENANT,
    validate_api_keys,
)
from ragkv.integrations.server_metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)

_OPEN_ROUTES = frozenset({"/health"})
# Bodies up to this size are decoded on the event loop (well under a millisecond); larger
# ones on a worker thread: a 2.6 MB body decoded inline stalled /health for 0.55 s.
_INLINE_PARSE_BYTES = 64 << 10


class _ClientGone(Exception):
    """The client closed the connection; nobody is left to answer."""


def create_app(
    engine_or_pipeline: Any,
    *,
    api_key: str | None = None,
    api_keys: Mapping[str, str] | None = None,
    allowed_hosts: Iterable[str] | None = None,
    limits: RequestLimits | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    model_name: str | None = None,
) -> FastAPI:
    """The FastAPI app serving an :class:`~ragkv.cache_engine.Engine` or a :class:`ragkv.Pipeline`.

    ``api_keys`` maps each API key to its tenant's name; ``api_key`` is the one-tenant case;
    with neither, every client is one anonymous tenant (a warning is logged).
    ``allowed_hosts`` are the ``Host`` names answered, with any port (default: localhost,
    127.0.0.1, ::1; ``"*"``: any). ``limits`` bound each request (default
    :class:`RequestLimits`, with ``max_prompt_tokens`` from the model context).
    ``model_name`` is the id clients must send as ``model`` (default: the engine's
    ``model_name``); requests naming another model get 404. A given pipeline must isolate
    its learned state per salt (``Pipeline(engine, isolate_by_salt=True)``). The caller owns
    the engine and closes it; the app never does.
    """
    from ragkv.pipeline import Pipeline

    if isinstance(engine_or_pipeline, Pipeline):
        pipeline, engine = engine_or_pipeline, engine_or_pipeline.engine
        if not pipeline.isolate_by_salt:
            raise ConfigError(
                "the server derives a cache salt per tenant and needs the pipeline's learned "
                "chunk order kept per salt: pass Pipeline(engine, isolate_by_salt=True)"
            )
    else:
        engine = engine_or_pipeline
        pipeline = Pipeline(engine, isolate_by_salt=True)
    if max_body_bytes < 1 or request_timeout_s <= 0:
        raise InvalidInputError("max_body_bytes and request_timeout_s must be positive")
    limits = limits or RequestLimits()
    # What only an in-process engine can tell (context, vocabulary, health, stats); a
    # pipeline over a RemoteEngine is served without it.
    local = engine if isinstance(engine, Engine) else None
    if limits.max_prompt_tokens is None and local is not None:
        limits = dataclasses.replace(limits, max_prompt_tokens=local.max_model_len - 1)
    served = _Served(
        engine=engine,
        local=local,
        pipeline=pipeline,
        model_name=model_name or engine.model_name or "ragkv",
        limits=limits,
        max_body_bytes=max_body_bytes,
        request_timeout_s=request_timeout_s,
        metrics=ServerMetrics(local),
    )
    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ragkv = served
    _add_routes(app, served, None if local is None else local.runner.vocab_size)
    _add_error_handlers(app)
    app.add_middleware(
        _Gate,
        tenants=_tenants(api_key, api_keys),
        allowed_hosts=_host_names(LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts),
        max_body_bytes=max_body_bytes,
        metrics=served.metrics,
    )
    return app


@dataclasses.dataclass(slots=True)
class _Served:
    """What the routes share: the engine, the pipeline and the limits."""

    engine: EngineLike
    local: Engine | None  # the same engine when it runs in this process
    pipeline: Any
    model_name: str
    limits: RequestLimits
    max_body_bytes: int
    request_timeout_s: float
    metrics: ServerMetrics


def tenant_salt(tenant: str, client_salt: str | None) -> str:
    """The cache salt the engine sees for a request of ``tenant`` with the client's ``cache_salt``.

    A fixed-size hex digest (the engine caps salts at 256 UTF-8 bytes; a client's salt can be
    any length), over the tenant's name length-prefixed, then the client's salt tagged as
    present or absent: no (tenant, salt) pair can reach another tenant's namespace.
    """
    name = tenant.encode()
    digest = hashlib.sha256(b"ragkv-tenant-salt\0")
    digest.update(len(name).to_bytes(8, "little") + name)
    if client_salt is not None:
        digest.update(b"\1" + client_salt.encode())
    return digest.hexdigest()


def _tenants(api_key: str | None, api_keys: Mapping[str, str] | None) -> dict[str, str] | None:
    """``{key: tenant}`` or None for a keyless server."""
    if api_key and api_keys:
        raise ConfigError("give either api_key (one tenant) or api_keys, not both")
    if api_keys:
        return validate_api_keys(dict(api_keys))
    if api_key:
        return validate_api_keys({api_key: SINGLE_TENANT}, "api_key")
    logger.warning(
        "serving without an API key: every client is one anonymous tenant; anything that "
        "can reach this server can use it"
    )
    return None


# -- routes ---------------------------------------------------------------------------------


def _add_routes(app: FastAPI, served: _Served, vocab_size: int | None) -> None:
    completion_schema, chat_schema = proto.request_schemas(
        served.limits,
        model_name=served.model_name,
        vocab_size=vocab_size,
        max_model_len=None if served.local is None else served.local.max_model_len,
    )

    @app.get("/health")
    async def health() -> Response:
        # 503 lets a supervisor restart a server whose engine died or keeps failing.
        if served.local is None:  # a remote engine reports no health here
            return Response(status_code=200)
        report = served.local.health()
        if not report.ok:
            return JSONResponse({"status": "unhealthy", "reason": report.reason}, 503)
        fields = {f: getattr(report, f) for f in report.__dataclass_fields__}
        return JSONResponse({"status": "ok", **fields})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served.model_name, "object": "model", "created": 0, "owned_by": "ragkv"}
        if served.local is not None:
            card["max_model_len"] = served.local.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", openapi_extra=_json_body(completion_schema))
    @_answered_here
    async def completions(request: Request) -> Response:
        parsed = await _parse(request, served, proto.parse_completion)
        prompt = parsed.prompt
        if isinstance(prompt, str):
            prompt = await asyncio.to_thread(_tokenize, served.engine, prompt)
            proto.check_prompt_tokens(len(prompt), served.limits, "prompt")
        return await _generate(request, served, parsed, prompt, chat=False, extra=None)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(chat_schema))
    @_answered_here
    async def chat_completions(request: Request) -> Response:
        parsed = await _parse(request, served, proto.parse_chat)
        token_ids, extra = await asyncio.to_thread(_chat_prompt, served, parsed)
        culprit = "messages" if parsed.rag is None else "ragkv.chunks"
        proto.check_prompt_tokens(len(token_ids), served.limits, culprit)
        return await _generate(request, served, parsed, token_ids, chat=True, extra=extra)


def _answered_here(
    route: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Turn an unexpected exception of ``route`` (a bug, a failed engine step) into a logged
    500 APIError. Left alone, it reaches Starlette's ServerErrorMiddleware, which re-raises
    after answering, and uvicorn then closes the keep-alive connection: the client's next
    request on it, possibly already sent, fails with a connection reset."""

    @functools.wraps(route)
    async def answered(request: Request) -> Response:
        try:
            return await route(request)
        except (APIError, RagkvError, _ClientGone):
            raise
        except Exception as exc:
            logger.exception("unexpected error serving %s", request.url.path)
            raise _internal_error() from exc

    return answered


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` of a route that reads its JSON itself (so the schema is
    documentation and fuzzing input; the parser in openai_protocol is the authority)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _parse(
    request: Request, served: _Served, parse: Callable[[Any, RequestLimits], GenerationRequest]
) -> GenerationRequest:
    """Read, decode and validate a body (off the loop when large) before anything is queued.

    The returned request's ``cache_salt`` is the tenant's namespace (:func:`tenant_salt`).
    """
    raw = await _read_body(request, served.max_body_bytes)
    if len(raw) > _INLINE_PARSE_BYTES:
        parsed = await asyncio.to_thread(_decode, raw, parse, served.limits)
    else:
        parsed = _decode(raw, parse, served.limits)
    _check_model(parsed, served)
    tenant = request.scope.get("state", {}).get("ragkv_tenant", ANONYMOUS_TENANT)
    parsed.tenant = tenant
    parsed.cache_salt = tenant_salt(tenant, parsed.cache_salt)
    return parsed


def _decode(
    raw: bytes, parse: Callable[[Any, RequestLimits], GenerationRequest], limits: RequestLimits
) -> GenerationRequest:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    bad = proto.find_lone_surrogate(body)
    if bad is not None:
        raise APIError(
            400,
            f"{bad} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); "
            "send valid Unicode text",
            param=bad,
        )
    parsed = parse(body, limits)
    _check_sampling(parsed)
    return parsed


def _check_sampling(parsed: GenerationRequest) -> None:
    """Validate the sampling settings with the engine's own rules, naming the bad field."""
    fields = dict(parsed.sampling)
    if parsed.max_tokens is not None:
        fields["max_tokens"] = parsed.max_tokens
    try:
        SamplingParams(**fields).validate()
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=exc.param or _failing_field(fields)) from exc


def _failing_field(fields: dict[str, Any]) -> str | None:
    # For validation errors that do not carry ``param`` yet: the field that fails on its own.
    for name, value in fields.items():
        try:
            SamplingParams(**{name: value}).validate()
        except InvalidInputError:
            return name
    return None


def _check_model(parsed: GenerationRequest, served: _Served) -> None:
    if parsed.model is not None and parsed.model != served.model_name:
        raise APIError(
            404,
            f"model {parsed.model!r} is not served here; this server serves {served.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _tokenize(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat_prompt(served: _Served, parsed: GenerationRequest) -> tuple[list[int], dict | None]:
    """Token ids of a chat request: the chat template, or dedup + assembly for ``ragkv``."""
    if parsed.rag is None:
        try:
            text = render_chat(served.engine.tokenizer, parsed.messages)
        except Exception as exc:  # jinja raises for messages the template refuses
            raise APIError(
                400, f"the chat template rejected messages: {exc}", param="messages"
            ) from exc
        return _tokenize(served.engine, text), None
    messages = parsed.messages
    if messages[-1]["role"] != "user":
        raise APIError(
            400, "with ragkv chunks the last message must be the user's question", param="messages"
        )
    system = parsed.rag.system
    if system is None:
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    history = [m for m in messages[:-1] if m["role"] != "system"]
    prepared = served.pipeline.prepare(
        messages[-1]["content"],
        parsed.rag.chunks,
        system=system,
        history=history,
        cache_salt=parsed.cache_salt,
        # Learned chunk order is the tenant's, whatever salts its clients pick: a client
        # cycling salts cannot evict other tenants' state.
        namespace=parsed.tenant,
    )
    stats = prepared.dedup.stats
    extra = {
        "chunks_in": stats.chunks_in,
        "chunks_out": stats.chunks_out,
        "expected_cached_tokens": prepared.plan.expected_cached_tokens,
    }
    return list(prepared.plan.token_ids), extra


# -- generation -------------------------------------------------------------------------------


async def _generate(
    request: Request,
    served: _Served,
    parsed: GenerationRequest,
    token_ids: list[int],
    *,
    chat: bool,
    extra: dict | None,
) -> Response:
    engine, local = served.engine, served.local
    max_tokens = parsed.max_tokens
    if max_tokens is None:  # chat default: up to the context (as vLLM does) or the KV pool
        limit = len(token_ids) + 16
        if local is not None:
            limit = min(local.max_model_len, local.kv_cache_tokens)
        max_tokens = max(1, limit - len(token_ids))
    params = SamplingParams(max_tokens=max_tokens, **parsed.sampling)
    deadline = asyncio.get_running_loop().time() + served.request_timeout_s
    request_id = proto.new_request_id("chatcmpl" if chat else "cmpl")
    stream = engine.astream(token_ids, params, cache_salt=parsed.cache_salt)
    served.metrics.in_flight.inc()
    try:
        # The first delta comes before any header, so a bad request still gets a 4xx.
        first = await _guarded(request, anext(stream), deadline)
    except BaseException:
        served.metrics.in_flight.dec()
        await stream.aclose()
        raise
    if parsed.stream:
        events = _sse(served, parsed, request_id, token_ids, stream, first, deadline, chat=chat)

        async def cleanup() -> None:
            served.metrics.in_flight.dec()
            await events.aclose()
            await stream.aclose()

        return _ClosingStream(events, cleanup)
    try:
        output = first.output or await _guarded(request, _last_output(stream), deadline)
    finally:
        served.metrics.in_flight.dec()
        await stream.aclose()
    build = proto.chat_body if chat else proto.completion_body
    body = build(request_id, served.model_name, output, return_token_ids=parsed.return_token_ids)
    if extra is not None:
        body["ragkv"] = extra
    return JSONResponse(body)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _sse(
    served: _Served,
    parsed: GenerationRequest,
    request_id: str,
    prompt_ids: list[int],
    stream: AsyncIterator[Any],
    first: Any,
    deadline: float,
    *,
    chat: bool,
) -> AsyncIterator[bytes]:
    """SSE events of one streamed request. Starlette cancels this generator when the client
    disconnects; closing ``stream`` then aborts the request and frees its blocks."""
    model = served.model_name
    ids = parsed.return_token_ids
    try:
        async with contextlib.aclosing(stream):
            if chat:
                yield _event(
                    proto.chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None)
                )
            delta = first
            while True:
                if delta.text or delta.finish_reason or ids:  # else text is held back
                    chunk = _stream_chunk(request_id, model, delta, chat=chat, ids=ids)
                    if ids and delta is first:
                        chunk["choices"][0]["prompt_token_ids"] = prompt_ids
                    yield _event(chunk)
                if delta.output is not None:
                    break
                async with asyncio.timeout_at(deadline):
                    delta = await anext(stream)
            if parsed.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _event(
                    proto.usage_chunk(request_id, model, obj, delta.output.usage.to_openai())
                )
    except TimeoutError:
        yield _event(_timeout_error(served).body())
    except RagkvError as exc:
        yield _event(_api_error(exc).body())
    except Exception:  # the headers are sent: the error can only travel as an event
        logger.exception("stream %s failed", request_id)
        yield _event(_internal_error().body())
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
    if chat:
        content = {"content": delta.text} if delta.text else {}
        return proto.chat_chunk(request_id, model, content, delta.finish_reason, tokens)
    return proto.completion_chunk(request_id, model, delta.text, delta.finish_reason, tokens)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _last_output(stream: AsyncIterator[Any]) -> Any:
    async for delta in stream:
        if delta.output is not None:
            return delta.output
    raise RequestAbortedError("the request ended without an output")  # pragma: no cover


async def _guarded(request: Request, step: Awaitable[Any], deadline: float) -> Any:
    """Await ``step`` unless the client disconnects first (raises _ClientGone) or the
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
        raise _ClientGone
    raise _timeout_error(request.app.state.ragkv)


async def _disconnected(request: Request) -> None:
    # The body is fully read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    size = 0
    parts = []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


# -- errors -----------------------------------------------------------------------------------


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def _timeout_error(served: _Served) -> APIError:
    return APIError(
        504,
        f"the request did not finish within {served.request_timeout_s:g} s and was aborted",
        type="timeout_error",
        code="timeout",
    )


def _internal_error() -> APIError:
    return APIError(500, "internal server error; see the server log", type="server_error")


def _api_error(exc: RagkvError) -> APIError:
    if isinstance(exc, PromptTooLongError | CacheCapacityError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidInputError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineClosedError | RequestAbortedError):
        return APIError(503, str(exc), type="server_error", code="unavailable")
    return APIError(500, str(exc), type="server_error")


def _add_error_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RagkvError)
    async def ragkv_error(request: Request, exc: RagkvError) -> JSONResponse:
        error = _api_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code=None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(_internal_error().body(), status_code=500)


# -- the gate: host, auth, content type, early size check, request counting -------------------


class _Gate:
    """Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware)."""

    def __init__(
        self,
        app: Any,
        *,
        tenants: dict[str, str] | None,
        allowed_hosts: frozenset[str] | None,
        max_body_bytes: int,
        metrics: ServerMetrics,
    ) -> None:
        self.app = app
        # Digests have one length, so comparing them leaks nothing about a key's length.
        self.keys = (
            None
            if tenants is None
            else [(hashlib.sha256(k.encode()).digest(), t) for k, t in tenants.items()]
        )
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"]
        status = 500

        async def counted_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._refuse(scope)
            if error is not None:
                await _send_error(counted_send, error)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            known = route if route in _KNOWN_ROUTES else "other"
            self.metrics.http_requests.labels(known, str(status)).inc()

    def _refuse(self, scope: dict) -> APIError | None:
        """The error that refuses this request before it reaches a route, else None; on
        success the request's tenant is in ``scope["state"]["ragkv_tenant"]``."""
        if scope["path"] in _OPEN_ROUTES:
            return None
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if self.allowed_hosts is not None and (
            len(hosts) != 1 or _host_name(hosts[0]) not in self.allowed_hosts
        ):
            return APIError(
                421,
                "this server does not answer to that Host name; add it to --allowed-hosts",
                code="host_not_allowed",
            )
        headers = dict(scope["headers"])
        tenant = self._tenant(headers.get(b"authorization", b""))
        if tenant is None:
            return APIError(
                401,
                "missing or wrong API key; send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )
        scope.setdefault("state", {})["ragkv_tenant"] = tenant
        if scope["method"] == "POST" and not _is_json(headers.get(b"content-type")):
            return APIError(
                415,
                "the request body must be JSON; send 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return None

    def _tenant(self, authorization: bytes) -> str | None:
        if self.keys is None:
            return ANONYMOUS_TENANT
        scheme, _, token = authorization.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        found = None
        for key, tenant in self.keys:  # every key, match or not: constant time in the key
            if hmac.compare_digest(digest, key) and found is None:
                found = tenant
        return found if scheme.lower() == b"bearer" else None


def _host_names(hosts: Iterable[str]) -> frozenset[str] | None:
    """Normalized allowed Host names (no port, no brackets, lower case); None for '*'."""
    names = set()
    for host in hosts:
        if host.strip() == "*":
            return None
        names.add(_host_name(host.strip().encode()))
    return frozenset(names)


def _host_name(value: bytes) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # a name or IPv4 with a port; a bare IPv6 has several colons
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    return content_type.partition(b";")[0].strip().lower() == b"application/json"


_KNOWN_ROUTES = frozenset(
    {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
)


async def _send_error(send: Any, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_REQUEST_TIMEOUT_S", "create_app", "tenant_salt"]
