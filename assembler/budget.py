"""The token budget: which chunks to leave out when a prompt exceeds ``max_prompt_tokens``.

Chunks are dropped whole, never cut: volatile (rare) chunks before stable ones, and within
each class the least relevant first (lowest score, then latest retrieval rank). The
non-chunk part of the prompt is never dropped; if it alone exceeds the budget, that is an
error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragkv.assembler.segments import Segment, Stability
from ragkv.errors import PromptTooLongError


def fit_budget(
    chunks: Sequence[Segment], max_tokens: int, length: Callable[[Sequence[Segment]], int]
) -> tuple[list[Segment], list[Segment]]:
    """Split ``chunks`` into (kept, dropped) so that ``length(kept) <= max_tokens``.

    ``length(chunks)`` is the prompt length with exactly those chunks.
    """
    if length(chunks) <= max_tokens:
        return list(chunks), []
    floor = length(())
    if floor > max_tokens:
        raise PromptTooLongError(
            f"The prompt needs {floor} tokens without any retrieved chunk, over "
            f"max_prompt_tokens={max_tokens}; shorten the system prompt, history or question, "
            "or raise the budget."
        )
    victims = sorted(chunks, key=lambda s: (s.stability is Stability.STABLE, s.relevance))
    dropped: set[int] = set()
    kept = list(chunks)
    for victim in victims:
        dropped.add(id(victim))
        kept = [s for s in chunks if id(s) not in dropped]
        if length(kept) <= max_tokens:
            break
    return kept, [s for s in chunks if id(s) in dropped]
