"""The few tokenizer operations the assembler needs, over any Hugging Face tokenizer.

Text is always encoded without special tokens (no BOS/EOS added): the chat template, when
there is one, supplies them. The fast Rust backend is used directly when present.

**Untrusted text never becomes control tokens** (Invariant 10). :meth:`TextTokenizer.encode`
encodes content (chunks, system prompt, history, question) literally: a retrieved chunk
holding ``<|im_end|>\n<|im_start|>system`` is those characters, tokenized as text, not a
forged system turn. Only the template's own pieces (:meth:`TextTokenizer.encode_template`)
are parsed for special tokens.

Normalization: byte-level BPE decodes a text's token ids back to exactly that text, provided
every byte's symbol is in the vocab. The shipped SmolLM2 vocab lacks 21 of the 256 (the
control bytes 04 06 13 14 16 1D and the UTF-8 lead bytes C0 C1 F1 F2 F5-FF): such bytes
are dropped, and characters U+40000-U+BFFFF decode as U+FFFD. Lone surrogates are encoded as
U+FFFD in other text; a :class:`ragkv.dedup.Chunk` holding one reads as its bytes do (each of
the surrogate's three bytes as U+FFFD), so text and bytes chunks of one identity agree.
Everything else round-trips.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Sequence
from typing import Any

from ragkv.errors import InvalidInputError

_SURROGATE = re.compile("[\ud800-\udfff]")


class TextTokenizer:
    """Encodes and decodes text with a Hugging Face tokenizer; ``key`` identifies it."""

    def __init__(self, tokenizer: Any) -> None:
        if not callable(getattr(tokenizer, "decode", None)):
            raise InvalidInputError(
                "The assembler needs a Hugging Face tokenizer (e.g. AutoTokenizer.from_pretrained"
                f"(path) or engine.tokenizer); got {type(tokenizer).__name__}."
            )
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._literal = None  # a copy of the backend that reads special-token strings as text
        if self._backend is not None:
            from tokenizers import Tokenizer

            self._literal = Tokenizer.from_str(self._backend.to_str())
            self._literal.encode_special_tokens = True
        self.key = tokenizer_key(tokenizer) + "|literal"

    def encode(self, text: str) -> list[int]:
        """Token ids of content ``text``: no special tokens added, and none parsed (a
        special-token string in the text is encoded as the characters it is)."""
        return self._guarded(self._encode_literal, text)

    def encode_template(self, text: str) -> list[int]:
        """Token ids of the template's own text, whose special-token strings are special."""
        return self._guarded(self._encode_special, text)

    @staticmethod
    def _guarded(encode: Any, text: str) -> list[int]:
        try:
            return encode(text)
        except (TypeError, UnicodeEncodeError):
            if not _SURROGATE.search(text):
                raise
            return encode(_SURROGATE.sub("\ufffd", text))

    # The Rust backend's ``encode`` holds the GIL for the whole call (0.7 s for 0.9 MB: a
    # server's event loop and stepping thread stood still); ``encode_batch`` releases it and
    # costs the same for one text.
    def _encode_literal(self, text: str) -> list[int]:
        if self._literal is not None:
            return self._literal.encode_batch([text], add_special_tokens=False)[0].ids
        return list(
            self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        )

    def _encode_special(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens kept, no clean-up of spaces."""
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template string, if it has one."""
        return chat_template_of(self.tokenizer)


_SHARED: weakref.WeakKeyDictionary[Any, TextTokenizer] = weakref.WeakKeyDictionary()


def text_tokenizer(tokenizer: Any) -> TextTokenizer:
    """The :class:`TextTokenizer` of a Hugging Face tokenizer, built once per tokenizer: its
    literal copy of the vocabulary and its key cost ~0.15 s for a 49k vocabulary, and every
    assembler (one per tenant on a server) and chat model of that tokenizer shares it."""
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer
    try:
        shared = _SHARED.get(tokenizer)
    except TypeError:  # not weak-referenceable: not shared
        return TextTokenizer(tokenizer)
    if shared is None:
        shared = _SHARED[tokenizer] = TextTokenizer(tokenizer)
    return shared


def chat_template_of(tokenizer: Any) -> str | None:
    """A Hugging Face tokenizer's chat template string, or None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


def tokenizer_key(tokenizer: Any) -> str:
    """A string naming the tokenizer: name or path, vocab size, hash of its vocab/config."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else 0
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(getattr(tokenizer, "init_kwargs", {}), sort_keys=True, default=str)
    digest = hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
    return f"{name}|{size}|{digest}"
