"""The tree with its components: the one place that loops over them.

``CacheCore`` holds the radix tree, the component tuple (KV first; then, as the model has
them, recurrent state and sliding-window KV; then any the caller adds), the per-node data of
the host tier, and, for each hook, the tuple of bound methods of the components that
implement it (built once, ``components.base.hooks``). It does what every engine call needs
from the tree: split, re-file, lock and unlock, the usable-prefix fixpoint, remove a leaf with
the ancestors it leaves dead, and the eviction loop. The engine-facing facade
(``radix.cache.RadixCache``) and the tiers (``radix.tiers``) use it; it knows no component by
name.

Eviction, for one component ``C`` and a target in ``C``'s units::

    while freed(C) + in flight(C) < target:
        node = C.pop_victim()                      # C's order (LRU, GDS, ...)
        node has children and C.evict_internal?  -> C frees its value only (state, SWA)
        else                                     -> the leaf leaves (or is demoted to host)

When the KV component is the only component and nothing else takes a removal or a re-file
(no host tier, no per-node data: the plain KV cache), the same walk runs inline in the
component (``KVComponent.evict_leaves``): the same victims in the same order, fewer calls per
freed node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from components.base import Component, hooks, tier_components
from radix.results import EvictResult, LockRef
from radix.tree import RadixTree, new_tuple

if TYPE_CHECKING:
    from radix.node import TreeNode

#: ``EvictResult`` fields, in order: the units one eviction step reports (the units of any
#: other component with an ``evict_field`` go to ``EvictResult.other``).
EVICT_FIELDS = ("num_tokens", "num_states", "num_swa_tokens")
_SINK = len(EVICT_FIELDS)  # the index units of a component without an evict field go to
# (with other components' fields, they come first and the sink follows them:
# ``CacheCore.field_index``)
#: The lock data of a lock that carries none.
NO_PARTS: dict[str, Any] = {}


def freed_counts() -> list[int]:
    """A fresh accumulator of freed units, per ``EVICT_FIELDS`` (plus a sink), for a cache
    whose components report no other field (``CacheCore.new_freed``: for any cache)."""
    return [0] * (_SINK + 1)


class CacheCore:
    """The tree and its components.

    Args:
        page_size: tokens per page.
        components: the components, KV first (``components.kv.KVComponent``); names unique.
    """

    def __init__(self, page_size: int, components: tuple[Component, ...]) -> None:
        self.page_size = page_size
        self.components = components
        self.per_node: tuple[Component, ...] = ()
        self.tree = RadixTree(page_size, self._on_split)
        self.clock = 0
        #: Frees a device leaf on eviction: removes it (``remove_leaf``) or, with a host tier,
        #: demotes it; adds the units freed to its accumulator (``freed_counts``).
        self.free_leaf: Callable[[TreeNode, list[int]], None] = self.remove_leaf
        self._remove_leaf = self.free_leaf  # (what :meth:`evict` compares ``free_leaf`` with)
        #: Called with an internal victim and the eviction's accumulator before the eviction
        #: drops one component's value from it (a write-back host tier backs the value up
        #: first, and adds to the accumulator the device units its host room cost), or ``None``.
        self.before_internal: Callable[[TreeNode, list[int]], None] | None = None
        #: Called first by every eviction (:meth:`evict`, :meth:`evict_bytes`), or ``None``: a
        #: host tier orders the reuse of the device units it frees after the loads in flight.
        self.before_evict: Callable[[], None] | None = None
        self._build_hooks()
        #: Units whose freeing is in flight (write-back copies), per field (``EVICT_FIELDS``,
        #: then ``other_fields``: an accumulator's indices, without the sink).
        self.pending = [0] * self._sink

    def add_per_node(self, holder: Component) -> None:
        """Add a holder of per-node data that takes the structural hooks (``on_split``,
        ``refresh``, ``on_remove`` when a node leaves) and the insert's planning and revival,
        but no match, lock or eviction role: the host tier's copies."""
        self.per_node += (holder,)
        self._build_hooks()

    def _build_hooks(self) -> None:
        comps, per_node = self.components, self.per_node
        everything = comps + per_node
        names = [c.name for c in everything]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique, got {names}")
        self.by_name: dict[str, Component] = {c.name: c for c in everything}
        fields: dict[str, str] = {}
        for c in comps:
            f = c.evict_field
            if f is not None:
                if f in fields:
                    raise ValueError(
                        f"components {fields[f]!r} and {c.name!r} both claim the eviction "
                        f"field {f!r}; each EvictResult field belongs to one component")
                fields[f] = c.name
        #: The ``evict_field`` of every component beyond ``EVICT_FIELDS`` (plug-ins), in
        #: order: ``EvictResult.other``; in an accumulator their units follow
        #: ``EVICT_FIELDS``'s, then the sink's.
        self.other_fields = tuple(f for f in fields if f not in EVICT_FIELDS)
        self._field_index: dict[str | None, int] = {
            f: i for i, f in enumerate(EVICT_FIELDS + self.other_fields)}
        self._sink = len(EVICT_FIELDS) + len(self.other_fields)
        self._nfreed = self._sink + 1
        tier_components(comps)  # a component with only some tier hooks is refused, named
        self._split_hooks = hooks(everything, "on_split")
        self.refreshers = hooks(everything, "refresh")
        self.device_removers = tuple(
            (self.field_index(c), c.on_remove)
            for c in comps if type(c).on_remove is not Component.on_remove
        )
        self._node_removers = hooks(per_node, "on_remove")
        self.detach_hooks = hooks(everything, "on_detach")
        self._reset_hooks = hooks(everything, "before_reset")
        self.dead_rules = hooks(comps, "is_dead")
        self.insert_checks = hooks(comps, "check_insert")
        self.planners = hooks(everything, "plan_insert")
        self.new_node_hooks = hooks(comps, "on_new_node")
        self.insert_hooks = hooks(comps, "on_insert")
        #: Component name -> its ``check_value``: the components that take a per-insert
        #: value (``RadixCache.insert(component_values=...)``, ``InsertPlan.value_of``).
        self.value_checks = {c.name: c.check_value for c in comps
                             if type(c).check_value is not Component.check_value}
        #: No component or holder plans an insert, sees its new nodes, takes a value or adopts
        #: anything at its end: an insert's plan would be its walk's, and ``radix.insert``
        #: builds none.
        self.unplanned_inserts = not (self.planners or self.new_node_hooks or self.insert_hooks
                                      or self.value_checks)
        # (the KV component has none: the cache re-files the deepest matched node itself, the
        # only one of a matched path that can be a KV leaf)
        self.touch_hooks = hooks(comps, "on_touch")
        self.hit_hooks = hooks(comps, "on_hit")
        self.match_hooks = hooks(comps, "on_match")
        self.hint_hooks = hooks(comps, "on_hint")
        #: ``(name, match_part)`` of the components with a part in ``MatchResult.parts``.
        self.part_hooks = tuple((c.name, c.match_part) for c in comps
                                if type(c).match_part is not Component.match_part)
        self.lockers = tuple(c for c in comps if type(c).lock is not Component.lock)
        self._lock_fns = tuple(c.lock for c in self.lockers)
        self._unlock_fns = hooks(comps, "unlock")
        self._named_unlocks = tuple((c.name, c.unlock) for c in comps
                                    if type(c).unlock is not Component.unlock)
        self.unlock_checks = tuple((c.name, c.unlock_error) for c in comps
                                   if type(c).unlock_error is not Component.unlock_error)
        #: Per component with an eviction walk: its EvictResult index, its internal-node
        #: eviction and its requeue hook (``None`` when it has none).
        self._evict_plans = {
            c.name: (self.field_index(c),
                     c.evict_internal if type(c).evict_internal is not Component.evict_internal
                     else None,
                     c.requeue if type(c).requeue is not Component.requeue else None)
            for c in comps if c.evict_field is not None
        }
        #: The KV component when it is the only component and nothing but it watches a
        #: removal or a re-file: its eviction runs inline (``KVComponent.evict_leaves``) as long
        #: as ``free_leaf`` is :meth:`remove_leaf` (no host tier).
        kv = comps[0] if len(comps) == 1 else None
        inline: Callable[[int, RadixTree], int] | None = getattr(kv, "evict_leaves", None)
        self._kv_only: Component | None = None
        self._evict_inline = None
        if (kv is not None and inline is not None and not per_node and not self.detach_hooks
                and not self.dead_rules and self.device_removers == ((0, kv.on_remove),)
                and self.refreshers == (kv.refresh,)
                and self._evict_plans.get(kv.name) == (0, None, None)):
            self._kv_only, self._evict_inline = kv, inline
        self.lock_data = any(c.lock_data for c in comps)
        self.revives = any(c.revives for c in everything)
        self.checkpoints = any(c.checkpoints for c in comps)
        rules = [(c.usable, c.miss_field) for c in comps
                 if type(c).usable is not Component.usable]
        self.rules = tuple(r for r, _ in rules)
        self.miss_fields = tuple(f for _, f in rules)
        #: The only rule, when there is exactly one and it reports no miss (the hybrid case).
        self.one_rule = rules[0][0] if len(rules) == 1 and rules[0][1] is None else None

    def field_index(self, comp: Component) -> int:
        """The index of ``comp``'s units in an accumulator (:meth:`new_freed`): its
        ``EVICT_FIELDS`` position, its place among ``other_fields``, or the sink."""
        return self._field_index.get(comp.evict_field, self._sink)

    def new_freed(self) -> list[int]:
        """A fresh accumulator of freed units for this cache's components: per
        ``EVICT_FIELDS``, then per ``other_fields``, then the sink."""
        return [0] * self._nfreed

    def result(self, freed: list[int] | tuple[int, ...]) -> EvictResult:
        """The :class:`EvictResult` of an accumulator (:meth:`new_freed`)."""
        others = self.other_fields
        other = tuple(zip(others, freed[_SINK:self._sink], strict=True)) if others else ()
        return new_tuple(EvictResult, (freed[0], freed[1], freed[2], other))

    def merge(self, res: EvictResult, extra: tuple[int, ...]) -> EvictResult:
        """``res`` plus the units of an accumulator's difference ``extra`` (copies that
        landed during the call)."""
        freed = [res[0] + extra[0], res[1] + extra[1], res[2] + extra[2], 0]
        if self.other_fields:
            freed[_SINK:] = [n + e for (_, n), e in zip(res.other, extra[_SINK:self._sink],
                                                           strict=True)]
        return self.result(freed)

    def reset(self) -> None:
        """Remove every node (no dead-leaf cascade, nothing counted as evicted) and reset every
        component and per-node holder; the tree gets a new identity (old handles go stale)."""
        for hook in self._reset_hooks:
            hook()
        for n in sorted(self.tree.iter_nodes(), key=lambda x: -x.depth):
            self.device_remove(n, self.new_freed())
            for hook in self._node_removers:
                hook(n)
            self.tree.remove_leaf(n)
        for c in self.components + self.per_node:
            c.reset()
        self.tree.reset()
        self.pending = [0] * self._sink

    @property
    def root(self) -> TreeNode:
        return self.tree.root

    def tick(self) -> int:
        """Advance the logical clock; return the new stamp."""
        self.clock += 1
        return self.clock

    # ---------------------------------------------------------------------- match
    def usable(self, path: list[TreeNode], n: int) -> tuple[int, list[int] | None]:
        """The largest ``k <= n`` such that a match may end after ``path[k - 1]`` under every
        component's rule at once (a fixpoint: one rule may make another cut further), and
        the tokens each rule cut beyond the rules before it: the fixpoint over
        ``rules[:i + 1]`` minus the one over ``rules[:i]``. ``None`` for those when only one
        rule that reports no miss applies (the fast path)."""
        one = self.one_rule
        if one is not None:
            return one(path, n), None
        rules = self.rules
        if not rules:
            return n, None
        misses = []
        for i in range(len(rules)):
            before = path[n - 1].depth if n else 0
            while True:
                m = n
                for rule in rules[: i + 1]:
                    m = rule(path, m)
                if m == n:
                    break
                n = m
            misses.append(before - (path[n - 1].depth if n else 0))
        return n, misses

    # ---------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> TreeNode | LockRef:
        """Every component's lock on ``node`` (not the root); the lock to hand back to
        :meth:`unlock`: the node itself, or a ``LockRef`` carrying the components' data."""
        node.lock_ref += 1
        lock: TreeNode | LockRef = node
        if self.lock_data:
            parts = {}
            for c in self.lockers:
                data = c.lock(node)
                if c.lock_data:
                    parts[c.name] = data
            lock = LockRef(node, parts)
        else:
            for fn in self._lock_fns:
                fn(node)
        for hook in self.refreshers:
            hook(node)
        return lock

    def unlock(self, node: TreeNode, parts: dict[str, Any]) -> None:
        """Release one lock :meth:`lock` took on ``node`` (checked by the caller), then prune
        what it leaves dead."""
        node.lock_ref -= 1
        if parts:
            for name, fn in self._named_unlocks:
                fn(node, parts.get(name))
        else:
            for fn in self._unlock_fns:
                fn(node, None)
        for hook in self.refreshers:
            hook(node)
        if not node.children and not node.kv_lock and self.dead_rules:
            self.prune(node)

    # ------------------------------------------------------------------ structure
    def _on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        for hook in self._split_hooks:
            hook(upper, lower, split_len)

    def refresh(self, node: TreeNode) -> None:
        """``node``'s leaf status, locks or stamps changed: re-file it everywhere."""
        for hook in self.refreshers:
            hook(node)

    def split_touched(self, node: TreeNode, split_len: int, now: int) -> TreeNode:
        """Split a node a walk entered; the walk passed through it, so both halves carry the
        new stamp (as SGLang's RadixCache stamps the node before splitting it). Returns the
        upper half."""
        node.last_access_time = now
        upper = self.tree.split(node, split_len)
        self.refresh(node)
        return upper

    def is_dead_leaf(self, node: TreeNode) -> bool:
        """An unlocked childless node nothing could ever resume from (a component's rule:
        no state, a tombstone)."""
        if node.parent is None or node.children or node.kv_lock:
            return False
        for rule in self.dead_rules:
            if rule(node):
                return True
        return False

    def device_remove(self, node: TreeNode, freed: list[int]) -> None:
        """Free every component's device value on ``node`` (the node itself stays);
        ``freed`` accumulates the units per ``EVICT_FIELDS``."""
        for idx, remove in self.device_removers:
            freed[idx] += remove(node)

    def remove_leaf(self, node: TreeNode, freed: list[int] | None = None) -> None:
        """Remove a leaf whole, then the ancestors it leaves as dead leaves; ``freed``
        (``freed_counts``) accumulates the units freed."""
        if freed is None:
            freed = self.new_freed()
        tree = self.tree
        root = tree.root
        removers, node_removers = self.device_removers, self._node_removers
        while True:
            for idx, remove in removers:
                freed[idx] += remove(node)
            for hook in node_removers:
                hook(node)
            parent = tree.remove_leaf(node)
            for hook in self.detach_hooks:
                hook(node)
            if parent is root:
                break
            if self.dead_rules and not parent.children and self.is_dead_leaf(parent):
                node = parent
                continue
            for hook in self.refreshers:
                hook(parent)
            break

    def detached(self, node: TreeNode) -> None:
        """``node`` (host-only) left the tree through a tier: tell every ``on_detach``."""
        for hook in self.detach_hooks:
            hook(node)

    def prune(self, node: TreeNode) -> None:
        """Remove ``node`` (and the ancestors it leaves dead) if it is a dead leaf."""
        if self.is_dead_leaf(node):
            self.remove_leaf(node)

    # ------------------------------------------------------------------- eviction
    def evict_bytes(self, target: int, pop: Callable[[], tuple[str, TreeNode] | None],
                    kinds: dict[str, tuple[Component, int]]) -> EvictResult:
        """Free at least ``target`` bytes over several components in one order: ``pop()``
        gives the next victim and its kind (``None``: nothing left), ``kinds[kind]`` the
        component it is a victim of and the bytes one of that component's units frees. A
        victim with children loses only that component's value when it evicts internal
        nodes, else it leaves whole (``free_leaf``: every component's units on it are freed
        and counted). The bytes freed are the units freed times their bytes."""
        if self.before_evict is not None:
            self.before_evict()
        freed = self.new_freed()
        plans = {kind: (self._evict_plans[c.name], size) for kind, (c, size) in kinds.items()}
        sizes = [0] * len(freed)
        for (idx, _, _), size in plans.values():
            sizes[idx] = size
        free_leaf, before = self.free_leaf, self.before_internal
        done = 0
        while done < target:
            picked = pop()
            if picked is None:
                break
            kind, node = picked
            (idx, internal, _), _ = plans[kind]
            try:
                if internal is None or not node.children or self._evict_internal(
                        kinds[kind][0], node, internal, before, freed, idx):
                    free_leaf(node, freed)
            except BaseException:
                self._refile(node)
                raise
            done = sum(f * s for f, s in zip(freed, sizes, strict=True))
        return self.result(freed)

    def _evict_internal(self, comp: Component, node: TreeNode, internal: Callable[[TreeNode], int],
                        before: Callable[[TreeNode, list[int]], None] | None, freed: list[int],
                        idx: int) -> bool:
        """Evict ``comp``'s value from internal victim ``node`` (``before_internal`` first);
        returns whether ``node`` is to leave whole instead (``free_leaf``). Copies landing
        during ``before_internal`` may have demoted or removed ``node`` (nothing left to evict:
        skipped; the units are in ``freed``) or removed its last children (a leaf now: it
        leaves whole, unless a copy in flight still locks it)."""
        if before is not None:
            before(node, freed)
            if not self.tree.is_attached(node) or (
                    type(comp).has_device is not Component.has_device and not comp.has_device(node)):
                return False
            if not node.children:
                return node.kv_lock == 0
        freed[idx] += internal(node)
        return False

    def _refile(self, node: TreeNode) -> None:
        """A popped victim whose step raised (a backup copy that could not start) is filed
        again where it still is, so it stays evictable and the orders stay whole."""
        if self.tree.is_attached(node):
            self.refresh(node)

    def evict(self, comp: Component, target: int) -> EvictResult:
        """Free at least ``target`` of ``comp``'s units (``comp.evict_field``) in its order:
        a victim with children loses only ``comp``'s value when ``comp`` evicts internal
        nodes, else the victim leaves whole (``free_leaf``). Copies in flight that will free
        ``comp``'s units count towards ``target`` but not in the result."""
        if self.before_evict is not None:
            self.before_evict()
        inline = self._evict_inline
        if inline is not None and comp is self._kv_only and self.free_leaf is self._remove_leaf:
            return new_tuple(EvictResult, (inline(target, self.tree), 0, 0, ()))
        plan = self._evict_plans.get(comp.name)
        if plan is None:
            raise ValueError(f"component {comp.name!r} of this cache has no eviction walk")
        idx, internal, requeue = plan
        freed = [0] * self._nfreed
        pending = self.pending
        start = pending[idx]
        pop, free_leaf, before = comp.pop_victim, self.free_leaf, self.before_internal
        while freed[idx] + pending[idx] - start < target:
            node = pop()
            if node is None:
                break
            try:
                if internal is not None and node.children and not self._evict_internal(
                        comp, node, internal, before, freed, idx):
                    continue
                free_leaf(node, freed)
            except BaseException:
                self._refile(node)
                raise
            if requeue is not None and node.owner:  # it stayed (a copy in flight)
                requeue(node)
        if self.other_fields:
            return self.result(freed)
        return new_tuple(EvictResult, (freed[0], freed[1], freed[2], ()))
