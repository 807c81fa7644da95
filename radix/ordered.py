"""One ordered set of nodes, reused by every eviction walk.

``OrderedNodeSet`` keeps nodes sorted by ``(key_fn(node), node.id)`` in a
``sortedcontainers.SortedList``; the key recorded at insertion is remembered so a node can be
moved or removed even after its fields changed. Keys may rise or fall between updates: the
structure is exact for every policy (no lazy entries).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sortedcontainers import SortedList

from radix.node import TreeNode


class OrderedNodeSet:
    """Nodes ordered by a key function, smallest first.

    Complexity: ``update``/``discard``/``pop_first`` O(log n); ``__contains__`` O(1).
    """

    __slots__ = ("_key_fn", "_sl", "_entries", "_nodes")

    def __init__(self, key_fn: Callable[[TreeNode], tuple[Any, ...]]) -> None:
        self._key_fn = key_fn
        self._sl: SortedList = SortedList()
        self._entries: dict[int, tuple[Any, ...]] = {}
        self._nodes: dict[int, TreeNode] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self._entries

    def update(self, node: TreeNode) -> None:
        """Insert ``node`` or move it to the position of its current key."""
        entry = (self._key_fn(node), node.id)
        old = self._entries.get(node.id)
        if old is not None:
            if old == entry:
                return
            self._sl.remove(old)
        self._sl.add(entry)
        self._entries[node.id] = entry
        self._nodes[node.id] = node

    def discard(self, node: TreeNode) -> None:
        """Remove ``node`` if present."""
        old = self._entries.pop(node.id, None)
        if old is not None:
            self._sl.remove(old)
            del self._nodes[node.id]

    def first(self) -> TreeNode | None:
        """The node with the smallest key, or ``None`` when empty."""
        if not self._sl:
            return None
        return self._nodes[self._sl[0][1]]

    def pop_first(self) -> TreeNode | None:
        """Remove and return the node with the smallest key, or ``None`` when empty."""
        if not self._sl:
            return None
        _, nid = self._sl.pop(0)
        del self._entries[nid]
        return self._nodes.pop(nid)

    def __iter__(self) -> Iterator[TreeNode]:
        for _, nid in list(self._sl):
            yield self._nodes[nid]

    def clear(self) -> None:
        self._sl.clear()
        self._entries.clear()
        self._nodes.clear()

    def check(self) -> None:
        """Every stored entry is the node's current key (the set is exact)."""
        assert len(self._sl) == len(self._entries) == len(self._nodes)
        for nid, entry in self._entries.items():
            node = self._nodes[nid]
            assert entry == (self._key_fn(node), nid), (
                f"stale ordered-set entry for {node}: {entry} != {(self._key_fn(node), nid)}"
            )
