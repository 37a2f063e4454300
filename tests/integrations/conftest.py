"""Fixtures for the HTTP server tests: one tiny engine and one live ``ragkv serve`` app on a
free loopback port, shared by every test in this folder that asks for them."""

from __future__ import annotations

import functools
import time

import pytest
from support import open_engine_fixture, running_servers, save_tiny_checkpoint

API_KEY = "test-key-0123456789"


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve-llama"), "llama", seed=7)


@pytest.fixture(scope="session")
def open_engine(serve_model_dir):
    """``open_engine(**engine_options)``: a CPU engine over the tiny checkpoint (close it, or
    use it as a context manager)."""
    from ragkv.cache_engine import Engine

    return functools.partial(Engine.from_pretrained, serve_model_dir, device="cpu")


serve_engine = open_engine_fixture("session", kv_cache_tokens=8192, max_model_len=1024)


@pytest.fixture(scope="session")
def start_server(serve_engine):
    """``start_server(**create_app_kwargs) -> base_url``; every server stops at session end."""
    pytest.importorskip("fastapi")
    with running_servers(serve_engine) as start:

        def start_url(engine=None, **kwargs) -> str:
            kwargs.setdefault("api_key", API_KEY)
            return start(engine, **kwargs)[0]

        yield start_url


@pytest.fixture(scope="session")
def base_url(start_server) -> str:
    return start_server(max_body_bytes=64 * 1024)


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def wait_until_idle():
    """``wait_until_idle(engine, baseline_free)``: poll (bounded) until no request holds a
    block; the caller asserts, so a leak fails there instead of hanging here."""

    def wait(engine, baseline_free: int, attempts: int = 400) -> None:
        for _ in range(attempts):
            if (
                engine.stats().num_free_blocks == baseline_free
                and not engine.scheduler.has_unfinished()
            ):
                return
            time.sleep(0.025)

    return wait


@pytest.fixture
def client(base_url, api_key):
    """An httpx client of the module's server, authenticated with its key."""
    import httpx

    with httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
    ) as c:
        yield c
