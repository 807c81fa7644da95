"""The component contract.

One tree, several components. A component owns one kind of per-node value (KV slots, a
recurrent-state checkpoint, ...), its allocator, its lock count, its evictable / protected
counters, its eviction order, and the rule for whether a match is usable. The cache facade
(``radix.cache``) composes components; a component never walks the tree on its own except to
check invariants.

Units: KV components count tokens; the state component counts slots (one per checkpoint).
"""

from __future__ import annotations

from typing import Protocol

from radix.node import TreeNode


class Component(Protocol):
    """What every component provides to the cache facade."""

    name: str

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        """``lower`` just lost its first ``split_len`` tokens to the new ``upper`` node."""

    def on_remove(self, node: TreeNode) -> None:
        """``node`` leaves the tree: free its value and forget it."""

    def refresh(self, node: TreeNode) -> None:
        """``node``'s leaf status, locks or stamps changed: re-file it in the eviction order."""

    def evictable_size(self) -> int:
        """Units held by the tree that no request protects."""

    def protected_size(self) -> int:
        """Units held by the tree under a request's lock."""

    def check(self, nodes: list[TreeNode]) -> None:
        """Recompute every counter from ``nodes`` (all non-root nodes) and assert invariants."""
