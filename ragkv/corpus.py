"""The bundled demo corpus: CPython's own reference docs, chunked as a RAG splitter would.

``pydoc_data.topics`` ships with every CPython install (the text behind ``help("if")``),
so the demo and the benchmarks have real documentation to retrieve from, offline.
"""

from __future__ import annotations

from functools import cache

from ragkv.dedup import Chunk
from ragkv.errors import ConfigError


def topics() -> dict[str, str]:
    """Topic name -> documentation text, from ``pydoc_data.topics``."""
    from pydoc_data.topics import topics as pydoc_topics

    return dict(sorted(pydoc_topics.items()))


def split_windows(text: str, size: int = 800, overlap: int = 200) -> list[str]:
    """Overlapping character windows (a plain sliding-window splitter); the last may be shorter."""
    if size <= 0 or not 0 <= overlap < size:
        raise ConfigError(f"need size > 0 and 0 <= overlap < size, got {size}, {overlap}")
    step = size - overlap
    windows = []
    for start in range(0, max(len(text) - overlap, 1), step):
        windows.append(text[start : start + size])
    return windows


@cache
def _windows(size: int, overlap: int) -> tuple[tuple[str, int, str], ...]:
    return tuple(
        (name, i, window)
        for name, text in topics().items()
        for i, window in enumerate(split_windows(text, size, overlap))
    )


def demo_corpus(size: int = 800, overlap: int = 200) -> list[Chunk]:
    """Every topic split into ``size``-character windows overlapping by ``overlap``.

    Each chunk's ``source_id`` is its topic; ``metadata`` has ``topic`` and ``window``.
    Fresh :class:`Chunk` objects on every call (callers may mutate metadata).
    """
    return [
        Chunk(window, source_id=name, metadata={"topic": name, "window": i})
        for name, i, window in _windows(size, overlap)
    ]
