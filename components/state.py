"""Recurrent-state component (Mamba / GDN / KDA checkpoints).

A state is a fixed-size tensor summarising every token before a position; it cannot be split
per token. A node may carry one checkpoint (``node.state_slot``, a slot of the state pool)
valid after ``node.depth`` tokens. A match is usable only up to the deepest matched node that
holds a state; a hit refreshes only the state it consumed.

Eviction: the state walk is GreedyDual-Size (``components.gds``) under ``gds``, else LRU on the
state's own access stamp. A state is a candidate when it is unlocked and, on a leaf, the leaf's
KV is unlocked too (the leaf leaves whole: a leaf never stays without a state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from components.gds import GDSStrategy
from radix.node import TreeNode
from radix.ordered import OrderedNodeSet

if TYPE_CHECKING:
    from allocators import MambaStatePool


def _state_lru_key(n: TreeNode) -> tuple[int]:
    return (n.state_access_time,)


def _joint_key(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class StateComponent:
    """Owns ``node.state_slot`` and ``node.state_lock``; counters in slots."""

    name = "state"

    def __init__(
        self, allocator: MambaStatePool, walk: str = "lru", gds: tuple[float, float] | None = None
    ) -> None:
        """Args:
            allocator: the state pool (slots).
            walk: ``"lru"`` (order by the state's own access stamp: a hit refreshes only the
                consumed state), ``"joint"`` (order by the node's stamp, shared with KV:
                ``joint_lru``) or ``"gds"`` (GreedyDual-Size with coefficients ``gds``).
        """
        if walk not in ("lru", "joint", "gds"):
            raise ValueError(f"walk must be 'lru', 'joint' or 'gds', got {walk!r}")
        if (walk == "gds") != (gds is not None):
            raise ValueError("gds=(d, e) is required with walk='gds' and only then")
        self.allocator = allocator
        #: The pool's live free mask over slots (``None`` for a pool without one).
        self.free_mask = getattr(allocator, "free_mask", None)
        self.walk = walk
        self.gds: GDSStrategy | None = (
            GDSStrategy(gds[0], gds[1], self.is_candidate) if gds is not None else None
        )
        self.lru = (
            OrderedNodeSet(_joint_key if walk == "joint" else _state_lru_key)
            if gds is None
            else None
        )
        self.slot_to_node: dict[int, TreeNode] = {}
        self._evictable = 0
        self._protected = 0

    @staticmethod
    def is_candidate(node: TreeNode) -> bool:
        return (
            node.state_slot is not None
            and node.state_lock == 0
            and (bool(node.children) or node.kv_lock == 0)
        )

    def refresh(self, node: TreeNode) -> None:
        if self.lru is not None:
            if self.is_candidate(node):
                self.lru.update(node)
            else:
                self.lru.discard(node)

    # ------------------------------------------------------------------ values
    def set_state(self, node: TreeNode, slot: int, clock: int) -> None:
        """Cache ``slot`` on ``node`` (which has none); stamps it."""
        assert node.state_slot is None and node.parent is not None, node
        node.state_slot = slot
        node.state_access_time = clock
        self.slot_to_node[slot] = node
        if node.state_lock == 0:
            self._evictable += 1
        else:
            self._protected += 1
        if self.gds is not None:
            self.gds.on_set(node)
        self.refresh(node)

    def use(self, node: TreeNode, clock: int) -> None:
        """The state on ``node`` was consumed by a match (only that state is refreshed)."""
        node.state_access_time = clock
        if self.gds is not None:
            self.gds.on_use(node)
        self.refresh(node)

    def remove_state(self, node: TreeNode) -> None:
        """Free ``node``'s state (its KV stays); the state must be unlocked."""
        slot = node.state_slot
        assert slot is not None and node.state_lock == 0, node
        if self.lru is not None:
            self.lru.discard(node)
        if self.gds is not None:
            self.gds.on_remove(node)
        del self.slot_to_node[slot]
        node.state_slot = None
        self._evictable -= 1
        free_owned = getattr(self.allocator, "free_owned", None)
        if free_owned is not None:
            free_owned(slot)
        else:
            self.allocator.free(_slot_tensor(slot))

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        """The state stays on ``lower`` (valid at its end); ``upper`` starts without one."""

    def on_remove(self, node: TreeNode) -> None:
        if node.state_slot is not None:
            self.remove_state(node)

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        if node.state_lock == 0 and node.state_slot is not None:
            self._evictable -= 1
            self._protected += 1
        node.state_lock += 1
        self.refresh(node)

    def unlock(self, node: TreeNode) -> None:
        node.state_lock -= 1
        if node.state_lock == 0 and node.state_slot is not None:
            self._evictable += 1
            self._protected -= 1
            if self.gds is not None:
                self.gds.on_use(node)  # released by its last request
        self.refresh(node)

    def requeue(self, node: TreeNode) -> None:
        """A popped victim kept its state (its write-back copy is in flight): file it again."""
        if node.state_slot is None:
            return
        if self.gds is not None:
            self.gds.requeue(node)
        else:
            self.refresh(node)

    # ---------------------------------------------------------------- eviction
    def pop_victim(self) -> TreeNode | None:
        """The next state to evict (walk order of the configured strategy), or ``None``."""
        if self.gds is not None:
            return self.gds.pop_victim()
        assert self.lru is not None
        return self.lru.pop_first()

    # ---------------------------------------------------------------- counters
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def check(self, nodes: list[TreeNode]) -> None:
        ev = pr = 0
        state_nodes = []
        for n in nodes:
            assert n.state_lock >= 0, n
            if n.state_slot is None:
                continue
            state_nodes.append(n)
            assert self.slot_to_node.get(n.state_slot) is n, f"slot map wrong for {n}"
            if n.state_lock == 0:
                ev += 1
            else:
                pr += 1
        assert len(state_nodes) == len(self.slot_to_node), "slot map holds removed states"
        assert ev == self._evictable, f"state evictable {self._evictable} != recomputed {ev}"
        assert pr == self._protected, f"state protected {self._protected} != recomputed {pr}"
        if self.lru is not None:
            expected = {n.id for n in state_nodes if self.is_candidate(n)}
            got = {n.id for n in self.lru}
            assert got == expected, f"state LRU set differs: {got ^ expected}"
            self.lru.check()
        if self.gds is not None:
            self.gds.check(state_nodes)


def _slot_tensor(slot: int) -> torch.Tensor:
    return torch.tensor([slot], dtype=torch.int64)
