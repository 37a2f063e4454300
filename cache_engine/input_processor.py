"""Requests in, in the caller's thread: every input validated and converted before queueing.

Everything the stepping thread will use is checked or converted here (the prompt's token
ids, the sampling parameters, the salt's digest, the seeded generator, the stop matcher),
so a bad value fails its caller and never a shared step (Invariant 9).

A prompt is hashed once (issue 28): when a residency probe already hashed it
(:meth:`~ragkv.cache_engine.Engine.prefix_probe`, on the assembler's chosen candidate), its
:class:`PromptHashes` come with the request and become the request's block hashes, as long
as they are exactly what this engine would compute for it; otherwise the prompt is hashed
here.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.cache_engine.block_hash import BlockHasher, digest_salt
from ragkv.cache_engine.chunk_reuse import BlendConfig, check_chunk_spans
from ragkv.cache_engine.engine_like import Prompt, is_single_prompt
from ragkv.cache_engine.output_processor import OutputProcessor, RequestState
from ragkv.cache_engine.request import Request
from ragkv.cache_engine.sampler import make_generator
from ragkv.cache_engine.sampling_params import SamplingParams, check_vocabulary, resolve_params
from ragkv.cache_engine.scheduler import Scheduler
from ragkv.errors import InvalidInputError, PromptTooLongError

ChunkSpans = Sequence[tuple[int, int]]


class PromptHashes:
    """A prompt's block hashes, computed before its request by a residency probe, for the
    one request that sends exactly that prompt (``generate(..., prompt_hashes=)``).

    Taken at most once: the request extends them with the tokens it generates, so a second
    request with the same plan hashes its prompt itself. Trusted only where they are what
    the engine would compute: made by its KV cache manager (block size, extra keys, hash
    algorithm), for the same ``cache_salt``, over exactly the prompt's token ids (a copy
    taken when hashed). Until taken they keep the salt, which the caller holds anyway; the
    request keeps only its digest.
    """

    __slots__ = ("salt_digest", "_owner", "_cache_salt", "_token_ids", "_hasher")

    def __init__(
        self,
        owner: object,
        token_ids: list[int],
        cache_salt: str | None,
        salt_digest: bytes | None,
        hasher: BlockHasher,
    ) -> None:
        self.salt_digest = salt_digest
        self._owner = owner
        self._cache_salt = cache_salt
        self._token_ids = token_ids
        self._hasher = [hasher]  # list.pop() hands it to one taker, whichever thread

    def made_for(self, owner: object, cache_salt: str | None) -> bool:
        """Whether these hashes are ``owner``'s (the engine's KV manager) for this salt."""
        return owner is self._owner and cache_salt == self._cache_salt

    def take(self, token_ids: list[int]) -> BlockHasher | None:
        """The hasher, if it hashed exactly ``token_ids`` and no request took it yet."""
        if token_ids != self._token_ids:
            return None
        try:
            hasher = self._hasher.pop()
        except IndexError:
            return None
        self._cache_salt, self._token_ids = None, []  # nothing more to check against
        return hasher


@dataclass(slots=True)
class InputProcessor:
    """Turns a caller's prompt and parameters into a :class:`RequestState` ready to queue."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    model_name: str
    scheduler: Scheduler
    outputs: OutputProcessor

    def next_id(self, prefix: str = "req") -> str:
        """A new request id: unique in this engine, and random, so an id a caller sees (in an
        output or an error message) says nothing about how much traffic others sent."""
        return f"{prefix}-{secrets.token_hex(8)}"

    def process(
        self,
        prompt: Prompt,
        params: SamplingParams,
        cache_salt: str | None,
        keep_logits: bool,
        chunk_spans: Any = None,
        reuse: Any = None,
        prompt_hashes: Any = None,
    ) -> RequestState:
        """Validate and convert one request; raise (with ``param``) on the first bad input.

        ``prompt_hashes`` (:class:`PromptHashes`) spare hashing the prompt again when they
        match it and this engine; anything else is hashed here."""
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(
                f"params must be SamplingParams, got {type(params).__name__}", param="params"
            )
        check_vocabulary(params, self.vocab_size)  # the rest was checked at construction
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidInputError("cache_salt must be a string or None", param="cache_salt")
        hashes = self._own_hashes(prompt_hashes, cache_salt)
        if hashes is not None:  # the probe digested this salt already
            salt_digest = hashes.salt_digest
        else:
            salt_digest = None if cache_salt is None else digest_salt(cache_salt)
        token_ids = self.prompt_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; the model context is {self.max_model_len} "
                "and at least one token must be generated. Shorten the prompt (ragkv.Pipeline "
                "fits it by default, dropping the least relevant chunks; or set "
                "Pipeline(..., max_prompt_tokens=N)) or use a model with a longer context",
                param="prompt",
            )
        spans, reuse = check_reuse(chunk_spans, reuse, len(token_ids))
        eos = frozenset() if params.ignore_eos else self.outputs.eos_token_ids
        request = Request(
            self.next_id(),
            token_ids,
            params,
            salt_digest=salt_digest,
            keep_logits=keep_logits,
            stop_token_ids=eos | frozenset(params.stop_token_ids),
            generator=make_generator(params),
            chunk_spans=spans,
            reuse=reuse,
        )
        self.scheduler.check_fits(request)
        if self.scheduler.config.enable_prefix_caching:  # hashed in the caller's thread
            hasher = None if hashes is None else hashes.take(token_ids)
            if hasher is None:
                hasher = self.scheduler.kv.new_hasher(salt_digest)
                hasher.extend(token_ids)
            request.block_hasher = hasher
        return self.outputs.new_state(request)

    def _own_hashes(self, prompt_hashes: Any, cache_salt: str | None) -> PromptHashes | None:
        """``prompt_hashes`` when this engine made them for this salt, else None."""
        if prompt_hashes is None:
            return None
        if not isinstance(prompt_hashes, PromptHashes):
            raise InvalidInputError(
                "prompt_hashes must be the PromptHashes an engine's prefix_probe returned (or "
                f"None), got {type(prompt_hashes).__name__}",
                param="prompt_hashes",
            )
        return prompt_hashes if prompt_hashes.made_for(self.scheduler.kv, cache_salt) else None

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt is empty", param="prompt")
            if not prompt.isascii():
                _check_utf8(prompt, "prompt")
            # Checked below like caller ids: a tokenizer may know more ids than the model has
            # embeddings for, or none for this text; either would fail a shared step.
            prompt = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not prompt:
                raise InvalidInputError("prompt has no tokens once tokenized", param="prompt")
        elif isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
            raise InvalidInputError(
                f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}",
                param="prompt",
            )
        ids: list[Any] = list(prompt)  # a caller's values: each is checked to be an id below
        if not ids:
            raise InvalidInputError("prompt is empty: pass at least one token id", param="prompt")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidInputError(
                    f"token id {t!r} is outside the vocabulary [0, {vocab}) of {self.model_name}",
                    param="prompt",
                )
        return ids


