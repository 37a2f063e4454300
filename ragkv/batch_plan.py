"""The batch planner: in which order a window's requests run, and their chunks' order.

Pure functions over content keys (no engine, no tokenizer), so the plan can be tested and
reasoned about alone; :mod:`ragkv.batch` runs it. The idea: a prefix tree of the window's
chunk sets, built greedily, walked depth-first (requests sharing a prefix run one after
another), each request's shared path first in its prompt; a request waits for the prefill
of the one before it in its subtree, and a session's turns keep their order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


def plan_window(
    chunk_keys: Sequence[Sequence[bytes]],
    heads: Sequence[Hashable],
    tails: Sequence[tuple[str, ...]] | None = None,
    weights: Mapping[bytes, int] | None = None,
) -> tuple[list[int], list[dict[bytes, int]]]:
    """The order to run a window's items in, and each item's chunk order (key → rank).

    A sharing is worth the shared chunk's ``weights[key]`` (its length: a long passage
    shared by two items saves more prefill than a short one shared by three); without
    ``weights`` every chunk is worth 1.

    Items group by ``heads[i]`` (what precedes the chunks: salt, system prompt), in order of
    first appearance. Within a group, a prefix tree is built greedily: at each node, a
    chunk held by several items of the node becomes the next chunk of all of them, which
    form its subtree; the others stay at the node, for its next child. At a node of at most
    ``_LOOKAHEAD_MEMBERS`` items (while the window's ``_LOOKAHEAD_BUDGET`` lasts) the chunk
    is the candidate whose whole tree (its subtree and the rest of the node, each built the
    cheap way) shares the most (:func:`_best_by_tree`); elsewhere the one whose subtree
    shares the most at its first two levels (:func:`_next_chunk`).
    A chunk held by one item of a node ends that item's path; the rank map names only the
    path (the assembler places the other chunks after it, in its learned order). At a
    leaf, items whose path holds all their chunks come first, sorted by ``tails[i]`` (what
    follows the chunks: the history turns), so turns sharing a history prefix run together.
    Running the items depth-first, each runs right after the items it shares the longest
    chunk prefix with.
    """
    first: dict[bytes, int] = {}
    for keys in chunk_keys:
        for key in keys:
            first.setdefault(key, len(first))
    groups: dict[Hashable, list[int]] = {}
    for i, head in enumerate(heads):
        groups.setdefault(head, []).append(i)
    order: list[int] = []
    paths: list[list[bytes]] = [[] for _ in chunk_keys]
    # Ordered (dicts as ordered sets): ties between equal counts must not depend on the
    # process's hash seed, or the same window would be planned differently each run.
    sets = [dict.fromkeys(keys) for keys in chunk_keys]
    window = _Window(sets, first, weights if weights is not None else _Unit())
    # (items, depth): items that share a path of ``depth`` chunks, still to place.
    stack = [(members, 0) for members in reversed(groups.values())]
    budget = [_LOOKAHEAD_BUDGET]
    while stack:
        members, depth = stack.pop()
        counts = Counter(key for i in members for key in sets[i] if key not in paths[i][:depth])
        path = paths[members[0]][:depth]
        if len(members) <= _LOOKAHEAD_MEMBERS and budget[0] > 0:
            best = _best_by_tree(counts, members, path, window, budget)
        else:
            best = _next_chunk(counts, members, path, window)
        if best is None:  # leaves: no chunk is shared below this node
            order.extend(sorted(members, key=lambda i: (
                len(sets[i]) > len(paths[i]), tails[i] if tails else (), i)))  # fmt: skip
            continue
        inside = [i for i in members if best in sets[i]]
        outside = [i for i in members if best not in sets[i]]
        for i in inside:
            paths[i].append(best)
        if outside:
            stack.append((outside, depth))  # the node's next child, after this subtree
        stack.append((inside, depth + 1))
    return order, [{key: r for r, key in enumerate(path)} for path in paths]


# Candidates scored per tree node (the most frequent); the score looks one level deeper.
_CANDIDATES = 32
# The whole-tree look-ahead: nodes of at most this many items, a few candidates each, and
# at most this many item visits per window (then one level only): planning a 1,024-item
# window stays within tens of seconds (measured in docs/benchmarks.md).
_LOOKAHEAD_MEMBERS = 512
_LOOKAHEAD_CANDIDATES = 32
_LOOKAHEAD_BUDGET = 5_000_000


class _Unit(dict[bytes, int]):
    """Every chunk weighs 1."""

    def __missing__(self, key: bytes) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class _Window:
    """What every tree node of one window reads: each item's chunk set (ordered), each
    chunk's first appearance (breaks ties) and weight."""

    sets: Sequence[Mapping[bytes, None]]
    first: Mapping[bytes, int]
    weight: Mapping[bytes, int]


def _best_by_tree(
    counts: Counter[bytes],
    members: Sequence[int],
    path: Sequence[bytes],
    window: _Window,
    budget: list[int],
) -> bytes | None:
    """The candidate whose choice gives the node the largest tree: weighted items sharing
    each chunk, summed over the subtree it starts and over the node's other items (both built with
    :func:`_next_chunk`). One level of look-ahead picks a topic's first passage; this also
    sees how far the items that do not hold it still share."""
    shared = [k for k, n in counts.most_common(_LOOKAHEAD_CANDIDATES) if n > 1]
    if not shared:
        return None
    taken = frozenset(path)
    sets = window.sets

    def value(key: bytes) -> tuple[int, int]:
        inside = [i for i in members if key in sets[i]]
        outside = [i for i in members if key not in sets[i]]
        shared_by = (len(inside) - 1) * window.weight[key]
        shared_by += _tree_size(inside, taken | {key}, window, budget)
        shared_by += _tree_size(outside, taken, window, budget)
        return shared_by, -window.first[key]

    return max(shared, key=value)


def _tree_size(
    members: Sequence[int], taken: frozenset[bytes], window: _Window, budget: list[int]
) -> int:
    """The weighted chunk-sharings (a node's items minus one, times its chunk's weight,
    over its nodes) of the cheap tree over ``members`` below ``taken``; spends ``budget``."""
    total, sets = 0, window.sets
    stack = [(list(members), taken)]
    while stack:
        items, used = stack.pop()
        budget[0] -= len(items)
        counts = Counter(k for i in items for k in sets[i] if k not in used)
        best = _next_chunk(counts, items, list(used), window)
        if best is None:
            continue
        inside = [i for i in items if best in sets[i]]
        outside = [i for i in items if best not in sets[i]]
        total += (len(inside) - 1) * window.weight[best]
        stack.append((inside, used | {best}))
        if outside:
            stack.append((outside, used))
    return total


def _next_chunk(
    counts: Counter[bytes], members: Sequence[int], path: Sequence[bytes], window: _Window
) -> bytes | None:
    """The node's next chunk, or None when no chunk is held by two of its items.

    Counting alone picks a chunk that many unrelated items hold (a generic passage) over
    the passages of one topic, which hold together for several levels; so each candidate
    scores the items sharing it plus the items sharing its best second chunk (each
    sharing times its chunk's weight).
    """
    taken = set(path)
    sets, weight = window.sets, window.weight
    shared = [k for k, n in counts.most_common(_CANDIDATES) if n > 1]
    if len(shared) < 2:
        return shared[0] if shared else None

    def score(key: bytes) -> tuple[int, int]:
        pairs = Counter(
            other for i in members if key in sets[i] for other in sets[i]
            if other != key and other not in taken
        )  # fmt: skip
        deeper = max(((n - 1) * weight[other] for other, n in pairs.items()), default=0)
        return (counts[key] - 1) * weight[key] + deeper, -window.first[key]

    return max(shared, key=score)


def prefix_leaders(
    order: Sequence[int], ranks: Sequence[Mapping[bytes, int]], heads: Sequence[Hashable]
) -> dict[int, int]:
    """For each item, the item just before it in ``order`` whose chunk order starts the same
    way (same head, same first chunk), if any.

    Run together, two such items would both compute the shared prefix: an engine step
    computes a prompt's blocks before they can be found in the cache. So an item waits for
    its leader's prefill (its first token) before it is submitted; items of other subtrees
    run meanwhile.
    """
    leaders: dict[int, int] = {}
    previous: int | None = None
    for i in order:
        first = _first(ranks[i])
        if (
            previous is not None
            and first is not None
            and heads[i] == heads[previous]
            and first == _first(ranks[previous])
        ):
            leaders[i] = previous
        previous = i
    return leaders


def _first(rank: Mapping[bytes, int]) -> bytes | None:
    return min(rank, key=rank.__getitem__, default=None)


def keep_turn_order(order: Sequence[int], sessions: Sequence[Hashable | None]) -> list[int]:
    """``order`` with each session's items in their own order: a turn whose earlier turn is
    still to run waits for it, and then runs right after it (its answer is this turn's
    history)."""
    waiting: dict[Hashable, list[int]] = {}
    for i in sorted(i for i in order if sessions[i] is not None):
        waiting.setdefault(sessions[i], []).append(i)
    out: list[int] = []
    done: set[int] = set()
    held: dict[int, int] = {}  # earlier turn -> the turn waiting for it

    def emit(i: int) -> None:
        while True:
            out.append(i)
            done.add(i)
            nxt = held.pop(i, None)
            if nxt is None:
                return
            i = nxt

    for i in order:
        session = sessions[i]
        if session is None:
            emit(i)
            continue
        turns = waiting[session]
        before = turns[turns.index(i) - 1] if turns.index(i) > 0 else None
        if before is None or before in done:
            emit(i)
        else:
            held[before] = i
    return out
