"""The ragkv exception hierarchy.

Every error ragkv raises on purpose is a :class:`RagkvError`, so callers can catch one
base class. Subclasses also derive from the matching built-in (``ValueError``,
``TypeError``, ``ImportError``) so generic handlers keep working. Messages say what to do.

This module is a leaf: every stage may import it, it imports nothing from ragkv.
"""

from __future__ import annotations


class RagkvError(Exception):
    """Base class of every error raised by ragkv.

    ``param`` names the offending argument or request field when there is one (``"seed"``,
    ``"cache_salt"``, ``"stop"``), so a server can report it without parsing the message.
    """

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidInputError(RagkvError, ValueError):
    """An argument has the wrong value (empty prompt, bad sampling value, bad metadata)."""


class InvalidChunkError(InvalidInputError, TypeError):
    """A retrieved chunk is not ``str``, ``bytes`` or :class:`ragkv.dedup.Chunk`."""


class ConfigError(RagkvError, ValueError):
    """A component was configured with an impossible or contradictory setting."""


class PromptTooLongError(InvalidInputError):
    """A prompt exceeds the model context or the whole KV pool; it is never truncated silently."""


class UnsupportedModelError(RagkvError):
    """The checkpoint's architecture or features (sliding window, recurrence, ...) are not supported."""


class ModelNotFoundError(RagkvError, FileNotFoundError):
    """A model directory or the embedded default model is missing."""


class CacheCapacityError(RagkvError):
    """The KV pool cannot hold a request even after preempting everything else."""


class EngineClosedError(RagkvError):
    """The engine was shut down; create a new one."""


class EngineUnhealthyError(RagkvError):
    """The engine's stepping thread died, or its steps kept failing for no single request.

    Requests still queued fail with this error and new ones are refused; ``Engine.health()``
    reports the reason. Create a new Engine (a server should be restarted).
    """


class RequestAbortedError(RagkvError):
    """A request was aborted (client disconnect, timeout or explicit abort)."""


class RemoteEngineError(RagkvError):
    """An OpenAI-compatible server answered with an error or could not be reached.

    ``unreachable`` is True when no connection could be made at all (refused, reset before
    a byte, connect timeout): the server's fault, never the request's."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        param: str | None = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__(message, param=param)
        self.status_code = status_code
        self.unreachable = unreachable


class MissingDependencyError(RagkvError, ImportError):
    """An optional dependency is not installed; the message names the pip extra."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"{package} is not installed; run `pip install 'ragkv[{extra}]'` to use this feature."
        )
        self.package = package
        self.extra = extra


__all__ = [
    "CacheCapacityError",
    "ConfigError",
    "EngineClosedError",
    "EngineUnhealthyError",
    "InvalidChunkError",
    "InvalidInputError",
    "MissingDependencyError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "RagkvError",
    "RemoteEngineError",
    "RequestAbortedError",
    "UnsupportedModelError",
]
