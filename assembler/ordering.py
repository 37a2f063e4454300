"""Chunk ordering policies.

- ``"retrieval"``: the caller's order. Relevance order is information the model may use
  (models attend unevenly over long contexts, "lost in the middle"), so this is the choice
  when answer quality depends on it; it shares little prefix between requests.
- ``"stable-first"`` (default): one global canonical order that does not depend on the
  request: stable chunks by the order in which they became stable (ties by content hash),
  then the other chunks by content hash. Two requests that retrieve the same hot chunks in
  any order send them in the same order.
- ``"cache-aware"``: walk the prefix tree of recently sent chunk orders greedily, choosing at
  each step a child chunk the request contains, then append the rest canonically. It
  follows orders that were actually sent (and therefore cached) rather than the order an
  ideal canonical ranking would have produced.

The trade-off: the reordering policies place a chunk by its popularity, not its relevance.
Chunk scores and retrieval ranks stay in the plan's segment table; the budget still drops
the least relevant chunks first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ragkv.assembler.prefix_tree import ChunkPrefixTree
from ragkv.assembler.segments import Segment, Stability
from ragkv.errors import ConfigError

ORDERS = ("retrieval", "stable-first", "cache-aware")
_UNRANKED = 1 << 62


def check_order(order: str) -> str:
    """Validate an ``order=`` name."""
    if order not in ORDERS:
        raise ConfigError(
            f"Unknown order {order!r}; choose one of {', '.join(ORDERS)}.", param="order"
        )
    return order


def retrieval_order(chunks: Sequence[Segment]) -> list[Segment]:
    """The caller's order (retrieval rank)."""
    return sorted(chunks, key=lambda s: s.rank)


def canonical_order(chunks: Sequence[Segment], ranks: Mapping[bytes, int]) -> list[Segment]:
    """Stable chunks by stable rank, then the rest; ties and the rest by content hash."""

    def sort_key(segment: Segment) -> tuple[bool, int, bytes]:
        rank = ranks.get(segment.key, _UNRANKED)
        return (segment.stability is not Stability.STABLE, rank, segment.key)

    return sorted(chunks, key=sort_key)


def cache_aware_order(
    chunks: Sequence[Segment], ranks: Mapping[bytes, int], tree: ChunkPrefixTree, head: bytes
) -> tuple[list[Segment], int]:
    """The tree's greedy path through the request's chunks, then the rest canonically.

    Returns the order and how many leading chunks came from the tree walk.
    """
    by_key: dict[bytes, Segment] = {}
    for segment in chunks:
        by_key.setdefault(segment.key, segment)
    path = tree.walk(head, by_key)
    # Identity, not key: uncollapsed duplicates of a path chunk still go to the rest.
    on_path = {id(by_key[key]) for key in path}
    rest = canonical_order([s for s in chunks if id(s) not in on_path], ranks)
    return [by_key[key] for key in path] + rest, len(path)
