"""EngineConfig's fields declare their own command-line flags; one helper offers them."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from ragkv.cache_engine.config import DEFAULTS, EngineConfig, Flag
from ragkv.cache_engine.engine_flags import (
    add_engine_flags,
    engine_config_from_args,
    engine_settings,
)


def parser(*names: str, **options) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test")
    add_engine_flags(p, names or None, **options)
    return p


def test_every_engine_setting_carries_its_flag():
    for spec in dataclasses.fields(EngineConfig):
        flag = spec.metadata.get("flag")
        assert isinstance(flag, Flag) and flag.help, spec.name
        default = getattr(DEFAULTS, spec.name)
        if isinstance(default, bool):  # the flag flips the default, and its name says so
            assert flag.name and flag.name.startswith("--no-") == default, spec.name


def test_bool_flags_flip_their_defaults():
    config = engine_config_from_args(parser().parse_args(["--compile", "--no-prepack-linear"]))
    assert config.compile and not DEFAULTS.compile
    assert not config.prepack_linear and DEFAULTS.prepack_linear


def test_no_flags_build_the_default_config_and_the_help_renders():
    p = parser()
    assert engine_config_from_args(p.parse_args([])) == DEFAULTS
    text = p.format_help()  # a stray % in a help text would raise here
    assert "--no-prefix-caching" in text and "--kv-load-timeout-s" in text


def test_flags_parse_into_a_validated_config():
    args = parser().parse_args(
        ["--block-size", "32", "--dtype", "bf16", "--no-prefix-caching", "--hash-algo",
         "blake3", "--no-kv-store-salted", "--kv-load-timeout-s", "2.5", "--model", "/m"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert (config.block_size, config.dtype, config.hash_algo) == (32, "bfloat16", "blake3")
    assert not config.enable_prefix_caching and not config.kv_store_salted
    assert (config.kv_load_timeout_s, config.model) == (2.5, "/m")
    with pytest.raises(SystemExit):
        parser().parse_args(["--schedule-policy", "random"])


def test_a_command_offers_some_fields_and_overrides_a_default():
    p = parser("block_size", "host_cache_bytes", overrides={"host_cache_bytes": {"default": None}})
    args = p.parse_args([])
    assert engine_settings(args) == {"block_size": DEFAULTS.block_size, "host_cache_bytes": None}
    assert engine_settings(args, ["block_size"]) == {"block_size": DEFAULTS.block_size}
    with pytest.raises(ValueError, match="not EngineConfig fields: blocksize"):
        parser("blocksize")


def test_ragkv_help_imports_no_torch():
    code = (
        "import sys; from ragkv.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by ragkv serve --help'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--kv-cache-tokens" in done.stdout
