"""Overlap merging: join windows of one source whose suffix and prefix share >= N bytes.

Sliding-window chunkers emit ``[0, 1000)`` and ``[900, 1900)`` of the same document; when
both are retrieved, the 100 shared bytes are paid twice. We find, per chunk ``a``, the
longest proper overlap with another chunk ``b`` of the same source (``a[i:] == b[:k]``,
``0 < i``, ``k < len(b)``, ``k >= min_overlap``), keep each chunk in at most one edge as
predecessor and one as successor (largest overlaps first), and return the resulting chains.
Chunks without a source id are never merged: equal bytes from different documents are
a coincidence, not a window seam.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

Chain = tuple[list[int], list[int]]  # (chunk indices in order, overlap length of each seam)


def find_overlap_chains(
    datas: Sequence[bytes], groups: Sequence[Hashable | None], min_overlap: int
) -> list[Chain]:
    """Chains of chunks (same non-None group) that overlap by at least ``min_overlap`` bytes.

    ``datas`` must be distinct and none may contain another (run containment first).
    """
    by_group: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        if group is not None and len(datas[i]) > min_overlap:
            by_group.setdefault(group, []).append(i)
    chains: list[Chain] = []
    for members in by_group.values():
        if len(members) > 1:
            chains.extend(_chains_in_group(datas, members, min_overlap))
    return chains


def _chains_in_group(datas: Sequence[bytes], members: list[int], m: int) -> list[Chain]:
    heads: dict[bytes, list[int]] = {}
    for b in members:
        heads.setdefault(datas[b][:m], []).append(b)
    edges = []  # (overlap, a, b)
    for a in members:
        best = _best_successor(a, datas, heads, m)
        if best is not None:
            edges.append((best[0], a, best[1]))
    edges.sort(key=lambda e: (-e[0], e[1]))
    succ: dict[int, tuple[int, int]] = {}
    has_pred: set[int] = set()
    for k, a, b in edges:
        if b not in has_pred and a not in succ:
            succ[a] = (b, k)
            has_pred.add(b)
    chains: list[Chain] = []
    for start in members:
        if start in has_pred or start not in succ:
            continue  # not a chain start (cycles without a start stay unmerged)
        order, seams = [start], []
        node = start
        while node in succ:
            node, k = succ[node]
            order.append(node)
            seams.append(k)
        chains.append((order, seams))
    return chains


def _best_successor(
    a: int, datas: Sequence[bytes], heads: dict[bytes, list[int]], m: int
) -> tuple[int, int] | None:
    data = datas[a]
    best: tuple[int, int] | None = None  # (overlap, b)
    for head, bs in heads.items():
        i = data.find(head, 1)
        while i != -1 and len(data) - i >= m:
            if best is not None and len(data) - i <= best[0]:
                break  # later starts only give shorter overlaps
            tail = data[i:]
            hit = next(
                (
                    b
                    for b in bs
                    if b != a and len(datas[b]) > len(tail) and datas[b].startswith(tail)
                ),
                None,
            )
            if hit is not None:
                best = (len(tail), hit)
                break
            i = data.find(head, i + 1)
    return best
