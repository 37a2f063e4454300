"""A tiny random-weight checkpoint and tiny workloads for the bench tests."""

from __future__ import annotations

import pytest
from support import save_tiny_checkpoint

from ragkv.bench.workload import SyntheticConfig


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("bench-llama"), "llama", seed=3))


def _small_config(**overrides) -> SyntheticConfig:
    base = dict(requests=8, topics=3, chunk_size=200, chunk_overlap=50, seed=1)
    base.update(overrides)
    return SyntheticConfig(**base)


@pytest.fixture(scope="session")
def small_config():
    """A factory of small synthetic configs (short chunks, few topics)."""
    return _small_config
