"""Recurrent-state component (Mamba / GDN / KDA checkpoints).

A state is a fixed-size tensor summarising every token before a position; it cannot be split
per token. A node may carry one checkpoint (``node.state_slot``, a slot of the state pool)
valid after ``node.depth`` tokens. A match is usable only up to the deepest matched node that
holds a state; a hit refreshes only the state it consumed.

Eviction: the state walk is GreedyDual-Size (``components.gds``) under ``gds`` (``gdsf``: with
frequency), else LRU on the state's own access stamp; a caller may instead supply its own walk
(``state_walk=``, a factory; the :class:`StateWalk` protocol). A state is a candidate when it
is unlocked and, on a leaf, the leaf's KV is unlocked too (the leaf leaves whole: a leaf never
stays without a state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from components.gds import GDS_WALKS, make_gds_walk
from radix.node import TreeNode
from radix.ordered import OrderedNodeSet

if TYPE_CHECKING:
    from allocators import MambaStatePool


@runtime_checkable
class StateWalk(Protocol):
    """A state eviction walk: what :class:`StateComponent` calls on every state event.

    The contract is the one of :class:`components.gds.GDSStrategy`: ``on_set`` when a state is
    cached on a node (stored, loaded back), ``on_hit`` when a match consumes it, ``on_use``
    when its last request releases it, ``on_remove`` when it leaves (always after a pop, and
    for states removed with their leaf), ``requeue`` when a popped victim kept its state (a
    write-back copy in flight), ``pop_victim`` for the next evictable state (``None`` when
    none; only nodes for which ``is_candidate`` holds may be returned), ``check`` to assert
    that the walk tracks exactly ``state_nodes``. ``watermark`` is what
    ``RadixCache.watermark`` reports (0.0 for walks without one).

    Optional: ``on_match(kv_end, consumed, key, end)``, called by every match before
    ``on_hit``, with the deepest KV-matched device node (``None`` when nothing matched), the
    node whose state the match consumes (``None`` when none) and the matched key
    (``key[:end]``, token ids): where requests wanted a state, whether or not one was left
    there.
    """

    watermark: float

    def on_set(self, node: TreeNode) -> None: ...
    def on_hit(self, node: TreeNode) -> None: ...
    def on_use(self, node: TreeNode) -> None: ...
    def on_remove(self, node: TreeNode) -> None: ...
    def requeue(self, node: TreeNode) -> None: ...
    def pop_victim(self) -> TreeNode | None: ...
    def check(self, state_nodes: list[TreeNode]) -> None: ...


#: Builds a state walk for a component, given its ``is_candidate`` predicate.
StateWalkFactory = Callable[[Callable[[TreeNode], bool]], StateWalk]

_WALK_METHODS = ("on_set", "on_hit", "on_use", "on_remove", "requeue", "pop_victim", "check")


def check_state_walk_factory(state_walk: object) -> None:
    """``TypeError`` naming ``state_walk`` unless it is ``None`` or callable."""
    if state_walk is not None and not callable(state_walk):
        raise TypeError(
            "state_walk must be a callable (is_candidate) -> state walk, or None; "
            f"got {type(state_walk).__name__}"
        )


def _state_lru_key(n: TreeNode) -> tuple[int]:
    return (n.state_access_time,)


def _joint_key(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class StateComponent:
    """Owns ``node.state_slot`` and ``node.state_lock``; counters in slots."""

    name = "state"

    def __init__(
        self,
        allocator: MambaStatePool,
        walk: str = "lru",
        gds: tuple[float, float] | None = None,
        state_walk: StateWalkFactory | None = None,
    ) -> None:
        """Args:
            allocator: the state pool (slots).
            walk: ``"lru"`` (order by the state's own access stamp: a hit refreshes only the
                consumed state), ``"joint"`` (order by the node's stamp, shared with KV:
                ``joint_lru``), ``"gds"`` (GreedyDual-Size with coefficients ``gds``),
                ``"gdsf"`` (GDS with frequency: cost x (1 + hits)) or ``"gds_adaptive"``
                (:class:`components.gds_adaptive.AdaptiveGDSStrategy`).
            gds: ``(d, e)``, required with the three GDS walks and only then.
            state_walk: a factory ``is_candidate -> walk`` (:class:`StateWalk`) that replaces
                the walk named by ``walk`` (``walk`` then only says which policy the cache was
                built with; ``self.walk`` becomes ``"custom"``). Called once here, and again
                on every ``RadixCache.reset``.

        Raises:
            TypeError: ``state_walk`` is not callable, or built an object lacking a walk method.
            ValueError: unknown ``walk``, or ``gds`` given / missing.
        """
        if walk not in ("lru", "joint") + GDS_WALKS:
            raise ValueError(
                f"walk must be one of 'lru', 'joint', {', '.join(map(repr, GDS_WALKS))}; got {walk!r}"
            )
        if (walk in GDS_WALKS) != (gds is not None):
            raise ValueError(f"gds=(d, e) is required with walk in {GDS_WALKS} and only then")
        check_state_walk_factory(state_walk)
        self.allocator = allocator
        #: The pool's live free mask over slots (``None`` for a pool without one).
        self.free_mask = getattr(allocator, "free_mask", None)
        self.walk = walk
        self.gds: StateWalk | None = None
        """The strategy object every state event goes to (GDS or a custom walk); ``None``
        under the LRU walks."""
        if state_walk is not None:
            built = state_walk(self.is_candidate)
            missing = [m for m in _WALK_METHODS if not callable(getattr(built, m, None))]
            if missing or not hasattr(built, "watermark"):
                raise TypeError(
                    f"state_walk built a {type(built).__name__} without "
                    f"{', '.join(missing) or 'watermark'} (see components.state.StateWalk)"
                )
            self.walk = "custom"
            self.gds = built
        elif gds is not None:
            self.gds = make_gds_walk(walk, gds[0], gds[1], self.is_candidate)
        self._on_match = getattr(self.gds, "on_match", None)
        self.lru = (
            OrderedNodeSet(_joint_key if walk == "joint" else _state_lru_key)
            if self.gds is None
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

    def match_end(self, kv_end: TreeNode | None, consumed: TreeNode | None,
                  key: Sequence[int], end: int) -> None:
        """A match of ``key[:end]`` (token ids; ``end`` page-aligned) walked the KV path down to
        ``kv_end`` (``None``: nothing matched) and will consume the state on ``consumed``
        (``None``: none usable). Passed to the walk's optional ``on_match`` (a walk that learns
        from where requests wanted a state); ``key`` must not be kept or modified."""
        hook = self._on_match
        if hook is not None:
            hook(kv_end, consumed, key, end)

    def use(self, node: TreeNode, clock: int) -> None:
        """The state on ``node`` was consumed by a match (only that state is refreshed)."""
        node.state_access_time = clock
        if self.gds is not None:
            self.gds.on_hit(node)
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
