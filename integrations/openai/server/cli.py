"""``ragkv serve``: load a model and serve it over an OpenAI-compatible HTTP API.

The top of the server: flags take their defaults from :mod:`.settings` (the server's),
:mod:`~ragkv.integrations.openai.limits` (the request limits) and the engine's
``EngineConfig`` (:mod:`~ragkv.cache_engine.engine_flags`), and :func:`run` builds the
app; no server module imports this one (only ``ragkv.cli``, which dispatches ``ragkv
serve``). Heavy imports (torch, fastapi, uvicorn) happen inside :func:`run`, so ``ragkv
--help`` stays fast and works without the ``server`` extra.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from ragkv.cache_engine.engine_flags import add_engine_flags, engine_config_from_args
from ragkv.cache_engine.engine_like import Closes
from ragkv.cache_engine.kv_events import DEFAULT_MAX_EVENTS
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS
from ragkv.errors import ConfigError, MissingDependencyError
from ragkv.integrations.kv_events.publisher import DEFAULT_TOPIC
from ragkv.integrations.openai.limits import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_RAG_BYTES,
    DEFAULT_MAX_STOP_STRINGS,
    DEFAULT_MAX_TEXT_BYTES,
    RequestLimits,
)
from ragkv.integrations.openai.server.settings import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_REQUESTS_PER_TENANT,
    DEFAULT_REQUEST_TIMEOUT_S,
    LOOPBACK_HOSTS,
    validate_api_keys,
)

if TYPE_CHECKING:
    from fastapi import FastAPI  # imported in run(), with the other heavy modules

logger = logging.getLogger(__name__)

# EngineConfig fields without a `ragkv serve` flag (yet): the engine's defaults apply.
NOT_SERVED = ("hash_algo", "enable_prefix_caching", "schedule_policy", "backend")


# The server's limits and request defaults: (flag, type, default, help).
_LIMIT_FLAGS: tuple[tuple[str, type, int | float | None, str | None], ...] = (
    ("--max-body-bytes", int, DEFAULT_MAX_BODY_BYTES, None),
    ("--request-timeout", float, DEFAULT_REQUEST_TIMEOUT_S, "seconds"),
    ("--max-chunk-bytes", int, DEFAULT_MAX_CHUNK_BYTES, None),
    ("--max-chunks", int, DEFAULT_MAX_CHUNKS, None),
    ("--max-rag-bytes", int, DEFAULT_MAX_RAG_BYTES, "total bytes of ragkv.chunks per request"),
    ("--max-text-bytes", int, DEFAULT_MAX_TEXT_BYTES, "UTF-8 bytes of prompt text per request "
     "besides ragkv.chunks (messages, prompt, ragkv.system; default "
     f"{DEFAULT_MAX_TEXT_BYTES >> 20} MiB)"),
    ("--max-messages", int, DEFAULT_MAX_MESSAGES, "messages per chat request"),
    ("--max-requests-per-tenant", int, DEFAULT_MAX_REQUESTS_PER_TENANT, "requests one API key's "
     "tenant may have in flight; past it, 429 + Retry-After (default "
     f"{DEFAULT_MAX_REQUESTS_PER_TENANT})"),
    ("--max-requests", int, DEFAULT_MAX_REQUESTS,
     f"requests in flight in all (default {DEFAULT_MAX_REQUESTS})"),
    ("--work-threads", int, None, "threads that decode, tokenize and assemble requests, taken "
     "round-robin by tenant; one tenant holds at most all but one (default: the cores, 2 to 8, "
     "plus one)"),
    ("--torch-threads", int, None, "torch compute threads of this process (default: torch's "
     "own, the cores; on a small CPU machine 1 often serves more: see docs/serving.md)"),
    ("--max-stop-strings", int, DEFAULT_MAX_STOP_STRINGS, None),
    ("--max-prompt-tokens", int, None, "default: the model context"),
    ("--default-max-tokens", int, DEFAULT_MAX_TOKENS, "new tokens a chat request that sets no "
     f"max_tokens may generate (default {DEFAULT_MAX_TOKENS}; a request may ask for more, up to "
     "the context)"),
)  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``ragkv serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve one engine (one shared prefix cache) over /v1/completions, "
            "/v1/chat/completions, /v1/models, /health and /metrics. Binds 127.0.0.1 unless "
            f"--host says otherwise; set --api-key or ${API_KEY_ENV} (one tenant) or "
            "--api-keys (several) before exposing it."
        ),
    )
    parser.add_argument("--served-model-name", default=None, help="model id clients send")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}); one tenant",
    )
    parser.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        metavar="FILE",
        help='JSON file {"<key>": "<tenant>", ...}: one cache namespace per tenant',
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names to answer (any port); '*' for any "
        "(default: the bind address, localhost, 127.0.0.1, ::1)",
    )
    # Every engine setting but those ragkv serve does not offer yet, declared once, with its
    # help and default, on EngineConfig's fields.
    add_engine_flags(parser.add_argument_group("engine"), exclude=NOT_SERVED)
    for flag, kind, default, help_text in _LIMIT_FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument(
        "--reuse",
        choices=("blend",),
        default=None,
        help="let chat requests opt into position-independent chunk reuse with "
        '"ragkv": {"chunks": [...], "reuse": "blend"} (approximate answers, '
        "usage.reused_nonprefix_tokens; optional strategy, k, ratio and head, null or absent "
        "meaning BlendConfig's default: deviation, k 16, ratio 0.15); off by default",
    )
    events = parser.add_argument_group(
        "KV events",
        "publish the KV cache's events in vLLM's format (ZMQ + msgpack; pip install "
        "'ragkv[events]') for a cache-aware router: BlockStored / BlockRemoved of the KV "
        'pool, medium "GPU" whatever its device, and of the KV tiers, "CPU" for host memory '
        'and "DISK" for disk; AllBlocksCleared at start and on reset. They '
        "carry prompts' token ids: bind loopback or a private network",
    )
    events.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ZMQ",
        help="PUB socket to bind, e.g. tcp://127.0.0.1:5557 (off by default)",
    )
    events.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ZMQ",
        help="ROUTER socket answering replay requests, e.g. tcp://127.0.0.1:5558",
    )
    events.add_argument("--kv-events-topic", default=DEFAULT_TOPIC, help="topic frame")
    events.add_argument(
        "--kv-events-buffer",
        type=int,
        default=DEFAULT_MAX_EVENTS,
        help="events held for the publisher before new ones are dropped (and subscribers "
        f"told of a gap); default {DEFAULT_MAX_EVENTS}",
    )
    parser.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="do not print one line per request (route, status, tenant, tokens, seconds)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the engine and the app, then serve until interrupted."""
    try:
        import uvicorn
    except ImportError as exc:
        raise MissingDependencyError("uvicorn", "server") from exc
    # Imported before the model loads, so a missing fastapi fails in a second, not a minute.
    from ragkv.cache_engine import Engine
    from ragkv.integrations.openai.server.app import create_app

    api_keys = None
    if args.api_keys is not None:
        if args.api_key:
            raise ConfigError(f"give either --api-key (or ${API_KEY_ENV}) or --api-keys, not both")
        api_keys = load_api_keys(args.api_keys)
    limits = RequestLimits(
        max_chunk_bytes=args.max_chunk_bytes,
        max_chunks=args.max_chunks,
        max_rag_bytes=args.max_rag_bytes,
        max_stop_strings=args.max_stop_strings,
        max_prompt_tokens=args.max_prompt_tokens,
        max_text_bytes=args.max_text_bytes,
        max_messages=args.max_messages,
    )
    config = engine_config_from_args(args)  # validated here, before the model loads
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise ConfigError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        import torch

        torch.set_num_threads(args.torch_threads)  # the server owns its process
    if args.kv_events_endpoint is None and args.kv_events_replay_endpoint is not None:
        raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    engine = Engine(config)
    publisher = None
    if args.kv_events_endpoint is not None:
        from ragkv.integrations.kv_events.publisher import (
            SALT_VIEWS_PER_TENANT,
            KVEventPublisher,
            SaltViews,
        )

        for endpoint in (args.kv_events_endpoint, args.kv_events_replay_endpoint):
            if endpoint is not None and not _is_private_endpoint(endpoint):
                logger.warning(
                    "KV events on %s carry every tenant's prompt token ids to anyone who "
                    "connects; bind loopback (or ipc://) unless the network is private",
                    endpoint,
                )
        tenants = len(set(api_keys.values())) if api_keys else 1
        publisher = KVEventPublisher(
            engine.kv_events(args.kv_events_buffer),
            args.kv_events_endpoint,
            replay_endpoint=args.kv_events_replay_endpoint,
            topic=args.kv_events_topic,
            salt_views=SaltViews(max_per_tenant=SALT_VIEWS_PER_TENANT if tenants > 1 else None),
        ).start()
    with engine:
        app = create_app(
            engine,
            api_key=args.api_key,
            api_keys=api_keys,
            allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
            limits=limits,
            max_body_bytes=args.max_body_bytes,
            request_timeout_s=args.request_timeout,
            model_name=args.served_model_name,
            reuse=args.reuse,
            default_max_tokens=args.default_max_tokens,
            max_requests_per_tenant=args.max_requests_per_tenant,
            max_requests=args.max_requests,
            work_threads=args.work_threads,
        )
        if publisher is not None:
            app.state.ragkv.salt_views = publisher.salt_views
        if args.access_log:
            show_access_log()
        close_on_shutdown(app, engine, publisher)
        print(f"ragkv serve: {engine.model_name} on http://{args.host}:{args.port}/v1", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", lifespan="on")
    return 0


def close_on_shutdown(app: FastAPI, engine: Closes, publisher: Closes | None = None) -> None:
    """Close ``engine`` (KV tiers write back), then the KV event ``publisher``, when the
    server shuts down, before uvicorn re-raises the signal that stopped it: a re-raised
    SIGTERM ends the process at once, so closing after ``uvicorn.run`` returned would never
    run."""
    import asyncio
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.close)
        if publisher is not None:
            await asyncio.to_thread(publisher.close)

    app.router.lifespan_context = lifespan


