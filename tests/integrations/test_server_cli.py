"""``ragkv serve`` argument parsing and its failure without the ``server`` extra."""

from __future__ import annotations

import argparse
import sys
import time

import pytest

from ragkv.errors import ConfigError, MissingDependencyError
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


@pytest.mark.parametrize(
    "name",
    ["device", "dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
     "host_cache_bytes", "kv_store_dir", "kv_store_bytes", "kv_tier_write_policy",
     "kv_store_salted"],
)  # fmt: skip
def test_engine_flags_default_to_the_one_engine_config(name):
    from ragkv.cache_engine.config import DEFAULTS

    assert getattr(parse(), name) == getattr(DEFAULTS, name)


def test_every_dtype_parses():
    from ragkv.cache_engine.config import DTYPES

    for dtype in DTYPES:
        assert parse("--dtype", dtype).dtype == dtype


def test_kv_tier_flags_parse():
    args = parse("--host-cache-bytes", "1024", "--kv-store-dir", "/tmp/s", "--kv-store-bytes", "99")
    assert (args.host_cache_bytes, args.kv_store_dir, args.kv_store_bytes) == (1024, "/tmp/s", 99)
    args = parse("--kv-tier-write-policy", "write-through", "--no-kv-store-salted")
    assert (args.kv_tier_write_policy, args.kv_store_salted) == ("write-through", False)
    with pytest.raises(SystemExit):
        parse("--kv-tier-write-policy", "write-around")


def test_sigterm_closes_the_engine_so_the_kv_store_is_written_back(tmp_path):
    """A supervisor stops servers with SIGTERM: host-tier blocks must reach the disk tier
    (write-back at close) as they do on Ctrl-C."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx
    from support import save_tiny_checkpoint

    pytest.importorskip("fastapi")
    model = save_tiny_checkpoint(tmp_path / "model", "llama", seed=3)
    store = tmp_path / "store"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "ragkv.cli", "serve", "--model", str(model), "--port", str(port),
         "--device", "cpu", "--kv-cache-tokens", "96", "--host-cache-bytes", str(64 << 20),
         "--kv-store-dir", str(store), "--api-key", "key-0123456789", "--no-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        for _line in range(200):  # progress bars first, then the banner
            line = server.stdout.readline()
            if "on http://" in line or not line:
                break
        assert "on http://" in line
        url = f"http://127.0.0.1:{port}/v1/completions"
        for _attempt in range(100):  # uvicorn binds just after the banner
            try:
                httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        for i in range(4):  # 64-token prompts through a 96-token pool: blocks go to host
            body = {"prompt": [5 + i + j for j in range(64)], "max_tokens": 1}
            answer = httpx.post(url, json=body, headers={"Authorization": "Bearer key-0123456789"})
            assert answer.status_code == 200, answer.text
        assert not list(store.rglob("*.kv"))  # still in host memory (write-back)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert list(store.rglob("*.kv")), "SIGTERM lost the host tier's blocks"


def test_engine_flags_build_the_engine_config_without_a_hand_mapping():
    from ragkv.cache_engine.engine_flags import engine_config_from_args

    args = parse("--block-size", "32", "--kv-cache-tokens", "96", "--no-kv-store-salted")
    config = engine_config_from_args(args)
    assert (config.block_size, config.kv_cache_tokens, config.kv_store_salted) == (32, 96, False)
    for name in server_cli.NOT_SERVED:  # not offered (yet): the engine's default applies
        assert not hasattr(args, name)


def test_kv_events_endpoints_this_machine_only_reaches_are_recognised():
    assert server_cli._is_private_endpoint("tcp://127.0.0.1:5557")
    assert server_cli._is_private_endpoint("tcp://[::1]:5557")
    assert server_cli._is_private_endpoint("ipc:///tmp/kv")
    assert not server_cli._is_private_endpoint("tcp://*:5557")
    assert not server_cli._is_private_endpoint("tcp://0.0.0.0:5557")


def test_kv_events_flags_are_off_by_default_and_replay_needs_the_endpoint():
    args = parse()
    assert args.kv_events_endpoint is None and args.kv_events_replay_endpoint is None
    assert args.kv_events_topic == "" and args.kv_events_buffer > 0
    args = parse("--kv-events-replay-endpoint", "tcp://127.0.0.1:5558", "--model", "x")
    with pytest.raises(ConfigError, match="--kv-events-endpoint"):
        args.func(args)


def test_served_kv_events_reach_a_subscriber_with_the_clients_salt(tmp_path):
    """``ragkv serve --kv-events-endpoint``: the engine's blocks as vLLM events, starting
    with a clear, named by the client's salt (not the tenant's) and by none without one."""
    import socket
    import subprocess

    import httpx
    from support import save_tiny_checkpoint

    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    from ragkv.cache_engine.block_hash import digest_salt
    from ragkv.cache_engine.kv_events import SALT_DIGEST_KEY, AllBlocksCleared, BlockStored
    from ragkv.integrations.kv_events.subscriber import ZmqFeed

    model = save_tiny_checkpoint(tmp_path / "model", "llama", seed=3)
    ports = []
    for _ in range(3):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    port, pub, replay = ports
    server = subprocess.Popen(
        [sys.executable, "-m", "ragkv.cli", "serve", "--model", str(model), "--port", str(port),
         "--device", "cpu", "--api-key", "key-0123456789", "--no-access-log",
         "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "--kv-events-topic", "t"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    feed = None
    try:
        for _line in range(200):
            line = server.stdout.readline()
            if "on http://" in line or not line:
                break
        assert "on http://" in line
        feed = ZmqFeed(
            f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="t"
        )
        headers = {"Authorization": "Bearer key-0123456789"}
        url = f"http://127.0.0.1:{port}/v1/completions"
        for salt in (None, "mine"):
            body = {"prompt": [5 + j for j in range(40)], "max_tokens": 1}
            if salt:
                body["cache_salt"] = salt
            for _attempt in range(100):
                try:
                    answer = httpx.post(url, json=body, headers=headers)
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert answer.status_code == 200, answer.text
        events = []
        for _attempt in range(50):
            events = [e for _, b in feed.replay(0) or [] for e in b.events]
            if sum(isinstance(e, BlockStored) for e in events) >= 2:
                break
            time.sleep(0.1)
        assert events[0] == AllBlocksCleared()
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert [e.extra_keys[0] for e in stored] == [
            None,
            [SALT_DIGEST_KEY, digest_salt("mine")],
        ]
        assert stored[0].token_ids == [5 + j for j in range(32)] and stored[0].medium == "GPU"
    finally:
        if feed is not None:
            feed.close()
        server.terminate()
        server.wait(timeout=60)


def test_torch_threads_is_the_processes_own_and_checked_before_the_model_loads(monkeypatch):
    import torch

    assert parse().torch_threads is None  # torch's own default: ragkv leaves it alone
    args = parse("--torch-threads", "0", "--model", "x")
    with pytest.raises(ConfigError, match="--torch-threads"):
        args.func(args)
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    # A later check fails, still before the model loads: the thread count was set by then.
    args = parse(
        "--torch-threads", "1", "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558",
        "--model", "x",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--kv-events-endpoint"):
        args.func(args)
    assert calls == [1]
