"""Per-request decoding settings: how to pick each next token and when to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class SamplingParams:
    """How one request decodes.

    The default is greedy decoding (``temperature=0``): a RAG answer should be reproducible, and
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

    max_tokens: int = 16
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, list | tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        # Bad settings fail where they are written, not later in a server's stepping thread.
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0 or below the greedy cut-off)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`~ragkv.errors.InvalidInputError` naming the first bad setting.

        The error's ``param`` is the field's name. Construction already ran this without a
        vocabulary; the engine runs it again (fields are mutable) with ``vocab_size``, which
        also bounds ``stop_token_ids``.
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


def _fail(param: str, message: str) -> None:
    raise InvalidInputError(message, param=param)


def _check_int(param: str, value: object, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(param, f"{what or param} must be an int, got {type(value).__name__} {value!r}.")


def _check_number(param: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(param, f"{param} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        _fail(param, f"{param} must be finite, got {value!r}.")
