"""The chunk model: one retrieved passage, as text or raw bytes, plus its metadata."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ragkv.dedup.hashing import hasher
from ragkv.errors import InvalidChunkError, InvalidInputError

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def encode_text(text: str) -> bytes:
    """UTF-8 bytes of ``text``; lone surrogates are kept (``surrogatepass``) instead of crashing."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


@dataclass(slots=True)
class Chunk:
    """A retrieved passage.

    ``content`` is what the retriever returned: ``str`` or ``bytes``. Identity is always
    the byte string :attr:`data`; :attr:`text` is for display and tokenization only.
    ``source_id`` names the document the chunk came from (used to merge overlapping
    windows), ``score`` is the retriever's relevance score, ``metadata`` is anything else.
    """

    content: str | bytes
    source_id: str | None = None
    score: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # Caches, each valid while ``content`` is the very object it was computed from.
    _src: object = field(default=None, init=False, repr=False, compare=False)
    _data: bytes = field(default=b"", init=False, repr=False, compare=False)
    _digest_src: object = field(default=None, init=False, repr=False, compare=False)
    _digest_algo: str | None = field(default=None, init=False, repr=False, compare=False)
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        content = self.content
        if type(content) is not str and type(content) is not bytes:
            if isinstance(content, bytearray | memoryview):
                self.content = bytes(content)
            elif isinstance(content, str | bytes):  # subclasses: store the plain value
                self.content = str(content) if isinstance(content, str) else bytes(content)
            else:
                raise InvalidChunkError(_bad_type_message(content), param="chunks")
        if self.source_id is not None and not isinstance(self.source_id, str):
            raise InvalidInputError(
                f"Chunk.source_id must be str or None, got {type(self.source_id).__name__}"
            )
        if self.score is not None:
            self.score = _check_score(self.score)
        if not isinstance(self.metadata, dict):
            raise InvalidInputError(
                f"Chunk.metadata must be a dict, got {type(self.metadata).__name__}"
            )
        for key in self.metadata:
            if not isinstance(key, str):
                raise InvalidInputError(f"Chunk.metadata keys must be str, got {key!r}")

    @property
    def data(self) -> bytes:
        """The chunk's bytes: UTF-8 for text, the content itself for bytes."""
        content = self.content
        if isinstance(content, bytes):
            return content
        if self._src is not content:
            self._data = encode_text(content)
            self._src = content
        return self._data

    @property
    def text(self) -> str:
        """The chunk as text; invalid UTF-8 bytes are shown as U+FFFD (never used for identity).

        Text is a function of :attr:`data`: a string with lone surrogates reads as its bytes
        do (each invalid byte U+FFFD), so a str and a bytes chunk of the same bytes, which
        share one identity, also share one text and one tokenization.
        """
        content = self.content
        if isinstance(content, str):
            if content.isascii() or not _LONE_SURROGATE.search(content):
                return content
            return self.data.decode("utf-8", "replace")
        return content.decode("utf-8", "replace")

    def digest(self, algo: str = "blake3") -> bytes:
        """Content hash of :attr:`data` under ``algo``, cached on the chunk."""
        content = self.content
        if self._digest_src is not content or self._digest_algo != algo:
            self._digest = hasher(algo)(self.data)
            self._digest_algo = algo
            self._digest_src = content
        return self._digest

    @classmethod
    def coerce(cls, obj: object) -> Chunk:
        """Turn ``str`` / ``bytes`` / :class:`Chunk` into a Chunk; anything else is an error."""
        if isinstance(obj, Chunk):
            return obj
        if isinstance(obj, str | bytes | bytearray | memoryview):
            return cls(obj)  # type: ignore[arg-type]
        raise InvalidChunkError(_bad_type_message(obj), param="chunks")


def _check_score(score: object) -> float:
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise InvalidInputError(f"Chunk.score must be a number or None, got {score!r}")
    if math.isnan(score):
        raise InvalidInputError("Chunk.score is NaN; pass None for 'no score'")
    return score


def _bad_type_message(obj: object) -> str:
    if obj is None:
        return "chunk is None; pass str, bytes or ragkv.dedup.Chunk"
    return (
        f"chunk of type {type(obj).__module__}.{type(obj).__qualname__} is not supported; "
        "pass str, bytes or ragkv.dedup.Chunk (LangChain / LlamaIndex objects are "
        "converted by ragkv.integrations)"
    )


def make_chunk(
    content: str | bytes,
    source_id: str | None,
    score: float | None,
    metadata: dict[str, Any],
    digest_algo: str | None = None,
    digest: bytes = b"",
) -> Chunk:
    """Build a Chunk from parts that are already valid (dedup's hot path skips ``__post_init__``).

    ``digest`` (if given) is the hash of the content's bytes under ``digest_algo``, so a
    later :meth:`Chunk.digest` / registry lookup costs nothing.
    """
    chunk = object.__new__(Chunk)
    chunk.content = content
    chunk.source_id = source_id
    chunk.score = score
    chunk.metadata = metadata
    chunk._src = None
    chunk._data = b""
    chunk._digest_src = content if digest_algo is not None else None
    chunk._digest_algo = digest_algo
    chunk._digest = digest
    return chunk
