"""HiCache L2 inside the one tree: backups, demotion, load-back and host eviction.

Residency of a node (its primary component's value: KV): on device, on host, or both. Nodes on
device form a prefix-closed set (a host-only node has no device child) and backed-up nodes form
a prefix from the root (a child is never backed up before its parent)::

    root ── A dev+host ── B dev+host ── C host      match [A B C]: device prefix A B,
                      └── D dev                     load_back(C) brings C to device

* backup (``write_through``: at insert; ``write_through_selective``: once hit twice;
  ``write_back``: when evicted from device, and before an eviction drops one component's
  value from an internal node): every component's part (host KV slots, a host state slot,
  host SWA slots, a plug-in's), one copy, the node's KV path locked until it has landed.
* device eviction of a backed-up leaf *demotes* it (device slots and state freed, the node
  stays, host-only); a leaf with no backup leaves the tree as before.
* ``load_back``: a host-only chain back to device, every component's part allocated at once
  (all or nothing: a shortfall in any pool rolls every pool back), evicting on device first.
* ``evict_host``: host-only leaves, least recently used first, cascading to parents that
  become host-only leaves.
* a copy that cannot start (the controller raises: a device out of memory for its
  temporary) gives back every unit it took, to the front of the free lists, is logged and
  counted (``copy_failures``) and is a backup or load-back without room: the insert, eviction
  or request step around it completes (see :meth:`HostTier._copy_failed`).

:class:`HostTier` is a component of the tree for the structural hooks (it holds each node's
host copy: split, re-file, free on removal; an insert over host-only nodes revives them) and a
tier for the rest (:class:`radix.tiers.base.Tier`: before a match, the host part of a match,
after an insert, on a device eviction). The L3 storage tier, when configured, hangs below it
(``self.storage``).

The tier names no component: it loops over the components with host copies
(``components.base.tier_components``: their tier hooks), the first of which (KV) is the
*primary*: its copy says where a node lives and its units (tokens) are the tier's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from allocators import alloc_all
from allocators.host_mirror import host_ids
from components.base import Component, InsertPlan, hooks, tier_components
from components.ordered import OrderedNodeSet
from radix.durations import Durations
from radix.tiers.base import Tier

if TYPE_CHECKING:
    from components.kv import KVValue
    from hicache import HiCacheController
    from radix.core import CacheCore
    from radix.node import TreeNode
    from radix.tiers.storage import StorageTier

log = logging.getLogger("hicache")

#: One copy's parts: ``(pool name, source indices, destination indices)``.
Parts = list[tuple[str, torch.Tensor, torch.Tensor]]


def _lru(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class HostTier(Component, Tier):
    """The host (L2) tier of one cache.

    Args:
        core: the cache's tree and components.
        controller: host pools and copies (``hicache.HiCacheController``); each component
            with host copies gets its pool pair registered there under its name.

    Raises:
        ValueError: no component keeps host copies, or one implements only some tier hooks
            (``components.base.tier_components``).
    """

    name = "host"
    revives = True

    def __init__(self, core: CacheCore, controller: HiCacheController) -> None:
        self.core = core
        self.controller = controller
        #: Where backup durations go (``RadixCache.durations``), ``None`` to record none.
        self.durations: Durations | None = None
        parts = tier_components(core.components)
        if not parts or parts[0] is not core.components[0]:
            raise ValueError("a host tier needs the first component (KV) to keep host copies")
        self.parts = parts
        self.primary = parts[0]
        for c in parts:
            pair = controller.pools.get(c.name)
            if pair is None:
                got = c.host_pool(controller.config)
                assert got is not None
                pair = controller.register_pair(c.name, *got)
            c.host_allocator = pair.host
        self._on_device = self.primary.has_device
        self._evictable_leaf = self.primary.is_candidate
        self._host_copy = self.primary.host_copy
        self._splitters = hooks(parts, "split_host")
        self._revivers = hooks(parts, "revive_host")
        self._requeues = hooks(core.components, "requeue")
        #: The usable rule of a host hit: each component's rule counting host copies.
        self._host_rules = tuple(
            c.host_usable if type(c).host_usable is not Component.host_usable else c.usable
            for c in core.components
            if type(c).host_usable is not Component.host_usable
            or type(c).usable is not Component.usable)
        self.storage: StorageTier | None = None
        #: Device units the tier freed (demotions, removals), per accumulator index
        #: (``CacheCore.new_freed``); running.
        self._freed = core.new_freed()
        if controller.config.hicache_write_policy == "write_back":
            core.before_internal = self.save_before_drop
        core.before_evict = controller.order_frees  # (a layerwise load's rows freed)
        self.reset()

    def reset(self) -> None:
        self.host_leaves = OrderedNodeSet(_lru)
        self.host_tokens = 0
        self._pinned: set[int] = set()  # node ids a load_back is bringing to device
        self.counters = {"backup_tokens": 0, "demoted_tokens": 0, "host_evicted_tokens": 0,
                         "load_back_tokens": 0, "load_back_states": 0, "host_hit_tokens": 0,
                         "copy_failures": 0}

    # ------------------------------------------------------------ residency
    def refresh(self, node: TreeNode) -> None:
        if (
            node.parent is not None
            and not self._on_device(node)
            and self._host_copy(node) is not None
            and not node.children
            and node.id not in self._pinned
        ):
            self.host_leaves.update(node)
        else:
            self.host_leaves.discard(node)

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        for split in self._splitters:
            split(upper, lower, split_len)

    def on_remove(self, node: TreeNode) -> int:
        """``node`` leaves the tree: free its host copies."""
        self.host_leaves.discard(node)
        hv = self._host_copy(node)
        if hv is not None:
            self.host_tokens -= len(hv)
        for c in self.parts:
            c.drop_host(node)
        return 0

    # ----------------------------------------------------------- tier hooks
    def before_match(self, key: Any, extra_key: Any) -> None:
        self.poll()
        if self.storage is not None:
            self.storage.before_match(key, extra_key)  # prefetch past the tree; never raises

    def device_part(self, path: list[TreeNode]) -> list[TreeNode]:
        """The device prefix of a matched path; the host-only rest is re-filed (stamped)."""
        dev = 0
        on_device = self._on_device
        while dev < len(path) and on_device(path[dev]):
            dev += 1
        for n in path[dev:]:
            self.refresh(n)
        return path if dev == len(path) else path[:dev]

    def host_hit(self, path: list[TreeNode], usable: int, last: TreeNode,
                 prefix_len: int) -> tuple[TreeNode, int]:
        """The deepest matched node usable once its host chain is loaded back (every
        component's rule counting host copies, to a fixpoint), and the tokens it adds past
        ``prefix_len``."""
        h = len(path)
        rules = self._host_rules
        while h > usable:
            m = h
            for rule in rules:
                m = rule(path, m)
            if m == h:
                break
            h = m
        if h <= usable:
            return last, 0
        last_host = path[h - 1]
        hit = last_host.depth - prefix_len
        self.counters["host_hit_tokens"] += hit
        return last_host, hit

    def plan_insert(self, plan: InsertPlan) -> None:
        """Matched host-only nodes take the caller's device slots (the caller computed those
        tokens itself), whole, or one piece per cut a component planned inside them (``cuts``
        below ``prefix_len``: where the caller's SWA KV turns live); the node the walk ends
        inside counts with its matched part. Only those above ``prefix_len`` (a component may
        stop the insert above host-only nodes it cannot use)."""
        walk = plan.walk
        on_device = self._on_device
        p = plan.prefix_len
        for n in walk.path:
            if not on_device(n):
                if n.depth > p:
                    return
                self._plan_pieces(plan, n.start, n.depth)
        part = walk.partial
        if part is not None and not on_device(part):
            hi = part.start + walk.partial_len
            if hi <= p:
                self._plan_pieces(plan, part.start, hi)

    def _plan_pieces(self, plan: InsertPlan, lo: int, hi: int) -> None:
        """Revive ``[lo, hi)`` (one matched node), a piece per cut inside it."""
        if plan.cuts:
            for c in sorted(plan.cuts):
                if lo < c < hi:
                    plan.add_revival(c, lo, self)
                    lo = c
        plan.add_revival(hi, lo, self)

    def revive(self, node: TreeNode, slots: KVValue) -> None:
        for revive in self._revivers:
            revive(node, slots)
        self.core.refresh(node)
        parent = node.parent
        if parent is not None and parent.parent is not None:
            self.core.refresh(parent)  # no longer a device leaf

    def after_insert(self, path: list[TreeNode], last: TreeNode) -> None:
        """``write_through``: back up what was inserted; ``write_through_selective``: the
        deepest node hit at least twice (and its ancestors); ``write_back``: nothing now."""
        policy = self.controller.config.hicache_write_policy
        root = self.core.root
        target: TreeNode | None = None
        if policy == "write_through":
            target = last if last is not root else None
        elif policy == "write_through_selective":
            for n in [*path, last]:
                if n is not root and n.hit_count >= 2:
                    target = n
        if target is not None:
            if self._host_copy(target) is None:
                self.backup_chain(target)
            else:
                self.backup_rest(target)
        self.poll()

    def collect_landed(self) -> tuple[int, ...]:
        """Finish landed copies before an eviction; returns the device units they freed
        (earlier write-back evictions), per accumulator index (``CacheCore.new_freed``)."""
        before = list(self._freed)
        self.poll()
        return tuple(a - b for a, b in zip(self._freed, before, strict=True))

    def poll(self) -> int:
        """Finish completed device -> host copies (unlock, demote); returns how many."""
        return self.controller.poll()

    # -------------------------------------------------------------- backups
    def backup_chain(self, node: TreeNode, demote_after: bool = False) -> bool:
        """Back up ``node`` and every ancestor not yet on host, root first. Returns whether
        ``node`` is backed up (or its copy is in flight) afterwards."""
        t0 = perf_counter()
        chain = []
        n: TreeNode | None = node
        host_copy = self._host_copy
        while n is not None and n.parent is not None and host_copy(n) is None:
            chain.append(n)
            n = n.parent
        ok = True
        for n in reversed(chain):
            if not self._backup_node(n, demote_after and n is node):
                ok = False
                break
        if ok and host_copy(node) is not None:
            self.backup_rest(node)
        if chain and self.durations is not None:
            self.durations.observe("backup", perf_counter() - t0)
        return ok and host_copy(node) is not None

    def _alloc_host(self, node: TreeNode, components: tuple[Component, ...],
                    evict: int) -> tuple[list[tuple[Component, int]], list[torch.Tensor]] | None:
        """Host units for every part of ``node`` the ``components`` would back up, all at once;
        when short, host-only leaves are evicted (``evict`` tokens at least) and it is tried
        again, then with the first part alone (the others are optional). ``None``: short."""
        sizes = [(c, n) for c in components if (n := c.backup_size(node))]
        if not sizes:
            return None
        got = alloc_all([(c.host_allocator, n) for c, n in sizes])
        if got is None and evict:
            self.evict_host(evict)
            got = alloc_all([(c.host_allocator, n) for c, n in sizes])
            if got is None and len(sizes) > 1:
                sizes = sizes[:1]
                got = alloc_all([(c.host_allocator, n) for c, n in sizes])
        return None if got is None else (sizes, got)

    def _backup_node(self, node: TreeNode, demote_after: bool) -> bool:
        core = self.core
        size = len(node.key)
        got = self._alloc_host(node, self.parts, size)
        if got is None:
            return False
        parts: Parts = []
        units = [0] * len(core.pending)
        taken = [c for c, _ in got[0]]
        for (c, _), host in zip(*got, strict=True):
            parts.append((c.name, c.backup(node, host), host))
            if c.evict_field is not None:
                units[core.field_index(c)] += len(host)
        flight = _Flight(node.start, tuple(units), demote_after)
        try:  # the copy is enqueued before anything else changes: one that cannot start
            self._write(parts, lambda: self._on_write_done(node, flight))
        except BaseException as exc:  # gives its host units back and leaves the node as it was
            for c in reversed(taken):  # (undone in reverse: each allocator as before)
                c.undo_host(node)
            self._copy_failed("backup", exc)  # (re-raised unless an Exception)
            return False  # as with no host room
        self.host_tokens += size
        primary = self.primary
        primary.lock(node)  # until the copy has landed
        core.refresh(node)
        if demote_after:  # the write-back victim's units are freed when the copy lands
            for i, u in enumerate(units):
                core.pending[i] += u
        self.counters["backup_tokens"] += size
        return True

    def _copy_failed(self, op: str, exc: BaseException) -> None:
        """A copy that could not start (``write_rows`` / ``load_rows`` raised; its units were
        given back). A failure of the device or of memory (``RuntimeError``, which torch's
        out-of-memory and device errors are, ``MemoryError``, ``OSError``) is logged and
        counted (``stats()["copy_failures"]``) and the step goes on as one without room (a
        backup is skipped, a load-back returns 0), so an insert, eviction or match that made
        it never fails half done; anything else (a programming error, ``KeyboardInterrupt``)
        is re-raised."""
        if not isinstance(exc, (RuntimeError, MemoryError, OSError)):
            raise exc
        self.counters["copy_failures"] += 1
        log.warning("host tier: a %s copy could not start (%s: %s); skipped", op,
                    type(exc).__name__, exc)

    def _write(self, parts: Parts, on_done: Callable[[], None] | None) -> None:
        """Enqueue one device -> host copy of ``parts`` (``(pool pair, device rows, host
        rows)``, the pairs named as their components)."""
        hc = self.controller
        hc.write_rows(parts, on_done)
        for name, _, host in parts:
            if name == self.primary.name:
                hc.backup_tokens += len(host)

    def backup_rest(self, node: TreeNode) -> None:
        """Give a backed-up node's other device values host copies too (a state set after
        its KV, SWA KV live again); each part on its own, skipped when its pool is short."""
        parts: Parts = []
        taken = []
        for c in self.parts[1:]:
            got = self._alloc_host(node, (c,), 0)
            if got is not None:
                host = got[1][0]
                parts.append((c.name, c.backup(node, host), host))
                taken.append(c)
        if not parts:
            return
        storage = self.storage
        try:  # the parts join the node's pages once they are on host (never raises)
            self._write(parts, None if storage is None else lambda: storage.backup(node))
        except BaseException as exc:
            for c in reversed(taken):
                c.undo_host(node)
            self._copy_failed("backup", exc)
            return
        self.poll()  # (on the CPU the copy has landed: nothing stays in flight)

    def save_before_drop(self, node: TreeNode, freed: list[int]) -> None:
        """``write_back``: an eviction is about to drop one component's value from internal
        ``node`` (a state, its SWA KV): back the node up first (its KV and ancestors too when
        not on host yet), so the value stays on host. Adds to ``freed`` the device units this
        freed: making host room can remove a device parent of the host-only leaves it evicts
        (a dead leaf then), and copies landing meanwhile demote nodes."""
        self._counted(freed, self._save, node)

    def _save(self, node: TreeNode) -> None:
        if self._host_copy(node) is None:
            self.backup_chain(node)
        else:
            self.backup_rest(node)
        self.poll()  # copies that landed (every one, on the CPU) finish now

    def _counted(self, freed: list[int], step: Callable[[TreeNode], None],
                 node: TreeNode) -> None:
        """Run ``step(node)``; add to ``freed`` the device units the tier freed meanwhile."""
        acc = self._freed
        before = list(acc)
        step(node)
        for i, (a, b) in enumerate(zip(acc, before, strict=True)):
            freed[i] += a - b

    def _on_write_done(self, node: TreeNode, flight: _Flight) -> None:
        """The copy of ``node``'s span (``flight``) landed. Splits while it was in flight cut
        upper halves off the span (``node`` kept the lowest part): every piece is backed up
        (to L3) and, for a write-back victim, demoted while it is an unlocked device leaf."""
        core = self.core
        if flight.demote:
            for i, u in enumerate(flight.units):
                core.pending[i] -= u
        span = _span(node, flight.start) if core.tree.is_attached(node) else [node]
        if self.storage is not None:
            for n in span:
                self.storage.backup(n)  # host copy landed -> pages to L3; never raises
        if not self._on_device(node) or not core.tree.is_attached(node):
            return
        self.primary.unlock(node, None)
        core.refresh(node)
        if core.is_dead_leaf(node):  # its children left while the copy was in flight
            core.remove_leaf(node, self._freed)
            return
        if flight.demote:
            for n in reversed(span):  # deepest first: each may leave its parent a device leaf
                if not self._evictable_leaf(n):  # on device, unlocked, no device child
                    break
                self._demote(n)
                if not core.tree.is_attached(n):
                    break
        for requeue in self._requeues:
            requeue(node)

    # ------------------------------------------------------------- eviction
    def free_leaf(self, node: TreeNode, freed: list[int]) -> None:
        """Free a device leaf on eviction: demote it when it is (or can be) backed up, else
        remove it. Adds to ``freed`` the device units freed now, measured around the whole
        step: a write-back backup may itself evict on host, and that cascade can remove a
        device parent of the host-only leaves it frees; copies landing meanwhile demote
        nodes too. (A write-back copy still in flight frees its slots when it lands.)"""
        self._counted(freed, self._free_device_leaf, node)

    def _free_device_leaf(self, node: TreeNode) -> None:
        has_copy = self._host_copy(node) is not None
        if not has_copy and self.controller.config.hicache_write_policy == "write_back":
            ok = self.backup_chain(node, demote_after=True)  # raises ``core.pending`` meanwhile
            self.poll()  # landed copies finish now, also those of ancestors backed up before a
            if ok:  # shortfall stopped the chain: unlocked, they are evictable again
                return
            if not self.core.tree.is_attached(node):  # making host room removed it (a dead
                return  # leaf once its host-only children went): its units are counted
        if has_copy:
            self.backup_rest(node)
            self._demote(node)
        elif node.children:  # host-only children below: keep the node and its KV only
            for c in self.parts[1:]:
                if c.has_device(node):
                    self._freed[self.core.field_index(c)] += c.evict_internal(node)
        else:
            self.core.remove_leaf(node, self._freed)

    def _demote(self, node: TreeNode) -> None:
        """Free ``node``'s device values; it stays in the tree, host-only."""
        assert self._host_copy(node) is not None, node
        core = self.core
        core.device_remove(node, self._freed)
        parent = node.parent
        core.refresh(node)
        if parent is not None and parent.parent is not None:
            core.refresh(parent)
        self.counters["demoted_tokens"] += len(node.key)
        if not node.children and core.is_dead_leaf(node):
            self._remove_host_leaf(node)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host KV tokens: host-only leaves, least recently used
        first; a parent that becomes a host-only leaf may follow in the same call. Returns
        the host tokens freed."""
        freed = 0
        while freed < num_tokens:
            node = self.host_leaves.pop_first()
            if node is None:
                break
            freed += self._remove_host_leaf(node)
        return freed

    def _remove_host_leaf(self, node: TreeNode) -> int:
        """Remove a host-only leaf: free its host copies; cascade."""
        assert not self._on_device(node) and not node.children, node
        core = self.core
        root = core.root
        before = self.host_tokens
        while True:
            self.on_remove(node)
            parent = core.tree.remove_leaf(node)
            core.detached(node)
            if parent is root:
                break
            kept = parent.id in self._pinned  # a pinned node stays, even left a dead leaf
            if not self._on_device(parent):
                self.refresh(parent)
                if not parent.children and not kept and core.is_dead_leaf(parent):
                    node = parent
                    continue
                break
            core.refresh(parent)
            if not kept and core.is_dead_leaf(parent):  # a device dead leaf: host copy goes too
                core.remove_leaf(parent, self._freed)
            break
        freed = before - self.host_tokens
        self.counters["host_evicted_tokens"] += freed
        return freed

    @contextmanager
    def pinned(self, node: TreeNode) -> Iterator[None]:
        """Keep ``node`` in the tree while the block runs: host evictions never pick it, nor
        remove it when they leave it a childless (or dead) leaf. For a caller that makes room
        under ``node`` and then attaches to it."""
        if node.id in self._pinned:
            yield
            return
        self._pinned.add(node.id)
        self.host_leaves.discard(node)
        try:
            yield
        finally:
            self._pinned.discard(node.id)
            if node.parent is not None:
                self.refresh(node)

    # ------------------------------------------------------------ load back
    def load_back(self, node: TreeNode) -> int:
        """Bring the host-only chain ending at ``node`` back to device (see
        ``RadixCache.load_back``); ``node`` is a checked node of this cache. Every
        component's part (KV of the chain, SWA KV of its nodes with a host copy, the state at
        its end) is allocated at once: a shortfall in any pool, after evicting, changes
        nothing."""
        core = self.core
        chain = self._chain(node)
        tokens = sum(len(c.key) for c in chain)
        if chain and tokens < self.controller.config.load_back_threshold:
            return 0
        targets = chain if chain else [node]
        if node.parent is None:
            return 0
        sizes = [[c.restore_size(t, t is node) for t in targets] for c in self.parts]
        wanted = [(c, sz) for c, sz in zip(self.parts, sizes, strict=True) if sum(sz)]
        if not wanted:
            return 0
        anchor = chain[0].parent if chain else node
        assert anchor is not None
        root = core.root
        primary = self.primary
        if anchor is not root:
            primary.lock(anchor)  # protect the device ancestor while room is made
        pinned = {c.id for c in chain}
        self._pinned |= pinned  # making room must not evict the chain from host
        for c in chain:
            self.host_leaves.discard(c)
        try:
            got = self._alloc_device([(c, sum(sz)) for c, sz in wanted])
        finally:
            self._pinned -= pinned
            for c in chain:
                self.refresh(c)
            if anchor is not root:
                primary.unlock(anchor, None)
                core.refresh(anchor)
        if got is None:
            return 0
        for (c, _), dev in zip(wanted, got, strict=True):
            overwrite = getattr(c.restore_allocator, "overwrite", None)
            if overwrite is not None:  # the load writes every unit it got: no zeroing first
                for slot in host_ids(dev, "restored units").tolist():
                    overwrite(slot)
        parts: Parts = []
        for j, (c, sz) in enumerate(wanted):
            hosts = [h for t, k in zip(targets, sz, strict=True)
                     if k and (h := c.host_copy(t)) is not None]
            parts.append((c.name, got[j], torch.cat(hosts) if len(hosts) > 1 else hosts[0]))
        hc = self.controller
        try:  # the copy is enqueued first: one that cannot start gives the device units back
            hc.load_rows(parts)
        except BaseException as exc:  # undone in reverse: each allocator as before the alloc
            for (c, _), dev in reversed(list(zip(wanted, got, strict=True))):
                c.restore_allocator.undo_alloc(dev)
            self._copy_failed("load-back", exc)
            return 0  # as with no device room
        hc.load_tokens += tokens
        now = core.tick()
        offsets = [0] * len(wanted)
        for i, t in enumerate(targets):
            for j, (c, sz) in enumerate(wanted):
                k = sz[i]
                if k:
                    o = offsets[j]
                    c.restore(t, got[j][o:o + k], now)
                    offsets[j] = o + k
        for c in chain:
            c.last_access_time = now
            self.refresh(c)
        for c in [anchor, *chain]:
            if c.parent is not None:
                core.refresh(c)
        if chain:
            self.counters["load_back_tokens"] += tokens
        else:
            self.counters["load_back_states"] += 1
        return tokens

    def _chain(self, node: TreeNode) -> list[TreeNode]:
        """The host-only chain ending at ``node`` (``node`` and its host-only ancestors),
        shallowest first; empty when ``node``'s KV is on device."""
        on_device = self._on_device
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None and not on_device(n):
            chain.append(n)
            n = n.parent
        chain.reverse()
        return chain

    def load_sizes(self, node: TreeNode) -> dict[str, int]:
        """What :meth:`load_back` of ``node`` would bring to device, by component name: each
        component's units (``Component.restore_size``, the load-back's own plan) over the
        host-only chain ending at ``node`` (``node`` alone when its KV is on device: its
        state); components that bring none are left out. ``load_back_threshold`` and free
        room are not considered."""
        chain = self._chain(node)
        targets = chain if chain else [node]
        out: dict[str, int] = {}
        for c in self.parts:
            k = sum(c.restore_size(t, t is node) for t in targets)
            if k:
                out[c.name] = k
        return out

    def _alloc_device(self, asks: list[tuple[Component, int]]) -> list[torch.Tensor] | None:
        """Every component's device units, all or nothing, evicting once when short (each
        short component in its own order)."""
        reqs = [(c.restore_allocator, n) for c, n in asks]
        got = alloc_all(reqs)
        if got is None:
            self.collect_landed()
            for c, n in asks:
                short = n - c.restore_allocator.available_size()
                if short > 0 and c.evict_field is not None:
                    self.core.evict(c, short)
            got = alloc_all(reqs)
        return got

    def describe(self, node: TreeNode) -> str:
        where = ("dev+host" if self._host_copy(node) is not None else "dev") if (
            self._on_device(node)) else "host"
        rest = "".join(f" host_{c.name}={'-' if (h := c.host_copy(node)) is None else len(h)}"
                       for c in self.parts[1:])
        return f" at={where}{rest}"

    # ---------------------------------------------------------------- sizes
    def host_evictable_size(self) -> int:
        """Host tokens of host-only leaves no copy is in flight for."""
        return sum(len(n.key) for n in self.host_leaves)

    def check(self, nodes: list[TreeNode]) -> None:
        """Host copies: every node is on device or on host, a component's host copy only on a
        backed-up node, ``host_tokens`` and the host-eviction order recomputed, then each
        component's own host checks."""
        host_tokens = 0
        expected_leaves = set()
        for n in nodes:
            hv = self._host_copy(n)
            dev = self._on_device(n)
            assert dev or hv is not None, f"node with no KV anywhere: {n}"
            if not dev and not n.children:
                expected_leaves.add(n.id)
            if hv is None:
                for c in self.parts[1:]:
                    assert c.host_copy(n) is None, f"host {c.name} without host KV: {n}"
                continue
            host_tokens += len(hv)
        assert host_tokens == self.host_tokens, f"host tokens {self.host_tokens} != {host_tokens}"
        for c in self.parts:
            c.check_host(nodes)
        got = {n.id for n in self.host_leaves}
        assert got == expected_leaves, f"host eviction set differs: {got ^ expected_leaves}"
        self.host_leaves.check()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["host_tokens"] = self.host_tokens
        if self.storage is not None:
            out.update(self.storage.stats())
        return out


class _Flight(NamedTuple):
    """One backup copy in flight: the span it covers starts at ``start`` [tokens]; a
    write-back victim (``demote``) raised ``CacheCore.pending`` by ``units`` (per
    accumulator index, ``CacheCore.new_freed``)."""

    start: int
    units: tuple[int, ...]
    demote: bool


def _span(node: TreeNode, start: int) -> list[TreeNode]:
    """``node`` and the ancestors that splits cut off the span beginning at ``start`` (a split
    keeps the lower part in ``node``; its upper halves are the ancestors starting at or after
    ``start``), shallowest first."""
    out = [node]
    n = node.parent
    while n is not None and n.parent is not None and n.start >= start:
        out.append(n)
        n = n.parent
    out.reverse()
    return out
