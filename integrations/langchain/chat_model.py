"""``ChatRagKV``: a LangChain chat model over the in-process prefix-caching engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage, UsageMetadata
from langchain_core.messages.ai import InputTokenDetails
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field

from ragkv.cache_engine import Output, SamplingParams, Usage
from ragkv.cache_engine.default_model import DEFAULT_MODEL_NAME
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS
from ragkv.errors import InvalidInputError
from ragkv.integrations._engine import (
    EngineFields,
    adapter_params,
    astream_until,
    chat_prompt_ids,
    stream_until,
)

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


class ChatRagKV(EngineFields, BaseChatModel):
    """Chat model backed by :class:`ragkv.cache_engine.Engine` (automatic prefix caching).

    Pass a loaded ``engine`` to share it (or any ``EngineLike``: a ``RemoteEngine`` in front
    of vLLM, SGLang or ``ragkv serve``), or ``model`` (a local Hugging Face checkpoint
    directory; ``None``: the embedded SmolLM2-135M-Instruct) to load one lazily; models with
    the same settings share one engine per process. Messages become a prompt through the
    tokenizer's chat template. ``usage_metadata.input_token_details["cache_read"]`` is the
    number of prompt tokens served from the prefix cache (0 included; absent when a remote
    server does not report it).

    ``max_retries`` is accepted for LangChain compatibility: a local engine has no transient
    failures to retry. ``timeout`` aborts a generation that runs longer.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    temperature: float | None = 0.0
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = None
    max_retries: int = 2
    cache_salt: str | None = None
    streaming: bool = False

    @property
    def _llm_type(self) -> str:
        return "ragkv"

    @property
    def model_name(self) -> str:
        """The served model's name (the engine's, once loaded)."""
        if self.engine is not None:
            return self.engine.model_name
        return self.model or DEFAULT_MODEL_NAME

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_name": self.model_name,
            "dtype": self.dtype,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ragkv",
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # -- the LangChain hooks ---------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for delta in self._deltas(messages, stop, kwargs, stream_until):
            chunk = _chunk(delta.text, delta.output, self.model_name)
            if run_manager and (delta.text or delta.output):
                run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for delta in self._deltas(messages, stop, kwargs, astream_until):
            chunk = _chunk(delta.text, delta.output, self.model_name)
            if run_manager and (delta.text or delta.output):
                await run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    # -- helpers --------------------------------------------------------------------------
    def sampling_params(self, stop: list[str] | None = None, **kwargs: Any) -> SamplingParams:
        """Engine sampling parameters from the fields, overridden by per-call kwargs."""
        return adapter_params(self, kwargs, stop if stop is not None else self.stop)

    def _deltas(
        self,
        messages: Sequence[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        until: Callable[..., Any],
    ) -> Any:
        """The engine's deltas for ``messages``: ``until`` is ``stream_until`` or
        ``astream_until`` (the generation's ``timeout`` applied)."""
        engine = self.get_engine()
        prompt = chat_prompt_ids(engine.tokenizer, [_to_chat(m) for m in messages])
        salt = kwargs.get("cache_salt", self.cache_salt)
        params = self.sampling_params(stop, **kwargs)
        return until(engine, prompt, params, cache_salt=salt, timeout=self.timeout)


def _to_chat(message: BaseMessage) -> dict[str, str]:
    role = _ROLES.get(message.type) or getattr(message, "role", None)
    if role is None:
        raise InvalidInputError(f"ChatRagKV cannot send a {message.type!r} message")
    content = message.content
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") not in ("text", None):
                raise InvalidInputError(
                    f"ChatRagKV takes text only; got a {block.get('type')!r} content block"
                )
    return {"role": role, "content": message.text}


def usage_metadata(u: Usage) -> UsageMetadata:
    """ragkv's usage as LangChain's ``UsageMetadata`` (``cache_read``: exact prefix reuse)."""
    # LangChain's details are ints; a remote server that does not report cached tokens
    # leaves cache_read out rather than None (which usage addition would choke on).
    details: InputTokenDetails = {} if u.cached_tokens is None else {"cache_read": u.cached_tokens}
    return UsageMetadata(
        input_tokens=u.prompt_tokens,
        output_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        input_token_details=details,
    )


def _response_metadata(output: Output, model_name: str) -> dict[str, Any]:
    return {
        "model_name": model_name,
        "finish_reason": output.finish_reason,
        "request_id": output.request_id,
    }


def _chunk(text: str, output: Output | None, model_name: str) -> ChatGenerationChunk:
    if output is None:
        return ChatGenerationChunk(message=AIMessageChunk(content=text))
    message = AIMessageChunk(
        content=text,
        usage_metadata=usage_metadata(output.usage),
        response_metadata=_response_metadata(output, model_name),
        chunk_position="last",
    )
    return ChatGenerationChunk(
        message=message, generation_info={"finish_reason": output.finish_reason}
    )
