"""Who may ask and what reaches the routes: the ASGI gate (host, API key, content type,
early size check, request counting) and the tenant each key names, whose cache namespace
:func:`tenant_salt` derives."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ragkv.errors import (
    ConfigError,
)
from ragkv.integrations.openai.limits import APIError
from ragkv.integrations.openai.server.access_log import log_request
from ragkv.integrations.openai.server.errors import too_large
from ragkv.integrations.openai.server.metrics import ServerMetrics
from ragkv.integrations.openai.server.settings import (
    ANONYMOUS_TENANT,
    SINGLE_TENANT,
    validate_api_keys,
)

logger = logging.getLogger(__name__)

_OPEN_ROUTES = frozenset({"/health"})


def tenant_salt(tenant: str, client_salt: str | None, secret: bytes = b"") -> str:
    """The cache salt the engine sees for a request of ``tenant`` with the client's ``cache_salt``.

    A fixed-size hex digest (the engine caps salts at 256 UTF-8 bytes; a client's salt can be
    any length): HMAC-SHA256 under the deployment's ``secret`` (:func:`deployment_secret`)
    over the tenant's name length-prefixed, then the client's salt tagged as present or
    absent. No (tenant, salt) pair can reach another tenant's namespace, and a server with
    another secret (other API keys) never reaches this one's, even for a tenant of the same
    name on a shared KV store directory.
    """
    name = tenant.encode()
    digest = hmac.new(secret, b"ragkv-tenant-salt\0", hashlib.sha256)
    digest.update(len(name).to_bytes(8, "little") + name)
    if client_salt is not None:
        digest.update(b"\1" + client_salt.encode())
    return digest.hexdigest()


def deployment_secret(tenants: Mapping[str, str] | None, secret: str | bytes | None) -> bytes:
    """The key of every tenant's cache namespace: the operator's ``secret``
    (``$RAGKV_TENANT_SECRET``) if given, else a digest of the configured API keys (so two
    servers with other keys never share a tenant's cached blocks; rotating keys then starts
    every tenant's cache afresh), else empty (a keyless server: one anonymous tenant)."""
    if secret:
        return secret.encode() if isinstance(secret, str) else bytes(secret)
    if not tenants:
        return b""
    digest = hashlib.sha256(b"ragkv-deployment\0")
    for key in sorted(tenants):
        digest.update(len(key).to_bytes(8, "little") + key.encode())
    return digest.digest()


def tenant_keys(api_key: str | None, api_keys: Mapping[str, str] | None) -> dict[str, str] | None:
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


# -- the gate: host, auth, content type, early size check, request counting -------------------


class Gate:
    """Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware). It sees every
    request, refused or answered: it counts it and writes its access-log line."""

    def __init__(
        self,
        app: Any,
        *,
        tenants: dict[str, str] | None,
        allowed_hosts: frozenset[str] | None,
        max_body_bytes: int,
        metrics: ServerMetrics,
        admin_key: str | None = None,
    ) -> None:
        self.app = app
        self.admin = None if not admin_key else hashlib.sha256(admin_key.encode()).digest()
        # /metrics counts every tenant's traffic: with several tenants, only the admin key.
        self.metrics_need_admin = tenants is not None and len(set(tenants.values())) > 1
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
        status = 500  # what a client sees when the app fails before answering
        # The request's deadline runs from here, not from after its body was parsed and
        # tokenized (streaming.generate reads it).
        loop = asyncio.get_running_loop()
        arrival = scope.setdefault("state", {})["ragkv_arrival"] = loop.time()

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
            log_request(scope, status, loop.time() - arrival)

    def _refuse(self, scope: dict) -> APIError | None:
        """The error that refuses this request before it reaches a route, else None; on
        success the request's tenant is in ``scope["state"]["ragkv_tenant"]``."""
        headers = dict(scope["headers"])
        if scope["path"] in _OPEN_ROUTES:  # answered to anyone; details only to a key holder
            tenant = self._tenant(headers.get(b"authorization", b""))  # anonymous: keyless
            if tenant is not None:
                scope.setdefault("state", {})["ragkv_tenant"] = tenant
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
        if scope["path"] == "/metrics" and (self.admin or self.metrics_need_admin):
            if not self._is_admin(headers.get(b"authorization", b"")):
                return APIError(
                    403,
                    "/metrics covers every tenant's traffic: send the admin key "
                    "($RAGKV_ADMIN_KEY when the server started)",
                    type="permission_error",
                    code="admin_key_required",
                )
            scope.setdefault("state", {})["ragkv_tenant"] = "admin"
            return None
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
            return too_large(self.max_body_bytes)
        return None

    def _is_admin(self, authorization: bytes) -> bool:
        if self.admin is None:
            return False
        scheme, _, token = authorization.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(digest, self.admin) and scheme.lower() == b"bearer"

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


def host_names(hosts: Iterable[str]) -> frozenset[str] | None:
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
