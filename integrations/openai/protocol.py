"""The OpenAI wire format as ``ragkv serve`` speaks it: request parsing (the limits it
applies and the errors it raises in :mod:`.limits`, response bodies in :mod:`.responses`,
the matching JSON Schemas in :mod:`.schemas`).

Pure Python (no web framework), so the rules are testable on their own. Parsing is strict
about types and refuses features the engine does not have (``n > 1``, penalties, logprobs)
with an :class:`APIError`, the OpenAI-style 4xx the server sends back; unknown fields are
ignored, as OpenAI clients send extras (``user``, ``metadata``).

vLLM extensions understood: ``cache_salt``, ``top_k``, ``min_p``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``return_token_ids``. The ragkv extension on chat requests, ``"ragkv": {"chunks": [...],
"system": "..."}``, carries retrieved chunks for server-side dedup and canonical assembly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.cache_engine.sampling_params import json_field, json_ints, openai_fields
from ragkv.dedup import Chunk
from ragkv.errors import ConfigError, InvalidInputError
from ragkv.integrations.openai.limits import (
    DEFAULT_LIMITS,
    APIError,
    RequestLimits,
    check_chunk_bytes,
    check_prompt_tokens,
    check_text_bytes,
    over_limit,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(slots=True)
class RagContext:
    """The ``ragkv`` extension of a chat request: retrieved chunks, an optional system and
    the opt-in to position-independent chunk reuse (``"reuse": "blend"``, with an optional
    ``"strategy"``, ``"k"``, ``"ratio"`` and ``"head"``, as :class:`BlendConfig`: absent or
    null means its default, ``deviation`` with ``k=16``, ``ratio`` the strategy's (0.15 for
    ``deviation``, 0 for ``first-k`` and ``none``) and ``head=0``; honoured only by a server
    started with ``--reuse blend``)."""

    chunks: list[Chunk]
    system: str | None = None
    reuse: BlendConfig | None = None


@dataclass(slots=True)
class GenerationRequest:
    """One parsed completions or chat request; ``max_tokens=None`` means "up to the context"."""

    model: str | None
    sampling: dict[str, Any]
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    tenant: str | None = None  # set by the server from the API key, never by the body
    return_token_ids: bool = False
    prompt: str | list[int] | None = None  # /v1/completions
    messages: list[dict[str, str]] = field(default_factory=list)  # /v1/chat/completions
    rag: RagContext | None = None
    params: Any = (
        None  # the validated SamplingParams (the server sets it; max_tokens decided later)
    )


def parse_completion(body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> GenerationRequest:
    """Parse a ``POST /v1/completions`` body."""
    body = _object(body)
    request = _common(body, limits, max_tokens_default=DEFAULT_COMPLETION_MAX_TOKENS)
    request.prompt = _prompt(body.get("prompt"))
    if isinstance(request.prompt, str):
        check_text_bytes([request.prompt], limits, "prompt")
    if isinstance(request.prompt, list):
        check_prompt_tokens(len(request.prompt), limits, "prompt")
    if _get(body, "echo", bool, False):
        raise _unsupported("echo")
    if _get(body, "logprobs", int, None) is not None:
        raise _unsupported("logprobs")
    return request


def parse_chat(body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> GenerationRequest:
    """Parse a ``POST /v1/chat/completions`` body (``max_completion_tokens`` wins)."""
    body = _object(body)
    request = _common(body, limits, max_tokens_default=None)
    newer = _get(body, "max_completion_tokens", int, None)
    if newer is not None:
        request.max_tokens = newer
    request.messages = _messages(body.get("messages"), limits)
    if _get(body, "logprobs", bool, False) or _get(body, "top_logprobs", int, None):
        raise _unsupported("logprobs")
    for name in ("tools", "functions", "response_format"):
        if body.get(name) is not None:
            raise _unsupported(name)
    if body.get("ragkv") is not None:
        request.rag = _rag(body["ragkv"], limits)
    return request


# -- parsing helpers ----------------------------------------------------------------------


def _common(
    body: dict[str, Any], limits: RequestLimits, *, max_tokens_default: int | None
) -> GenerationRequest:
    if _get(body, "n", int, 1) != 1 or _get(body, "best_of", int, 1) not in (None, 1):
        raise _unsupported("n", "one choice per request (n=1)")
    for name, neutral in (
        ("presence_penalty", 0),
        ("frequency_penalty", 0),
        ("repetition_penalty", 1),
    ):
        if _get(body, name, float, neutral) != neutral:
            raise _unsupported(name)
    if body.get("logit_bias"):
        raise _unsupported("logit_bias")
    stream_options = _get(body, "stream_options", dict, None) or {}
    with _as_api_error():
        sampling = openai_fields(body, max_stop_strings=limits.max_stop_strings)
    return GenerationRequest(
        model=_get(body, "model", str, None),
        sampling=sampling,
        max_tokens=_get(body, "max_tokens", int, max_tokens_default),
        stream=_get(body, "stream", bool, False),
        include_usage=_get(stream_options, "include_usage", bool, False, "stream_options."),
        cache_salt=_get(body, "cache_salt", str, None),
        return_token_ids=_get(body, "return_token_ids", bool, False),
    )


def _prompt(prompt: Any) -> str | list[int]:
    # OpenAI accepts a string, token ids, or a batch of either; a batch of one is unwrapped.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return prompt
    tokens = json_ints(prompt)
    if tokens:
        return tokens
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise APIError(
            400, "batched prompts are not supported; send one per request", param="prompt"
        )
    raise APIError(
        400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(messages: Any, limits: RequestLimits) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    if len(messages) > limits.max_messages:
        raise over_limit(
            "messages", len(messages), "entries", limits.max_messages, param="messages"
        )
    parsed = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"{param} must be an object with a string role", param=param)
        if message["role"] not in ROLES:  # a role is template text: never free-form
            raise APIError(
                400, f"{param}.role must be one of {', '.join(ROLES)}", param=f"{param}.role"
            )
        parsed.append({"role": message["role"], "content": _content(message.get("content"), param)})
    check_text_bytes([m["content"] for m in parsed], limits, "messages")
    return parsed


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(400, f"{param}: only text content parts are supported", param=param)
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{param}: a text part needs a string 'text'", param=param)
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{param}.content must be a string or a list of text parts", param=param)


RAG_KEYS = ("chunks", "system", "reuse", "strategy", "k", "ratio", "head")


def _rag(value: Any, limits: RequestLimits) -> RagContext:
    if not isinstance(value, dict):
        raise APIError(400, "ragkv must be an object {chunks, system}", param="ragkv")
    unknown = sorted(set(value) - set(RAG_KEYS))
    if unknown:  # a typo ("sytem") would otherwise drop what it meant without a word
        raise APIError(
            400,
            f"ragkv.{unknown[0]} is not a ragkv field; ragkv takes {', '.join(RAG_KEYS)}",
            param=f"ragkv.{unknown[0]}",
        )
    chunks = value.get("chunks", [])
    if not isinstance(chunks, list):
        raise APIError(400, "ragkv.chunks must be a list", param="ragkv.chunks")
    if len(chunks) > limits.max_chunks:
        raise over_limit(
            "ragkv.chunks", len(chunks), "chunks", limits.max_chunks, param="ragkv.chunks",
            tail=" per request", code="too_many_chunks",
        )  # fmt: skip
    parsed = []
    total = 0
    for i, chunk in enumerate(chunks):
        param = f"ragkv.chunks[{i}]"
        total += check_chunk_bytes(chunk, param, limits)
        if total > limits.max_rag_bytes:
            raise APIError(
                400,
                f"ragkv.chunks hold more than {limits.max_rag_bytes} bytes of text in all; "
                "send fewer or shorter chunks",
                param="ragkv.chunks",
                code="chunks_too_large",
            )
        try:
            if isinstance(chunk, str):
                parsed.append(Chunk(chunk))
            elif isinstance(chunk, dict) and isinstance(chunk.get("content"), str):
                parsed.append(
                    Chunk(
                        chunk["content"],
                        source_id=chunk.get("source_id"),
                        score=chunk.get("score"),
                        metadata=chunk.get("metadata") or {},
                    )
                )
            else:
                raise APIError(400, f"{param} must be a string or {{content, ...}}", param=param)
        except InvalidInputError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from exc
    system = _get(value, "system", str, None, "ragkv.")
    if system is not None:
        check_text_bytes([system], limits, "ragkv.system")
    return RagContext(parsed, system, _reuse(value))


MAX_REUSE_K = 1024  # tokens recomputed per reused chunk: more is a full recompute anyway


def _reuse(value: dict[str, Any]) -> BlendConfig | None:
    """``ragkv.reuse`` / ``ragkv.strategy`` / ``ragkv.k`` / ``ragkv.ratio`` / ``ragkv.head``:
    the request's chunk reuse opt-in (:class:`BlendConfig`'s fields; null: its default, and
    a null ratio the strategy's, so ``{"strategy": "first-k"}`` means what it always has)."""
    reuse = _get(value, "reuse", str, None, "ragkv.")
    if reuse is None:
        for name in ("strategy", "k", "ratio", "head"):
            if value.get(name) is not None:
                raise APIError(
                    400, f"ragkv.{name} needs ragkv.reuse='blend'", param=f"ragkv.{name}"
                )
        return None
    if reuse != "blend":
        raise APIError(400, "ragkv.reuse must be 'blend' (or absent)", param="ragkv.reuse")
    default = BlendConfig()
    strategy = _get(value, "strategy", str, default.strategy, "ragkv.")
    k, head = _token_count(value, "k", default.k), _token_count(value, "head", default.head)
    ratio = value.get("ratio")  # None: the strategy's default (BlendConfig resolves it)
    try:
        return BlendConfig(strategy, k=k, ratio=ratio, head=head)
    except ConfigError as exc:
        field = exc.param if exc.param in ("ratio", "head") else "strategy"
        raise APIError(400, str(exc), param=f"ragkv.{field}") from exc


def _token_count(value: dict[str, Any], name: str, default: int) -> int:
    """``ragkv.<name>``: a count of tokens per reused chunk, at most ``MAX_REUSE_K``."""
    count = value.get(name)
    count = default if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_REUSE_K:
        raise APIError(
            400, f"ragkv.{name} must be an int in [0, {MAX_REUSE_K}]", param=f"ragkv.{name}"
        )
    return count


def _get(body: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    """``body[name]`` if present and of ``kind`` (JSON null means default), else a 400."""
    with _as_api_error():
        return json_field(body, name, kind, default, prefix)


@contextlib.contextmanager
def _as_api_error() -> Iterator[None]:
    """The 400 (with the field as ``param``) for a value the sampling mapping refuses."""
    try:
        yield
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _unsupported(param: str, what: str | None = None) -> APIError:
    detail = f"; ragkv serve supports {what}" if what else ""
    return APIError(400, f"{param} is not supported by ragkv serve{detail}", param=param)
