"""Without a framework installed, ragkv still imports and the integration names its extra."""

from __future__ import annotations

import importlib
import sys

import pytest

from ragkv.errors import MissingDependencyError


def _forget(prefix: str, monkeypatch) -> None:
    for name in list(sys.modules):
        if name == prefix or name.startswith(prefix + "."):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [
        ("ragkv.integrations.langchain", "langchain_core", "langchain"),
        ("ragkv.integrations.llama_index", "llama_index", "llama-index"),
    ],
)
def test_missing_framework_raises_an_import_error_naming_the_extra(
    module, framework, extra, monkeypatch
):
    _forget(module, monkeypatch)
    _forget(framework, monkeypatch)
    monkeypatch.setitem(sys.modules, framework, None)  # `import framework` now fails
    importlib.import_module("ragkv")
    importlib.import_module("ragkv.integrations")
    with pytest.raises(MissingDependencyError) as info:
        importlib.import_module(module)
    assert isinstance(info.value, ImportError)
    assert f"pip install 'ragkv[{extra}]'" in str(info.value)
