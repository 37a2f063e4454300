"""Structured system prompts: the application marks what changes, so nothing has to be learned.

``system`` may be a plain string (the assembler then learns its stable parts, see
:mod:`ragkv.assembler.slots`), a list of parts::

    system=["You are a support bot for ACME.\\n", Volatile("Today is 2026-12-01.\\n"),
            "Rules: answer from the context; ..."]

or a template whose substituted values are the volatile parts::

    system=SystemPrompt("You are {bot}. Today is {date}.\\nRules: ...", bot="Ava", date=today)

Stable parts stay in front, in their order (joined without separators, as written);
volatile parts move after the retrieved chunks, before history and question. The text the
model reads is the parts' concatenation with the volatile ones moved, so write each part
so that it reads well on its own (end it with a newline or a space).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.errors import InvalidInputError


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
    """A system prompt template: the template's text is stable, substituted values volatile.

    ``SystemPrompt("You are {bot}. Today is {date}.", bot="Ava", date="2026-12-01")``.
    Every ``{field}`` must be given; values are converted with ``str()``. A value that is
    the same on every request belongs in the template text itself.
    """

    __slots__ = ("template", "values")

    def __init__(self, template: str, **values: Any) -> None:
        if not isinstance(template, str):
            raise InvalidInputError("SystemPrompt's template must be a str.", param="system")
        self.template = template
        self.values = values
        self.parts()  # validate now, in the caller's thread

    def parts(self) -> list[str | Volatile]:
        """The template split into stable text and :class:`Volatile` values, in order."""
        parts: list[str | Volatile] = []
        try:
            parsed = list(string.Formatter().parse(self.template))
        except ValueError as exc:
            raise InvalidInputError(f"Bad SystemPrompt template: {exc}.", param="system") from exc
        for literal, name, spec, conversion in parsed:
            if literal and parts and isinstance(parts[-1], str):
                parts[-1] += literal  # "{{" splits one literal run in two
            elif literal:
                parts.append(literal)
            if name is None:
                continue
            if name not in self.values:
                raise InvalidInputError(
                    f"SystemPrompt template field {{{name}}} has no value; pass {name}=...",
                    param="system",
                )
            value = self.values[name]
            if conversion:
                value = {"r": repr, "s": str, "a": ascii}[conversion](value)
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
