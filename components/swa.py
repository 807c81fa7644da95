"""Sliding-window attention (SWA) component.

SWA layers only need the last ``sliding_window_size`` tokens. Nodes hold full-pool slot ids
(``node.kv_value``, owned by the KV component); the SWA slot of each token is found through the
allocator's full-to-SWA mapping. When the SWA KV of a node is freed while its full KV stays,
the node becomes a **tombstone** (``node.swa_tombstone``).

Usable prefix: a match may end after node ``i`` only if the ``sliding_window_size`` tokens
before that end all have live SWA KV, or no tombstone lies on the path from the root::

    root ── A [0, 8) live ── B [8, 16) tombstone ── C [16, 40) live      window W = 16
    ends usable: A (path live), C (24 live tokens >= W); not B.

Locks are window-bounded: ``lock(node)`` protects SWA only for nodes whose span reaches into
the last W tokens before ``node``'s end, and returns the start position of the topmost locked
node; ``unlock`` releases exactly the nodes with ``depth > start`` (splits in between copy the
lock to both halves, and both lie below ``start``).

Eviction (``evict_swa``): live, unlocked nodes in LRU order of ``last_access_time``; an internal
node becomes a tombstone, a leaf leaves whole (a tombstoned leaf could never be used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radix.node import TreeNode
from radix.ordered import OrderedNodeSet

if TYPE_CHECKING:
    from allocators.swa import SWAAllocator


def _lru_key(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class SWAComponent:
    """Owns ``node.swa_tombstone`` and ``node.swa_lock``; counters in tokens of live nodes."""

    name = "swa"

    def __init__(self, allocator: SWAAllocator, sliding_window_size: int) -> None:
        self.allocator = allocator
        self.window = sliding_window_size
        self.order = OrderedNodeSet(_lru_key)
        self._evictable = 0
        self._protected = 0

    @staticmethod
    def is_candidate(node: TreeNode) -> bool:
        return (
            node.parent is not None
            and not node.swa_tombstone
            and node.swa_lock == 0
            and (bool(node.children) or node.kv_lock == 0)
        )

    def refresh(self, node: TreeNode) -> None:
        if self.is_candidate(node):
            self.order.update(node)
        else:
            self.order.discard(node)

    # ------------------------------------------------------------------ values
    def attach(self, node: TreeNode, live: bool) -> None:
        """A new node (unlocked): live SWA KV, or a tombstone from the start."""
        node.swa_tombstone = not live
        if live:
            self._evictable += len(node.key)
        self.refresh(node)

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        upper.swa_tombstone = lower.swa_tombstone
        upper.swa_lock = lower.swa_lock
        self.refresh(upper)
        self.refresh(lower)

    def on_remove(self, node: TreeNode) -> None:
        """The KV component frees both sides of the slots; only the counters move here."""
        assert node.swa_lock == 0, node
        self.order.discard(node)
        if not node.swa_tombstone:
            self._evictable -= len(node.key)

    def tombstone(self, node: TreeNode) -> None:
        """Free ``node``'s SWA KV (full KV stays). The node must be live and unlocked."""
        assert not node.swa_tombstone and node.swa_lock == 0 and node.kv_value is not None, node
        self.allocator.free_swa(node.kv_value)
        node.swa_tombstone = True
        self._evictable -= len(node.key)
        self.order.discard(node)

    def revive(self, node: TreeNode) -> None:
        """``node`` just took slots with live SWA KV (insert over a tombstone)."""
        assert node.swa_tombstone and node.swa_lock == 0, node
        node.swa_tombstone = False
        self._evictable += len(node.key)
        self.refresh(node)

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> int:
        """Protect the live nodes covering the last ``window`` tokens before ``node``'s end.

        Returns the start position [tokens] of the topmost locked node (pass it to
        :meth:`unlock`); ``node.depth`` when nothing was locked.
        """
        start = node.depth
        covered = 0
        n = node
        while n.parent is not None and covered < self.window and not n.swa_tombstone:
            if n.swa_lock == 0:
                size = len(n.key)
                self._evictable -= size
                self._protected += size
            n.swa_lock += 1
            self.order.discard(n)
            covered += len(n.key)
            start = n.depth - len(n.key)
            n = n.parent
        starts = node.swa_lock_starts
        if starts is None:
            starts = node.swa_lock_starts = {}
        starts[start] = starts.get(start, 0) + 1
        return start

    def unlock(self, node: TreeNode, start: int) -> None:
        """Release the SWA lock taken by :meth:`lock` (``start`` as it returned)."""
        starts = node.swa_lock_starts
        assert starts is not None and starts.get(start, 0) > 0, (node, start)
        if starts[start] == 1:
            del starts[start]
            if not starts:
                node.swa_lock_starts = None
        else:
            starts[start] -= 1
        n = node
        while n.parent is not None and n.depth > start:
            n.swa_lock -= 1
            if n.swa_lock == 0:
                size = len(n.key)
                self._evictable += size
                self._protected -= size
            self.refresh(n)
            n = n.parent

    @staticmethod
    def can_unlock(node: TreeNode, start: int) -> bool:
        """Whether a lock taken on ``node`` returned ``start`` and is still held."""
        starts = node.swa_lock_starts
        return starts is not None and starts.get(start, 0) > 0

    # ------------------------------------------------------------------- rules
    def usable_ends(self, path: list[TreeNode]) -> list[bool]:
        """For each node of a matched path: may the match end after it?"""
        out = []
        live_run = 0
        seen_tombstone = False
        w = self.window
        for n in path:
            if n.swa_tombstone:
                seen_tombstone = True
                live_run = 0
                out.append(False)
            else:
                live_run += len(n.key)
                out.append(not seen_tombstone or live_run >= w)
        return out

    def pop_victim(self) -> TreeNode | None:
        return self.order.pop_first()

    # ---------------------------------------------------------------- counters
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def check(self, nodes: list[TreeNode]) -> None:
        ev = pr = 0
        expected = set()
        for n in nodes:
            assert n.swa_lock >= 0, n
            held = sum(n.swa_lock_starts.values()) if n.swa_lock_starts else 0
            assert held == n.lock_ref, f"SWA lock handles {held} != direct locks {n.lock_ref}: {n}"
            v = n.kv_value
            assert v is not None
            live = self.allocator.has_swa(v)
            if n.swa_tombstone:
                assert n.swa_lock == 0, f"tombstone under an SWA lock: {n}"
                assert not bool(live.any()), f"tombstone still maps SWA slots: {n}"
                if not n.children:
                    assert n.kv_lock > 0, f"unlocked tombstoned leaf: {n}"
                continue
            assert bool(live.all()), f"live node with unmapped SWA slots: {n}"
            if n.swa_lock == 0:
                ev += len(n.key)
            else:
                pr += len(n.key)
            if self.is_candidate(n):
                expected.add(n.id)
        assert ev == self._evictable, f"swa evictable {self._evictable} != recomputed {ev}"
        assert pr == self._protected, f"swa protected {self._protected} != recomputed {pr}"
        got = {n.id for n in self.order}
        assert got == expected, f"SWA eviction set differs: {got ^ expected}"
        self.order.check()
