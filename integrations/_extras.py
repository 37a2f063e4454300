"""Optional framework dependencies: import them or say which pip extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from ragkv.errors import MissingDependencyError


def require(module: str, package: str, extra: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming ``ragkv[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(package, extra) from exc
