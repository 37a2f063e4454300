"""What ``ragkv serve`` runs with when no flag says otherwise: the server's defaults, the
environment variables it reads, and its tenant and host policy.

Framework-free (no FastAPI, uvicorn or torch): the CLI parser, the app and the gate all
read these values, and ``ragkv --help`` imports this module. The per-request wire limits
(chunk, text and message bounds) live beside the parsing that checks them, in
:mod:`ragkv.integrations.openai.limits`.
"""

from __future__ import annotations

from ragkv.errors import ConfigError

API_KEY_ENV = "RAGKV_API_KEY"
# Keys tenants' cache namespaces; read from the environment only, never a flag (ps shows flags).
TENANT_SECRET_ENV = "RAGKV_TENANT_SECRET"
# Reads /metrics on a server with several tenants.
ADMIN_KEY_ENV = "RAGKV_ADMIN_KEY"

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Requests in flight (queued or running) per tenant and in all: past them, 429 + Retry-After.
# A tenant's share is a quarter of the server's, so three others always find room.
DEFAULT_MAX_REQUESTS = 256
DEFAULT_MAX_REQUESTS_PER_TENANT = 64

# Host names a loopback server answers to (with any port); see --allowed-hosts.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Tenant of every request on a server with one --api-key, and on one with none.
SINGLE_TENANT = "default"
ANONYMOUS_TENANT = "anonymous"


def validate_api_keys(keys: object, origin: str = "api_keys") -> dict[str, str]:
    """``keys`` if it is a non-empty ``{key: tenant}`` of non-empty strings, else ConfigError."""
    if not isinstance(keys, dict) or not keys:
        raise ConfigError(
            f'{origin} must be a non-empty JSON object {{"<api key>": "<tenant name>", ...}}'
        )
    for key, tenant in keys.items():
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ConfigError(
                f"{origin}: every API key must be a non-empty string without surrounding whitespace"
            )
        if not key.isascii() or not key.isprintable():
            raise ConfigError(f"{origin}: API keys must be printable ASCII (HTTP headers)")
        if not isinstance(tenant, str) or not tenant.strip():
            raise ConfigError(f"{origin}: the tenant of every key must be a non-empty string")
        try:
            tenant.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"{origin}: tenant {tenant!r} is not valid text") from exc
    return dict(keys)
