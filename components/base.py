"""The component contract: what every kind of per-node data provides to the cache.

One tree, several components. A component owns one kind of per-node value (KV slots, a
recurrent-state checkpoint, sliding-window KV, ...), its allocator, its lock counts, its
evictable / protected counters, its eviction order, and the rule for whether a match may end
at a node. The cache (``radix.cache.RadixCache``) holds its components as a tuple, built once,
and calls them only through the hooks below; for each hook it keeps the tuple of components
that override it (:func:`hooks`), so a hook nobody implements costs nothing on the hot path.

A component never walks the tree on its own except to check invariants, and touches nodes only
through their attributes (``radix.node.TreeNode``); it imports nothing from ``radix`` at run
time. Units: the KV components count tokens, the state component counts slots.

Hook order, per engine call (``node`` is a ``TreeNode``; positions are half-open token ranges)::

    match_prefix   on_split* -> on_touch(path) -> usable(path, n) (fixpoint, every component)
                   -> on_hit(node) -> match_part(node) (``MatchResult.parts``)
    insert         check_insert(n, value, state_slot) -> check_value(n, value) (the components
                   given a ``component_values`` entry) -> plan_insert(plan) (every component; raise to refuse,
                   nothing changed) -> [KV claims the slots] -> on_split* / revive ->
                   on_touch(path) -> on_new_node(node, plan, lo, hi)* -> on_insert(plan, last)
    inc_lock_ref   lock(node) -> data          (``data`` travels in the ``LockRef``)
    dec_lock_ref   unlock_error(node, data) (every component, before anything changes)
                   -> unlock(node, data)
    evict*         pop_victim() -> evict_internal(node) (it has children) or the leaf leaves
                   whole: on_remove(node) for every component -> on_detach(node) (it left
                   the tree; also when a host tier drops a host-only node)
    reset          before_reset() -> on_remove(node) for every node -> reset()
    any change     refresh(node) (re-file ``node`` in the eviction order)

Tier hooks (a host tier, ``radix.tiers.host``, and the L3 tier below it, ``radix.tiers.storage``,
loop over the components that implement them, naming none). A component that keeps a copy of
its per-node value on the host implements every hook of :data:`TIER_HOOKS` (the cache refuses
one that implements only some, naming it); the first such component (KV) is the *primary*:
its copy says where a node lives (device, host, both) and its units are the host tier's::

    built          host_pool(config) -> (device allocator, host allocator, lanes); the tier
                   registers the pair by this name and sets ``host_allocator``
    backup         backup_size(node) units -> the tier allocates them on host (all parts
                   at once; the primary's part first, the others dropped when short) ->
                   backup(node, host) -> device indices to copy from
    load back      restore_size(node, last) units -> the tier allocates every part on
                   device through ``restore_allocator`` at once (all or nothing) ->
                   restore(node, device, now) -> host indices to copy from
    host eviction  drop_host(node) (the node leaves the host, or the tree)
    split          split_host(upper, lower, split_len)
    insert over a host-only node   revive_host(node, slots) (the caller's device slots)
    a host hit     host_usable(path, n) (the usable rule counting host copies)
    L3             l3_layout() -> the layout tag's part; l3_sections() -> byte sizes; the
                   primary's host copy is stored a record per page (pack_pages /
                   unpack_pages, :data:`L3_PAGE_HOOKS`); every other component with host
                   copies stores its sections at a node's end (pack_end / unpack_end,
                   :data:`L3_END_HOOKS`): one record per page end holds them all; an end
                   component may cover the last l3_span() tokens before the end (SWA KV:
                   the window), the chain read back is cut there
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from components.kv import KVValue
    from hicache.storage import Page
    from radix.node import TreeNode


class InsertPlan:
    """What an insert will do, decided before anything changes (``Component.plan_insert``).

    Positions are tokens of ``key``; ``[prefix_len, end)`` is the new tail, ``end`` the key cut
    to whole pages. ``key`` is the ids' array, which may run past the inserted key (a prefix
    slice of a ``RadixKey`` shares its parent's array): read positions below ``end`` only,
    never ``len(key)``. Components may lower ``insert_end`` (to ``prefix_len``: nothing new worth
    caching), cut the new tail into separate nodes (:meth:`add_cut`), and ask to revive a
    matched node with the caller's slots (:meth:`add_revival`: node end -> first position
    taken from ``value``, and the component that revives it, :meth:`Component.revive`).
    :meth:`set_note` keeps a component's own planning data, by its name. ``state_slot`` is
    the state component's per-insert value, :meth:`value_of` any other component's (checked
    by its ``check_value``). (Built on every insert: the collections are created only when a
    component writes them.)
    """

    __slots__ = ("key", "value", "extra_key", "state_slot", "walk", "prefix_len", "end",
                 "insert_end", "cuts", "revive", "_notes", "values")

    def __init__(self, key: Any, value: torch.Tensor, extra_key: Any, state_slot: int | None,
                 walk: Any, end: int, values: dict[str, Any] | None = None) -> None:
        self.key = key
        self.value = value
        self.extra_key = extra_key
        self.state_slot = state_slot
        #: Component name -> the caller's value for it (``RadixCache.insert``'s
        #: ``component_values``, checked), or ``None``.
        self.values = values
        self.walk = walk
        self.prefix_len: int = walk.matched_len
        self.end = end
        self.insert_end = end
        self.cuts: tuple[int, ...] = ()
        self.revive: dict[int, tuple[int, Component]] | None = None
        self._notes: dict[str, Any] | None = None

    def add_cut(self, pos: int) -> None:
        """Cut at ``pos`` [tokens]: inside ``(prefix_len, end)`` the new tail becomes separate
        nodes there; below ``prefix_len`` a matched host-only node being revived is split there
        (SWA: where the caller's SWA KV turns live)."""
        self.cuts = (*self.cuts, pos)

    def add_revival(self, end: int, start: int, owner: Component) -> None:
        """The matched node ending at ``end`` takes the caller's slots from ``start`` on
        (split there first when ``start`` is inside it); ``owner.revive`` does the rest."""
        if self.revive is None:
            self.revive = {}
        self.revive[end] = (start, owner)

    def set_note(self, name: str, value: Any) -> None:
        if self._notes is None:
            self._notes = {}
        self._notes[name] = value

    def value_of(self, name: str, default: Any = None) -> Any:
        """The caller's per-insert value for component ``name`` (``default`` if none)."""
        return default if self.values is None else self.values.get(name, default)

    def note(self, name: str, default: Any = None) -> Any:
        """What the component ``name`` noted while planning (``default`` if nothing)."""
        return default if self._notes is None else self._notes.get(name, default)


class Component:
    """Base class of every component: each hook is a no-op here (see the module docstring for
    when the cache calls which). Subclasses override what they need.

    Class attributes:
        name: short name (``"kv"``, ``"state"``, ``"swa"``); unique in one cache.
        evict_field: the ``radix.results.EvictResult`` field this component's freed units are
            reported in, or ``None``.
        checkpoints: whether the component holds checkpoints the engine creates during prefill
            (a match then reports ``branching_seqlen`` when the usable prefix ends before the
            KV match).
        miss_field: the ``MatchResult`` field that reports the tokens this component's rule
            alone cut from the usable prefix, beyond the components before it, or ``None``.
        lock_data: ``lock`` returns data that ``unlock`` needs (it travels in the lock token).
        revives: an insert may give this component's nodes the caller's slots below
            ``prefix_len`` (so a request cannot assume its slots there are duplicates).
    """

    #: Hooks this instance does not use although its class implements them (a setting
    #: switched a behaviour off): left out of the cache's hook tuples.
    skip_hooks: frozenset[str] = frozenset()

    name: ClassVar[str] = "component"
    evict_field: ClassVar[str | None] = None
    checkpoints: ClassVar[bool] = False
    miss_field: ClassVar[str | None] = None
    lock_data: ClassVar[bool] = False
    revives: ClassVar[bool] = False

    # ------------------------------------------------------------- tree structure
    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        """``lower`` just lost its first ``split_len`` tokens to the new node ``upper``."""

    def on_remove(self, node: TreeNode) -> int:
        """``node``'s device data leaves (the node leaves the tree, or is demoted to host):
        free this component's value on it. Returns the units freed (counted as evicted)."""
        return 0

    def on_detach(self, node: TreeNode) -> None:
        """``node`` has left the tree (after every component's :meth:`on_remove`, or, for a
        host-only node a host tier drops, without it): forget what is kept per node."""

    def before_reset(self) -> None:
        """The cache is about to remove every node (``on_remove`` follows for each, then
        :meth:`reset`)."""

    def refresh(self, node: TreeNode) -> None:
        """``node``'s leaf status, locks or stamps changed: re-file it in the eviction order."""

    def is_candidate(self, node: TreeNode) -> bool:
        """Whether ``node`` may be evicted now in this component's order (unlocked, ...)."""
        return False

    def is_dead(self, node: TreeNode) -> bool:
        """Whether an unlocked childless ``node`` is useless to every later match because of
        this component's data (no state to resume from, a tombstone): it is then pruned."""
        return False

    # ---------------------------------------------------------------------- match
    def on_touch(self, path: list[TreeNode]) -> None:
        """The access stamps of ``path`` (a matched path, shallowest first) just moved."""

    def usable(self, path: list[TreeNode], n: int) -> int:
        """The largest ``k <= n`` such that a match may end after ``path[k - 1]`` under this
        component's rule (``k = 0``, the root, always may). Must not mutate anything."""
        return n

    def on_match(self, path: list[TreeNode], usable: int, key: Sequence[int], end: int) -> None:
        """Every match, once its usable prefix is known and before ``on_hit``: ``path`` the
        device nodes the KV match walked, ``path[:usable]`` the part the match returns,
        ``key[:end]`` the matched token ids (page aligned; not to be kept or modified)."""

    def on_hit(self, node: TreeNode, now: int) -> None:
        """A match's usable prefix ends at ``node`` (not the root)."""

    def on_hint(self, extra: Mapping[str, Any] | None) -> None:
        """The hints (:mod:`radix.hints`) of the request the next match or insert serves,
        already checked; ``None`` when it carries none. Called at the start of every
        ``match_prefix`` and ``insert``, before anything else."""

    def match_part(self, node: TreeNode) -> Any:
        """This component's part of a match whose usable prefix ends at ``node`` (the root
        when it is empty): ``MatchResult.parts[name]`` (a plug-in's value valid there, say).
        Must not mutate anything."""
        return None

    # --------------------------------------------------------------------- insert
    def check_insert(self, n: int, value: Any, state_slot: int | None) -> None:
        """Validate an insert's arguments (``n``: tokens of the key) before the walk; raise
        ``TypeError`` / ``ValueError`` naming the argument."""

    def check_value(self, n: int, value: Any) -> None:
        """This component takes a per-insert value (``RadixCache.insert(...,
        component_values={name: value})``, read in the plan as ``plan.value_of(name)``):
        validate it for a key of ``n`` tokens before anything changes; raise ``TypeError`` /
        ``ValueError`` naming ``component_values[name]`` and the expected form. (The state
        component's value is ``state_slot``.)"""

    def plan_insert(self, plan: InsertPlan) -> None:
        """Validate and plan (``InsertPlan``) before anything changes; raise to refuse."""

    def revive(self, node: TreeNode, slots: KVValue) -> None:
        """Give a matched ``node`` (split to the planned start) the caller's ``slots`` (claimed,
        the node's own copy), as planned in ``plan.revive``."""

    def on_new_node(self, node: TreeNode, plan: InsertPlan, lo: int, hi: int) -> None:
        """The insert created ``node`` for ``key[lo:hi]`` (it already holds its KV slots)."""

    def on_insert(self, plan: InsertPlan, last: TreeNode, now: int) -> bool:
        """The insert's nodes exist; ``last`` ends at ``plan.insert_end`` (the root when 0).
        Returns whether the component adopted a per-insert value (``state_slot``)."""
        return False

    # ---------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> Any:
        """Protect what a request using ``node`` needs; return data for :meth:`unlock`."""
        return None

    def unlock_error(self, node: TreeNode, data: Any) -> str | None:
        """Why :meth:`unlock` cannot release ``data`` on ``node`` (``None``: it can)."""
        return None

    def unlock(self, node: TreeNode, data: Any) -> None:
        """Release one lock :meth:`lock` took (checked by :meth:`unlock_error`)."""

    # ------------------------------------------------------------------- eviction
    def pop_victim(self) -> TreeNode | None:
        """Remove and return the next node to evict from in this component's order, or
        ``None`` when nothing is evictable. A childless victim leaves whole."""
        return None

    def evict_internal(self, node: TreeNode) -> int:
        """Free this component's value on a victim that has children (its KV stays);
        returns the units freed."""
        return 0

    def requeue(self, node: TreeNode) -> None:
        """A popped victim kept its value (its write-back copy is in flight): file it again."""

    # ------------------------------------------------------------------ tiers
    #: The device allocator a load-back asks for this component's units (set by a component
    #: that implements :data:`TIER_HOOKS`; see :meth:`restore`).
    restore_allocator: Any = None
    #: The host allocator of this component's host copies (set by the host tier from
    #: :meth:`host_pool`).
    host_allocator: Any = None

    def host_pool(self, config: Any) -> tuple[Any, Any, Any] | None:
        """``(device allocator, host allocator, lanes)``: the pools holding this component's
        values and their host copies (the host one mirroring the device one; ``config`` is the
        ``hicache.HiCacheConfig``) and the tensors a copy moves
        (``hicache.host_pools.kv_lanes`` / ``state_lanes``), or ``None``: no host copies. The
        host tier registers the pair in its controller under this component's name
        (``HiCacheController.register_pair``)."""
        return None

    def host_demand(self) -> tuple[int, int, int] | None:
        """``(device units, page size, bytes per unit)`` of the device pool :meth:`host_pool`
        mirrors by ``hicache_ratio``, so the host tier can fit every such pool together into
        ``hicache_host_memory_fraction`` of the host memory
        (``hicache.host_pools.fit_host_ratio``); ``None``: not counted."""
        return None

    def has_device(self, node: TreeNode) -> bool:
        """Whether ``node`` holds this component's value on device."""
        return False

    def host_copy(self, node: TreeNode) -> torch.Tensor | None:
        """The host indices of ``node``'s host copy (int64), or ``None``."""
        return None

    def backup_size(self, node: TreeNode) -> int:
        """Host units a backup of ``node``'s device value needs now (0: nothing to back up:
        no device value, a host copy already, or nothing a later match could use)."""
        return 0

    def backup(self, node: TreeNode, host: torch.Tensor) -> torch.Tensor:
        """``node`` keeps ``host`` (``backup_size(node)`` fresh host indices) as its host copy;
        returns the device indices the tier copies from (same length)."""
        raise NotImplementedError

    def adopt_host(self, node: TreeNode, host: torch.Tensor) -> None:
        """The primary component: host-only ``node`` (just made from L3 pages unpacked into
        ``host``) keeps ``host`` as its host copy."""
        raise NotImplementedError

    def restore_size(self, node: TreeNode, last: bool) -> int:
        """Device units a load-back of ``node`` needs (its host copy without a device value;
        ``last``: the chain ends at ``node``)."""
        return 0

    def restore(self, node: TreeNode, device: torch.Tensor, now: int) -> torch.Tensor:
        """``node`` takes ``device`` (``restore_size`` fresh units of
        ``restore_allocator``) as its device value; returns the host indices the tier copies
        from (same length)."""
        raise NotImplementedError

    def drop_host(self, node: TreeNode) -> None:
        """Free ``node``'s host copy (if any)."""

    def undo_host(self, node: TreeNode) -> None:
        """Give back the host copy :meth:`backup` just gave ``node``, whose copy could not
        start: as :meth:`drop_host`, but to the front of the host allocator's free list
        (``undo_alloc``), so that allocator is as before the backup. Default:
        :meth:`drop_host`."""
        self.drop_host(node)

    def split_host(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        """``lower`` lost its first ``split_len`` tokens to ``upper``: split the host copy."""

    def revive_host(self, node: TreeNode, slots: KVValue) -> None:
        """An insert gave host-only ``node`` the caller's (claimed) KV ``slots``."""

    def host_usable(self, path: list[TreeNode], n: int) -> int:
        """:meth:`usable` counting host copies as if loaded back (``path``: device nodes,
        then host-only ones)."""
        return n

    def check_host(self, nodes: list[TreeNode]) -> None:
        """Assert the host copies' invariants (``nodes``: every non-root node)."""

    # -------------------------------------------------------------------- L3
    # (``radix.tiers.storage``, a host tier's L3: :data:`L3_PAGE_HOOKS` for the primary
    # component, :data:`L3_END_HOOKS` for a component with a section at a node's end)
    def l3_layout(self) -> str | None:
        """L3: this component's part of the layout tag (the shapes and dtypes of the bytes
        it stores, no ``;``: caches whose parts differ never share a key), or ``None``: it
        stores nothing in L3. Asked once its ``host_allocator`` is set."""
        return None

    def l3_sections(self) -> tuple[int, ...]:
        """L3: byte sizes of this component's sections: of each page's record for the
        primary component (two: KV's ``(K, V)``), of its part of the record at a node's end
        for any other (one or more; the state's ``(conv, ssm)``)."""
        return ()

    def l3_span(self) -> int:
        """L3, an end component: how many tokens before a record's end its end sections
        cover [tokens, a multiple of ``page_size``]. ``0`` (the default): a value valid at
        the end itself, one host unit (the state). ``s > 0``: one host unit per token of the
        last ``s`` tokens before the end (SWA KV: the window, whole pages); a chain of
        ``t`` tokens read back from L3 is cut ``s`` tokens before its end when ``t > s``,
        and the component fills the last ``min(s, t)`` tokens' units (the records of a
        shallower end still have the full size: their leading part is unused)."""
        return 0

    def pack_pages(self, host: torch.Tensor) -> list[tuple[bytes, bytes]]:
        """L3, the primary component: the sections of each whole page of the host units
        ``host`` (int64, a multiple of ``page_size`` long), in page order."""
        raise NotImplementedError

    def unpack_pages(self, host: torch.Tensor, pages: Sequence[Page]) -> None:
        """L3, the primary component: write ``pages`` (verified records of
        :meth:`l3_sections`' sizes, ``.a`` and ``.b``) into the fresh host units ``host``
        (``len(pages)`` whole pages)."""
        raise NotImplementedError

    def pack_end(self, node: TreeNode) -> Sequence[bytes] | None:
        """L3: this component's end sections of ``node`` (sizes :meth:`l3_sections`), from
        its host copies (only asked when ``host_copy(node)`` is not ``None``), or ``None``:
        not every host copy they need is there (with :meth:`l3_span`, the ancestors' within
        the span): no end record is written at ``node``'s end."""
        raise NotImplementedError

    def unpack_end(self, nodes: Sequence[TreeNode], host: torch.Tensor,
                   sections: Sequence[bytes | memoryview]) -> None:
        """L3: the host-only ``nodes`` (just made from L3 records, top to bottom: the chain
        read back, ending at the record's end, cut where :meth:`l3_span` s ask) take
        ``host`` (fresh units of ``host_allocator``: one with span ``0``, else one per token
        of the last ``min(span, chain tokens)``), filled from ``sections`` (this
        component's end sections, of :meth:`l3_sections`' sizes), as their host copies;
        a node that gets none is set as a node without one (an SWA tombstone)."""
        raise NotImplementedError

    # ------------------------------------------------------------- sizes, checks
    def evictable_size(self) -> int:
        """Units held by the tree that no request protects."""
        return 0

    def protected_size(self) -> int:
        """Units held by the tree under a request's lock."""
        return 0

    def stats(self) -> dict[str, Any]:
        """This component's counters for ``RadixCache.stats()``."""
        return {}

    def reset(self) -> None:
        """Forget everything (the cache has just removed every node): empty orders, zero
        counters, a fresh eviction walk."""

    def describe(self, node: TreeNode) -> str:
        """This component's part of ``node``'s line in ``RadixCache.pretty_print`` (leading
        space included; empty for nothing to show)."""
        return ""

    def check(self, nodes: list[TreeNode]) -> None:
        """Recompute every counter from ``nodes`` (every non-root node, parents first) and
        assert this component's invariants."""


#: The tier hooks a component with host copies implements all of (``host_pool`` says it
#: has them).
TIER_HOOKS = ("host_pool", "has_device", "host_copy", "backup_size", "backup", "restore_size",
              "restore", "drop_host")


def tier_components(components: tuple[Any, ...]) -> tuple[Any, ...]:
    """The components that keep host copies (implement ``host_pool``), in order.

    Raises:
        ValueError: a component implements some of :data:`TIER_HOOKS` but not all (it
            could back up but not restore, say), naming it and what it lacks.
    """
    out = []
    for c in components:
        have = [h for h in TIER_HOOKS if getattr(type(c), h, None) is not getattr(Component, h)]
        if not have:
            continue
        missing = [h for h in TIER_HOOKS if h not in have]
        if missing:
            raise ValueError(
                f"component {c.name!r} implements the tier hooks {have} but not {missing}: "
                "a component with host copies implements every one of "
                f"{list(TIER_HOOKS)} (components.base)"
            )
        out.append(c)
    return tuple(out)


def hooks(components: tuple[Any, ...], name: str) -> tuple[Callable[..., Any], ...]:
    """Bound methods ``name`` of the components that override :class:`Component`'s no-op
    and do not list it in ``skip_hooks`` (objects that are not ``Component`` subclasses count
    when they have the method), in order: what the cache loops over for one hook."""
    base = getattr(Component, name)
    out = []
    for c in components:
        impl = getattr(type(c), name, None)
        if impl is None or impl is base or name in getattr(c, "skip_hooks", ()):
            continue
        out.append(getattr(c, name))
    return tuple(out)


#: The L3 hooks of a host tier's primary component: its host copy is stored a record per page.
L3_PAGE_HOOKS = ("l3_layout", "l3_sections", "pack_pages", "unpack_pages")
#: The L3 hooks of any other component with host copies: its sections at a node's end.
L3_END_HOOKS = ("l3_layout", "l3_sections", "pack_end", "unpack_end")


def _implemented(c: Any, names: tuple[str, ...]) -> list[str]:
    return [h for h in names if getattr(type(c), h, None) is not getattr(Component, h)]


def l3_components(parts: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The L3 roles of a host tier's components (``parts``: :func:`tier_components`, the
    primary first): ``(primary, end components)``, the components whose sections a record at
    a node's end holds, in order.

    An end component with a span (:meth:`Component.l3_span`, the SWA component: its window
    of SWA KV) is read back over the last ``span`` tokens of a chain; the nodes above stay
    without its value (SWA tombstones), as a device tree keeps them.

    Raises:
        ValueError: the primary lacks one of :data:`L3_PAGE_HOOKS`; another component
            implements only some of :data:`L3_END_HOOKS`, or none (its host copies could not
            be stored, so no match could end on the records read back), naming it and what
            it lacks.
    """
    primary, out = parts[0], []
    missing = [h for h in L3_PAGE_HOOKS if h not in _implemented(primary, L3_PAGE_HOOKS)]
    if missing:
        raise ValueError(f"component {primary.name!r} keeps the host tier's primary copies but "
                         f"does not implement {missing}: L3 stores them a record per page "
                         f"({list(L3_PAGE_HOOKS)}, components.base)")
    for c in parts[1:]:
        have = _implemented(c, L3_END_HOOKS)
        missing = [h for h in L3_END_HOOKS if h not in have]
        if missing:
            raise ValueError(
                f"component {c.name!r} keeps host copies that L3 records cannot carry: it "
                f"implements {have} of the L3 end hooks but not {missing} (a record at a "
                "page's end holds every other component's sections: without them no match "
                "could end on the pages read back); implement them, or use the host tier "
                "without L3")
        out.append(c)
    return primary, tuple(out)
