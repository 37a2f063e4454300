"""``ragkv serve`` argument parsing and its failure without the ``server`` extra."""

from __future__ import annotations

import argparse
import sys

import pytest

from ragkv.errors import MissingDependencyError
from ragkv.integrations.openai.server import cli as server_cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ragkv")
    server_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback_and_read_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv(server_cli.API_KEY_ENV, "from-env")
    args = parse()
    assert args.host == "127.0.0.1" and args.port == 8000
    assert args.api_key == "from-env" and args.model is None
    assert parse("--api-key", "flag").api_key == "flag"


def test_without_the_server_extra_it_names_the_pip_extra(monkeypatch):
    for name in [
        m for m in sys.modules if m.startswith(("fastapi", "ragkv.integrations.openai.server"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` fail
    args = parse("--port", "1")
    with pytest.raises(MissingDependencyError, match=r"ragkv\[server\]"):
        args.func(args)


def test_non_loopback_hosts_are_recognised():
    assert server_cli._is_loopback("127.0.0.1") and server_cli._is_loopback("::1")
    assert server_cli._is_loopback("localhost")
    assert not server_cli._is_loopback("0.0.0.0")


def test_engine_flags_default_to_the_one_engine_config():
    from ragkv.cache_engine.config import DEFAULTS, DTYPES

    args = parse()
    assert (args.device, args.dtype, args.block_size) == (
        DEFAULTS.device,
        DEFAULTS.dtype,
        DEFAULTS.block_size,
    )
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (
        DEFAULTS.max_num_seqs,
        DEFAULTS.max_num_batched_tokens,
    )
    for dtype in DTYPES:
        assert parse("--dtype", dtype).dtype == dtype


def test_kv_tier_flags_default_to_the_engine_config_and_parse():
    from ragkv.cache_engine.config import DEFAULTS

    args = parse()
    assert (args.host_cache_bytes, args.kv_store_dir, args.kv_store_bytes) == (
        DEFAULTS.host_cache_bytes,
        DEFAULTS.kv_store_dir,
        DEFAULTS.kv_store_bytes,
    )
    assert (args.kv_tier_write_policy, args.kv_store_salted) == (
        DEFAULTS.kv_tier_write_policy,
        DEFAULTS.kv_store_salted,
    )
    args = parse("--host-cache-bytes", "1024", "--kv-store-dir", "/tmp/s", "--kv-store-bytes", "99")
    assert (args.host_cache_bytes, args.kv_store_dir, args.kv_store_bytes) == (1024, "/tmp/s", 99)
    args = parse("--kv-tier-write-policy", "write-through", "--no-kv-store-salted")
    assert (args.kv_tier_write_policy, args.kv_store_salted) == ("write-through", False)
    with pytest.raises(SystemExit):
        parse("--kv-tier-write-policy", "write-around")
