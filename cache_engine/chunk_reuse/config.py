"""What an opted-in request asks of chunk reuse: the strategy, and its chunk spans checked.

Position-independent chunk reuse is approximate (Invariant 8): a chunk's K/V computed after
one context is reused after another. A strategy says which reused tokens are computed
again to repair the cross-chunk attention they missed:

- ``"none"``: naive reuse, every reused token kept as copied;
- ``"first-k"``: the first ``k`` tokens of every reused chunk are recomputed (EPIC's
  observation: the attention sink at a chunk's start absorbs most of the damage);
- ``"deviation"``: as many tokens as ``first-k`` recomputes (``k`` per reused chunk), but
  the ones whose values deviate most from a fresh computation (CacheBlend's selection).
  The model runner first runs a probe forward over every token after the prefix that
  stops once layer :data:`DEVIATION_LAYER` has stored its K/V (about one layer's cost),
  compares those values with the copied ones, and recomputes the top tokens across all
  reused chunks. Layer 0's K/V depend on the token and its position alone, so copied
  layer-0 K/V are already right; layer 1 is the first that sees the new context.

The budget is ``k`` tokens per reused chunk, or, with ``ratio``, a share of each chunk
(``ceil(ratio * chunk tokens)``, at least ``k``): an absolute ``k`` that repairs 600-token
passages would recompute short chunks whole. ``deviation`` can also keep a chunk's first
``head`` tokens among its recomputed ones (where the chunk's first computation put its
attention sink) and choose only the rest by deviation.

The default, ``BlendConfig()``, is ``deviation`` with ``k=16`` and ``ratio=0.15``: on the
quality harness (``benchmarks/blend_quality.py``, MuSiQue) it beat ``first-k`` with
``k=16`` at the same prefill (KL 0.049 vs 0.074, top-1 0.934 vs 0.923, answer F1 0.745 vs
0.722). A probe that does not fit one step runs the ``first-k`` plan of the same budget
instead (:mod:`.source`). ``ratio`` left unset means the strategy's default
(:data:`DEFAULT_RATIOS`: 0.15 for ``deviation``, 0 for the others), so ``first-k`` and
``none`` settings mean what they meant before ``deviation`` became the default; a
``deviation`` setting without a ratio now gets 0.15 (``ratio=0`` for ``k`` alone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from ragkv.errors import ConfigError, InvalidInputError

STRATEGIES: tuple[str, ...] = ("none", "first-k", "deviation")
DEVIATION_LAYER = 1  # the first layer whose K/V depend on the context (see above)
MAX_CHUNK_SPANS = 256  # per request: a RAG prompt has tens of chunks, not thousands
MIN_CHUNK_TOKENS = 4  # shorter spans are not worth a lookup; they are computed fresh
DEFAULT_STRATEGY = "deviation"
# ``ratio`` when not given, per strategy (0.15: the harness's best at first-k16's prefill)
DEFAULT_RATIOS: dict[str, float] = {"none": 0.0, "first-k": 0.0, "deviation": 0.15}


@dataclass(frozen=True, slots=True)
class BlendConfig:
    """How an opted-in request reuses chunks found elsewhere (see the module docstring).

    ``k``: tokens recomputed per reused chunk: its first ``k`` (``first-k``; 0 is naive), or
    as many chosen by deviation across all reused chunks (``deviation``).
    ``ratio``: in [0, 1]; when set, a reused chunk of ``n`` tokens gets ``ceil(ratio * n)``
    recomputed tokens, never fewer than ``k`` (``k=0`` for the ratio alone); 0: ``k``
    alone; None (default): the strategy's (:data:`DEFAULT_RATIOS`: 0.15 for ``deviation``,
    0 for ``first-k`` and ``none``), resolved here so that ``BlendConfig()`` equals
    ``BlendConfig("deviation", ratio=0.15)`` (one setting, one scope).
    ``head`` (``deviation`` only): the first ``head`` tokens of each reused chunk are always
    among its recomputed ones (within its budget); deviation chooses the rest.
    """

    strategy: str = DEFAULT_STRATEGY
    k: int = 16
    ratio: float | None = None  # a float once constructed
    head: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown chunk reuse strategy {self.strategy!r}; use "
                f"{' or '.join(map(repr, STRATEGIES))}",
                param="strategy",
            )
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= 1 << 16:
            raise ConfigError(f"k must be an int in [0, 65536], got {self.k!r}", param="k")
        ratio = DEFAULT_RATIOS[self.strategy] if self.ratio is None else self.ratio
        # The range test also refuses NaN, infinities and ints too large for a float.
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise ConfigError(f"ratio must be a number in [0, 1], got {ratio!r}", param="ratio")
        object.__setattr__(self, "ratio", float(ratio))  # 1 and 1.0: one setting, one scope
        if isinstance(self.head, bool) or not isinstance(self.head, int):
            raise ConfigError(f"head must be an int, got {self.head!r}", param="head")
        if not 0 <= self.head <= 1 << 16:
            raise ConfigError(f"head must be in [0, 65536], got {self.head!r}", param="head")
        if self.head and self.strategy != "deviation":
            raise ConfigError(
                f"head applies to strategy 'deviation' only (first-k recomputes the first k; "
                f"none recomputes nothing), got strategy {self.strategy!r}",
                param="head",
            )
        if self.ratio and self.strategy == "none":
            raise ConfigError("ratio needs strategy 'first-k' or 'deviation'", param="ratio")

    def recomputed(self, chunk_len: int) -> int:
        """How many tokens of a reused chunk of ``chunk_len`` tokens are recomputed (its
        leading ones for ``first-k``; the budget they add for ``deviation``)."""
        if self.strategy == "none":
            return 0
        budget = self.k
        if self.ratio:  # exact arithmetic: 0.15 * 600 is 90, not 90.00000000000001 -> 91
            budget = max(budget, math.ceil(Fraction(repr(self.ratio)) * chunk_len))
        return min(budget, chunk_len)

    def head_tokens(self, chunk_len: int) -> int:
        """How many of a reused chunk's first tokens are recomputed whatever deviation
        chooses (``deviation`` with ``head``; within the chunk's budget)."""
        return min(self.head, self.recomputed(chunk_len))


def check_chunk_spans(spans: object, num_tokens: int) -> tuple[tuple[int, int], ...]:
    """``spans`` as sorted ``(start, end)`` token offsets into a prompt of ``num_tokens``.

    Raises :class:`~ragkv.errors.InvalidInputError` (``param="chunk_spans"``) unless they
    are at most :data:`MAX_CHUNK_SPANS` int pairs with ``0 <= start < end <= num_tokens``,
    in order and not overlapping (a plan's ``spans("chunk")`` always are).
    """
    if isinstance(spans, str | bytes) or not isinstance(spans, Sequence):
        raise InvalidInputError(
            "chunk_spans must be a list of (start, end) token offsets", param="chunk_spans"
        )
    if len(spans) > MAX_CHUNK_SPANS:
        raise InvalidInputError(
            f"at most {MAX_CHUNK_SPANS} chunk spans per request, got {len(spans)}",
            param="chunk_spans",
        )
    checked: list[tuple[int, int]] = []
    previous_end = 0
    for span in spans:
        if isinstance(span, str | bytes) or not isinstance(span, Sequence) or len(span) != 2:
            raise InvalidInputError(
                f"chunk span {span!r} is not a (start, end) pair", param="chunk_spans"
            )
        start, end = span
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)):
            raise InvalidInputError(f"chunk span {span!r} must hold two ints", param="chunk_spans")
        if not previous_end <= start < end <= num_tokens:
            raise InvalidInputError(
                f"chunk span ({start}, {end}) must satisfy {previous_end} <= start < end <= "
                f"{num_tokens} (spans in order, not overlapping, inside the prompt)",
                param="chunk_spans",
            )
        checked.append((start, end))
        previous_end = end
    return tuple(checked)
