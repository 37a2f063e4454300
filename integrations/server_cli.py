"""``ragkv serve``: load a model and serve it over an OpenAI-compatible HTTP API.

Heavy imports (torch, fastapi, uvicorn) happen inside :func:`run`, so ``ragkv --help``
stays fast and works without the ``server`` extra.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os

from ragkv.errors import MissingDependencyError

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAGKV_API_KEY"
# Defaults of create_app too; kept here because this module must import no framework.
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_REQUEST_TIMEOUT_S = 600.0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``ragkv serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve one engine (one shared prefix cache) over /v1/completions, "
            "/v1/chat/completions, /v1/models, /health and /metrics. Binds 127.0.0.1 unless "
            f"--host says otherwise; set --api-key or ${API_KEY_ENV} before exposing it."
        ),
    )
    parser.add_argument("--model", default=None, help="local HF checkpoint dir (default: embedded)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument(
        "--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S, help="seconds"
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
    from ragkv.integrations.server import create_app

    if not args.api_key and not _is_loopback(args.host):
        logger.warning(
            "serving on %s without an API key: anyone who can reach it can use it", args.host
        )
    engine = Engine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    with engine:
        app = create_app(
            engine,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            request_timeout_s=args.request_timeout,
            model_name=args.served_model_name,
        )
        print(f"ragkv serve: {engine.model_name} on http://{args.host}:{args.port}/v1", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
