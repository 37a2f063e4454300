"""``EngineLike``: the surface :class:`ragkv.Pipeline`, the framework adapters and the server
use, written once. :class:`~ragkv.cache_engine.Engine` (in process) and
:class:`ragkv.integrations.openai.RemoteEngine` (over HTTP) implement it.

It lives in ``cache_engine`` because its records (``Output``, ``StreamDelta``,
``SamplingParams``) do; ``ragkv`` and ``integrations`` both may import it from here.
Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self, overload, runtime_checkable

from ragkv.cache_engine.outputs import Output, StreamDelta
from ragkv.cache_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

Prompt = str | Sequence[int]


def is_single_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """Whether ``generate``'s ``prompts`` is one prompt (a string, or token ids: an empty
    list counts as one, empty, prompt) rather than a list of them."""
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, Sequence) and (
        not prompts or not isinstance(prompts[0], str | Sequence)
    )


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

    # One prompt gives one Output, a list of prompts a list (a str is one prompt).
    @overload
    def generate(
        self,
        prompts: Prompt,
        params: Any = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Output: ...
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: Any = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> list[Output]: ...

    # The streams are generators: closing one early (``close()`` / ``aclose()``) aborts the
    # request, which the server and the framework adapters rely on.
    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Generator[StreamDelta, None, None]: ...

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
    ) -> AsyncGenerator[StreamDelta, None]: ...

    def cached_prefix_length(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens of ``token_ids`` cached now; 0 when the engine cannot know (a remote
        server does not say; ``knows_residency`` is then False)."""
        ...


class ForwardingEngine:
    """What the engines that forward each request elsewhere share (``RemoteEngine`` to a
    server, ``ReplicaRouter`` to a replica): :meth:`generate` over one prompt or a list,
    each prompt sent on its own, and ``with`` / ``async with`` blocks that close them."""

    # Provided by the engine: one prompt's request (``options``: its own keywords), and
    # what releases its connections.
    _generate_one: Callable[..., Output]
    close: Callable[[], None]
    aclose: Callable[[], Awaitable[None]]

    @overload
    def generate(
        self,
        prompts: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **options: Any,
    ) -> Output: ...
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **options: Any,
    ) -> list[Output]: ...
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        **options: Any,
    ) -> Output | list[Output]:
        """One prompt → an :class:`Output`; a list of prompts → a list, each prompt sent (or
        routed) on its own, in order. ``options`` are the engine's own keywords (for
        ``RemoteEngine``, settings that change ``params``; for ``ReplicaRouter``,
        ``session_id``)."""
        if is_single_prompt(prompts):
            return self._generate_one(prompts, params, cache_salt, **options)
        return [self._generate_one(p, params, cache_salt, **options) for p in prompts]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


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
class Closes(Protocol):
    """Holds what ``close()`` releases (the in-process engine's thread and KV tiers,
    ``RemoteEngine``'s connections)."""

    def close(self) -> None: ...


@runtime_checkable
class ClosesAsync(Protocol):
    """Releases its resources from asyncio too (``RemoteEngine``'s async client)."""

    async def aclose(self) -> None: ...


@runtime_checkable
class KnowsContextLength(Protocol):
    """Says its context length in tokens, prompt and answer together (``max_model_len``;
    None: unknown). A remote server does not say."""

    @property
    def max_model_len(self) -> int | None: ...


@runtime_checkable
class KnowsPoolSize(Protocol):
    """Says how many tokens its KV pool holds (``kv_cache_tokens``)."""

    @property
    def kv_cache_tokens(self) -> int: ...


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
    "Closes",
    "ClosesAsync",
    "EngineLike",
    "ForwardingEngine",
    "KnowsContextLength",
    "KnowsPoolSize",
    "MayReuseChunks",
    "ProbesPrefix",
    "Prompt",
    "ReportsHealth",
    "is_single_prompt",
]
