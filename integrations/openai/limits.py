"""What ``ragkv serve`` accepts on the wire, checked before any tokenizing or queueing: the
per-request size limits (:class:`RequestLimits` and the defaults of its ``ragkv serve``
flags), text that has a UTF-8 form, and :class:`APIError`, the OpenAI-style refusal the
server sends back (:func:`rate_limited` for a 429).

The request parsers in :mod:`.protocol` apply these while parsing; the server checks the
prompt's token count once it has tokenized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ragkv.cache_engine.sampling_params import MAX_STOP_STRINGS
from ragkv.errors import ConfigError

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


DEFAULT_LIMITS = RequestLimits()  # the parsers' default: frozen, so one shared instance


def over_limit(
    what: str,
    count: int,
    unit: str,
    limit: int,
    *,
    param: str,
    tail: str = "",
    code: str | None = None,
) -> APIError:
    """The 400 for a request past one of the server's limits, in one wording: "``what`` has
    ``count`` ``unit``; this server accepts at most ``limit``" and ``tail`` (what to do)."""
    message = f"{what} has {count} {unit}; this server accepts at most {limit}{tail}"
    return APIError(400, message, param=param, code=code)


def check_prompt_tokens(count: int, limits: RequestLimits, param: str) -> None:
    """400 when a prompt of ``count`` tokens exceeds ``limits.max_prompt_tokens``."""
    if limits.max_prompt_tokens is not None and count > limits.max_prompt_tokens:
        raise over_limit(
            "the prompt", count, "tokens", limits.max_prompt_tokens, param=param,
            tail=". Send fewer or shorter chunks or messages", code="context_length_exceeded",
        )  # fmt: skip


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


def check_text_bytes(texts: list[str], limits: RequestLimits, param: str) -> None:
    """Refuse prompt text over ``limits.max_text_bytes`` UTF-8 bytes (before tokenizing)."""
    total = 0
    for text in texts:
        total += _utf8_size(text)
        if total > limits.max_text_bytes:
            raise APIError(
                400,
                f"{param} hold more than {limits.max_text_bytes} bytes of text; this server "
                "accepts at most that per request (send retrieved passages as ragkv.chunks)",
                param=param,
                code="text_too_large",
            )


def check_chunk_bytes(chunk: Any, param: str, limits: RequestLimits) -> int:
    """UTF-8 size of a chunk's text, a 400 over ``limits.max_chunk_bytes`` (0 for a
    malformed chunk: its shape is refused later)."""
    text = chunk.get("content") if isinstance(chunk, dict) else chunk
    if not isinstance(text, str):
        return 0
    size = _utf8_size(text)
    if size > limits.max_chunk_bytes:
        raise over_limit(
            param, size, "bytes", limits.max_chunk_bytes, param=param,
            tail=" per chunk. Split it into smaller chunks", code="chunk_too_large",
        )  # fmt: skip
    return size


def _utf8_size(text: str) -> int:
    # len(text) <= bytes <= 4 * len(text): encode only when the bound does not decide.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
