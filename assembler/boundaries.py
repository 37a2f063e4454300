"""Text boundaries: where the assembler may cut a system prompt (Invariant 10).

A learned split or a :class:`~ragkv.assembler.SystemPrompt` value moves part of the app's
system prompt after the retrieved context. The part must read on its own and what stays must
still read, so a cut falls only

- after a newline (``"...members.\\n" | "Rules: ..."``),
- after a CJK sentence end (``。``, ``？``, ``！``), or
- after a sentence end ``.``, ``?``, ``!`` (closing quotes or brackets may follow) that is
  followed by whitespace or the end, anywhere in that whitespace (``"It is 9." | " Rules"``),

never inside a word or a number (``3.14``, ``v1.2``, ``2026-12-05``). Cutting at the start or
the end of the text is always allowed (it cuts off nothing).
"""

from __future__ import annotations

_CJK_ENDS = frozenset("。？！")
_ENDS = frozenset(".?!")
_CLOSERS = frozenset("\"')]}»”’")
_SPACE = frozenset(" \t\u3000\u00a0")


def is_boundary(text: str, pos: int) -> bool:
    """Whether a cut between ``text[:pos]`` and ``text[pos:]`` is on a text boundary."""
    if pos <= 0 or pos >= len(text):
        return True
    before = text[pos - 1]
    if before == "\n" or before in _CJK_ENDS:
        return True
    # Inside or at the start of a whitespace run that follows a sentence end.
    i = pos
    while i > 0 and text[i - 1] in _SPACE:
        i -= 1
    if i == pos and not text[pos].isspace():
        return False  # "9.|5" or "end.|Next": no whitespace after the terminator
    while i > 0 and text[i - 1] in _CLOSERS:
        i -= 1
    return i > 0 and text[i - 1] in _ENDS


def last_boundary(text: str, pos: int) -> int:
    """The largest boundary ``<= pos`` (0 at worst)."""
    pos = min(max(pos, 0), len(text))
    while not is_boundary(text, pos):
        pos -= 1
    return pos


def next_boundary(text: str, pos: int) -> int:
    """The smallest boundary ``>= pos`` (``len(text)`` at worst)."""
    pos = min(max(pos, 0), len(text))
    while not is_boundary(text, pos):
        pos += 1
    return pos
