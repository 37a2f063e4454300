"""EngineConfig: one place for every setting, checked once, before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ragkv.cache_engine import EngineConfig
from ragkv.cache_engine.config import DEFAULTS, resolve_dtype
from ragkv.errors import ConfigError


@pytest.mark.parametrize(
    ("setting", "param"),
    [
        ({"block_size": 12}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_tokens": 8}, "kv_cache_tokens"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"dtype": "int8"}, "dtype"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"schedule_policy": "random"}, "schedule_policy"),
        ({"backend": "cuda"}, "backend"),
        ({"device": "tpu"}, "device"),
        ({"host_cache_bytes": -1}, "host_cache_bytes"),
        ({"kv_store_bytes": 0}, "kv_store_bytes"),
        ({"kv_load_timeout_s": 0}, "kv_load_timeout_s"),
        ({"kv_load_timeout_s": float("nan")}, "kv_load_timeout_s"),
        ({"kv_load_timeout_s": True}, "kv_load_timeout_s"),
        ({"kv_store_dir": ""}, "kv_store_dir"),
        ({"kv_store_dir": __file__}, "kv_store_dir"),  # a file, not a directory
        ({"kv_tier_write_policy": "write-around"}, "kv_tier_write_policy"),
    ],
)
def test_an_impossible_setting_is_a_config_error_naming_it(setting, param):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**setting)
    assert info.value.param == param


def test_replace_checks_the_new_settings_again():
    with pytest.raises(ConfigError, match="multiple of 8"):
        DEFAULTS.replace(block_size=20)
    assert DEFAULTS.replace(block_size=32).block_size == 32


@pytest.mark.parametrize("given", [None, "auto", "torch.float32", torch.float32, "float", "fp32"])
def test_dtype_names_are_normalized(given):
    assert EngineConfig(dtype=given).dtype in ("auto", "float32")


def test_one_dtype_rule_keeps_cpu_exact_by_default():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16


def test_import_ragkv_exports_the_engine_names_without_importing_torch():
    code = (
        "import sys, ragkv; assert 'torch' not in sys.modules; "
        "assert ragkv.EngineConfig().block_size == 16; assert 'torch' not in sys.modules; "
        "assert ragkv.Engine.__name__ == 'Engine' and ragkv.SamplingParams().max_tokens == 256"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiers_are_off_by_default_and_on_with_a_host_tier_or_a_store():
    assert not DEFAULTS.tiers_enabled
    assert EngineConfig(host_cache_bytes=1 << 20).tiers_enabled
    assert EngineConfig(kv_store_dir="/tmp/ragkv-store").tiers_enabled
    assert not EngineConfig(host_cache_bytes=1, enable_prefix_caching=False).tiers_enabled
