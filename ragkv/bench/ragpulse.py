"""Replay of a RAGPulse trace (a production RAG service's requests, logged as segment ids).

RAGPulse (MIT licence) logs each request as lists of segment ids by role, with a token
length per id and no text. Its directory holds ``0_trace.jsonl`` (one request a line:
``timestamp`` in seconds from the trace's start, ``session_id``, ``hash_ids`` with the
lists ``sys_prompt``, ``passages_ids``, ``history``, ``user_input``, ``web_search``) and one
length table per role (``1_sys_prompt.jsonl`` … ``5_web_search.jsonl``, lines like
``{"passage_id": 7, "token_length": 286}``).

The same id is the same content wherever it appears, so every id becomes one fixed token
sequence of its (scaled) length, made of whole-word tokens of the tokenizer so that the text
re-tokenizes to exactly that many tokens. Roles map onto a RAG request as:

================ ===========================================================================
trace role       request
================ ===========================================================================
``sys_prompt``   the system prompt, one part per id in order (``system=[part, ...]``): the
                 parts are what the assembler's learner sees
``passages_ids`` retrieved chunks, in the logged order
``web_search``   more retrieved chunks, after the passages
``history``      history turns (alternating user / assistant)
``user_input``   the question
================ ===========================================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ragkv.bench.workload import (
    RequestSpec,
    Workload,
    read_jsonl,
    segment_text,
    word_vocabulary,
)
from ragkv.dedup import Chunk
from ragkv.errors import ConfigError, InvalidInputError

TRACE_FILE = "0_trace.jsonl"
# role in hash_ids -> (length table, id key in that table)
TABLES = {
    "sys_prompt": ("1_sys_prompt.jsonl", "sys_prompt_id"),
    "passages_ids": ("2_passages.jsonl", "passage_id"),
    "history": ("3_history.jsonl", "history_id"),
    "user_input": ("4_user_input.jsonl", "user_input_id"),
    "web_search": ("5_web_search.jsonl", "web_search_id"),
}
DAY_S = 86_400


def parse_days(text: str | None) -> tuple[int, int] | None:
    """``"2"`` or ``"1-3"`` (1-based, inclusive) as ``(first, last)``; None for all days."""
    if text is None:
        return None
    first, _, last = text.partition("-")
    try:
        days = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"--days must look like 2 or 1-3, got {text!r}") from None
    if days[0] < 1 or days[1] < days[0]:
        raise ConfigError(f"--days must be 1-based and ascending, got {text!r}")
    return days


def ragpulse_workload(
    trace_dir: str | Path,
    tokenizer: Any,
    *,
    days: tuple[int, int] | None = None,
    skip: int = 0,
    limit: int | None = None,
    scale: float = 1.0,
    seed: int = 0,
) -> Workload:
    """The requests of a RAGPulse trace directory as a bench workload.

    ``days`` keeps requests whose timestamp falls in those days (1-based, inclusive; day 1
    is the trace's first 24 hours); then ``skip`` requests are dropped and at most ``limit``
    kept. ``scale`` multiplies every segment's token length (at least one token each), to
    replay a long trace on a small machine; the shape (which ids repeat where) is unchanged.
    """
    if not 0 < scale <= 1:
        raise ConfigError(f"scale must be in (0, 1], got {scale}")
    if skip < 0 or (limit is not None and limit < 1):
        raise ConfigError("skip must be >= 0 and limit >= 1")
    root = Path(trace_dir).expanduser()
    if not (root / TRACE_FILE).is_file():
        raise InvalidInputError(
            f"{root} is not a RAGPulse trace directory (no {TRACE_FILE}); see docs/benchmarks.md, "
            "'Replaying a public trace'"
        )
    lengths = {role: _lengths(root / name, key) for role, (name, key) in TABLES.items()}
    lines = list(_select(read_jsonl(root / TRACE_FILE), days, skip, limit))
    vocab = word_vocabulary(tokenizer)
    texts: dict[tuple[str, int], str] = {}

    def text(role: str, segment_id: int) -> str:
        key = (role, segment_id)
        if key not in texts:
            length = lengths[role].get(segment_id)
            if length is None:
                raise InvalidInputError(f"{root}: {role} id {segment_id} has no token length")
            scaled = max(1, round(length * scale))
            texts[key] = segment_text(f"{role}:{segment_id}", scaled, vocab, seed)
        return texts[key]

    requests = []
    for index, (number, line) in enumerate(lines):
        ids = _hash_ids(line, number, root)
        if not ids["user_input"]:
            raise InvalidInputError(f"{root / TRACE_FILE}:{number}: no user_input segment")
        roles = ("user", "assistant")
        chunks = [
            Chunk(text("passages_ids", i), source_id=f"passage:{i}") for i in ids["passages_ids"]
        ]
        chunks += [Chunk(text("web_search", i), source_id=f"web:{i}") for i in ids["web_search"]]
        requests.append(
            RequestSpec(
                index=index,
                session_id=str(line.get("session_id", f"r{number}")),
                system=[text("sys_prompt", i) for i in ids["sys_prompt"]],
                question="".join(text("user_input", i) for i in ids["user_input"]),
                chunks=chunks,
                history=[
                    {"role": roles[j % 2], "content": text("history", i)}
                    for j, i in enumerate(ids["history"])
                ],
                follow_up=bool(ids["history"]),
            )
        )
    if not requests:
        raise ConfigError("the trace selection (--days/--skip/--limit) holds no request")
    params = {
        "kind": "ragpulse",
        "trace_dir": str(root),
        "days": list(days) if days else None,
        "skip": skip,
        "limit": limit,
        "scale": scale,
        "seed": seed,
        "requests": len(requests),
        "num_sessions": len({r.session_id for r in requests}),
    }
    return Workload("ragpulse", requests, params)


def _lengths(path: Path, key: str) -> dict[int, int]:
    table: dict[int, int] = {}
    for number, obj in read_jsonl(path):
        segment_id, length = obj.get(key), obj.get("token_length")
        if not isinstance(segment_id, int) or not isinstance(length, int) or length < 1:
            raise InvalidInputError(f"{path}:{number}: needs {key} (int) and token_length >= 1")
        table[segment_id] = length
    return table


def _select(
    lines: Iterator[tuple[int, dict[str, Any]]],
    days: tuple[int, int] | None,
    skip: int,
    limit: int | None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    kept = 0
    for number, line in lines:
        if days is not None:
            try:
                day = int(float(line["timestamp"])) // DAY_S + 1
            except (KeyError, TypeError, ValueError):
                raise InvalidInputError(f"trace line {number}: no numeric timestamp") from None
            if not days[0] <= day <= days[1]:
                continue
        if skip:
            skip -= 1
            continue
        yield number, line
        kept += 1
        if limit is not None and kept >= limit:
            return


def _hash_ids(line: dict[str, Any], number: int, root: Path) -> dict[str, list[int]]:
    raw = line.get("hash_ids")
    if not isinstance(raw, dict):
        raise InvalidInputError(f"{root / TRACE_FILE}:{number}: no hash_ids object")
    ids = {}
    for role in TABLES:
        value = raw.get(role, [])
        if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
            raise InvalidInputError(f"{root / TRACE_FILE}:{number}: {role} must be a list of ints")
        ids[role] = value
    return ids
