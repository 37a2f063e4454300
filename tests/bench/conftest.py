"""A tiny random-weight checkpoint, the bench settings for it, and tiny workloads for the
bench tests."""

from __future__ import annotations

import pytest
from support import save_tiny_checkpoint

from ragkv.bench.runner import BenchConfig
from ragkv.bench.workload import SyntheticConfig


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("bench-llama"), "llama", seed=3))


@pytest.fixture(scope="session")
def tiny_bench(tiny_model):
    """A factory of the bench tests' ``BenchConfig``: the tiny model on CPU in float32, two
    new tokens per answer, two clients (keywords override or add settings)."""

    def make(**overrides) -> BenchConfig:
        settings = dict(
            model=tiny_model, device="cpu", dtype="float32", max_tokens=2, concurrency=2
        )
        settings.update(overrides)
        return BenchConfig(**settings)

    return make


def _small_config(**overrides) -> SyntheticConfig:
    base = dict(requests=8, topics=3, chunk_size=200, chunk_overlap=50, seed=1)
    base.update(overrides)
    return SyntheticConfig(**base)


@pytest.fixture(scope="session")
def small_config():
    """A factory of small synthetic configs (short chunks, few topics)."""
    return _small_config
