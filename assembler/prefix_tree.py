"""A bounded chunk-level prefix tree of the chunk sequences recently sent (RAGCache-style).

Each path from the root is the sequence of content keys of one prompt: first the key of its
static head (system prompt, few-shot examples), then its chunks in the order sent. Node
counts are bounded by ``max_nodes``; the least recently used leaf is evicted first.

LRU invariant: a path is always touched leaf-first, root-last, so every node is more recent
than all of its descendants and the least recently used node is always a leaf. Eviction
therefore never orphans a subtree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ragkv.errors import ConfigError


@dataclass(slots=True, eq=False)
class _Node:
    key: bytes
    parent: _Node | None
    children: dict[bytes, _Node] = field(default_factory=dict)
    hits: int = 0
    last: int = 0


class ChunkPrefixTree:
    """The chunk orders sent recently, as a tree, for a greedy longest-shared-prefix walk."""

    def __init__(self, max_nodes: int = 16_384) -> None:
        if max_nodes < 1:
            raise ConfigError("max_nodes must be >= 1.")
        self.max_nodes = max_nodes
        self._root = _Node(b"", None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # least recently used first
        self._tick = 0

    def walk(self, head: bytes, wanted: Collection[bytes]) -> list[bytes]:
        """Greedy walk below ``head``: at each node take the most-hit child in ``wanted``.

        Returns the chunk keys along the walked path, each at most once, all from ``wanted``.
        """
        node = self._root.children.get(head)
        path: list[bytes] = []
        taken: set[bytes] = set()
        while node is not None and node.children:
            children = node.children
            if len(children) <= len(wanted):
                candidates = [c for k, c in children.items() if k in wanted and k not in taken]
            else:
                candidates = [children[k] for k in wanted if k in children and k not in taken]
            if not candidates:
                break
            node = max(candidates, key=_preference)
            path.append(node.key)
            taken.add(node.key)
        return path

    def insert(self, head: bytes, keys: Sequence[bytes]) -> None:
        """Record that a prompt with static head ``head`` sent chunks ``keys`` in this order."""
        self._tick += 1
        node = self._root
        touched: list[_Node] = []
        for key in (head, *keys):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, node)
            child.hits += 1
            child.last = self._tick
            touched.append(child)
            node = child
        lru = self._lru
        for child in reversed(touched):
            lru[child] = None
            lru.move_to_end(child)
        while len(lru) > self.max_nodes:
            leaf, _ = lru.popitem(last=False)
            assert leaf.parent is not None and not leaf.children
            del leaf.parent.children[leaf.key]

    def __len__(self) -> int:
        return len(self._lru)


def _preference(node: _Node) -> tuple[int, int]:
    return (node.hits, node.last)
