"""Engine fixtures shared by the engine API and failure tests: one tiny llama checkpoint."""

from __future__ import annotations

import pytest
from support import save_tiny_checkpoint

from ragkv.cache_engine import Engine


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture
def engine(llama_dir):
    with Engine.from_pretrained(llama_dir, device="cpu", kv_cache_tokens=2048) as eng:
        yield eng
