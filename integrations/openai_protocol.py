"""The OpenAI wire format as ``ragkv serve`` speaks it: request parsing and response bodies.

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

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ragkv.cache_engine.outputs import Output
from ragkv.dedup import Chunk
from ragkv.errors import InvalidInputError

# OpenAI's default; a client that wants ragkv's reproducible greedy decoding sends 0.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(slots=True)
class RagContext:
    """The ``ragkv`` extension of a chat request: retrieved chunks and an optional system."""

    chunks: list[Chunk]
    system: str | None = None


@dataclass(slots=True)
class GenerationRequest:
    """One parsed completions or chat request; ``max_tokens=None`` means "up to the context"."""

    model: str | None
    sampling: dict[str, Any]
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    return_token_ids: bool = False
    prompt: str | list[int] | None = None  # /v1/completions
    messages: list[dict[str, str]] = field(default_factory=list)  # /v1/chat/completions
    rag: RagContext | None = None


def parse_completion(body: Any) -> GenerationRequest:
    """Parse a ``POST /v1/completions`` body."""
    body = _object(body)
    request = _common(body, max_tokens_default=DEFAULT_COMPLETION_MAX_TOKENS)
    request.prompt = _prompt(body.get("prompt"))
    if _get(body, "echo", bool, False):
        raise _unsupported("echo")
    if _get(body, "logprobs", int, None) is not None:
        raise _unsupported("logprobs")
    return request


def parse_chat(body: Any) -> GenerationRequest:
    """Parse a ``POST /v1/chat/completions`` body (``max_completion_tokens`` wins)."""
    body = _object(body)
    request = _common(body, max_tokens_default=None)
    newer = _get(body, "max_completion_tokens", int, None)
    if newer is not None:
        request.max_tokens = newer
    request.messages = _messages(body.get("messages"))
    if _get(body, "logprobs", bool, False) or _get(body, "top_logprobs", int, None):
        raise _unsupported("logprobs")
    for name in ("tools", "functions", "response_format"):
        if body.get(name) is not None:
            raise _unsupported(name)
    if body.get("ragkv") is not None:
        request.rag = _rag(body["ragkv"])
    return request


def completion_body(
    request_id: str, model: str, output: Output, *, return_token_ids: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": output.text,
        "logprobs": None,
        "finish_reason": output.finish_reason,
    }
    if return_token_ids:
        choice["prompt_token_ids"] = output.prompt_token_ids
        choice["token_ids"] = output.token_ids
    return _envelope(request_id, "text_completion", model, [choice], output.usage.to_openai())


def chat_body(
    request_id: str, model: str, output: Output, *, return_token_ids: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": output.text},
        "logprobs": None,
        "finish_reason": output.finish_reason,
    }
    if return_token_ids:
        choice["prompt_token_ids"] = output.prompt_token_ids
        choice["token_ids"] = output.token_ids
    return _envelope(request_id, "chat.completion", model, [choice], output.usage.to_openai())


def completion_chunk(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return _envelope(request_id, "text_completion", model, [choice])


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return _envelope(request_id, "chat.completion.chunk", model, [choice])


def usage_chunk(request_id: str, model: str, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The extra last chunk of a stream with ``stream_options.include_usage``."""
    return _envelope(request_id, obj, model, [], usage)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- parsing helpers ----------------------------------------------------------------------


def _common(body: dict[str, Any], *, max_tokens_default: int | None) -> GenerationRequest:
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
    sampling = {
        "temperature": _get(body, "temperature", float, DEFAULT_TEMPERATURE),
        "top_p": _get(body, "top_p", float, 1.0),
        "top_k": _get(body, "top_k", int, 0),
        "min_p": _get(body, "min_p", float, 0.0),
        "seed": _get(body, "seed", int, None),
        "stop": _stop(body.get("stop")),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "ignore_eos": _get(body, "ignore_eos", bool, False),
        "include_stop_str_in_output": _get(body, "include_stop_str_in_output", bool, False),
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
    }
    return GenerationRequest(
        model=_get(body, "model", str, None),
        sampling={k: v for k, v in sampling.items() if v is not None},
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
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise APIError(
            400, "batched prompts are not supported; send one per request", param="prompt"
        )
    raise APIError(
        400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"{param} must be an object with a string role", param=param)
        parsed.append({"role": message["role"], "content": _content(message.get("content"), param)})
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


def _rag(value: Any) -> RagContext:
    if not isinstance(value, dict):
        raise APIError(400, "ragkv must be an object {chunks, system}", param="ragkv")
    chunks = value.get("chunks", [])
    if not isinstance(chunks, list):
        raise APIError(400, "ragkv.chunks must be a list", param="ragkv.chunks")
    parsed = []
    for i, chunk in enumerate(chunks):
        param = f"ragkv.chunks[{i}]"
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
    return RagContext(parsed, _get(value, "system", str, None, "ragkv."))


def _stop(stop: Any) -> list[str] | None:
    if stop is None or isinstance(stop, str):
        return None if stop is None else [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise APIError(400, "stop must be a string or a list of strings", param="stop")


def _int_list(body: dict[str, Any], name: str) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    raise APIError(400, f"{name} must be a list of integers", param=name)


_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "an object",
}


def _get(body: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    """``body[name]`` if present and of ``kind`` (JSON null means default), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    ok = (
        _is_int(value)
        if kind is int
        else (_is_int(value) or isinstance(value, float))
        if kind is float
        else isinstance(value, kind)
    )
    if not ok:
        param = prefix + name
        raise APIError(
            400, f"{param} must be {_TYPE_NAMES[kind]}, got {type(value).__name__}", param=param
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _unsupported(param: str, what: str | None = None) -> APIError:
    detail = f"; ragkv serve supports {what}" if what else ""
    return APIError(400, f"{param} is not supported by ragkv serve{detail}", param=param)


def _envelope(
    request_id: str,
    obj: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body
