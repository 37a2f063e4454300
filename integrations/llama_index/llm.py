"""``RagKVLLM``: a LlamaIndex LLM over the in-process prefix-caching engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from ragkv.cache_engine import Output, SamplingParams
from ragkv.cache_engine.engine_like import KnowsContextLength
from ragkv.cache_engine.sampling_params import DEFAULT_MAX_TOKENS
from ragkv.integrations._engine import (
    EngineFields,
    adapter_params,
    astream_until,
    chat_prompt_ids,
    stream_until,
)


class RagKVLLM(EngineFields, CustomLLM):
    """LlamaIndex LLM backed by :class:`ragkv.cache_engine.Engine` (automatic prefix caching).

    Pass a loaded ``engine`` (any ``EngineLike``, a ``RemoteEngine`` included), or ``model``
    (local checkpoint directory; ``None``: the embedded SmolLM2-135M-Instruct) to load one
    lazily, shared per process. ``chat`` and unformatted
    ``complete`` prompts go through the tokenizer's chat template; ``complete(...,
    formatted=True)`` sends the text as is. Every response has ``raw["usage"]`` in the OpenAI
    shape (``prompt_tokens_details.cached_tokens`` included) and ``prompt_tokens``,
    ``completion_tokens``, ``total_tokens`` and ``cached_tokens`` in ``additional_kwargs``.
    """

    temperature: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    timeout: float | None = None
    cache_salt: str | None = None

    @classmethod
    def class_name(cls) -> str:
        return "RagKVLLM"

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.get_engine()
        # A remote engine does not know the server's context: LlamaIndex's default then.
        known = engine.max_model_len if isinstance(engine, KnowsContextLength) else None
        return LLMMetadata(
            context_window=known or DEFAULT_CONTEXT_WINDOW,
            num_output=self.max_tokens,
            is_chat_model=True,
            model_name=engine.model_name,
        )

    def sampling_params(self, **kwargs: Any) -> SamplingParams:
        """Engine sampling parameters from the fields, overridden by per-call kwargs."""
        return adapter_params(self, kwargs, kwargs.get("stop", self.stop))

    # -- completion ---------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        ids = self._completion_ids(prompt, formatted)
        return _last(self._completions(self._deltas(ids, kwargs)))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        ids = self._completion_ids(prompt, formatted)
        return self._completions(self._deltas(ids, kwargs))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await _alast(self._acompletions(self._completion_ids(prompt, formatted), kwargs))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return self._acompletions(self._completion_ids(prompt, formatted), kwargs)

    # -- chat -----------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        ids = self._chat_ids(messages)
        return _as_chat(_last(self._completions(self._deltas(ids, kwargs))))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        ids = self._chat_ids(messages)
        return (_as_chat(r) for r in self._completions(self._deltas(ids, kwargs)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _as_chat(await _alast(self._acompletions(self._chat_ids(messages), kwargs)))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        async def gen() -> ChatResponseAsyncGen:
            async for response in self._acompletions(self._chat_ids(messages), kwargs):
                yield _as_chat(response)

        return gen()

    # -- helpers --------------------------------------------------------------------------
    def _chat_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        turns = [{"role": _role(m.role), "content": m.content or ""} for m in messages]
        if self.system_prompt and not any(t["role"] == "system" for t in turns):
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return chat_prompt_ids(self.get_engine().tokenizer, turns)

    def _completion_ids(self, prompt: str, formatted: bool) -> list[int]:
        if formatted:
            return list(self.get_engine().tokenizer(prompt, add_special_tokens=False).input_ids)
        return self._chat_ids([ChatMessage(role=MessageRole.USER, content=prompt)])

    def _deltas(
        self, ids: list[int], kwargs: dict[str, Any], until: Callable[..., Any] = stream_until
    ) -> Any:
        """The engine's deltas for ``ids``: ``until`` is ``stream_until`` or ``astream_until``
        (the generation's ``timeout`` applied)."""
        params = self.sampling_params(**kwargs)
        salt = kwargs.get("cache_salt", self.cache_salt)
        return until(self.get_engine(), ids, params, cache_salt=salt, timeout=self.timeout)

    def _completions(self, deltas: Any) -> CompletionResponseGen:
        merge = _LastWithUsage()
        for delta in deltas:
            yield from merge.feed(delta)

    async def _acompletions(
        self, ids: list[int], kwargs: dict[str, Any]
    ) -> CompletionResponseAsyncGen:
        merge = _LastWithUsage()
        async for delta in self._deltas(ids, kwargs, astream_until):
            for response in merge.feed(delta):
                yield response


class _LastWithUsage:
    """Completion responses from engine deltas, the last text delta carrying the usage: a
    response is held back until the next delta shows whether it is the last, so a stream
    never ends on an empty delta (the engine's final delta often has no text)."""

    def __init__(self) -> None:
        self.text = ""
        self.held: str | None = None  # the delta text of the response not yet sent

    def feed(self, delta: Any) -> list[CompletionResponse]:
        out = []
        if delta.output is not None:
            if delta.text or self.held is None:
                if self.held is not None:
                    out.append(_response(self.text, self.held, None))
                self.text += delta.text
                out.append(_response(self.text, delta.text, delta.output))
            else:
                out.append(_response(self.text, self.held, delta.output))
            self.held = None
            return out
        if delta.text:
            if self.held is not None:
                out.append(_response(self.text, self.held, None))
            self.text += delta.text
            self.held = delta.text
        return out


def _role(role: MessageRole | str) -> str:
    value = role.value if isinstance(role, MessageRole) else str(role)
    return "assistant" if value == "model" else value


def _response(text: str, delta: str, output: Output | None) -> CompletionResponse:
    if output is None:
        return CompletionResponse(text=text, delta=delta)
    usage = output.usage.to_openai()
    counts = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return CompletionResponse(
        text=text,
        delta=delta,
        raw={"usage": usage, "finish_reason": output.finish_reason, "id": output.request_id},
        additional_kwargs={**counts, "cached_tokens": output.usage.cached_tokens},
    )


def _as_chat(response: CompletionResponse) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
        delta=response.delta,
        raw=response.raw,
        additional_kwargs=response.additional_kwargs,
    )


def _last(responses: Any) -> Any:
    return deque(responses, maxlen=1)[0]


async def _alast(responses: Any) -> Any:
    last = None
    async for response in responses:
        last = response
    return last
