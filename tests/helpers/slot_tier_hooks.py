"""Tier hooks shared by the test plug-ins that keep one slot per node (``components.base.TIER_HOOKS``).

A plug-in built on :class:`OneSlotTierHooks` keeps, in the node's extension slot (``node.ext``),
its device slot under ``"dev"`` and its host slot under ``"host"``: the host tier backs up a
node that has a device slot and no host slot, restores one that has a host slot and no device
slot, and frees the host slot back to ``host_allocator`` when the host copy is dropped.
"""

from __future__ import annotations

from typing import Any

import torch


class OneSlotTierHooks:
    """The host-tier hooks of a plug-in with one device slot and one host slot per node.

    ``host_allocator`` is set by the host tier (from the plug-in's ``host_pool``).
    """

    host_allocator: Any

    @staticmethod
    def _ext(node: Any) -> dict[str, int]:
        if node.ext is None:
            node.ext = {}
        return node.ext

    def has_device(self, node: Any) -> bool:
        return "dev" in self._ext(node)

    def host_copy(self, node: Any) -> torch.Tensor | None:
        h = self._ext(node).get("host")
        return None if h is None else torch.tensor([h])

    def backup_size(self, node: Any) -> int:
        ext = self._ext(node)
        return int("dev" in ext and "host" not in ext)

    def backup(self, node: Any, host: torch.Tensor) -> torch.Tensor:
        ext = self._ext(node)
        ext["host"] = int(host[0])
        return torch.tensor([ext["dev"]])

    def restore_size(self, node: Any, last: bool) -> int:
        ext = self._ext(node)
        return int("host" in ext and "dev" not in ext)

    def restore(self, node: Any, device: torch.Tensor, now: int) -> torch.Tensor:
        ext = self._ext(node)
        ext["dev"] = int(device[0])
        return torch.tensor([ext["host"]])

    def drop_host(self, node: Any) -> None:
        h = self._ext(node).pop("host", None)
        if h is not None:
            self.host_allocator.free(torch.tensor([h]))
