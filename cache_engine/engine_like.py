"""``EngineLike``: the surface :class:`ragkv.Pipeline`, the framework adapters and the server
use, written once. :class:`~ragkv.cache_engine.Engine` (in process) and
:class:`ragkv.integrations.openai.RemoteEngine` (over HTTP) implement it.

It lives in ``cache_engine`` because its records (``Output``, ``StreamDelta``,
``SamplingParams``) do; ``ragkv`` and ``integrations`` both may import it from here.
Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class EngineLike(Protocol):
    """What an engine offers its callers.

    Every generating method takes a :class:`SamplingParams` and keyword settings that change
    it (``generate(ids, max_tokens=64, temperature=0.7)``; default 256 new tokens, greedy).

    ``tokenizer`` is the tokenizer whose ids the engine expects (the assembler tokenizes with
    it); ``block_size`` the KV block size stable segments are aligned to; ``model_name`` the
    model id reported in responses.
    """

    tokenizer: Any
    block_size: int
    #: Whether :meth:`cached_prefix_length` observes the cache. When False the assembler
    #: orders chunks by its own record of what it sent instead of by the engine's answer.
    knows_residency: bool

    @property
    def model_name(self) -> str: ...

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: Any = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Output | list[Output]: ...

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Iterator[StreamDelta]: ...

    async def agenerate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Output: ...

    def astream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamDelta]: ...

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens of ``token_ids`` cached now; 0 when the engine cannot know (a remote
        server does not say; ``knows_residency`` is then False)."""
        ...


# Optional capabilities: an engine may offer them on top of EngineLike. Callers test with
# isinstance (these check that the member exists, not its signature or value).


@runtime_checkable
class ChecksHealth(Protocol):
    """Asks its server whether it answers (``RemoteEngine``); True when it does."""

    def check_health(self, timeout_s: float = 2.0) -> bool: ...


@runtime_checkable
class ReportsHealth(Protocol):
    """Knows its own health (the in-process ``Engine``): ``health().ok``, or it raises."""

    def health(self) -> Any: ...


@runtime_checkable
class MayReuseChunks(Protocol):
    """Says whether ``generate(..., chunk_spans=, reuse=)`` can reuse a chunk's KV at another
    position (``supports_chunk_reuse``); an engine without the flag cannot."""

    supports_chunk_reuse: bool


@runtime_checkable
class ProbesPrefix(Protocol):
    """Hashes each prompt once (the in-process ``Engine``): ``prefix_probe(cache_salt)`` is a
    residency probe whose calls answer ``(cached tokens, hashes)``, and the hashes of the
    prompt that is sent go back with it (``generate(..., prompt_hashes=)``)."""

    def prefix_probe(self, cache_salt: str | None = None) -> Any: ...


__all__ = [
    "ChecksHealth",
    "EngineLike",
    "MayReuseChunks",
    "ProbesPrefix",
    "Prompt",
    "ReportsHealth",
]
