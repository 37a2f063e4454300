"""The assembler's settings are one validated, frozen AssemblerConfig."""

from __future__ import annotations

import dataclasses

import pytest

from ragkv.assembler import Assembler, AssemblerConfig
from ragkv.defaults import DEFAULT_BLOCK_SIZE
from ragkv.errors import ConfigError


def test_keywords_build_the_same_config_as_config_does(local_tokenizer):
    by_keywords = Assembler(local_tokenizer, block_size=4, order="cache-aware", never_worse=False)
    config = AssemblerConfig(block_size=4, order="cache-aware", never_worse=False)
    assert by_keywords.config == config == Assembler(local_tokenizer, config=config).config
    assert (by_keywords.block_size, by_keywords.order, by_keywords.never_worse) == (
        4,
        "cache-aware",
        False,
    )
    assert Assembler(local_tokenizer).config == AssemblerConfig()
    assert AssemblerConfig().block_size == DEFAULT_BLOCK_SIZE


def test_config_and_keywords_together_are_refused(local_tokenizer):
    with pytest.raises(ConfigError, match="order") as caught:
        Assembler(local_tokenizer, config=AssemblerConfig(), order="retrieval")
    assert caught.value.param == "config"


@pytest.mark.parametrize(
    ("setting", "param"),
    [
        ({"block_size": 0}, "block_size"),
        ({"order": "random"}, "order"),
        ({"invalidator_after": 1}, "invalidator_after"),
        ({"tree_max_nodes": 0}, "tree_max_nodes"),
        ({"sent_max_blocks": 0}, "sent_max_blocks"),
    ],
)
def test_an_impossible_setting_fails_when_the_config_is_built(setting, param):
    with pytest.raises(ConfigError) as caught:
        AssemblerConfig(**setting)
    assert caught.value.param == param
    with pytest.raises(ConfigError):
        AssemblerConfig().replace(**setting)


def test_the_config_is_frozen_and_a_fork_shares_it(local_tokenizer):
    config = AssemblerConfig(block_size=4, measure_seams=True, never_worse_slack=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8  # type: ignore[misc]
    asm = Assembler(local_tokenizer, config=config)
    fork = asm.fork("tenant")
    assert fork.config is config and fork.registry is asm.registry
    assert (fork.never_worse_slack, fork.measure_seams) == (0, True)
