"""Which tree node holds each KV id, and per group of ids how many are held, and how many by
locked nodes: kept by the KV component's hooks, so that a memory arena's compaction
(``components.compaction``) picks its chunks and the nodes to rewrite without walking the tree.

A *group* is ``group`` consecutive KV ids (pages when paged; slots otherwise): id ``i`` lies in
group ``i // group`` (an arena chunk: ``MemoryArena.pages_per_chunk`` pages, group 0 holding
the padding id 0). Kept per group ``g``::

    held[g]     ids of group g held by a tree node (a node's ``kv_value``)
    locked[g]   ids of group g held by a node with kv_lock > 0      (locked[g] <= held[g])
    holder[i]   node.id of the node holding id i                    (stale where i is not held)

What changes them, and only there (``components.kv.KVComponent`` calls each):

* :meth:`add` / :meth:`remove`: a node takes (attach, replace, a load-back) or gives up its
  ids (a removal, an eviction): ``held`` (and ``locked`` for a locked node) +- its ids.
* :meth:`set_locked`: a node's ``kv_lock`` goes 0 -> 1 or 1 -> 0: ``locked`` +- its ids.
* :meth:`split`: the upper half's ids now name the new node (a split copies ``kv_lock`` to
  the new node, so no count changes).
* :meth:`move`: ids ``src`` of unlocked nodes became ids ``dst`` (a compaction).

The per-group counts of one node value are computed once per value (``np.unique`` of its ids'
groups) and kept with the node's id while the node holds that same array (a node's array is
never written: ``components.kv``), so a lock change costs O(groups the node touches).
:meth:`check` recounts everything from the nodes (the reference).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from allocators.arena import group_counts

if TYPE_CHECKING:
    from components.kv import KVValue
    from radix.node import TreeNode

__all__ = ["ChunkHolders"]


class ChunkHolders:
    """Per-group held / locked id counts and the holder of each id (module docstring).

    Args:
        num_ids: ids ``1..num_ids`` (0 is the padding id).
        group: ids per group (``> 0``).
        page_size: slots per id (a node value holds ``page_size`` slots per id, in order).

    Raises:
        ValueError: a bad size, naming it.
    """

    def __init__(self, num_ids: int, group: int, page_size: int) -> None:
        for name, v in (("num_ids", num_ids), ("group", group), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.group = group
        self.page_size = page_size
        num_groups = num_ids // group + 1
        #: ids held by tree nodes, per group (int64)
        self.held = np.zeros(num_groups, dtype=np.int64)
        #: ids held by locked tree nodes, per group (int64)
        self.locked = np.zeros(num_groups, dtype=np.int64)
        #: node.id holding each id (int64; stale where the id is not held)
        self.holder = np.zeros(num_ids + 1, dtype=np.int64)
        #: node.id -> node, for every node holding ids
        self.nodes: dict[int, TreeNode] = {}
        #: node.id -> (the value counted, its groups ascending, ids per group)
        self._counts: dict[int, tuple[KVValue, np.ndarray, np.ndarray]] = {}

    @classmethod
    def build(cls, nodes: Iterable[TreeNode], num_ids: int, group: int,
              page_size: int) -> ChunkHolders:
        """The counts of ``nodes`` (every node of a tree: those with a ``kv_value`` count),
        from scratch. O(slots held)."""
        out = cls(num_ids, group, page_size)
        for node in nodes:
            if node.kv_value is not None:
                out.add(node, node.kv_value)
        return out

    def ids(self, value: KVValue) -> np.ndarray:
        """The ids of a node value (a node's ``array('q')``, on every device) as int64, in
        token order (pages when paged). A view: not to be written."""
        assert type(value) is array, "a node's KV value is an array('q')"
        slots = np.frombuffer(value, dtype=np.int64)
        return slots if self.page_size == 1 else slots[:: self.page_size] // self.page_size

    def counts(self, node: TreeNode) -> tuple[np.ndarray, np.ndarray]:
        """``(groups, ids per group)`` of ``node``'s value (ascending groups), computed once
        per value."""
        value = node.kv_value
        assert value is not None, node
        got = self._counts.get(node.id)
        if got is not None and got[0] is value:
            return got[1], got[2]
        groups, k = group_counts(self.ids(value) // self.group, self.held.size)
        self._counts[node.id] = (value, groups, k)
        return groups, k

    # ----------------------------------------------------------------- hooks
    def add(self, node: TreeNode, value: KVValue) -> None:
        """``node`` holds ``value`` now (it is ``node.kv_value``)."""
        self.holder[self.ids(value)] = node.id
        self.nodes[node.id] = node
        groups, k = self.counts(node)
        self.held[groups] += k
        if node.kv_lock:
            self.locked[groups] += k

    def remove(self, node: TreeNode) -> None:
        """``node`` gives up its ``kv_value`` (still set when called)."""
        groups, k = self.counts(node)
        self.held[groups] -= k
        if node.kv_lock:
            self.locked[groups] -= k
        del self.nodes[node.id]
        del self._counts[node.id]

    def set_locked(self, node: TreeNode, sign: int) -> None:
        """``node``'s ``kv_lock`` went 0 -> 1 (``sign = 1``) or 1 -> 0 (``-1``)."""
        if node.kv_value is not None:
            groups, k = self.counts(node)
            self.locked[groups] += sign * k

    def split(self, upper: TreeNode) -> None:
        """``upper`` (new, its ``kv_value`` set) took the first ids of a node's value."""
        if upper.kv_value is not None:
            self.holder[self.ids(upper.kv_value)] = upper.id
            self.nodes[upper.id] = upper

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Ids ``src[i]`` of unlocked nodes are ids ``dst[i]`` now."""
        self.holder[dst] = self.holder[src]
        n = self.held.size
        self.held += np.bincount(dst // self.group, minlength=n) \
            - np.bincount(src // self.group, minlength=n)

    # ------------------------------------------------------------------ check
    def check(self, nodes: Iterable[TreeNode]) -> None:
        """Recount from ``nodes`` (every node of the tree) and compare: ``held``, ``locked``,
        the holder of every held id, the node map. Raises ``AssertionError``."""
        held = np.zeros_like(self.held)
        locked = np.zeros_like(self.locked)
        seen: dict[int, TreeNode] = {}
        for node in nodes:
            if node.kv_value is None:
                continue
            ids = self.ids(node.kv_value)
            np.add.at(held, ids // self.group, 1)
            if node.kv_lock:
                np.add.at(locked, ids // self.group, 1)
            bad = ids[self.holder[ids] != node.id]
            assert not bad.size, f"ids {bad[:8].tolist()} of {node} name another holder"
            seen[node.id] = node
        assert (held == self.held).all(), (
            f"held per group {self.held.tolist()} != recounted {held.tolist()}")
        assert (locked == self.locked).all(), (
            f"locked per group {self.locked.tolist()} != recounted {locked.tolist()}")
        assert seen.keys() == self.nodes.keys() and all(
            self.nodes[i] is n for i, n in seen.items()), "the node map differs from the tree"
