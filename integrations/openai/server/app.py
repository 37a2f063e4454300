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
  are bounded by :class:`~ragkv.integrations.openai.limits.RequestLimits`.
- A request that outlives ``request_timeout_s`` is aborted (504); a client that disconnects
  aborts its request, which frees its KV blocks; every error is an OpenAI-style JSON body,
  never a traceback, and every stream ends with an error event or ``data: [DONE]``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ragkv.errors import MissingDependencyError

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
except ImportError as exc:  # pragma: no cover - exercised through server.cli
    raise MissingDependencyError("fastapi", "server") from exc

from ragkv.cache_engine import Engine
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from ragkv.errors import (
    ConfigError,
    InvalidInputError,
    RagkvError,
)
from ragkv.integrations.openai import protocol as proto
from ragkv.integrations.openai import schemas
from ragkv.integrations.openai.limits import (
    APIError,
    RequestLimits,
    check_prompt_tokens,
    find_lone_surrogate,
    may_hold_lone_surrogate,
)
from ragkv.integrations.openai.protocol import GenerationRequest
from ragkv.integrations.openai.server import auth
from ragkv.integrations.openai.server.auth import Gate, host_names, tenant_keys
from ragkv.integrations.openai.server.chat_prompt import chat_prompt, tokenize
from ragkv.integrations.openai.server.errors import (
    ClientGone,
    add_error_handlers,
    internal_error,
    too_large,
)
from ragkv.integrations.openai.server.fair_work import DEFAULT_WORK_THREADS, FairWorkers
from ragkv.integrations.openai.server.metrics import CONTENT_TYPE, ServerMetrics
from ragkv.integrations.openai.server.settings import (
    ADMIN_KEY_ENV,
    ANONYMOUS_TENANT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_REQUESTS_PER_TENANT,
    DEFAULT_REQUEST_TIMEOUT_S,
    LOOPBACK_HOSTS,
    TENANT_SECRET_ENV,
)
from ragkv.integrations.openai.server.state import Served
from ragkv.integrations.openai.server.streaming import generate

logger = logging.getLogger(__name__)

# Bodies up to this size are decoded on the event loop (well under a millisecond); larger
# ones on a worker thread: a 2.6 MB body decoded inline stalled /health for 0.55 s.
_INLINE_PARSE_BYTES = 64 << 10


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
    reuse: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    tenant_secret: str | bytes | None = None,
    admin_key: str | None = None,
    max_requests_per_tenant: int = DEFAULT_MAX_REQUESTS_PER_TENANT,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    work_threads: int | None = None,
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
    the engine and closes it; the app never does. ``reuse="blend"`` (in-process engine only)
    lets chat requests opt into position-independent chunk reuse with ``"ragkv": {"chunks":
    [...], "reuse": "blend"}`` (settings absent or null: ``BlendConfig()``'s, deviation with
    ``ratio=0.15``); their answers are approximate and their usage says how many
    prompt tokens were reused that way (``reused_nonprefix_tokens``). A chat request that
    sets no ``max_tokens`` generates at most ``default_max_tokens`` (within the context); it
    may ask for more. Tenants' cache namespaces are keyed by a deployment secret
    (``tenant_secret``, else ``$RAGKV_TENANT_SECRET``, else a digest of the API keys; see
    :func:`~ragkv.integrations.openai.server.auth.deployment_secret`). ``/metrics`` counts
    every tenant's traffic: on a server with several tenants only ``admin_key`` (else
    ``$RAGKV_ADMIN_KEY``) reads it; ``/health`` without a key says only ok or unhealthy.
    A tenant may have ``max_requests_per_tenant`` requests in flight and the server
    ``max_requests`` in all; past them a request gets 429 with ``Retry-After`` before it is
    queued (the engine then admits tenants' waiting requests round-robin). Before that, a
    request's CPU work (decoding a large body, tokenizing, assembling) runs on
    ``work_threads`` threads (default: the cores, 2 to 8, plus one) taken round-robin by tenant,
    within the same shares
    (:mod:`~ragkv.integrations.openai.server.fair_work`).
    Every request logs one line to ``ragkv.serve.access`` (see
    :mod:`~ragkv.integrations.openai.server.access_log`).
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
    if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int):
        raise ConfigError(f"default_max_tokens must be an int, got {default_max_tokens!r}")
    if default_max_tokens < 1:
        raise ConfigError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    if min(max_requests_per_tenant, max_requests) < 1:
        raise ConfigError("max_requests_per_tenant and max_requests must be >= 1")
    work_threads = DEFAULT_WORK_THREADS if work_threads is None else work_threads
    if work_threads < 1:
        raise ConfigError(f"work_threads must be >= 1, got {work_threads}", param="work_threads")
    limits = limits or RequestLimits()
    # What only an in-process engine can tell (context, vocabulary, health, stats); a
    # pipeline over a RemoteEngine is served without it.
    local = engine if isinstance(engine, Engine) else None
    if local is not None:
        local.start()  # /health reports a live stepping thread from the first probe
    if reuse not in (None, "blend"):
        raise ConfigError(f"unknown reuse {reuse!r}; use None or 'blend'", param="reuse")
    if reuse is not None and local is None:
        raise ConfigError("reuse='blend' needs the in-process Engine", param="reuse")
    if limits.max_prompt_tokens is None and local is not None:
        limits = dataclasses.replace(limits, max_prompt_tokens=local.max_model_len - 1)
    served = Served(
        engine=engine,
        local=local,
        pipeline=pipeline,
        model_name=model_name or engine.model_name or "ragkv",
        limits=limits,
        max_body_bytes=max_body_bytes,
        request_timeout_s=request_timeout_s,
        metrics=ServerMetrics(local),
        reuse=reuse,
        default_max_tokens=default_max_tokens,
        max_requests_per_tenant=max_requests_per_tenant,
        max_requests=max_requests,
        workers=FairWorkers(
            work_threads, max_per_tenant=max_requests_per_tenant, max_total=max_requests
        ),
    )
    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ragkv = served
    _add_routes(app, served, None if local is None else local.runner.vocab_size)
    add_error_handlers(app)
    tenants = tenant_keys(api_key, api_keys)
    served.tenant_secret = auth.deployment_secret(
        tenants, tenant_secret or os.environ.get(TENANT_SECRET_ENV)
    )
    app.add_middleware(
        Gate,
        tenants=tenants,
        allowed_hosts=host_names(LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts),
        max_body_bytes=max_body_bytes,
        metrics=served.metrics,
        admin_key=admin_key or os.environ.get(ADMIN_KEY_ENV),
    )
    return app


