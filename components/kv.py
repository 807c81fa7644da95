"""Full-attention KV component: per-node KV slot indices; any prefix of a cached path is usable.

Eviction candidates are unlocked leaves, ordered by the radix eviction policy's key
(``radix.policies``) in one exact ordered set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radix.node import TreeNode
from radix.ordered import OrderedNodeSet
from radix.policies import KeyFn

if TYPE_CHECKING:
    from allocators import SlotAllocator


class KVComponent:
    """Owns ``node.kv_value`` (1-D int64 slot tensor, one slot per token) and ``node.kv_lock``.

    Counters (tokens): ``evictable_size`` = tokens of nodes with ``kv_lock == 0``,
    ``protected_size`` = tokens of nodes with ``kv_lock > 0``.
    """

    name = "kv"

    def __init__(self, allocator: SlotAllocator, key_fn: KeyFn, host_tier: bool = False) -> None:
        """Args:
            allocator: device KV slots.
            key_fn: the radix eviction policy's key.
            host_tier: nodes may be host-only (HiCache): an eviction candidate is then a
                *device* leaf (on device, no child on device) rather than a childless node.
        """
        self.allocator = allocator
        # The tree frees only slots its nodes hold: skip the allocator's boundary checks.
        self._free = getattr(allocator, "free_owned", allocator.free)
        self.host_tier = host_tier
        self.leaves = OrderedNodeSet(key_fn)
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ values
    def attach(self, node: TreeNode, value: torch.Tensor) -> None:
        """Give a node (``kv_lock == 0``) its slots: a copy, so the node does not keep the
        caller's whole tensor alive (8 bytes per cached token, not the request's length)."""
        node.kv_value = value.clone()
        self._evictable += value.shape[0]

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        value = lower.kv_value
        if value is None:  # a host-only node (HiCache)
            return
        upper.kv_value = value[:split_len]
        lower.kv_value = value[split_len:]
        if lower in self.leaves:  # its key may depend on its start (tlru)
            self.leaves.update(lower)

    def on_remove(self, node: TreeNode) -> None:
        value = node.kv_value
        assert value is not None and node.kv_lock == 0, node
        self.leaves.discard(node)
        self._evictable -= value.shape[0]
        self._free(value)
        node.kv_value = None

    def is_candidate(self, node: TreeNode) -> bool:
        """An unlocked device leaf."""
        if node.parent is None or node.kv_lock or node.kv_value is None:
            return False
        if not self.host_tier:
            return not node.children
        return not any(c.kv_value is not None for c in node.children.values())

    def refresh(self, node: TreeNode) -> None:
        if self.is_candidate(node):
            self.leaves.update(node)
        else:
            self.leaves.discard(node)

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors (root excluded)."""
        n = node
        while n.parent is not None:
            if n.kv_lock == 0:
                size = len(n.key)
                self._evictable -= size
                self._protected += size
            n.kv_lock += 1
            n = n.parent
        self.leaves.discard(node)

    def unlock(self, node: TreeNode) -> None:
        """Release one lock on ``node`` and its ancestors; the caller checked ``kv_lock > 0``."""
        n = node
        while n.parent is not None:
            n.kv_lock -= 1
            if n.kv_lock == 0:
                size = len(n.key)
                self._evictable += size
                self._protected -= size
            n = n.parent
        self.refresh(node)

    # ---------------------------------------------------------------- counters
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def check(self, nodes: list[TreeNode]) -> None:
        ev = pr = 0
        expected_leaves = set()
        for n in nodes:
            v = n.kv_value
            if v is None:
                assert self.host_tier and n.host_value is not None, f"node with no KV anywhere: {n}"
                assert n.kv_lock == 0, f"host-only node locked: {n}"
                assert all(c.kv_value is None for c in n.children.values()), (
                    f"device node below a host-only one: {n}"
                )
                continue
            assert v.dtype == torch.int64 and v.dim() == 1, n
            assert len(v) == len(n.key), f"{n}: {len(v)} slots for {len(n.key)} tokens"
            assert n.kv_lock >= 0, n
            p = n.parent
            assert p is not None
            if p.parent is not None:
                assert p.kv_lock >= n.kv_lock, f"parent less locked than child: {p} / {n}"
            if n.kv_lock == 0:
                ev += len(v)
            else:
                pr += len(v)
            if self.is_candidate(n):
                expected_leaves.add(n.id)
        assert ev == self._evictable, f"kv evictable {self._evictable} != recomputed {ev}"
        assert pr == self._protected, f"kv protected {self._protected} != recomputed {pr}"
        got = {n.id for n in self.leaves}
        assert got == expected_leaves, (
            f"kv eviction set differs: extra {got - expected_leaves}, missing {expected_leaves - got}"
        )
        self.leaves.check()
