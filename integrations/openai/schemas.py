"""JSON Schemas of the bodies ``ragkv serve`` accepts (OpenAPI documentation and fuzzing
input). :mod:`ragkv.integrations.openai.protocol`'s parsers are the authority; these describe
the same rules."""

from __future__ import annotations

from typing import Any

from ragkv.cache_engine.sampling_params import OPENAI_SEED_MAX, OPENAI_SEED_MIN
from ragkv.integrations.openai.limits import RequestLimits
from ragkv.integrations.openai.protocol import ROLES


def request_schemas(
    limits: RequestLimits,
    *,
    model_name: str,
    vocab_size: int | None,
    max_model_len: int | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON Schemas of the completions and chat bodies this module accepts.

    The protocol's parsers are the authority; these describe the same rules (types, ranges and
    this server's limits) so ``app.openapi()`` documents the real bodies and a schema fuzzer
    generates meaningful ones. Unknown fields stay allowed, as the parsers ignore them.
    """
    token: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    max_tokens: dict[str, Any] = {"type": ["integer", "null"], "minimum": 1}
    if max_model_len is not None:
        max_tokens["maximum"] = max_model_len
    token_prompt: dict[str, Any] = {"type": "array", "items": token, "minItems": 1}
    if limits.max_prompt_tokens is not None:
        token_prompt["maxItems"] = limits.max_prompt_tokens
    common: dict[str, Any] = {
        "model": {"enum": [model_name, None]},
        "max_tokens": max_tokens,
        "temperature": {"type": ["number", "null"], "minimum": 0},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "seed": {
            "type": ["integer", "null"],
            "minimum": OPENAI_SEED_MIN,
            "maximum": OPENAI_SEED_MAX,
        },
        "stop": {
            "anyOf": [
                {"type": "null"},
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "maxItems": limits.max_stop_strings,
                },
            ]
        },
        "stop_token_ids": {"type": ["array", "null"], "items": token},
        "ignore_eos": {"type": ["boolean", "null"]},
        "include_stop_str_in_output": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": ["boolean", "null"]}},
        },
        "cache_salt": {"type": ["string", "null"]},
        "return_token_ids": {"type": ["boolean", "null"]},
        "n": {"type": ["integer", "null"], "enum": [1, None]},
        "presence_penalty": {"type": ["number", "null"], "enum": [0, None]},
        "frequency_penalty": {"type": ["number", "null"], "enum": [0, None]},
        "user": {"type": ["string", "null"]},
    }
    completion = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **common,
            "prompt": {"anyOf": [{"type": "string", "minLength": 1}, token_prompt]},
            "echo": {"type": ["boolean", "null"], "enum": [False, None]},
        },
    }
    content = {
        "anyOf": [
            {"type": "string"},
            {"type": "null"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                },
            },
        ]
    }
    chunk = {
        "anyOf": [
            {"type": "string", "maxLength": limits.max_chunk_bytes // 4},
            {
                "type": "object",
                "required": ["content"],
                "properties": {
                    "content": {"type": "string", "maxLength": limits.max_chunk_bytes // 4},
                    "source_id": {"type": ["string", "null"]},
                    "score": {"type": ["number", "null"]},
                    "metadata": {"type": ["object", "null"]},
                },
            },
        ]
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **common,
            "max_completion_tokens": max_tokens,
            "messages": {
                "type": "array",
                "minItems": 1,
                "maxItems": limits.max_messages,
                "items": {
                    "type": "object",
                    "required": ["role"],
                    "properties": {
                        "role": {"type": "string", "enum": list(ROLES)},
                        "content": content,
                    },
                },
            },
            "ragkv": {
                "type": ["object", "null"],
                "description": "ragkv extension: chunks deduplicated and assembled on the "
                "server; the last message must then be the user's question",
                "properties": {
                    "chunks": {"type": "array", "items": chunk, "maxItems": limits.max_chunks},
                    "system": {"type": ["string", "null"]},
                    "reuse": {
                        "type": ["string", "null"],
                        "enum": ["blend", None],
                        "description": "opt-in position-independent chunk reuse (approximate; "
                        "servers started with --reuse blend)",
                    },
                    "strategy": {
                        "type": ["string", "null"],
                        "enum": ["none", "first-k", "deviation", None],
                        "description": "which reused tokens are recomputed; null: deviation",
                    },
                    "k": {
                        "type": ["integer", "null"],
                        "minimum": 0,
                        "maximum": 1024,
                        "description": "tokens recomputed per reused chunk; null: 16",
                    },
                    "ratio": {
                        "type": ["number", "null"],
                        "minimum": 0,
                        "maximum": 1,
                        "description": "share of each reused chunk recomputed (k its floor); "
                        "null: the strategy's, 0.15 for deviation, 0 for first-k and none",
                    },
                    "head": {
                        "type": ["integer", "null"],
                        "minimum": 0,
                        "maximum": 1024,
                        "description": "deviation only: first tokens of each reused chunk "
                        "always recomputed; null: 0",
                    },
                },
                "additionalProperties": False,
            },
            "logprobs": {"type": ["boolean", "null"], "enum": [False, None]},
        },
    }
    return completion, chat