def show_access_log() -> None:
    """Print ``ragkv.serve.access`` lines to stderr (the CLI's choice; the library configures
    no logging)."""
    access = logging.getLogger("ragkv.serve.access")
    if not access.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access.addHandler(handler)
    access.setLevel(logging.INFO)


def load_api_keys(path: Path) -> dict[str, str]:
    """Read ``--api-keys``: a JSON object mapping each API key to its tenant's name.

    Several keys may name one tenant (key rotation); a key may not appear twice.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-keys: cannot read {path}: {exc}") from exc

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"--api-keys: {path} lists the same API key twice")
        return dict(pairs)

    try:
        keys = json.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--api-keys: {path} is not valid JSON: {exc}") from exc
    return validate_api_keys(keys, str(path))


def allowed_hosts(bind_host: str, flag: str | None) -> list[str]:
    """The Host names to answer: ``--allowed-hosts`` if given, else loopback + the bind address."""
    if flag is not None:
        hosts = [h.strip() for h in flag.split(",") if h.strip()]
        if not hosts:
            raise ConfigError("--allowed-hosts is empty; name at least one host, or '*'")
        return hosts
    hosts = list(LOOPBACK_HOSTS)
    if bind_host not in hosts and bind_host not in ("0.0.0.0", "::"):
        hosts.append(bind_host)
    if bind_host in ("0.0.0.0", "::"):
        logger.warning(
            "binding %s but answering only Host names %s; pass --allowed-hosts with the "
            "names clients use to reach this server",
            bind_host,
            ", ".join(hosts),
        )
    return hosts


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_private_endpoint(endpoint: str) -> bool:
    """A ZMQ endpoint only this machine can reach (``ipc://``, ``inproc://``, loopback)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return _is_loopback(host)