# -- routes ---------------------------------------------------------------------------------


def _add_routes(app: FastAPI, served: Served, vocab_size: int | None) -> None:
    completion_schema, chat_schema = schemas.request_schemas(
        served.limits,
        model_name=served.model_name,
        vocab_size=vocab_size,
        max_model_len=None if served.local is None else served.local.max_model_len,
    )

    @app.get("/health")
    async def health(request: Request) -> Response:
        # 503 lets a supervisor restart a server whose engine died or keeps failing. Without
        # an API key (a probe), only the verdict: the engine's internals are a key holder's.
        if served.local is None:  # a remote engine reports no health here
            return Response(status_code=200)
        report = served.local.health()
        status = "ok" if report.ok else "unhealthy"
        if "ragkv_tenant" not in request.scope.get("state", {}):
            return JSONResponse({"status": status}, 200 if report.ok else 503)
        if not report.ok:
            return JSONResponse({"status": status, "reason": report.reason}, 503)
        fields = {f: getattr(report, f) for f in report.__dataclass_fields__}
        return JSONResponse({"status": status, **fields})

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
        tenant, prompt = parsed.tenant or "", parsed.prompt  # _parse sets the tenant
        assert prompt is not None  # parse_completion sets it or refuses the body
        if isinstance(prompt, str):
            prompt = await served.workers.run(tenant, tokenize, served.engine, prompt)
            check_prompt_tokens(len(prompt), served.limits, "prompt")
        return await generate(request, served, parsed, prompt, chat=False, extra=None)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(chat_schema))
    @_answered_here
    async def chat_completions(request: Request) -> Response:
        parsed = await _parse(request, served, proto.parse_chat)
        token_ids, extra, reuse = await served.workers.run(
            parsed.tenant or "", chat_prompt, served, parsed
        )
        culprit = "messages" if parsed.rag is None else "ragkv.chunks"
        check_prompt_tokens(len(token_ids), served.limits, culprit)
        return await generate(
            request, served, parsed, token_ids, chat=True, extra=extra, reuse=reuse
        )


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
        except (APIError, RagkvError, ClientGone):
            raise
        except Exception as exc:
            logger.exception("unexpected error serving %s", request.url.path)
            raise internal_error() from exc

    return answered


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` of a route that reads its JSON itself (so the schema is
    documentation and fuzzing input; the parser in protocol.py is the authority)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _parse(
    request: Request, served: Served, parse: Callable[[Any, RequestLimits], GenerationRequest]
) -> GenerationRequest:
    """Read, decode and validate a body (off the loop when large) before anything is queued.

    The returned request's ``cache_salt`` is the tenant's namespace
    (:func:`~ragkv.integrations.openai.server.auth.tenant_salt`).
    """
    tenant = request.scope.get("state", {}).get("ragkv_tenant", ANONYMOUS_TENANT)
    raw = await _read_body(request, served.max_body_bytes)
    if len(raw) > _INLINE_PARSE_BYTES:
        parsed = await served.workers.run(tenant, _decode, raw, parse, served.limits)
    else:
        parsed = _decode(raw, parse, served.limits)
    _check_model(parsed, served)
    parsed.tenant = tenant
    client_salt = parsed.cache_salt
    parsed.cache_salt = auth.tenant_salt(tenant, client_salt, served.tenant_secret)
    if served.salt_views is not None:  # KV events name blocks by the client's salt
        served.salt_views.note(parsed.cache_salt, client_salt, tenant)
    return parsed


def _decode(
    raw: bytes, parse: Callable[[Any, RequestLimits], GenerationRequest], limits: RequestLimits
) -> GenerationRequest:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    bad = find_lone_surrogate(body) if may_hold_lone_surrogate(raw) else None
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
    """Validate the sampling settings with the engine's own rules, naming the bad field;
    the validated (frozen) settings go on ``parsed.params``, validated once."""
    fields = dict(parsed.sampling)
    if parsed.max_tokens is not None:
        fields["max_tokens"] = parsed.max_tokens
    try:
        parsed.params = SamplingParams(**fields)
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=exc.param or _failing_field(fields)) from exc


def _failing_field(fields: dict[str, Any]) -> str | None:
    # For validation errors that do not carry ``param`` yet: the field that fails on its own.
    for name, value in fields.items():
        try:
            SamplingParams(**{name: value})
        except InvalidInputError:
            return name
    return None


def _check_model(parsed: GenerationRequest, served: Served) -> None:
    if parsed.model is not None and parsed.model != served.model_name:
        raise APIError(
            404,
            f"model {parsed.model!r} is not served here; this server serves {served.model_name!r}",
            param="model",
            code="model_not_found",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    size = 0
    parts = []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(limit)
        parts.append(part)
    return b"".join(parts)


__all__ = ["create_app"]
