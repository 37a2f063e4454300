"""Structured system prompts: the application marks what changes, so nothing has to be learned.

``system`` may be a plain string (the assembler then learns its stable parts, see
:mod:`ragkv.assembler.slots`), a list of parts::

    system=["You are a support bot for ACME.\\n", Volatile("Today is 2026-12-01.\\n"),
            "Rules: answer from the context; ..."]

or a template whose substituted values make their sentences volatile::

    system=SystemPrompt("You are {bot}. Today is {date}.\\nRules: ...", bot="Ava", date=today)

A value never moves alone: the whole sentence or line that holds it moves, label included
(``"Today is 2026-12-01."``), cut on text boundaries (:mod:`ragkv.assembler.boundaries`).

Stable parts stay in front, in their order (joined without separators, as written);
volatile parts move after the retrieved chunks, before history and question. The text the
model reads is the parts' concatenation with the volatile ones moved, so write each part
so that it reads well on its own (end it with a newline or a space).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.assembler.boundaries import last_boundary, next_boundary
from ragkv.errors import InvalidInputError

# str.format's ``!r``, ``!s`` and ``!a`` conversions.
_CONVERSIONS: dict[str, Callable[[object], str]] = {"r": repr, "s": str, "a": ascii}


@dataclass(slots=True, frozen=True)
class Volatile:
    """A part of a system prompt that changes between requests (a date, a user's name)."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise InvalidInputError(
                f"Volatile(...) takes a str, got {type(self.text).__name__}.", param="system"
            )


class SystemPrompt:
    """A system prompt template whose substituted values change between requests.

    ``SystemPrompt("You are {bot}. Today is {date}.", bot="Ava", date="2026-12-01")``.
    Every ``{field}`` must be given; values are converted with ``str()``. Each sentence or
    line that holds a value is volatile as a whole (``"Today is 2026-12-01."``); the rest of
    the template is stable. A value that is the same on every request belongs in the template
    text itself. Literal braces are written doubled (``{{`` and ``}}``).
    """

    __slots__ = ("template", "values")

    def __init__(self, template: str, **values: Any) -> None:
        if not isinstance(template, str):
            raise InvalidInputError("SystemPrompt's template must be a str.", param="system")
        self.template = template
        self.values = values
        self.parts()  # validate now, in the caller's thread

    def parts(self) -> list[str | Volatile]:
        """The prompt split into stable text and :class:`Volatile` sentences, in order: the
        parts' texts joined are the formatted prompt, byte for byte."""
        pieces = self._pieces()
        text = "".join(p if isinstance(p, str) else p.text for p in pieces)
        spans: list[list[int]] = []  # volatile [start, end), widened to whole sentences
        pos = 0
        for piece in pieces:
            size = len(piece if isinstance(piece, str) else piece.text)
            if isinstance(piece, Volatile):
                start, end = last_boundary(text, pos), next_boundary(text, pos + size)
                rest = text[end:]
                line_end = re.match(r"[ \t]*\r?\n", rest)
                if line_end:  # the line ends here: take its newline along
                    end += line_end.end()
                if spans and start <= spans[-1][1]:
                    spans[-1][1] = max(spans[-1][1], end)
                else:
                    spans.append([start, end])
            pos += size
        parts: list[str | Volatile] = []
        pos = 0
        for start, end in spans:
            if start > pos:
                parts.append(text[pos:start])
            parts.append(Volatile(text[start:end]))
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _pieces(self) -> list[str | Volatile]:
        """The template's literal runs and the bare formatted values, in order."""
        parts: list[str | Volatile] = []
        try:
            parsed = list(string.Formatter().parse(self.template))
        except ValueError as exc:
            raise InvalidInputError(
                f"Bad SystemPrompt template: {exc}. Write a literal brace doubled: {{{{ or }}}}.",
                param="system",
            ) from exc
        for literal, name, spec, conversion in parsed:
            if literal and parts and isinstance(parts[-1], str):
                parts[-1] += literal  # "{{" splits one literal run in two
            elif literal:
                parts.append(literal)
            if name is None:
                continue
            if name not in self.values:
                raise InvalidInputError(
                    f"SystemPrompt template field {{{name}}} has no value; pass {name}=... "
                    "(for literal braces in the text, double them: {{ and }})",
                    param="system",
                )
            value = self.values[name]
            if conversion:
                value = _CONVERSIONS[conversion](value)
            parts.append(Volatile(format(value, spec or "")))
        return parts

    def __str__(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts())

    def __repr__(self) -> str:
        return f"SystemPrompt({self.template!r}, **{self.values!r})"


SystemLike = str | SystemPrompt | Sequence[str | Volatile]


def system_parts(system: SystemLike | None) -> list[str | Volatile]:
    """The parts of any accepted ``system`` value (empty parts dropped)."""
    if system is None:
        return []
    if isinstance(system, str):
        return [system] if system else []
    if isinstance(system, SystemPrompt):
        parts = system.parts()
    elif isinstance(system, Sequence):
        parts = list(system)
    else:
        raise InvalidInputError(
            "system must be a str, a list of str / Volatile parts, or a SystemPrompt; got "
            f"{type(system).__name__}.",
            param="system",
        )
    for i, part in enumerate(parts):
        if not isinstance(part, str | Volatile):
            raise InvalidInputError(
                f"system[{i}] must be a str or Volatile, got {type(part).__name__}.",
                param="system",
            )
    return [p for p in parts if (p if isinstance(p, str) else p.text)]
