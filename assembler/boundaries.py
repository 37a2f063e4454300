"""Text boundaries: where the assembler may cut a system prompt (Invariant 10).

A learned split or a :class:`~ragkv.assembler.SystemPrompt` value moves part of the app's
system prompt after the retrieved context. The part must read on its own and what stays must
still read, so a cut falls only

- after a newline (``"...members.\\n" | "Rules: ..."``),
- after a CJK sentence end (``。``, ``？``, ``！``) and the closing quotes or brackets that
  follow it (``“你好。”`` stays whole), or
- after a sentence end ``.``, ``?``, ``!`` (closing quotes or brackets may follow) that is
  followed by whitespace or the end, anywhere in that whitespace (``"It is 9." | " Rules"``),

never inside a word or a number (``3.14``, ``v1.2``, ``2026-12-05``). A period after a
common abbreviation (``Dr.``, ``e.g.``), an initial (``J. Smith``) or a list number at the
start of a line (``2. The customer ...``) ends no sentence. Cutting at the start or the end
of the text is always allowed (it cuts off nothing).
"""

from __future__ import annotations

import re

_CJK_ENDS = frozenset("。？！")
_ENDS = frozenset(".?!")
_CLOSERS = frozenset("\"')]}»”’")
_SPACE = frozenset(" \t\u3000\u00a0")
# Case-sensitive: "No. 5" is an abbreviation, "say no. Then" ends a sentence.
_ABBREVIATIONS = frozenset(
    {"Mr", "Mrs", "Ms", "Dr", "Prof", "Sr", "Jr", "St", "Mt", "Fig", "No", "Nos", "Vol"}
    | {"Inc", "Ltd", "Co", "Corp", "Dept", "vs", "cf", "e.g", "i.e", "approx"}
    | {"Jan", "Feb", "Mar", "Apr", "Jun", "Jul", "Aug", "Sep", "Sept", "Oct", "Nov", "Dec"}
)
# The word before a period: letters, digits and inner periods ("e.g", "U.S", "2", "Dr").
_LOOK_BACK = 64  # characters any one check looks back (bounded work per position)
_WORD_BEFORE = re.compile(r"([\w.]*\w)$")


def is_boundary(text: str, pos: int) -> bool:
    """Whether a cut between ``text[:pos]`` and ``text[pos:]`` is on a text boundary."""
    if pos <= 0 or pos >= len(text):
        return True
    if text[pos] in _CLOSERS:
        return False  # a closing quote or bracket stays with what it closes
    i, floor = pos, max(0, pos - _LOOK_BACK)
    while i > floor and text[i - 1] in _CLOSERS:
        i -= 1
    before = text[i - 1] if i > 0 else ""
    if (before == "\n" and i == pos) or before in _CJK_ENDS:
        return True
    # Inside or at the start of a whitespace run that follows a sentence end (looked at up to
    # _LOOK_BACK characters back: every check here is bounded, whatever the text).
    i, floor = pos, max(0, pos - _LOOK_BACK)
    while i > floor and text[i - 1] in _SPACE:
        i -= 1
    if i == pos and not text[pos].isspace():
        return False  # "9.|5" or "end.|Next": no whitespace after the terminator
    while i > floor and text[i - 1] in _CLOSERS:
        i -= 1
    if i == 0 or text[i - 1] not in _ENDS:
        return False
    return text[i - 1] != "." or not _no_sentence_end(text, i - 1)


def _no_sentence_end(text: str, dot: int) -> bool:
    """Whether the period at ``dot`` closes an abbreviation, an initial or a list number."""
    match = _WORD_BEFORE.search(text, max(0, dot - _LOOK_BACK), dot)
    if match is None:
        return False
    word = match.group(1)
    if word in _ABBREVIATIONS or (len(word) == 1 and word.isupper()):
        return True
    if not word.isdigit():
        return False
    start = match.start()
    before = text[max(0, start - _LOOK_BACK) : start]  # a list number starts its line
    line = before.rsplit("\n", 1)
    return not line[-1].strip() and (len(line) == 2 or start <= _LOOK_BACK)


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
