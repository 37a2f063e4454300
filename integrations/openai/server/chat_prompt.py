"""What the model reads for a request of ``ragkv serve``: a completion's text tokenized, a
chat's messages through the chat template, or, with the ``ragkv`` extension, its question,
history and retrieved chunks deduplicated and assembled by the server's
:class:`ragkv.Pipeline`. Runs on a worker thread (:mod:`.fair_work`); a request the template
or the extension refuses is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from ragkv.assembler.template import chat_token_ids
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.integrations.openai.limits import APIError
from ragkv.integrations.openai.protocol import GenerationRequest
from ragkv.integrations.openai.server.state import Served


def tokenize(engine: Any, text: str) -> list[int]:
    """A completion's text as the engine's tokenizer reads it (no special tokens added)."""
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt(
    served: Served, parsed: GenerationRequest
) -> tuple[list[int], dict | None, dict[str, Any]]:
    """Token ids of a chat request: the chat template, or dedup + assembly for ``ragkv``;
    plus the engine's chunk reuse arguments (the plan's chunk spans on a ``--reuse blend``
    server, so exact answers record their chunks, and the request's opt-in)."""
    if parsed.rag is not None and parsed.rag.reuse is not None and served.reuse is None:
        raise APIError(
            400,
            "this server does not reuse chunks at another position; start it with "
            "--reuse blend, or leave ragkv.reuse out",
            param="ragkv.reuse",
        )
    if parsed.rag is None:
        try:
            ids = chat_token_ids(served.pipeline.assembler.tokenizer, parsed.messages)
        except Exception as exc:  # jinja raises for messages the template refuses
            raise APIError(
                400, f"the chat template rejected messages: {exc}", param="messages"
            ) from exc
        return ids, None, {}
    messages = parsed.messages
    if messages[-1]["role"] != "user":
        raise APIError(
            400, "with ragkv chunks the last message must be the user's question", param="messages"
        )
    instructions = ("system", "developer")  # OpenAI's newer name for the system message
    system = parsed.rag.system
    if system is None:
        system = "\n\n".join(m["content"] for m in messages if m["role"] in instructions)
        system = system or None
    history = [m for m in messages[:-1] if m["role"] not in instructions]
    prepared = served.pipeline.prepare(
        messages[-1]["content"],
        parsed.rag.chunks,
        system=system,
        history=history,
        cache_salt=parsed.cache_salt,
        # Learned chunk order is the tenant's, whatever salts its clients pick: a client
        # cycling salts cannot evict other tenants' state.
        namespace=parsed.tenant,
        # The prompt budget leaves room for this request's answer.
        params=SamplingParams(max_tokens=parsed.max_tokens or served.default_max_tokens),
    )
    stats = prepared.dedup.stats
    extra = {
        "chunks_in": stats.chunks_in,
        "chunks_out": stats.chunks_out,
        "expected_cached_tokens": prepared.plan.expected_cached_tokens,
    }
    reuse: dict[str, Any] = {}
    if prepared.plan.prompt_hashes is not None:  # the probe hashed it: not hashed again
        reuse["prompt_hashes"] = prepared.plan.prompt_hashes
    if served.reuse is not None:
        reuse["chunk_spans"] = [(s.start, s.end) for s in prepared.plan.spans("chunk")]
        reuse["reuse"] = parsed.rag.reuse
    return list(prepared.plan.token_ids), extra, reuse


__all__ = ["chat_prompt", "tokenize"]
