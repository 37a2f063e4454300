"""Token ids to streamed text, one token at a time, with stop conditions."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ragkv.cache_engine.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token so that leading-space rules
# (SentencePiece "▁" stripped only at the start of a text) see the output as a continuation.
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decide:
    """Marker: the detokenizer decides stop tokens and length itself (standalone use)."""


DECIDE = Decide()


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, and decides when it stops.

    Each :meth:`add` decodes only a small window of ids (vLLM/TGI's ``prefix_offset`` /
    ``read_offset`` technique): the text of ``ids[prefix_offset:]`` minus the text of
    ``ids[prefix_offset:read_offset]`` is what the new token added. While that text ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) the token is held back, so a character split
    across byte-level tokens is emitted whole, never as "\\ufffd".

    Generation stops on EOS (``eos_token_ids``, default the tokenizer's; not with
    ``params.ignore_eos``), on ``params.stop_token_ids``, on a ``params.stop`` string (found even
    when it spans tokens, cut from the text unless ``include_stop_str_in_output``) and after
    ``params.max_tokens`` tokens. Until then up to ``len(longest stop) - 1`` characters are held
    back, so a streaming client never sees text that is later cut. The :meth:`add` call that
    finishes returns everything still held back; when the engine ends a request for its own
    reasons (abort, context limit), call :meth:`flush` for the rest.

    Decoding never applies ``clean_up_tokenization_spaces``: it is not incremental.
    Concatenated deltas equal ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for
    byte-level BPE tokenizers (up to a stop string).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.params = params
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" or "length"
        self.stop_reason: str | int | None = None  # the stop string or stop token id that matched
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos]
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        # Built here, in the caller's thread: the stepping thread only runs the search.
        self._stops = StopMatcher(params.stop)
        # A stop string that is kept in the output can be streamed as it forms.
        longest = self._stops.max_len
        self._hold = 0 if params.include_stop_str_in_output else max(longest - 1, 0)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text = ""
        self._searched_upto = 0  # no stop string ends before this index of _text
        self._emitted = 0
        self._finished = False

    @property
    def text(self) -> str:
        """All output text decoded so far (the final text once finished)."""
        return self._text

    @property
    def finished(self) -> bool:
        return self._finished

    def add(self, token_id: int, engine_reason: str | None | Decide = DECIDE) -> str:
        """Take the next generated token; return the text it releases ("" if none yet).

        ``engine_reason`` is the engine's decision for this token, made once, by its
        scheduler: ``"stop"`` (a stop token), ``"length"`` (the last token allowed) or None
        (it goes on); then only stop strings are looked for here. Standalone, this decides
        the same itself. After the request finished, further tokens are ignored.
        """
        if self._finished:
            return ""
        self.output_token_ids.append(token_id)
        if isinstance(engine_reason, Decide):
            engine_reason = self._decide(token_id)
        ends = engine_reason == "stop"
        stop_id = ends and token_id in self._stop_ids
        if not ends or (stop_id and self.params.include_stop_str_in_output):
            self._ids.append(token_id)
        last = engine_reason is not None
        if self._decode_window(force=last) and self._find_stop_string():
            return self._release()
        if ends:
            self._finish("stop", token_id if stop_id else None)
        elif last:
            self._finish("length", None)
        return self._release()

    def _decide(self, token_id: int) -> str | None:
        """The scheduler's rule, for standalone use: stop token, then the length limit."""
        if token_id in self._stop_ids or token_id in self._eos:
            return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens:
            return "length"
        return None

    def flush(self) -> str:
        """Finish now (the engine's own reason) and return all text still held back."""
        if not self._finished:
            if self._decode_window(force=True):
                self._find_stop_string()
            self._finished = True
        return self._release()

    def _decode_window(self, force: bool) -> int:
        """Append the text of the tokens past ``read_offset``; return how many chars it added.

        Holds the tokens back while they end in an incomplete character, unless ``force``.
        """
        if self._read_offset == len(self._ids):
            return 0
        new_text = self._decode(self._ids[self._prefix_offset :])
        complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(_INCOMPLETE)
        if not (complete or force):
            return 0
        added = new_text[len(self._prefix_text) :]
        self._text += added
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return len(added)

    def _find_stop_string(self) -> bool:
        """Finish on the earliest stop string that ends in the newly added text."""
        best = self._stops.search(self._text, self._searched_upto)
        self._searched_upto = len(self._text)
        if best is None:
            return False
        at, stop = best
        end = at + len(stop) if self.params.include_stop_str_in_output else at
        self._text = self._text[:end]
        self._finish("stop", stop)
        return True

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self._finished = True

    def _release(self) -> str:
        end = len(self._text) if self._finished else len(self._text) - self._hold
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta


class StopMatcher:
    """The earliest of a few stop strings in a text that only grows at its end.

    One compiled alternation of the escaped strings, in the given order: the regex engine
    returns the leftmost match, and at one position the first listed string that matches,
    which is exactly "earliest start, ties to the first listed". Each search starts
    ``max_len - 1`` characters before the already searched end (no earlier match can exist:
    it would have ended the request), so a token costs a scan of ``max_len + len(new text)``
    characters, never the whole text and not once per stop string.
    """

    __slots__ = ("max_len", "_pattern")

    def __init__(self, stops: Sequence[str]) -> None:
        self.max_len = max(map(len, stops), default=0)
        self._pattern = re.compile("|".join(map(re.escape, stops))) if stops else None

    def search(self, text: str, searched_upto: int) -> tuple[int, str] | None:
        """``(start, stop)`` of the earliest match ending past ``searched_upto``, or None."""
        if self._pattern is None:
            return None
        match = self._pattern.search(text, max(searched_upto - self.max_len + 1, 0))
        return None if match is None else (match.start(), match.group())


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer directly: no Python-side clean-up pass, a few µs per window.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
