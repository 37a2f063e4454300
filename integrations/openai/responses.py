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
    ids = _output_ids(output) if return_token_ids else {}
    choice = _choice({"text": output.text}, output.finish_reason, ids)
    return _envelope(request_id, "text_completion", model, [choice], output.usage.to_openai())


def chat_body(
    request_id: str, model: str, output: Output, *, return_token_ids: bool
) -> dict[str, Any]:
    ids = _output_ids(output) if return_token_ids else {}
    message = {"role": "assistant", "content": output.text}
    choice = _choice({"message": message}, output.finish_reason, ids)
    return _envelope(request_id, "chat.completion", model, [choice], output.usage.to_openai())


def stream_chunk(
    request_id: str,
    model: str,
    piece: str | dict[str, Any],
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    *,
    chat: bool,
) -> dict[str, Any]:
    """One chunk of a stream: ``piece`` is a chat's ``delta`` or a completion's text."""
    ids = {} if token_ids is None else {"token_ids": token_ids}
    choice = _choice({"delta": piece} if chat else {"text": piece}, finish_reason, ids)
    return _envelope(request_id, _chunk_object(chat), model, [choice])


def _choice(
    content: dict[str, Any], finish_reason: str | None, ids: dict[str, list[int]]
) -> dict[str, Any]:
    """One choice: ``content`` is its text, message or delta; ``ids`` the vLLM-style token ids."""
    return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason, **ids}


def _output_ids(output: Output) -> dict[str, list[int]]:
    return {"prompt_token_ids": output.prompt_token_ids, "token_ids": output.token_ids}


def usage_chunk(
    request_id: str, model: str, usage: dict[str, Any], *, chat: bool
) -> dict[str, Any]:
    """The extra last chunk of a stream with ``stream_options.include_usage``."""
    return _envelope(request_id, _chunk_object(chat), model, [], usage)


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


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
