"""Benchmark workloads: lists of requests as a RAG application would send them, before dedup.

- :func:`synthetic_workload`: questions over the bundled corpus with Zipf topic popularity,
  multi-query BM25 retrieval (duplicates kept), multi-turn sessions and an optional
  per-request timestamp in the system prompt. Seeded: the same config gives the same list.
- :func:`trace_workload`: replay of a JSONL trace of segment ids (see docs/benchmarks.md,
  "Benchmark"), each id turned into a deterministic token sequence of its listed length.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ragkv.corpus import demo_corpus, topics
from ragkv.dedup import Chunk
from ragkv.errors import ConfigError, InvalidInputError

SYSTEM_PROMPT = (
    "You are a concise assistant for Python questions. Answer from the context documents; "
    "if they do not contain the answer, say so."
)
_WORD = re.compile(r"[A-Za-z_][A-Za-z_]{3,}")
_STOP = frozenset(
    [
        "this",
        "that",
        "with",
        "from",
        "have",
        "which",
        "their",
        "there",
        "these",
        "those",
        "when",
        "then",
        "than",
        "into",
        "also",
        "such",
        "only",
        "other",
        "some",
        "must",
        "will",
        "what",
        "been",
        "being",
        "were",
        "does",
        "each",
        "more",
        "most",
        "same",
        "used",
        "uses",
    ]
)


@dataclass(slots=True)
class RequestSpec:
    """One request: system prompt, retrieved chunks (retrieval order, duplicates kept), question.

    ``system`` is anything the assembler accepts (a string, or a list of parts for a trace
    that logs its system prompt in segments).

    ``history`` is fixed by the workload (trace) or ``None``: the lane then uses its own
    question/answer turns of the same ``session_id`` so far (synthetic follow-ups).
    """

    index: int
    session_id: str
    system: Any
    question: str
    chunks: list[Chunk]
    history: list[dict[str, str]] | None = None
    topic: str = ""
    follow_up: bool = False


@dataclass(slots=True)
class Workload:
    """A named list of requests plus the knobs that produced it (reported in the JSON)."""

    name: str
    requests: list[RequestSpec]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SyntheticConfig:
    """Knobs of :func:`synthetic_workload`; the defaults are the benchmark's default workload.

    ``chunk_size``/``chunk_overlap`` default to 400/100 characters (the demo corpus uses
    800/200) so that 200 requests x 4 lanes fit the CPU time budget with the default model.
    """

    requests: int = 200
    topics: int = 50
    zipf_s: float = 1.1
    query_variants: int = 3
    top_k: int = 4
    follow_up_rate: float = 0.2
    timestamp: bool = True
    questions_per_topic: int = 4
    chunk_size: int = 400
    chunk_overlap: int = 100
    seed: int = 0

    def validate(self) -> None:
        if self.requests < 1 or self.topics < 1 or self.top_k < 1 or self.query_variants < 1:
            raise ConfigError("requests, topics, top_k and query_variants must be >= 1")
        if self.questions_per_topic < 1:
            raise ConfigError("questions_per_topic must be >= 1")
        if not 0.0 <= self.follow_up_rate <= 1.0:
            raise ConfigError(f"follow_up_rate must be in [0, 1], got {self.follow_up_rate}")
        if self.zipf_s < 0:
            raise ConfigError(f"zipf_s must be >= 0, got {self.zipf_s}")


@dataclass(slots=True)
class _Intent:
    """One thing a user asks about a topic: the question and its retrieval phrasings."""

    question: str
    variants: list[str]


def synthetic_workload(config: SyntheticConfig | None = None) -> Workload:
    """The seeded synthetic workload over the bundled corpus (see :class:`SyntheticConfig`)."""
    from ragkv.bench.retrieval import BM25Retriever

    config = config or SyntheticConfig()
    config.validate()
    rng = random.Random(config.seed)
    corpus = demo_corpus(config.chunk_size, config.chunk_overlap)
    retriever = BM25Retriever(corpus)
    texts = topics()
    eligible = [name for name, text in texts.items() if len(text) >= config.chunk_size]
    chosen = rng.sample(eligible, min(config.topics, len(eligible)))  # Zipf rank = list order
    weights = [1.0 / (rank + 1) ** config.zipf_s for rank in range(len(chosen))]
    intents = {
        name: _intents(name, texts[name], config.questions_per_topic, config.query_variants)
        for name in chosen
    }
    start = datetime(2025, 1, 6, 9, 0, 0, tzinfo=UTC)
    sessions: list[tuple[str, str]] = []  # (session id, topic), most recent last
    requests = []
    for index in range(config.requests):
        follow_up = bool(sessions) and rng.random() < config.follow_up_rate
        if follow_up:
            session_id, topic = rng.choice(sessions[-8:])
        else:
            topic = rng.choices(chosen, weights)[0]
            session_id = f"s{len(sessions)}"
            sessions.append((session_id, topic))
        intent = rng.choice(intents[topic])
        system = SYSTEM_PROMPT
        if config.timestamp:
            start += timedelta(seconds=rng.randint(1, 90))
            system += f"\nCurrent time: {start.isoformat(timespec='seconds')}"
        retrieved = retriever.multi_query(intent.variants, config.top_k)
        requests.append(
            RequestSpec(
                index=index,
                session_id=session_id,
                system=system,
                question=intent.question,
                chunks=[
                    Chunk(c.text, source_id=c.source_id, metadata=dict(c.metadata))
                    for c in retrieved
                ],
                topic=topic,
                follow_up=follow_up,
            )
        )
    params = {"kind": "synthetic", **asdict(config)}
    params["num_sessions"] = len(sessions)
    return Workload("synthetic", requests, params)


_QUESTIONS = (
    "What does the Python reference say about {title}?",
    "Can you explain {title} in Python, with an example?",
    "What are the exact rules for {title} in Python?",
    "What are common mistakes with {title} in Python?",
    "How is {title} evaluated step by step in Python?",
)


def _intents(name: str, text: str, count: int, variants: int) -> list[_Intent]:
    """Questions about one topic, phrased around its title ("The "for" statement").

    Each question's retrieval variants are the question itself, then sentences and
    keywords from the topic's text, as a multi-query retriever's rewrites would be.
    """
    title = _title(name, text)
    sentences = _sentences(text)
    intents = []
    for i in range(min(count, len(_QUESTIONS))):
        question = _QUESTIONS[i].format(title=title)
        sentence = sentences[i % len(sentences)] if sentences else title
        words = [w for w in _WORD.findall(sentence) if w.lower() not in _STOP][:5]
        options = [question, f"{title} {' '.join(words)}", sentence]
        intents.append(_Intent(question, _cycle(options, variants)))
    return intents


def _title(name: str, text: str) -> str:
    """The topic's heading, first letter lower-cased unless it starts a quoted keyword."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), name)
    return first[0].lower() + first[1:] if first[:1].isupper() and first[1:2].islower() else first


