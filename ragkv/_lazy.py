"""Names a package offers without importing their modules until first use.

A package that re-exports heavy names (torch, transformers, httpx, FastAPI behind them)
sets ``__getattr__ = lazy_attributes(__name__, {name: module})``; the names stay visible to
type checkers through imports under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``modules`` maps each lazy name to the
    module it is imported from on first use; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
