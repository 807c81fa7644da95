"""What a tier below the device pools provides to the cache.

The cache calls its tier, when it has one, through a few named hooks, once per engine call
(the per-node structural hooks of a tier that keeps per-node copies go through the component
tuple, ``components.base.Component``)::

    match_prefix   before_match(key, extra_key)   (finish copies; L3 prefetch past the tree)
                   device_part(path)              (the device prefix of the matched path)
                   host_hit(path, usable, ...)    (what a load-back would add)
    insert         after_insert(path, last)       (write policy)
    evict          collect_landed()               (copies that landed free their slots now)
                   free_leaf(node, freed)         (demote instead of remove)

:class:`Tier` documents the hooks; its defaults are what a cache without a tier does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radix.node import TreeNode


class Tier:
    """A tier below the device pools. The defaults are the device-only behaviour: matches
    are device matches, inserts back nothing up, evicted leaves leave the tree."""

    def before_match(self, key: Any, extra_key: Any) -> None:
        """Called first by every ``match_prefix``."""

    def device_part(self, path: list[TreeNode]) -> list[TreeNode]:
        """The prefix of a matched path whose KV is on device."""
        return path

    def host_hit(self, path: list[TreeNode], usable: int, last: TreeNode,
                 prefix_len: int) -> tuple[TreeNode, int]:
        """``(last_host_node, host_hit_length)`` of a match whose usable device prefix is
        ``path[:usable]`` ending at ``last`` (``prefix_len`` tokens)."""
        return last, 0

    def after_insert(self, path: list[TreeNode], last: TreeNode) -> None:
        """Called last by every ``insert``."""

    def collect_landed(self) -> tuple[int, ...]:
        """Before a KV eviction: the device units freed by copies that landed since, per
        ``radix.core.EVICT_FIELDS``."""
        return (0, 0, 0)

