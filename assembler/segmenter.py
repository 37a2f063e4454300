"""One request's content as tokenized segments: the assembler's first step, run outside its lock.

System prompt parts, few-shot examples and retrieved chunks are tokenized through the
:class:`~ragkv.dedup.ChunkRegistry` (keyed by content hash, so a chunk seen before costs a
lookup); history turns and the question, new on almost every request, are tokenized
directly. Tokenization is O(text) and touches no learned state, so many requests do it at
once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ragkv.assembler.plan import AssemblyStats
from ragkv.assembler.segments import DEFAULT_STABILITY, Segment, SegmentKind, Stability
from ragkv.assembler.structured import SystemLike, Volatile, system_parts
from ragkv.assembler.tokenization import TextTokenizer
from ragkv.dedup import Chunk, ChunkRegistry, content_hash
from ragkv.errors import InvalidInputError

Turn = Mapping[str, str] | tuple[str, str]
HISTORY_ROLES = frozenset({"user", "assistant"})


@dataclass(slots=True)
class TokenizedRequest:
    """A request's segments after tokenization, in the caller's order."""

    statics: list[Segment]  # system parts and few-shot examples
    chunks: list[Segment]
    turns: list[Segment]
    question: Segment
    stats: AssemblyStats


class Segmenter:
    """Turns a request's content into :class:`Segment` s with their token ids.

    ``key`` scopes token ids in the shared registry (a tenant's fork has its own, so how fast
    a document tokenizes cannot tell one tenant what another sent).
    """

    def __init__(
        self, tokenizer: TextTokenizer, registry: ChunkRegistry, *, collapse_duplicates: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.registry = registry
        self.key = tokenizer.key
        self.collapse_duplicates = collapse_duplicates

    def segment(
        self,
        system: SystemLike | None,
        raw_chunks: Iterable[str | bytes | Chunk],
        question: str,
        history: Sequence[Turn] | None,
        few_shot: Sequence[str] | None,
        overrides: dict[SegmentKind, Stability],
        order: str,
    ) -> TokenizedRequest:
        """Every segment of one request, tokenized; ``stats`` counts registry hits."""
        stats = AssemblyStats(order=order)
        statics = self._static_segments(system, few_shot, overrides)
        chunks = self._chunk_segments(raw_chunks, stats)
        registry, key, encode_text = self.registry, self.key, self.tokenizer.encode
        misses = 0

        def encode(text: str) -> list[int]:
            nonlocal misses
            misses += 1
            return encode_text(text)

        for segment in statics:
            if segment.chunk is None:  # a volatile part: not worth a registry entry
                segment.token_ids = encode_text(segment.text)
            else:
                segment.token_ids = registry.token_ids(segment.chunk, key, encode_text)
        for segment in chunks:
            segment.text = segment.chunk.text  # type: ignore[union-attr]
            segment.token_ids = registry.token_ids(segment.chunk, key, encode)  # type: ignore[arg-type]
        stats.chunks_tokenized, stats.chunks_reused = misses, len(chunks) - misses
        registry.observe([s.key for s in statics if s.chunk is not None] + [s.key for s in chunks])
        turns = self._turns(history)
        return TokenizedRequest(statics, chunks, turns, self._volatile(question), stats)

    def statics(self, system: SystemLike | None) -> list[Segment]:
        """The segments of a system prompt, tokenized (caller-marked volatile parts are
        left untokenized: the system-prompt learner skips them)."""
        statics = self._static_segments(system, None, {})
        for segment in statics:
            if segment.chunk is not None:
                segment.token_ids = self.registry.token_ids(
                    segment.chunk, self.key, self.tokenizer.encode
                )
        return statics

    def _static_segments(
        self,
        system: SystemLike | None,
        few_shot: Sequence[str] | None,
        overrides: dict[SegmentKind, Stability],
    ) -> list[Segment]:
        parts = system_parts(system)
        segments = []
        for i, part in enumerate(parts):
            slot = "system" if len(parts) == 1 else f"system[{i}]"
            if isinstance(part, Volatile):
                key = content_hash(part.text.encode("utf-8", "surrogatepass"), self.registry.hash)
                segments.append(
                    Segment(
                        SegmentKind.SYSTEM, Stability.VOLATILE, part.text, (), key, i, slot=slot
                    )
                )
            else:
                segments.append(self._static(SegmentKind.SYSTEM, part, i, slot, overrides))
        for i, example in enumerate(few_shot or ()):
            text = _text(example, "few_shot example", "few_shot")
            segments.append(
                self._static(SegmentKind.FEW_SHOT, text, i, f"few_shot[{i}]", overrides)
            )
        return segments

    def _static(
        self,
        kind: SegmentKind,
        text: str,
        index: int,
        slot: str,
        overrides: dict[SegmentKind, Stability],
    ) -> Segment:
        chunk = Chunk(text)
        stability = overrides.get(kind, DEFAULT_STABILITY[kind])
        return Segment(
            kind, stability, text, (), self.registry.key(chunk), index, chunk, None, slot
        )

    def _chunk_segments(
        self, raw_chunks: Iterable[str | bytes | Chunk], stats: AssemblyStats
    ) -> list[Segment]:
        segments: list[Segment] = []
        seen: set[bytes] = set()
        key = self.registry.key
        for rank, raw in enumerate(raw_chunks):
            chunk = Chunk.coerce(raw)
            chunk_key = key(chunk)
            if chunk_key in seen and self.collapse_duplicates:
                stats.duplicates_collapsed += 1
                continue
            seen.add(chunk_key)
            segments.append(
                Segment(SegmentKind.CHUNK, Stability.STABLE, "", (), chunk_key, rank, chunk)
            )
        return segments

    def _turns(self, history: Sequence[Turn] | None) -> list[Segment]:
        turns = []
        for i, turn in enumerate(history or ()):
            if isinstance(turn, Mapping):
                role, content = turn.get("role"), turn.get("content")
            elif isinstance(turn, tuple) and len(turn) == 2:
                role, content = turn
            else:
                role = content = None
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidInputError(
                    f"history[{i}] must be {{'role': str, 'content': str}} or (role, content).",
                    param="history",
                )
            if role not in HISTORY_ROLES:  # a role is template text: never free-form
                raise InvalidInputError(
                    f"history[{i}] has role {role[:40]!r}; history turns are 'user' or "
                    "'assistant' (the system prompt goes in system=...)",
                    param=f"history[{i}].role",
                )
            segment = self._volatile(content, SegmentKind.HISTORY, i)
            segment.role = role
            turns.append(segment)
        return turns

    def _volatile(
        self, text: str, kind: SegmentKind = SegmentKind.QUESTION, index: int = 0
    ) -> Segment:
        key = content_hash(text.encode("utf-8", "surrogatepass"), self.registry.hash)
        ids = self.tokenizer.encode(text)
        return Segment(kind, Stability.VOLATILE, text, ids, key, index)


def _text(value: object, what: str, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be str, got {type(value).__name__}.", param=param)
    return value
