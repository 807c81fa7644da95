"""Recurrent-state component (Mamba / GDN / KDA checkpoints).

A state is a fixed-size tensor summarising every token before a position; it cannot be split
per token. A node may carry one checkpoint (``node.state_slot``, a slot of the state pool)
valid after ``node.depth`` tokens. A match is usable only up to the deepest matched node that
holds a state; a hit refreshes only the state it consumed.

Eviction: the state walk is GreedyDual-Size (``components.eviction.gds``) under ``gds`` (``gdsf``: with
frequency), else LRU on the state's own access stamp; a caller may instead supply its own walk
(``state_walk=``, a factory; the :class:`StateWalk` protocol). A state is a candidate when it
is unlocked and, on a leaf, the leaf's KV is unlocked too (the leaf leaves whole: a leaf never
stays without a state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from allocators.host_mirror import host_int
from components.base import Component, InsertPlan
from components.eviction.adaptive import AdaptiveGDSStrategy
from components.eviction.gds import GDS_WALKS, GDSFStrategy, GDSStrategy
from components.ordered import OrderedNodeSet

if TYPE_CHECKING:
    from allocators import MambaStatePool
    from radix.node import TreeNode


@runtime_checkable
class StateWalk(Protocol):
    """A state eviction walk: what :class:`StateComponent` calls on every state event.

    The contract is the one of :class:`components.eviction.gds.GDSStrategy`: ``on_set`` when a state is
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
    there. ``key`` must not be kept or modified.

    Optional: ``on_hint(extra)``, called at the start of every match and insert with the
    request's checked hints (:mod:`radix.hints`; ``None`` when it carries none): every
    ``on_set`` / ``on_hit`` / ``on_match`` until the next ``on_hint`` serves that request.
    """

    @property
    def watermark(self) -> float: ...

    def on_set(self, node: TreeNode) -> None: ...
    def on_hit(self, node: TreeNode) -> None: ...
    def on_use(self, node: TreeNode) -> None: ...
    def on_remove(self, node: TreeNode) -> None: ...
    def requeue(self, node: TreeNode) -> None: ...
    def pop_victim(self) -> TreeNode | None: ...
    def check(self, state_nodes: list[TreeNode]) -> None: ...


#: Builds a state walk for a component, given its ``is_candidate`` predicate.
StateWalkFactory = Callable[[Callable[["TreeNode"], bool]], StateWalk]

_WALK_METHODS = ("on_set", "on_hit", "on_use", "on_remove", "requeue", "pop_victim", "check")


def check_state_walk_factory(state_walk: object) -> None:
    """``TypeError`` naming ``state_walk`` unless it is ``None`` or callable."""
    if state_walk is not None and not callable(state_walk):
        raise TypeError(
            "state_walk must be a callable (is_candidate) -> state walk, or None; "
            f"got {type(state_walk).__name__}"
        )


#: The GreedyDual-Size family of state walks by name: ``(d, e, is_candidate) -> walk``.
GDS_WALK_CLASSES: dict[str, Callable[[float, float, Callable[[TreeNode], bool]], StateWalk]] = {
    "gds": GDSStrategy,
    "gdsf": GDSFStrategy,
    "gds_adaptive": AdaptiveGDSStrategy,
}
assert tuple(GDS_WALK_CLASSES) == GDS_WALKS


def make_gds_walk(walk: str, d: float, e: float,
                  is_candidate: Callable[[TreeNode], bool]) -> StateWalk:
    """The GDS-family walk named ``walk`` (one of :data:`components.eviction.gds.GDS_WALKS`).

    Raises:
        ValueError: not a GDS walk name.
    """
    cls = GDS_WALK_CLASSES.get(walk)
    if cls is None:
        raise ValueError(f"not a GDS walk: {walk!r}; expected one of {GDS_WALKS}")
    return cls(d, e, is_candidate)


def _state_lru_key(n: TreeNode) -> tuple[int]:
    return (n.state_access_time,)


def _joint_key(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class StateComponent(Component):
    """Owns ``node.state_slot`` and ``node.state_lock``; counters in slots.

    ``evicted`` counts states freed (evictions, demotions), ``inserted`` states adopted by
    inserts. Under ``joint_lru`` (``walk="joint"``) a state's order follows its node's stamp,
    so a match re-files the states along its path (:meth:`on_touch`).
    """

    name = "state"
    evict_field = "num_states"
    checkpoints = True

    def __init__(
        self,
        allocator: MambaStatePool,
        walk: str = "lru",
        gds: tuple[float, float] | None = None,
        state_walk: StateWalkFactory | None = None,
        *,
        recency: str = "consumed",
        stateless_leaf: str = "prune",
    ) -> None:
        """Args:
            allocator: the state pool (slots).
            walk: ``"lru"`` (order by the state's own access stamp: a hit refreshes only the
                consumed state), ``"joint"`` (order by the node's stamp, shared with KV:
                ``joint_lru``), ``"gds"`` (GreedyDual-Size with coefficients ``gds``),
                ``"gdsf"`` (GDS with frequency: cost x (1 + hits)) or ``"gds_adaptive"``
                (:class:`components.eviction.adaptive.AdaptiveGDSStrategy`).
            gds: ``(d, e)``, required with the three GDS walks and only then.
            state_walk: a factory ``is_candidate -> walk`` (:class:`StateWalk`) that replaces
                the walk named by ``walk`` (``walk`` then only says which policy the cache was
                built with; ``self.walk`` becomes ``"custom"``). Called once here, and again
                on every ``RadixCache.reset``.
            recency: ``"consumed"`` (a match refreshes only the state it ends at, an insert
                the state it ends at) or ``"path"`` (every state on the matched or inserted
                path, and the lower half of a split: SGLang's ``MambaRadixCache``); ``"path"``
                needs ``walk="lru"``.
            stateless_leaf: ``"prune"`` (an unlocked leaf left with no state is removed, with
                the ancestors it leaves childless and stateless) or ``"keep"`` (it stays, KV
                only, until a KV eviction frees it: SGLang 0.5.23).

        Raises:
            TypeError: ``state_walk`` is not callable, or built an object lacking a walk method.
            ValueError: unknown ``walk``, ``gds`` given / missing, a bad ``recency`` or
                ``stateless_leaf``.
        """
        if walk not in ("lru", "joint") + GDS_WALKS:
            raise ValueError(
                f"walk must be one of 'lru', 'joint', {', '.join(map(repr, GDS_WALKS))}; got {walk!r}"
            )
        if (walk in GDS_WALKS) != (gds is not None):
            raise ValueError(f"gds=(d, e) is required with walk in {GDS_WALKS} and only then")
        check_state_walk_factory(state_walk)
        if recency not in ("consumed", "path"):
            raise ValueError(f"recency must be 'consumed' or 'path', got {recency!r}")
        if recency == "path" and (walk != "lru" or state_walk is not None):
            raise ValueError(f"recency='path' needs walk='lru' (the state LRU), got walk={walk!r}")
        if stateless_leaf not in ("prune", "keep"):
            raise ValueError(f"stateless_leaf must be 'prune' or 'keep', got {stateless_leaf!r}")
        self.recency = recency
        self.stateless_leaf = stateless_leaf
        self.allocator = allocator
        self.restore_allocator: Any = allocator
        #: The pool's live free mask over slots (``None`` for a pool without one).
        self.free_mask = getattr(allocator, "free_mask", None)
        #: The pool's check that a slot lies in memory it owns (a memory arena's view:
        #: ``ArenaStatePool.check_owned_slots``); ``None``: every slot in range is the pool's.
        self._check_owned: Callable[[int, str], None] | None = getattr(
            allocator, "check_owned_slots", None)
        self._walk_name = walk
        self._gds_args = gds
        self._state_walk = state_walk
        skip = set()
        if walk != "joint" and recency != "path":
            skip.add("on_touch")
        if recency != "path":
            skip.add("on_split")
        if stateless_leaf == "keep":
            skip.add("is_dead")
        self.skip_hooks = frozenset(skip)
        self.walk = walk
        self.gds: StateWalk | None = None
        """The strategy object every state event goes to (GDS or a custom walk); ``None``
        under the LRU walks."""
        self.lru: OrderedNodeSet | None = None
        self.slot_to_node: dict[int, TreeNode] = {}
        self._evictable = self._protected = self.evicted = self.inserted = 0
        self._on_match: Callable[..., None] | None = None
        self._on_hint: Callable[..., None] | None = None
        #: Observer of every state cached on (``True``) or freed from (``False``) a node,
        #: called after the node's ``state_slot`` changed (the KV event recorder).
        self.on_state_change: Callable[[TreeNode, bool], None] | None = None
        self.reset()
        if self._on_match is None:
            self.skip_hooks = self.skip_hooks | {"on_match"}
        if self._on_hint is None:
            self.skip_hooks = self.skip_hooks | {"on_hint"}

    def reset(self) -> None:
        """Every state is gone: counters at 0, a fresh walk (a custom walk's factory is
        called again)."""
        walk, gds, state_walk = self._walk_name, self._gds_args, self._state_walk
        self.gds = None
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
        self._on_hint = getattr(self.gds, "on_hint", None)
        self.lru = (
            OrderedNodeSet(_joint_key if walk == "joint" else _state_lru_key)
            if self.gds is None
            else None
        )
        self.slot_to_node = {}
        self._evictable = self._protected = self.evicted = self.inserted = 0

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
        if self.on_state_change is not None:
            self.on_state_change(node, True)
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
            self.gds.on_hit(node)
        self.refresh(node)

    def remove_state(self, node: TreeNode) -> None:
        """Free ``node``'s state (its KV stays; counted as evicted); the state must be
        unlocked."""
        slot = node.state_slot
        assert slot is not None and node.state_lock == 0, node
        if self.lru is not None:
            self.lru.discard(node)
        if self.gds is not None:
            self.gds.on_remove(node)
        del self.slot_to_node[slot]
        node.state_slot = None
        if self.on_state_change is not None:
            self.on_state_change(node, False)
        self._evictable -= 1
        self.evicted += 1
        free_owned = getattr(self.allocator, "free_owned", None)
        if free_owned is not None:
            free_owned(slot)
        else:
            self.allocator.free(_slot_tensor(slot))

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        """The state stays on ``lower`` (valid at its end; ``upper`` starts without one).
        ``recency="path"`` only: the walk that split it passed through, so its state moves to
        most recently used."""
        if lower.state_slot is not None:
            lower.state_access_time = lower.last_access_time
            self.refresh(lower)

    def on_remove(self, node: TreeNode) -> int:
        if node.state_slot is None:
            return 0
        self.remove_state(node)
        return 1

    def is_dead(self, node: TreeNode) -> bool:
        """No state on device or on host: nothing could ever be resumed from this leaf."""
        return node.state_slot is None and node.host_state_slot is None

    # ------------------------------------------------------------------- match
    def usable(self, path: list[TreeNode], n: int) -> int:
        """A match ends at a node holding a state (the deepest such node within ``n``)."""
        while n > 0 and path[n - 1].state_slot is None:
            n -= 1
        return n

    def on_touch(self, path: list[TreeNode]) -> None:
        """``joint_lru``: the states along a touched path follow their nodes' stamps;
        ``recency="path"``: every state on the path takes its node's new stamp."""
        stamp = self.recency == "path"
        for n in path:
            if n.state_slot is not None:
                if stamp:
                    n.state_access_time = n.last_access_time
                self.refresh(n)

    def on_match(self, path: list[TreeNode], usable: int, key: Sequence[int], end: int) -> None:
        """Passes the match to the walk's optional ``on_match`` (see :class:`StateWalk`): the
        deepest KV-matched node ``path[-1]`` and the node whose state it consumes."""
        hook = self._on_match
        if hook is not None:
            hook(path[-1] if path else None, path[usable - 1] if usable else None, key, end)

    def on_hit(self, node: TreeNode, now: int) -> None:
        self.use(node, now)

    def on_hint(self, extra: Mapping[str, Any] | None) -> None:
        """Passes the request's hints to the walk's optional ``on_hint`` (see
        :class:`StateWalk`)."""
        hook = self._on_hint
        if hook is not None:
            hook(extra)

    # ------------------------------------------------------------------ insert
    def check_insert(self, n: int, value: Any, state_slot: Any) -> None:
        """``state_slot``: ``None`` or a slot of the pool the caller got from ``alloc`` and the
        tree does not hold."""
        if state_slot is None:
            return
        if isinstance(state_slot, bool) or not isinstance(state_slot, int):
            raise TypeError(f"state_slot must be an int or None, got {type(state_slot).__name__}")
        size = getattr(self.allocator, "size", None)
        if state_slot < 1 or (size is not None and state_slot > size):
            raise ValueError(f"state_slot must be in [1, {size}], got {state_slot}")
        if state_slot in self.slot_to_node:
            raise ValueError(f"state_slot {state_slot} is already held by the tree")
        free = self.free_mask
        if free is not None and free[state_slot]:
            raise ValueError(
                f"state_slot {state_slot} is free in the state pool: the tree adopts only a slot "
                "the caller got from alloc"
            )
        owned = self._check_owned
        if owned is not None:  # a memory arena's view: the other kind's chunks count as used
            owned(state_slot, "state_slot")

    def plan_insert(self, plan: InsertPlan) -> None:
        """New tokens need a state at their end: a leaf never stays without one."""
        if plan.prefix_len < plan.end and plan.state_slot is None:
            raise ValueError(
                "state_slot is required to insert new tokens into a cache with a recurrent-state "
                f"component (the key adds tokens [{plan.prefix_len}, {plan.end}) and a leaf "
                "never stays without a state)"
            )

    def on_insert(self, plan: InsertPlan, last: TreeNode, now: int) -> bool:
        """Adopt ``plan.state_slot`` on ``last`` when the whole key went in and ``last`` has
        no state yet."""
        slot = plan.state_slot
        if slot is None or plan.insert_end != plan.end or plan.end == 0 or last.state_slot is not None:
            return False
        self.set_state(last, slot, now)
        self.inserted += 1
        return True

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """One more request uses ``node``'s state (the cache re-files the node after)."""
        if node.state_lock == 0 and node.state_slot is not None:
            self._evictable -= 1
            self._protected += 1
        node.state_lock += 1

    def unlock(self, node: TreeNode, data: Any = None) -> None:
        node.state_lock -= 1
        if node.state_lock == 0 and node.state_slot is not None:
            self._evictable += 1
            self._protected -= 1
            if self.gds is not None:
                self.gds.on_use(node)  # released by its last request

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

    def evict_internal(self, node: TreeNode) -> int:
        """An internal victim loses only its state (its KV stays)."""
        self.remove_state(node)
        return 1

    # ------------------------------------------------------------------- tiers
    # ``node.host_state_slot``: the host copy of the state at a backed-up node's end. L3
    # keeps it in the record at the end of the node's last page (two end sections: conv, ssm).

    def host_pool(self, config: Any) -> tuple[Any, Any, Any]:
        from hicache.host_pools import mirror_state, state_lanes

        host = mirror_state(self.allocator, config)
        return self.allocator, host, state_lanes(self.allocator, host)

    def host_demand(self) -> tuple[int, int, int]:
        return self.allocator.size, 1, int(getattr(self.allocator, "bytes_per_slot", 0))

    def has_device(self, node: TreeNode) -> bool:
        return node.state_slot is not None

    def host_copy(self, node: TreeNode) -> torch.Tensor | None:
        slot = node.host_state_slot
        return None if slot is None else _slot_tensor(slot)

    def backup_size(self, node: TreeNode) -> int:
        return int(node.state_slot is not None and node.host_state_slot is None)

    def backup(self, node: TreeNode, host: torch.Tensor) -> torch.Tensor:
        assert node.state_slot is not None
        node.host_state_slot = int(host[0])
        return _slot_tensor(node.state_slot)

    def adopt_host(self, node: TreeNode, host: torch.Tensor) -> None:
        node.host_state_slot = int(host[0])

    def restore_size(self, node: TreeNode, last: bool) -> int:
        return int(last and node.host_state_slot is not None and node.state_slot is None)

    def restore(self, node: TreeNode, device: torch.Tensor, now: int) -> torch.Tensor:
        """``node`` takes the fresh device slot ``device[0]`` (stamped at the watermark
        under GDS)."""
        assert node.host_state_slot is not None
        self.set_state(node, host_int(device, "state slot"), now)  # (its host mirror)
        return _slot_tensor(node.host_state_slot)

    def drop_host(self, node: TreeNode) -> None:
        slot = node.host_state_slot
        if slot is not None:
            self.host_allocator.free_owned(slot)
            node.host_state_slot = None

    def undo_host(self, node: TreeNode) -> None:
        slot = node.host_state_slot
        if slot is not None:
            node.host_state_slot = None
            self.host_allocator.undo_alloc(_slot_tensor(slot))

    def host_usable(self, path: list[TreeNode], n: int) -> int:
        """A match may end at a node with a state on device or on host."""
        while n > 0 and path[n - 1].state_slot is None and path[n - 1].host_state_slot is None:
            n -= 1
        return n

    def check_host(self, nodes: list[TreeNode]) -> None:
        """A host-only node holds no device state; every host state slot held once, not free."""
        slots = []
        for n in nodes:
            if n.kv_value is None:
                assert n.state_slot is None, f"device state on a host-only node: {n}"
            if n.host_state_slot is not None:
                slots.append(n.host_state_slot)
        assert len(set(slots)) == len(slots), "a host state slot is held twice"
        if slots:
            assert not bool(self.host_allocator.is_free(torch.tensor(slots)).any()), (
                "a host state slot held by the tree is free")

    def l3_layout(self) -> str:
        from hicache.storage.keys import state_layout

        return state_layout(self.host_allocator)

    def l3_sections(self) -> tuple[int, ...]:
        """``(conv, ssm)``: one slot's bytes of every layer."""
        hs = self.host_allocator
        return tuple(t[:, 0].numel() * t.element_size() for t in (hs.conv, hs.ssm))

    def pack_end(self, node: TreeNode) -> tuple[bytes, bytes]:
        hs, slot = self.host_allocator, node.host_state_slot
        assert slot is not None
        return (hs.conv[:, slot].contiguous().view(torch.uint8).cpu().numpy().tobytes(),
                hs.ssm[:, slot].contiguous().view(torch.uint8).cpu().numpy().tobytes())

    def unpack_end(self, nodes: Sequence[TreeNode], host: torch.Tensor,
                   sections: Sequence[bytes | memoryview]) -> None:
        """The state valid at the chain's end: the last node's."""
        node = nodes[-1]
        hs = self.host_allocator
        slot = int(host[0])
        for target, section in ((hs.conv, sections[0]), (hs.ssm, sections[1])):
            shape = target[:, slot].shape
            target[:, slot] = torch.frombuffer(bytearray(section), dtype=torch.uint8).view(
                hs.dtype).reshape(shape)
        node.host_state_slot = slot

    # ---------------------------------------------------------------- counters
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    @property
    def watermark(self) -> float:
        """The GDS watermark ``L`` (0.0 under the LRU walks; a custom walk's ``watermark``)."""
        return self.gds.watermark if self.gds is not None else 0.0

    def stats(self) -> dict[str, Any]:
        return {"evicted_states": self.evicted, "inserted_states": self.inserted,
                "state_evictable": self._evictable, "state_protected": self._protected,
                "watermark": self.watermark}


    def check(self, nodes: list[TreeNode]) -> None:
        ev = pr = 0
        state_nodes = []
        for n in nodes:
            assert n.state_lock >= 0, n
            assert n.state_lock == n.lock_ref, f"state_lock differs from direct locks: {n}"
            if n.state_lock > 0:
                assert n.kv_lock > 0, f"state locked but KV not: {n}"
            if n.state_slot is None:
                continue
            state_nodes.append(n)
            assert self.slot_to_node.get(n.state_slot) is n, f"slot map wrong for {n}"
            if n.state_lock == 0:
                ev += 1
            else:
                pr += 1
        assert len(state_nodes) == len(self.slot_to_node), "slot map holds removed states"
        slots = [n.state_slot for n in state_nodes]
        assert len(set(slots)) == len(slots), "a state slot is held by two nodes"
        is_free = getattr(self.allocator, "is_free", None)
        if slots and callable(is_free):
            assert not bool(is_free(torch.tensor(slots, dtype=torch.int64)).any()), (
                "a state slot held by the tree is free in the pool"
            )
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
