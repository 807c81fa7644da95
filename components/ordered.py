"""One ordered set of nodes, reused by every eviction walk.

``OrderedNodeSet`` keeps nodes ordered by ``(key_fn(node), node.id)``: a binary heap
(``heapq``, C comparisons of the entry tuples) with lazy deletion, plus a dict holding each
member's *current* entry. A heap entry is live only while it equals its node's current entry,
so moving a node is one push (the old entry goes stale) and removing one is a dict delete;
stale entries are dropped when they reach the top, and the heap is rebuilt from the live
entries when stale ones outnumber them. Keys may rise or fall between updates: the order is
exact for every policy (the live entry is the one compared, never a stale one).

The heap holds node *ids*, not nodes, so a removed node is not kept alive by a stale entry
(it is freed at once, without the cycle collector). An entry is one flat tuple, the key's
fields then the id (``key_fn(node) + (node.id,)``, not ``(key, id)``: one tuple per entry, not
two, and one object less to reach per comparison; the same order, as every key of one key
function has the same length).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radix.node import TreeNode

#: A heap larger than ``2 * live + _SLACK`` entries is rebuilt from the live ones (a small
#: slack: stale entries of a small set are memory the cache holds, about 100 bytes each).
_SLACK = 8


class OrderedNodeSet:
    """Nodes ordered by a key function, smallest first.

    Complexity (n members): ``update`` O(log n) amortised (one ``heappush``; one O(n) rebuild
    per n stale entries), ``discard`` and ``__contains__`` O(1), ``pop_first`` / ``first``
    O(log n) amortised, iteration O(n log n).
    """

    __slots__ = ("_key_fn", "_heap", "_entries", "_nodes")

    def __init__(self, key_fn: Callable[[TreeNode], tuple[Any, ...]]) -> None:
        self._key_fn = key_fn
        self._heap: list[tuple[Any, ...]] = []
        self._entries: dict[int, tuple[Any, ...]] = {}
        self._nodes: dict[int, TreeNode] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self._entries

    def update(self, node: TreeNode) -> None:
        """Insert ``node`` or move it to the position of its current key."""
        nid = node.id
        entry = self._key_fn(node) + (nid,)
        entries = self._entries
        if entries.get(nid) == entry:
            return
        entries[nid] = entry
        self._nodes[nid] = node
        heap = self._heap
        heappush(heap, entry)
        if len(heap) > 2 * len(entries) + _SLACK:
            self._rebuild()

    def discard(self, node: TreeNode) -> None:
        """Remove ``node`` if present (its heap entries go stale)."""
        if self._entries.pop(node.id, None) is not None:
            del self._nodes[node.id]

    def _top(self) -> tuple[Any, ...] | None:
        """The smallest live entry, dropping stale ones above it."""
        heap, entries = self._heap, self._entries
        while heap:
            top = heap[0]
            if entries.get(top[-1]) == top:
                return top
            heappop(heap)
        return None

    def first(self) -> TreeNode | None:
        """The node with the smallest key, or ``None`` when empty."""
        top = self._top()
        return None if top is None else self._nodes[top[-1]]

    def pop_first(self) -> TreeNode | None:
        """Remove and return the node with the smallest key, or ``None`` when empty."""
        heap, entries = self._heap, self._entries
        while heap:  # (:meth:`_top` inline: pop, and drop a stale entry)
            top = heappop(heap)
            nid = top[-1]
            if entries.get(nid) == top:
                del entries[nid]
                return self._nodes.pop(nid)
        return None

    def _rebuild(self) -> None:
        heap = list(self._entries.values())
        heapify(heap)
        self._heap = heap

    def __iter__(self) -> Iterator[TreeNode]:
        nodes = self._nodes
        for entry in sorted(self._entries.values()):
            yield nodes[entry[-1]]

    def clear(self) -> None:
        self._heap.clear()
        self._entries.clear()
        self._nodes.clear()

    def check(self) -> None:
        """Every member's entry is its node's current key and is in the heap; the heap holds
        no live entry of a non-member (the set is exact)."""
        assert len(self._entries) == len(self._nodes)
        in_heap = set(self._heap)
        for nid, entry in self._entries.items():
            node = self._nodes[nid]
            assert entry == self._key_fn(node) + (nid,), (
                f"stale ordered-set entry for {node}: {entry} != {self._key_fn(node) + (nid,)}"
            )
            assert entry in in_heap, f"{node}'s entry {entry} is missing from the heap"
        for i in range(1, len(self._heap)):
            assert not self._heap[i] < self._heap[(i - 1) // 2], "heap order broken"
