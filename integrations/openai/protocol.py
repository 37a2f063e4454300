"""The OpenAI wire format as ``ragkv serve`` speaks it: request parsing and limits (response
bodies in :mod:`.responses`, the matching JSON Schemas in :mod:`.schemas`).

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
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ragkv.cache_engine.chunk_reuse import BlendConfig
from ragkv.cache_engine.sampling_params import (
    MAX_STOP_STRINGS,
    json_field,
    json_ints,
    openai_fields,
)
from ragkv.dedup import Chunk
from ragkv.errors import ConfigError, InvalidInputError

DEFAULT_COMPLETION_MAX_TOKENS = 16

# Wire limits: the defaults of RequestLimits and of their `ragkv serve` flags.
# RAG limits. Measured on 2 CPU cores: one request with an 8 MB chunk made a small RAG
# request wait 11.9 s instead of 0.31 s, and eight 2 MB RAG requests made a plain completion
# wait 13.8 s (tokenizing and hashing hold the GIL). 256 KiB of chunks is ~64k tokens, more
# than most contexts hold, so an honest request never reaches these.
DEFAULT_MAX_CHUNK_BYTES = 32 << 10
DEFAULT_MAX_CHUNKS = 64
DEFAULT_MAX_RAG_BYTES = 256 << 10
# The rest of a request's text (messages, a string prompt, ragkv.system), bounded before
# tokenizing like the chunks: six 7 MB chats once made another tenant's small chat take 67 s.
DEFAULT_MAX_TEXT_BYTES = 1 << 20
DEFAULT_MAX_MESSAGES = 256
# The engine's own cap (OpenAI's 4): the flag can only lower it.
DEFAULT_MAX_STOP_STRINGS = MAX_STOP_STRINGS


class APIError(Exception):
    """An error the server answers with ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def rate_limited(tenant: bool, what: str) -> APIError:
    """A 429 with ``Retry-After``: the tenant's share (``tenant``) or the server's of
    ``what`` is used up."""
    which = "this API key's" if tenant else "the server's"
    return APIError(
        429,
        f"{which} limit of {what} is reached; retry shortly",
        type="rate_limit_error",
        code="too_many_requests",
        headers={"Retry-After": "1"},
    )


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request size limits, checked while parsing, before any tokenization or queueing.

    One huge RAG request stalls everyone (tokenizing and hashing megabytes holds the GIL
    and the assembler), so chunks are bounded one by one, in number and in total UTF-8
    bytes. The rest of the prompt's text (messages, a string prompt, ``ragkv.system``) is
    bounded in UTF-8 bytes (``max_text_bytes``) and messages in number (``max_messages``),
    also before any tokenization. ``max_prompt_tokens`` (None: the model context) bounds the
    prompt after tokenization, and a token-id prompt before anything else.
    """

    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    max_chunks: int = DEFAULT_MAX_CHUNKS
    max_rag_bytes: int = DEFAULT_MAX_RAG_BYTES
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_prompt_tokens: int | None = None
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES

    def __post_init__(self) -> None:
        names = ("max_chunk_bytes", "max_chunks", "max_rag_bytes", "max_stop_strings")
        for name in (*names, "max_messages", "max_text_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1", param=name)
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError("max_prompt_tokens must be at least 1", param="max_prompt_tokens")


@dataclass(slots=True)
class RagContext:
    """The ``ragkv`` extension of a chat request: retrieved chunks, an optional system and
    the opt-in to position-independent chunk reuse (``"reuse": "blend"``, with an optional
    ``"strategy"`` and ``"k"``; honoured only by a server started with ``--reuse blend``)."""

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


def parse_completion(body: Any, limits: RequestLimits = RequestLimits()) -> GenerationRequest:
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


def parse_chat(body: Any, limits: RequestLimits = RequestLimits()) -> GenerationRequest:
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


def check_prompt_tokens(count: int, limits: RequestLimits, param: str) -> None:
    """400 when a prompt of ``count`` tokens exceeds ``limits.max_prompt_tokens``."""
    if limits.max_prompt_tokens is not None and count > limits.max_prompt_tokens:
        raise APIError(
            400,
            f"the prompt has {count} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}. Send fewer or shorter chunks or messages",
            param=param,
            code="context_length_exceeded",
        )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def may_hold_lone_surrogate(raw: bytes) -> bool:
    """Whether a JSON body could decode to a lone surrogate: only a ``\\ud800``-``\\udfff``
    escape can produce one (raw UTF-8 cannot encode it). One O(bytes) scan, so a large body
    without such an escape is never walked field by field."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def find_lone_surrogate(body: Any) -> str | None:
    """The path (``messages[0].content``) of the first string in ``body`` that holds a lone
    UTF-16 surrogate, else None.

    JSON may escape one (``"\\ud800"``) and ``json.loads`` keeps it, but such a string has
    no UTF-8 form: tokenizers, hashers and the JSON encoder of the answer all fail on it.
    Iterative, so any nesting depth ``json.loads`` accepted is walked without recursion.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _utf8_encodable(value):
                return _path_name(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _utf8_encodable(key):
                    return _path_name(path) or "body"
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
    return None


def _utf8_encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path_name(path: tuple[str | int, ...]) -> str:
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name


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
        raise APIError(
            400,
            f"messages has {len(messages)} entries; this server accepts at most "
            f"{limits.max_messages}",
            param="messages",
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


def check_text_bytes(texts: list[str], limits: RequestLimits, param: str) -> None:
    """Refuse prompt text over ``limits.max_text_bytes`` UTF-8 bytes (before tokenizing)."""
    total = 0
    for text in texts:
        # len(text) <= bytes <= 4 * len(text): encode only when the bound does not decide.
        total += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if total > limits.max_text_bytes:
            raise APIError(
                400,
                f"{param} hold more than {limits.max_text_bytes} bytes of text; this server "
                "accepts at most that per request (send retrieved passages as ragkv.chunks)",
                param=param,
                code="text_too_large",
            )


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


RAG_KEYS = ("chunks", "system", "reuse", "strategy", "k")


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
        raise APIError(
            400,
            f"ragkv.chunks has {len(chunks)} chunks; this server accepts at most "
            f"{limits.max_chunks} per request",
            param="ragkv.chunks",
            code="too_many_chunks",
        )
    parsed = []
    total = 0
    for i, chunk in enumerate(chunks):
        param = f"ragkv.chunks[{i}]"
        total += _chunk_bytes(chunk, param, limits)
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
    """``ragkv.reuse`` / ``ragkv.strategy`` / ``ragkv.k``: the request's chunk reuse opt-in."""
    reuse = _get(value, "reuse", str, None, "ragkv.")
    if reuse is None:
        for name in ("strategy", "k"):
            if value.get(name) is not None:
                raise APIError(
                    400, f"ragkv.{name} needs ragkv.reuse='blend'", param=f"ragkv.{name}"
                )
        return None
    if reuse != "blend":
        raise APIError(400, "ragkv.reuse must be 'blend' (or absent)", param="ragkv.reuse")
    strategy = _get(value, "strategy", str, "first-k", "ragkv.")
    k = value.get("k", BlendConfig().k)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_REUSE_K:
        raise APIError(400, f"ragkv.k must be an int in [0, {MAX_REUSE_K}]", param="ragkv.k")
    try:
        return BlendConfig(strategy, k=k)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="ragkv.strategy") from exc


def _chunk_bytes(chunk: Any, param: str, limits: RequestLimits) -> int:
    """UTF-8 size of a chunk's text (0 for a malformed chunk: its shape is refused later)."""
    text = chunk.get("content") if isinstance(chunk, dict) else chunk
    if not isinstance(text, str):
        return 0
    # len(text) <= bytes <= 4 * len(text): encode only when the bound does not decide.
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_chunk_bytes:
        raise APIError(
            400,
            f"{param} has {size} bytes; this server accepts at most {limits.max_chunk_bytes} "
            "per chunk. Split it into smaller chunks",
            param=param,
            code="chunk_too_large",
        )
    return size


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