def check_reuse(
    chunk_spans: Any, reuse: Any, num_tokens: int
) -> tuple[tuple[tuple[int, int], ...], BlendConfig | None]:
    """A request's chunk spans (checked) and chunk reuse opt-in; reuse needs the spans."""
    if reuse is not None and not isinstance(reuse, BlendConfig):
        raise InvalidInputError(
            f"reuse must be a BlendConfig or None, got {type(reuse).__name__}", param="reuse"
        )
    if chunk_spans is None:
        if reuse is not None:
            raise InvalidInputError(
                "reuse needs chunk_spans: the (start, end) token offsets of the prompt's "
                "chunks (PromptPlan.spans('chunk'))",
                param="chunk_spans",
            )
        return (), None
    return check_chunk_spans(chunk_spans, num_tokens), reuse


def _check_utf8(text: str, param: str) -> None:
    """Refuse text that has no UTF-8 form (lone surrogates, e.g. from a bad JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{param} is not valid Unicode: {exc.reason} at index {exc.start} "
            f"({text[exc.start : exc.end]!r}); send UTF-8 text without lone surrogates",
            param=param,
        ) from None


def pair_prompts(
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[bool, list[Prompt], list[SamplingParams]]:
    """``generate``'s arguments as (one prompt given?, prompts, one SamplingParams each)."""
    batch: list[Prompt] = [prompts] if (single := is_single_prompt(prompts)) else list(prompts)
    if not batch:
        raise InvalidInputError("generate() needs at least one prompt", param="prompt")
    if params is None or isinstance(params, SamplingParams | Mapping | str):
        return single, batch, [resolve_params(params, {})] * len(batch)  # a dict: a clear error
    params_list = list(params)
    if len(params_list) != len(batch):
        raise InvalidInputError(
            f"got {len(params_list)} SamplingParams for {len(batch)} prompts; pass one "
            "SamplingParams for all or one per prompt",
            param="params",
        )
    return single, batch, params_list


def per_prompt(
    value: Any, single: bool, num_prompts: int, name: str, each: str
) -> list[Any] | None:
    """A ``generate`` argument that goes with each prompt (``chunk_spans``,
    ``prompt_hashes``) as one entry per prompt: None when not given, else the one prompt's,
    or the list given for many, which must hold one ``each`` (or None) per prompt."""
    if value is None:
        return None
    if single:
        return [value]
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence)
        or len(value) != num_prompts
    ):
        raise InvalidInputError(
            f"for {num_prompts} prompts, {name} must be a list of {num_prompts} {each} "
            "(or None each)",
            param=name,
        )
    return list(value)
