"""What the framework adapters share about the engine: one engine per model, chat prompts,
sampling parameters and deadlines."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from ragkv.assembler.template import chat_token_ids
from ragkv.assembler.tokenization import text_tokenizer
from ragkv.cache_engine import Engine, SamplingParams, StreamDelta
from ragkv.cache_engine.engine_like import EngineLike
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS
from ragkv.errors import InvalidInputError, RequestAbortedError

_ENGINES: dict[tuple[Any, ...], Engine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(
    model: str | None = None, *, device: str = "auto", dtype: str | None = None
) -> Engine:
    """One engine per (model, device, dtype) in this process.

    A model owns its KV pool; every adapter that names the same model shares that pool (and
    its prefix cache) instead of loading the weights again.
    """
    key = (model, device, dtype)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine.from_pretrained(model, device=device, dtype=dtype)
            _ENGINES[key] = engine
        return engine


_ENGINE_SURFACE = (
    "tokenizer",
    "block_size",
    "model_name",
    "generate",
    "stream",
    "agenerate",
    "astream",
)


def check_engine(engine: Any) -> Any:
    """``engine`` itself when it offers the :class:`EngineLike` surface (an in-process
    :class:`Engine`, a ``RemoteEngine``, a replica router...), else :class:`InvalidInputError`
    naming what it lacks. ``None`` passes (the adapter then loads its ``model``)."""
    if engine is None:
        return None
    missing = [name for name in _ENGINE_SURFACE if not hasattr(engine, name)]
    if missing:
        raise InvalidInputError(
            f"engine must offer the EngineLike surface (an Engine, a RemoteEngine or a replica "
            f"router); {type(engine).__name__} lacks {', '.join(missing)}",
            param="engine",
        )
    return engine


# An adapter's ``engine`` field (a pydantic model's): None, or what check_engine lets through.
EngineField = Annotated[Any, AfterValidator(check_engine)]


def engine_for(adapter: Any) -> EngineLike:
    """The engine of a framework adapter: its ``engine`` field, else the shared engine of its
    ``model``/``device``/``dtype`` fields (loaded on first use)."""
    if adapter.engine is not None:
        return adapter.engine
    return shared_engine(adapter.model, device=adapter.device, dtype=adapter.dtype)


class EngineFields(BaseModel):
    """The fields that say which engine a framework adapter runs on (what :func:`engine_for`
    reads): a loaded ``engine``, else the shared engine of ``model``/``device``/``dtype``.
    The adapters list it before their framework's base, so its fields follow the
    framework's own."""

    # Any EngineLike: an in-process Engine, a RemoteEngine, a replica router (EngineField checks).
    engine: EngineField = Field(default=None, exclude=True, repr=False)
    model: str | None = None
    device: str = "auto"
    dtype: str | None = None

    def get_engine(self) -> EngineLike:
        """The engine this adapter runs on (loaded on first use when only ``model`` was given)."""
        return engine_for(self)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered by ragkv's one chat renderer, contents encoded
    literally (:func:`ragkv.assembler.template.chat_token_ids`)."""
    return chat_token_ids(text_tokenizer(tokenizer), messages)


def sampling_params(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> SamplingParams:
    """Engine sampling parameters from framework-style optional fields (None: default; the
    temperature default is greedy), through the one OpenAI mapping."""
    body = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": None if stop is None else list(stop),
    }
    return SamplingParams.from_openai(
        body, default_max_tokens=default_max_tokens, default_temperature=0.0
    )


def adapter_params(
    adapter: Any, kwargs: Mapping[str, Any], stop: Sequence[str] | None
) -> SamplingParams:
    """Sampling parameters from a framework adapter's fields (``max_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``seed``), each overridden by the call's keyword
    of that name; ``stop`` as the adapter's framework passes it."""
    return sampling_params(
        max_tokens=kwargs.get("max_tokens", adapter.max_tokens),
        temperature=kwargs.get("temperature", adapter.temperature),
        top_p=kwargs.get("top_p", adapter.top_p),
        top_k=kwargs.get("top_k", adapter.top_k),
        seed=kwargs.get("seed", adapter.seed),
        stop=stop,
    )


def stream_until(
    engine: EngineLike,
    prompt: list[int],
    params: SamplingParams,
    *,
    cache_salt: str | None,
    timeout: float | None,
) -> Generator[StreamDelta, None, None]:
    """``engine.stream`` that aborts the request once ``timeout`` seconds have passed."""
    deadline = _deadline(timeout)
    stream = engine.stream(prompt, params, cache_salt=cache_salt)
    try:
        for delta in stream:
            yield delta
            _check_deadline(delta, deadline, timeout)
    finally:
        stream.close()  # aborts the engine request if it is still running


async def astream_until(
    engine: EngineLike,
    prompt: list[int],
    params: SamplingParams,
    *,
    cache_salt: str | None,
    timeout: float | None,
) -> AsyncGenerator[StreamDelta, None]:
    """Asyncio form of :func:`stream_until`."""
    deadline = _deadline(timeout)
    stream = engine.astream(prompt, params, cache_salt=cache_salt)
    try:
        async for delta in stream:
            yield delta
            _check_deadline(delta, deadline, timeout)
    finally:
        await stream.aclose()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _check_deadline(delta: StreamDelta, deadline: float | None, timeout: float | None) -> None:
    """Abort (raise) a generation still running past its ``deadline``."""
    if delta.finish_reason is None and deadline and time.monotonic() > deadline:
        raise RequestAbortedError(f"generation timed out after {timeout} s")
