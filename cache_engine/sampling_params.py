"""Per-request decoding settings: how to pick each next token and when to stop."""

from __future__ import annotations

import copy as _copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, NoReturn

from ragkv.errors import InvalidInputError

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan,
# and the limit of softmax(logits / t) as t -> 0 is argmax anyway (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
# torch.Generator.manual_seed takes any unsigned 64-bit value; outside it sampling would fail
# in the stepping thread, so it is refused here.
MAX_SEED = 2**64 - 1
# Stop strings are matched after every generated token and held back from the stream while
# they may still form, so both their number and their length are capped: 4 like OpenAI's API,
# and 256 characters, far above any real delimiter. Per-token matching then scans at most
# 256 + len(new text) characters, whatever the request asks for.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# OpenAI's ``seed`` is a signed 64-bit integer (OpenAI's and vLLM's schemas); a negative one
# is taken as its two's complement, since the engine's seeds are unsigned.
OPENAI_SEED_MIN, OPENAI_SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's default temperature; ragkv's own default (greedy) is SamplingParams().temperature.
OPENAI_TEMPERATURE = 1.0
# The one default answer length: SamplingParams, Engine.generate, Pipeline.answer, the
# LangChain and LlamaIndex models, and `ragkv serve` (--default-max-tokens) all use it.
# A RAG answer is a paragraph; 256 tokens is one, and a cap a forgotten max_tokens cannot
# turn into a ten-minute generation.
DEFAULT_MAX_TOKENS = 256


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request decodes.

    ``max_tokens`` defaults to ``DEFAULT_MAX_TOKENS`` (256), the answer length every ragkv
    entry point shares. The default is greedy decoding (``temperature=0``): a RAG answer should be reproducible, and
    greedy output is what the engine's exactness tests compare against Hugging Face. Set
    ``temperature > 0`` to sample; ``top_k``, ``top_p`` and ``min_p`` then restrict the
    candidates (top-k first, then top-p and min-p on the top-k renormalised distribution), and
    ``seed`` (0 to 2**64 - 1) makes the draws reproducible per request, whatever else shares
    the batch.

    ``stop`` strings end generation and are cut from the text (kept with
    ``include_stop_str_in_output``); a single string is accepted, at most ``MAX_STOP_STRINGS``
    of at most ``MAX_STOP_CHARS`` characters each. ``stop_token_ids`` and the
    model's EOS token (unless ``ignore_eos``) end generation too. ``logprobs=n`` returns the
    sampled token's logprob plus the top-n alternatives (``0``: only the sampled one), computed
    from the raw logits, before temperature and filtering.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Copy sequences so a caller's list is never shared; leave anything else for validate().
        stop, stop_ids = self.stop, self.stop_token_ids
        if isinstance(stop, str):
            object.__setattr__(self, "stop", [stop])
        elif stop is None or isinstance(stop, list | tuple):
            object.__setattr__(self, "stop", list(stop or []))
        if stop_ids is None or isinstance(stop_ids, list | tuple):
            object.__setattr__(self, "stop_token_ids", list(stop_ids or []))
        # Bad settings fail where they are written, not later in a server's stepping thread.
        # Frozen: this is the one validation; the engine adds only the vocabulary's bound.
        self.validate()

    @classmethod
    def from_openai(
        cls,
        body: Mapping[str, Any],
        *,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        default_temperature: float = OPENAI_TEMPERATURE,
        max_stop_strings: int = MAX_STOP_STRINGS,
    ) -> SamplingParams:
        """The settings of an OpenAI (or vLLM-extended) request body; absent or null fields
        take their default. ``max_completion_tokens`` wins over ``max_tokens``. Raises
        :class:`~ragkv.errors.InvalidInputError` whose ``param`` is the body's field."""
        max_tokens = json_field(body, "max_completion_tokens", int, None)
        if max_tokens is None:
            max_tokens = json_field(body, "max_tokens", int, default_max_tokens)
        fields = openai_fields(
            body, default_temperature=default_temperature, max_stop_strings=max_stop_strings
        )
        return cls(max_tokens=max_tokens, **fields)

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """A copy with the given fields changed (``None`` values ignored), validated.

        What ``generate(..., max_tokens=64, temperature=0.7)`` style keywords build on."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise InvalidInputError(
                f"unknown sampling setting(s) {unknown}; SamplingParams takes "
                f"{', '.join(f.name for f in fields(self))}",
                param=unknown[0],
            )
        return replace(self, **changes) if changes else self

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with another ``max_tokens``, checking only that field (the rest were
        validated when this was built): a server's default length, decided per request."""
        _check_int("max_tokens", max_tokens)
        if max_tokens < 1:
            _fail("max_tokens", f"max_tokens must be at least 1, got {max_tokens}.")
        copy = _copy.copy(self)
        object.__setattr__(copy, "max_tokens", max_tokens)
        return copy

    def to_openai(self) -> dict[str, Any]:
        """The request-body fields for these settings. The vLLM-style extensions appear only
        when they differ from the neutral value: a plain OpenAI server refuses unknown
        fields. ``logprobs`` is not mapped (the completions API means something else)."""
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        extensions = {
            "top_k": self.top_k if self.top_k > 0 else None,
            "min_p": self.min_p or None,
            "seed": self.seed,
            "stop": self.stop or None,
            "stop_token_ids": self.stop_token_ids or None,
            "ignore_eos": self.ignore_eos or None,
            "include_stop_str_in_output": self.include_stop_str_in_output or None,
            "skip_special_tokens": None if self.skip_special_tokens else False,
        }
        body.update({k: v for k, v in extensions.items() if v is not None})
        return body

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0 or below the greedy cut-off)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`~ragkv.errors.InvalidInputError` naming the first bad setting.

        The error's ``param`` is the field's name. Construction runs this (without a
        vocabulary); the settings are frozen after it. ``vocab_size`` also bounds
        ``stop_token_ids`` (what :meth:`check_vocabulary` checks alone).
        """
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            _fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            _fail("top_k", f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"min_p must be in [0, 1] (0 = off), got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                _fail("seed", f"seed must be between 0 and 2**64 - 1, got {self.seed}.")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                _fail(
                    "logprobs",
                    f"logprobs must be between 0 and {MAX_LOGPROBS} "
                    f"(0 = only the sampled token), got {self.logprobs}.",
                )
        self._validate_stops(vocab_size)

    def _validate_stops(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop, list):
            _fail("stop", f"stop must be a str or a list of str, got {type(self.stop).__name__}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail(
                "stop",
                f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}; "
                "keep the ones that matter.",
            )
        for s in self.stop:
            if not isinstance(s, str):
                _fail("stop", f"stop must hold strings, got {type(s).__name__} {s!r}.")
            if not s:
                _fail("stop", "stop strings must be non-empty; remove the empty string from stop.")
            if len(s) > MAX_STOP_CHARS:
                _fail(
                    "stop",
                    f"stop strings are at most {MAX_STOP_CHARS} characters, got one of {len(s)}.",
                )
        if not isinstance(self.stop_token_ids, list):
            _fail(
                "stop_token_ids",
                f"stop_token_ids must be a list of int, got {type(self.stop_token_ids).__name__}.",
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, what="stop_token_ids entries")
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                _fail(
                    "stop_token_ids",
                    f"stop_token_ids holds {t}, outside the vocabulary; "
                    f"stop token ids must be in {bound}.",
                )


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """The part of validation that needs the model: ``stop_token_ids`` in its vocabulary."""
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            _fail(
                "stop_token_ids",
                f"stop_token_ids holds {t}, outside the vocabulary; "
                f"stop token ids must be in [0, {vocab_size}).",
            )


def resolve_params(params: Any, overrides: Mapping[str, Any]) -> SamplingParams:
    """``params`` (default ``SamplingParams()``) with keyword settings applied: how every
    entry point reads ``generate(prompt, params, max_tokens=64, temperature=0.7)``."""
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        hint = " (write SamplingParams(**params))" if isinstance(params, Mapping) else ""
        raise InvalidInputError(
            f"params must be a SamplingParams{hint}, got {type(params).__name__}; or pass the "
            "settings as keywords, e.g. max_tokens=64, temperature=0.7",
            param="params",
        )
    return params.with_overrides(**overrides) if overrides else params


# -- the OpenAI mapping -------------------------------------------------------------------


def openai_fields(
    body: Mapping[str, Any],
    *,
    default_temperature: float = OPENAI_TEMPERATURE,
    max_stop_strings: int = MAX_STOP_STRINGS,
) -> dict[str, Any]:
    """The :class:`SamplingParams` keyword arguments (all but ``max_tokens``) an OpenAI body
    sets, type-checked; fields it leaves unset are omitted, so the class default applies
    (temperature: ``default_temperature``). Ranges are checked by :meth:`SamplingParams.validate`.
    """
    fields = {
        "temperature": json_field(body, "temperature", float, default_temperature),
        "top_p": json_field(body, "top_p", float, 1.0),
        "top_k": json_field(body, "top_k", int, 0),
        "min_p": json_field(body, "min_p", float, 0.0),
        "seed": _openai_seed(body),
        "stop": _openai_stop(body.get("stop"), max_stop_strings),
        "stop_token_ids": _openai_ints(body, "stop_token_ids"),
        "ignore_eos": json_field(body, "ignore_eos", bool, False),
        "include_stop_str_in_output": json_field(body, "include_stop_str_in_output", bool, False),
        "skip_special_tokens": json_field(body, "skip_special_tokens", bool, True),
    }
    return {k: v for k, v in fields.items() if v is not None}


_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "an object",
}


def json_field(
    body: Mapping[str, Any], name: str, kind: type, default: Any, prefix: str = ""
) -> Any:
    """``body[name]`` if present and of ``kind`` in JSON's sense (``2.0`` is an integer, an
    integer is a number; null means ``default``); else InvalidInputError with ``param``
    ``prefix + name``."""
    value = body.get(name)
    if value is None:
        return default
    if kind is int:
        value = json_integral(value)
        ok = value is not None
    elif kind is float:
        ok = _is_int(value) or isinstance(value, float)
    else:
        ok = isinstance(value, kind)
    if not ok:
        param = prefix + name
        _fail(param, f"{param} must be {_TYPE_NAMES[kind]}, got {type(body[name]).__name__}")
    return value


def json_integral(value: Any) -> int | None:
    """``value`` as an int if it is one in JSON Schema's sense (``2`` or ``2.0``), else None."""
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def json_ints(value: Any) -> list[int] | None:
    """``value`` as a list of ints (JSON Schema integers), else None."""
    if not isinstance(value, list):
        return None
    ints = []
    for v in value:
        i = json_integral(v)
        if i is None:
            return None
        ints.append(i)
    return ints


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _openai_seed(body: Mapping[str, Any]) -> int | None:
    seed = json_field(body, "seed", int, None)
    if seed is not None and not OPENAI_SEED_MIN <= seed <= OPENAI_SEED_MAX:
        _fail("seed", f"seed must be a signed 64-bit integer, got {seed}")
    return None if seed is None else seed % 2**64


def _openai_stop(stop: Any, max_stop_strings: int) -> list[str] | None:
    if stop is None or isinstance(stop, str):
        return None if stop is None else [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > max_stop_strings:
            _fail(
                "stop",
                f"stop has {len(stop)} strings; at most {max_stop_strings} are accepted",
            )
        return stop
    _fail("stop", "stop must be a string or a list of strings")
    return None  # pragma: no cover - _fail raised


def _openai_ints(body: Mapping[str, Any], name: str) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    ints = json_ints(value)
    if ints is None:
        _fail(name, f"{name} must be a list of integers")
    return ints


def _fail(param: str, message: str) -> NoReturn:
    raise InvalidInputError(message, param=param)


def _check_int(param: str, value: object, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(param, f"{what or param} must be an int, got {type(value).__name__} {value!r}.")


def _check_number(param: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(param, f"{param} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        _fail(param, f"{param} must be finite, got {value!r}.")
