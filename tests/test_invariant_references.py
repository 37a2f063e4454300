"""Every "Invariant N" the code, tests and docs cite is defined in docs/invariants.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("ragkv", "dedup", "assembler", "cache_engine", "kernels", "integrations", "tests")
CITATION = re.compile(r"\bInvariant (\d+)\b")


def defined() -> list[int]:
    text = (ROOT / "docs" / "invariants.md").read_text(encoding="utf-8")
    return [int(n) for n in re.findall(r"^(\d+)\. \*\*", text, flags=re.MULTILINE)]


def citations() -> dict[int, list[str]]:
    sources = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    sources += [p for p in (ROOT / "docs").glob("*.md") if p.name != "invariants.md"]
    cited: dict[int, list[str]] = {}
    for source in sources:
        for number in CITATION.findall(source.read_text(encoding="utf-8")):
            cited.setdefault(int(number), []).append(str(source.relative_to(ROOT)))
    return cited


def test_invariants_are_numbered_from_one_without_gaps():
    numbers = defined()
    assert numbers == list(range(1, len(numbers) + 1)) and numbers


def test_every_cited_invariant_is_defined():
    cited = citations()
    assert cited, "the code cites no invariant: is the pattern still right?"
    undefined = {n: where for n, where in cited.items() if n not in defined()}
    assert not undefined
