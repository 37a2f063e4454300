"""Optional canonicalization applied to a chunk's bytes before hashing (never to the output).

Off by default: byte-exact means byte-exact. Invalid UTF-8 survives both modes unchanged
(it is carried through as surrogate escapes), so normalizing never crashes or merges
different invalid byte sequences.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

from ragkv.errors import ConfigError

NORMALIZE_MODES: tuple[str | None, ...] = (None, "nfc", "whitespace")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def nfc(data: bytes) -> bytes:
    """Unicode NFC (composed) form, e.g. ``e`` + combining acute == ``é``."""
    if data.isascii():
        return data
    text = _decode(data)
    if unicodedata.is_normalized("NFC", text):
        return data
    return _encode(unicodedata.normalize("NFC", text))


def whitespace(data: bytes) -> bytes:
    """Collapse every run of (Unicode) whitespace to one space and strip both ends."""
    return _encode(" ".join(_decode(data).split()))


def normalizer(mode: str | None) -> Callable[[bytes], bytes] | None:
    """The canonicalization function for ``mode``, or None when off."""
    if mode is None:
        return None
    if mode == "nfc":
        return nfc
    if mode == "whitespace":
        return whitespace
    raise ConfigError(f"unknown normalize {mode!r}; choose None, 'nfc' or 'whitespace'")
