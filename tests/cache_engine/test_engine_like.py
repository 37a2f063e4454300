"""Both engines offer every member of the one ``EngineLike`` protocol (no probing needed)."""

import inspect

import pytest

from ragkv.cache_engine.engine import Engine
from ragkv.cache_engine.engine_like import ChecksHealth, EngineLike, MayReuseChunks, ReportsHealth
from ragkv.integrations.openai import RemoteEngine

MEMBERS = [name for name in vars(EngineLike) if not name.startswith("_")] + list(
    EngineLike.__annotations__
)


@pytest.mark.parametrize("engine_class", [Engine, RemoteEngine])
def test_engines_implement_every_engine_like_member(engine_class):
    init = inspect.getsource(engine_class.__init__)
    for name in MEMBERS:
        assert hasattr(engine_class, name) or f"self.{name} =" in init, name


def test_remote_engine_cannot_know_residency():
    assert Engine.knows_residency and not RemoteEngine.knows_residency
    remote = RemoteEngine("http://localhost:1/v1", tokenizer=object(), model="m")
    assert remote.cached_prefix_length([1, 2, 3]) == 0


def test_optional_capabilities_are_told_apart_by_isinstance():
    remote = RemoteEngine("http://localhost:1/v1", tokenizer=object(), model="m")
    assert isinstance(remote, ChecksHealth)
    assert not isinstance(remote, ReportsHealth) and not isinstance(remote, MayReuseChunks)
    assert issubclass(Engine, ReportsHealth) and not issubclass(Engine, ChecksHealth)
    assert Engine.supports_chunk_reuse  # MayReuseChunks has a data member: no issubclass