def _sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if 6 <= len(s.split()) <= 40]


def _cycle(options: Sequence[str], n: int) -> list[str]:
    return [options[i % len(options)] for i in range(n)]


# -- trace replay ---------------------------------------------------------------------------

ROLES = ("system", "passages", "history", "user")


def trace_workload(
    trace_path: str | Path, lengths_path: str | Path, tokenizer: Any, *, seed: int = 0
) -> Workload:
    """Requests from a JSONL trace of segment ids plus a JSON table ``{id: token length}``.

    Each line: ``{"session_id": str, "system": [ids], "passages": [ids], "history": [ids],
    "user": [ids]}`` (missing roles are empty; ``history`` alternates user/assistant turns).
    Every id becomes the same ``length`` tokens in every request (seeded by ``seed`` and the
    id), drawn from whole-word tokens of ``tokenizer`` so the text re-tokenizes exactly. The
    system prompt is a list of parts, one per id (the text has no sentences for a learned
    split to cut at; a logged segment is the unit the app itself changed).
    """
    lengths = _read_lengths(lengths_path)
    vocab = word_vocabulary(tokenizer)
    texts: dict[str, str] = {}

    def text(segment_id: str) -> str:
        if segment_id not in texts:
            if segment_id not in lengths:
                raise InvalidInputError(f"segment id {segment_id!r} has no entry in {lengths_path}")
            texts[segment_id] = segment_text(segment_id, lengths[segment_id], vocab, seed)
        return texts[segment_id]

    requests = []
    for index, line in enumerate(_read_lines(trace_path)):
        ids = {role: _ids(line, role, trace_path, index) for role in ROLES}
        roles = ("user", "assistant")
        history = [{"role": roles[i % 2], "content": text(s)} for i, s in enumerate(ids["history"])]
        if not ids["user"]:
            raise InvalidInputError(f"{trace_path}: request {index} has no 'user' segment")
        requests.append(
            RequestSpec(
                index=index,
                session_id=str(line.get("session_id", f"r{index}")),
                system=[text(s) for s in ids["system"]],  # one part per id: see ragpulse
                question="".join(text(s) for s in ids["user"]),
                chunks=[Chunk(text(s), source_id=s) for s in ids["passages"]],
                history=history,
                follow_up=bool(history),
            )
        )
    params = {
        "kind": "trace",
        "trace": str(trace_path),
        "lengths": str(lengths_path),
        "seed": seed,
        "requests": len(requests),
        "num_sessions": len({r.session_id for r in requests}),
    }
    return Workload("trace", requests, params)


def word_vocabulary(tokenizer: Any) -> list[str]:
    """Tokens that are one lower-case word after a space and re-tokenize to themselves."""
    candidates = []
    for token_id in range(len(tokenizer)):
        word = tokenizer.decode([token_id])
        if re.fullmatch(r" [a-z]{2,}", word):
            candidates.append((token_id, word))
    encoded = tokenizer([w for _, w in candidates], add_special_tokens=False)["input_ids"]
    words = sorted({w for (t, w), ids in zip(candidates, encoded, strict=True) if ids == [t]})
    if len(words) < 16:
        raise ConfigError("the tokenizer has too few whole-word tokens to synthesize trace text")
    return words


def segment_text(segment_id: str, length: int, vocab: Sequence[str], seed: int = 0) -> str:
    """``length`` whole-word tokens, the same for the same id and seed."""
    rng = random.Random(f"{seed}:{segment_id}")
    return "".join(rng.choice(vocab) for _ in range(length))


def _read_lengths(path: str | Path) -> dict[str, int]:
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"cannot read the lengths table {path}: {exc}") from exc
    if not isinstance(table, dict):
        raise InvalidInputError(f"{path} must hold a JSON object {{segment id: token length}}")
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{path}: length of {key!r} must be a positive int")
    return table


def _read_lines(path: str | Path) -> list[dict[str, Any]]:
    lines = [obj for _, obj in read_jsonl(Path(path))]
    if not lines:
        raise InvalidInputError(f"the trace {path} has no requests")
    return lines


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a JSONL file of objects."""
    try:
        handle = path.open()
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc}") from exc
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{path}:{number}: not JSON ({exc})") from exc
            if not isinstance(obj, dict):
                raise InvalidInputError(f"{path}:{number}: each line must be a JSON object")
            yield number, obj


def _ids(line: dict[str, Any], role: str, path: str | Path, index: int) -> list[str]:
    ids = line.get(role, [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidInputError(f"{path}: request {index}: {role!r} must be a list of string ids")
    return ids
