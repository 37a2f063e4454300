"""Containment: find chunks that are byte-for-byte substrings of a longer chunk.

Pairwise ``a in b`` over n chunks is O(n^2) substring scans. Instead, every container is
indexed by its Q-byte grams at offsets 0, S, 2S, ... (S = Q = 16). If a needle of length
L >= Q + S - 1 occurs in a container at offset o, the container's sampled grams cover the
needle at offsets j, j + S, j + 2S, ... for the one j = (-o) mod S in [0, S). So the
candidate containers are, for some j, in the posting list of every gram on that chain;
we intersect those lists (stopping early once few candidates remain) and confirm each
candidate with a real ``in``. Cost: O(total bytes / S) index entries plus, per needle,
S posting lookups when nothing matches (the common case). Shorter needles are checked
against the containers one by one (they are rare in RAG and cheap to scan).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

_Q = 16
_STEP = 16
_MIN_INDEXED = _Q + _STEP - 1
_FEW = 4  # stop intersecting posting lists once this few candidates are left


def find_contained(datas: Sequence[bytes], groups: Sequence[Hashable]) -> dict[int, int]:
    """Map each chunk that lies inside a longer chunk of the same group to that container.

    ``datas`` must be distinct byte strings. Containers are never themselves contained
    (a chain c < b < a maps both b and c to a). Among several containers the longest,
    then the earliest, wins.
    """
    by_group: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        by_group.setdefault(group, []).append(i)
    found: dict[int, int] = {}
    for members in by_group.values():
        if len(members) > 1:
            found.update(_contained_in_group(datas, members))
    return found


def _contained_in_group(datas: Sequence[bytes], members: list[int]) -> dict[int, int]:
    order = sorted(members, key=lambda i: -len(datas[i]))  # stable: ties keep input order
    postings: dict[bytes, list[int]] = {}
    rank: dict[int, int] = {}  # container -> position in `order` (longest, then earliest)
    found: dict[int, int] = {}
    for i in order:
        needle = datas[i]
        host = _find_host(needle, datas, postings, rank)
        if host is not None:
            found[i] = host
            continue
        rank[i] = len(rank)
        grams = {needle[p : p + _Q] for p in range(0, len(needle) - _Q + 1, _STEP)}
        for gram in grams:
            postings.setdefault(gram, []).append(i)
    return found


def _find_host(
    needle: bytes, datas: Sequence[bytes], postings: dict[bytes, list[int]], rank: dict[int, int]
) -> int | None:
    if len(needle) < _MIN_INDEXED:
        return next((c for c in rank if needle in datas[c]), None)
    hosts: set[int] = set()
    for j in range(_STEP):
        candidates: set[int] | None = None
        for p in range(j, len(needle) - _Q + 1, _STEP):
            posting = postings.get(needle[p : p + _Q])
            if posting is None:
                candidates = None
                break
            if candidates is None:
                candidates = set(posting)
            else:
                candidates.intersection_update(posting)
            if len(candidates) <= _FEW:
                break
        if candidates:
            hosts.update(c for c in candidates if needle in datas[c])
    return min(hosts, key=rank.__getitem__) if hosts else None
