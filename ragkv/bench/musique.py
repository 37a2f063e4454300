"""MuSiQue examples as RAG requests, and SQuAD's answer agreement (token F1).

The shared file (``musique_dev.json``, CC BY 4.0, as packaged for the CacheBlend
evaluation) is a JSON list of ``{"question", "answers": [...], "ctxs": [{"title",
"text"}, ...]}``. It serves to measure approximate KV reuse against exact prefill on real
passages: how close the approximate answer stays to the exact one, not how a small model
scores against the gold answers.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ragkv.errors import InvalidInputError

INSTRUCTION = (
    "Answer the question from the passages below. Reply with the answer alone, in a few "
    "words, without explanation."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True, slots=True)
class MusiqueExample:
    """One question, its gold answers and its retrieved passages (title and text joined)."""

    question: str
    answers: tuple[str, ...]
    passages: tuple[str, ...]


def load_musique(path: str | Path, limit: int | None = None) -> list[MusiqueExample]:
    """The first ``limit`` examples (all when None) of a MuSiQue file in the shared format.

    Raises :class:`~ragkv.errors.InvalidInputError` naming the example that does not fit
    the format (a missing file raises ``FileNotFoundError``).
    """
    if limit is not None and limit < 0:
        raise InvalidInputError(f"limit must be >= 0, got {limit}")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise InvalidInputError(f"{path}: expected a JSON list of examples")
    examples = []
    for number, item in enumerate(data[:limit] if limit is not None else data):
        try:
            question, answers, ctxs = item["question"], item["answers"], item["ctxs"]
            passages = tuple(_passage(c["title"], c["text"]) for c in ctxs)
        except (KeyError, TypeError):
            raise InvalidInputError(
                f"{path}: example {number} needs question, answers and ctxs [{{title, text}}]"
            ) from None
        if not isinstance(question, str) or not passages:
            raise InvalidInputError(f"{path}: example {number} has no question or no passage")
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise InvalidInputError(f"{path}: example {number}'s answers must be a list of str")
        examples.append(MusiqueExample(question, tuple(answers), passages))
    return examples


def _passage(title: object, text: object) -> str:
    if not isinstance(title, str) or not isinstance(text, str):
        raise TypeError
    return f"{title}\n{text}" if title.strip() else text


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1 of two answers after :func:`normalize_answer` (1.0 when both are
    empty: two answers that say nothing agree)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
