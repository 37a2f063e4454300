"""The response bodies ``ragkv serve`` answers with, in OpenAI's shapes: completions, chat
completions, their stream chunks and the usage chunk."""

from __future__ import annotations

import time
import uuid
from typing import Any

from ragkv.cache_engine.outputs import Output


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
