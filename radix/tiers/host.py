"""HiCache L2 inside the one tree: backups, demotion, load-back and host eviction.

Residency of a node's KV: on device (``kv_value``), on host (``host_value``), or both. Nodes on
device form a prefix-closed set (a host-only node has no device child) and backed-up nodes form
a prefix from the root (a child is never backed up before its parent)::

    root ── A dev+host ── B dev+host ── C host      match [A B C]: device prefix A B,
                      └── D dev                     load_back(C) brings C to device

* backup (``write_through``: at insert; ``write_through_selective``: once hit twice;
  ``write_back``: when evicted from device): host KV slots (+ a host state slot), one copy,
  the node's KV path locked until the copy has landed (``poll``).
* device eviction of a backed-up leaf *demotes* it (device slots and state freed, the node
  stays, host-only); a leaf with no backup leaves the tree as before.
* ``load_back``: a host-only chain back to device, all or nothing, evicting on device first.
* ``evict_host``: host-only leaves, least recently used first, cascading to parents that
  become host-only leaves.

:class:`HostTier` is a component of the tree for the structural hooks (it holds each node's
host copy: split, re-file, free on removal; an insert over host-only nodes revives them) and a
tier for the rest (:class:`radix.tiers.base.Tier`: before a match, the host part of a match,
after an insert, on a device eviction). The L3 storage tier, when configured, hangs below it
(``self.storage``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from allocators import alloc_all, host_int
from components.base import Component, InsertPlan
from components.ordered import OrderedNodeSet
from radix.core import freed_counts
from radix.durations import Durations
from radix.tiers.base import Tier

if TYPE_CHECKING:
    from allocators.token_allocator import _FreeListAllocator
    from components.kv import KVComponent, KVValue
    from components.state import StateComponent
    from hicache import HiCacheController
    from radix.core import CacheCore
    from radix.node import TreeNode
    from radix.tiers.storage import StorageTier


def _lru(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class HostTier(Component, Tier):
    """The host (L2) tier of one cache.

    Args:
        core: the cache's tree and components.
        controller: host pools and copies (``hicache.HiCacheController``).
    """

    name = "host"
    revives = True

    def __init__(self, core: CacheCore, controller: HiCacheController) -> None:
        self.core = core
        self.controller = controller
        #: Where backup durations go (``RadixCache.durations``), ``None`` to record none.
        self.durations: Durations | None = None
        self.kv = cast("KVComponent", core.by_name["kv"])
        self.state = cast("StateComponent | None", core.by_name.get("state"))
        self.storage: StorageTier | None = None
        self.reset()

    def reset(self) -> None:
        self.host_leaves = OrderedNodeSet(_lru)
        self.host_tokens = 0
        self._pinned: set[int] = set()  # node ids a load_back is bringing to device
        self.counters = {"backup_tokens": 0, "demoted_tokens": 0, "host_evicted_tokens": 0,
                         "load_back_tokens": 0, "load_back_states": 0, "host_hit_tokens": 0}

    # ------------------------------------------------------------ residency
    def refresh(self, node: TreeNode) -> None:
        if (
            node.parent is not None
            and node.kv_value is None
            and node.host_value is not None
            and not node.children
            and node.id not in self._pinned
        ):
            self.host_leaves.update(node)
        else:
            self.host_leaves.discard(node)

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        hv = lower.host_value
        if hv is not None:
            upper.host_value = hv[:split_len]
            lower.host_value = hv[split_len:]

    def on_remove(self, node: TreeNode) -> int:
        """``node`` leaves the tree: free its host copies."""
        self.host_leaves.discard(node)
        hc = self.controller
        if node.host_value is not None:
            hc.host_kv.free_owned(node.host_value)
            self.host_tokens -= len(node.key)
            node.host_value = None
        if node.host_state_slot is not None:
            assert hc.host_state is not None
            hc.host_state.free_owned(node.host_state_slot)
            node.host_state_slot = None
        return 0

    # ----------------------------------------------------------- tier hooks
    def before_match(self, key: Any, extra_key: Any) -> None:
        self.poll()
        if self.storage is not None:
            self.storage.before_match(key, extra_key)  # prefetch past the tree; never raises

    def device_part(self, path: list[TreeNode]) -> list[TreeNode]:
        """The device prefix of a matched path; the host-only rest is re-filed (stamped)."""
        dev = 0
        while dev < len(path) and path[dev].kv_value is not None:
            dev += 1
        for n in path[dev:]:
            self.refresh(n)
        return path if dev == len(path) else path[:dev]

    def host_hit(self, path: list[TreeNode], usable: int, last: TreeNode,
                 prefix_len: int) -> tuple[TreeNode, int]:
        """The deepest matched node usable once its host chain is loaded back (a state on
        device or on host at its end, with a recurrent-state component), and the tokens it
        adds past ``prefix_len``."""
        h = len(path)
        if self.state is not None:
            while h > usable and path[h - 1].state_slot is None and (
                path[h - 1].host_state_slot is None
            ):
                h -= 1
        if h <= usable:
            return last, 0
        last_host = path[h - 1]
        hit = last_host.depth - prefix_len
        self.counters["host_hit_tokens"] += hit
        return last_host, hit

    def plan_insert(self, plan: InsertPlan) -> None:
        """Matched host-only nodes take the caller's device slots (the caller computed those
        tokens itself), whole; the node the walk ends inside counts with its matched part."""
        walk = plan.walk
        for n in walk.path:
            if n.kv_value is None:
                plan.add_revival(n.depth, n.start, self)
        part = walk.partial
        if part is not None and part.kv_value is None:
            plan.add_revival(part.start + walk.partial_len, part.start, self)

    def revive(self, node: TreeNode, slots: KVValue) -> None:
        self.kv.attach(node, slots)  # the node keeps ``slots`` (as its own) as its kv_value
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
            if target.host_value is None:
                self.backup_chain(target)
            else:
                self.backup_state(target)
        self.poll()

    def collect_landed(self) -> tuple[int, int]:
        """Finish landed copies before an eviction; returns the device tokens and states
        they freed (earlier write-back evictions)."""
        kv, state = self.kv, self.state
        t0, s0 = kv.evicted, state.evicted if state is not None else 0
        self.poll()
        return kv.evicted - t0, (state.evicted if state is not None else 0) - s0

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
        while n is not None and n.parent is not None and n.host_value is None:
            chain.append(n)
            n = n.parent
        ok = True
        for n in reversed(chain):
            if not self._backup_node(n, demote_after and n is node):
                ok = False
                break
        if ok and node.host_value is not None:
            self.backup_state(node)
        if chain and self.durations is not None:
            self.durations.observe("backup", perf_counter() - t0)
        return ok and node.host_value is not None

    def _backup_node(self, node: TreeNode, demote_after: bool) -> bool:
        hc = self.controller
        assert node.kv_value is not None
        with_state = node.state_slot is not None and node.host_state_slot is None
        size = len(node.key)
        got = hc.alloc_host(size, int(with_state))
        if got is None:
            self.evict_host(size)
            got = hc.alloc_host(size, int(with_state))
            if got is None and with_state:
                with_state = False
                got = hc.alloc_host(size, 0)
            if got is None:
                return False
        host_slots, host_state = got
        flight = _Flight(node.start, size, int(node.state_slot is not None), demote_after)
        try:  # the copy is enqueued first: one that cannot start changes nothing
            hc.write(self.kv.slots(node), host_slots, node.state_slot if with_state else None,
                     host_state, lambda: self._on_write_done(node, flight))
        except BaseException:
            hc.host_kv.free_owned(host_slots)
            if host_state is not None and hc.host_state is not None:
                hc.host_state.free_owned(host_state)
            raise
        node.host_value = host_slots
        node.host_state_slot = host_state
        self.host_tokens += size
        self.kv.lock(node)  # until the copy has landed
        self.core.refresh(node)
        if demote_after:  # the write-back victim's units are freed when the copy lands
            self.core.pending[0] += flight.tokens
            self.core.pending[1] += flight.states
        self.counters["backup_tokens"] += size
        return True

    def backup_state(self, node: TreeNode) -> None:
        """Give a backed-up node's device state a host copy too (a state set after its KV)."""
        hs = self.controller.host_state
        if node.state_slot is None or node.host_state_slot is not None or hs is None:
            return
        got = hs.alloc(1)
        if got is None:
            return
        node.host_state_slot = int(got[0])
        storage = self.storage
        # the state joins the node's pages once it is on host; never raises
        self.controller.save_state(node.state_slot, node.host_state_slot,
                                   None if storage is None else lambda: storage.backup(node))

    def _on_write_done(self, node: TreeNode, flight: _Flight) -> None:
        """The copy of ``node``'s span (``flight``) landed. Splits while it was in flight cut
        upper halves off the span (``node`` kept the lowest part): every piece is backed up
        (to L3) and, for a write-back victim, demoted while it is an unlocked device leaf."""
        core = self.core
        if flight.demote:
            core.pending[0] -= flight.tokens
            core.pending[1] -= flight.states
        span = _span(node, flight.start) if core.tree.is_attached(node) else [node]
        if self.storage is not None:
            for n in span:
                self.storage.backup(n)  # host copy landed -> pages to L3; never raises
        if node.kv_value is None or not core.tree.is_attached(node):
            return
        self.kv.unlock(node)
        core.refresh(node)
        if core.is_dead_leaf(node):  # its children left while the copy was in flight
            core.remove_leaf(node)
            return
        if flight.demote:
            for n in reversed(span):  # deepest first: each may leave its parent a device leaf
                if n.kv_value is None or n.kv_lock or not _is_device_leaf(n):
                    break
                self._demote(n)
                if not core.tree.is_attached(n):
                    break
        if self.state is not None and node.state_slot is not None:
            self.state.requeue(node)

    # ------------------------------------------------------------- eviction
    def free_leaf(self, node: TreeNode, freed: list[int]) -> None:
        """Free a device leaf on eviction: demote it when it is (or can be) backed up, else
        remove it. Adds to ``freed`` the device units freed now, measured around the whole
        step: a write-back backup may itself evict on host, and that cascade can remove a
        stateless device parent of the host-only leaves it frees; copies landing meanwhile
        demote nodes too. (A write-back copy still in flight frees its slots when it lands.)"""
        kv, state = self.kv, self.state
        t0, s0 = kv.evicted, state.evicted if state is not None else 0
        self._free_device_leaf(node)
        freed[0] += kv.evicted - t0
        freed[1] += (state.evicted if state is not None else 0) - s0

    def _free_device_leaf(self, node: TreeNode) -> None:
        if node.host_value is None and self.controller.config.hicache_write_policy == "write_back":
            if self.backup_chain(node, demote_after=True):  # raises ``core.pending`` meanwhile
                self.poll()
                return
        if node.host_value is not None:
            self.backup_state(node)
            self._demote(node)
        elif node.children:  # host-only children below: keep the node, drop its state only
            if self.state is not None and node.state_slot is not None:
                self.state.remove_state(node)
        else:
            self.core.remove_leaf(node)

    def _demote(self, node: TreeNode) -> None:
        """Free ``node``'s device KV and state; it stays in the tree, host-only."""
        assert node.kv_lock == 0 and node.host_value is not None, node
        core = self.core
        core.device_remove(node, freed_counts())
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
        """Remove a host-only leaf: free its host slots and host state; cascade."""
        assert node.kv_value is None and not node.children, node
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
            if parent.kv_value is None:
                self.refresh(parent)
                if not parent.children and not kept and core.is_dead_leaf(parent):
                    node = parent
                    continue
                break
            core.refresh(parent)
            if not kept and core.is_dead_leaf(parent):  # a device dead leaf: host copy goes too
                core.remove_leaf(parent)
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
        ``RadixCache.load_back``); ``node`` is a checked node of this cache."""
        core = self.core
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None and n.kv_value is None:
            chain.append(n)
            n = n.parent
        chain.reverse()
        want_state = (
            self.state is not None and node.host_state_slot is not None and node.state_slot is None
        )
        if not chain:  # KV on device, only the state is on host: bring the state back
            if want_state and node.parent is not None:
                return self._load_state_only(node)
            return 0
        anchor = chain[0].parent
        assert anchor is not None
        tokens = sum(len(c.key) for c in chain)
        if tokens < self.controller.config.load_back_threshold:
            return 0
        root = core.root
        if anchor is not root:
            self.kv.lock(anchor)
        pinned = {c.id for c in chain}
        self._pinned |= pinned  # making room must not evict the chain from host
        for c in chain:
            self.host_leaves.discard(c)
        try:
            got = self._alloc_device(tokens, int(want_state))
        finally:
            self._pinned -= pinned
            for c in chain:
                self.refresh(c)
            if anchor is not root:
                self.kv.unlock(anchor)
                core.refresh(anchor)
        if got is None:
            return 0
        dev_slots, dev_state = got
        host_slots = torch.cat([c.host_value for c in chain if c.host_value is not None])
        try:  # a copy that cannot start gives the device units back
            self.controller.load(host_slots, dev_slots,
                                 node.host_state_slot if want_state else None, dev_state)
        except BaseException:
            self.kv.allocator.free(dev_slots)
            if dev_state is not None and self.state is not None:
                self.state.allocator.free(torch.tensor([dev_state]))
            raise
        self.kv.claim(dev_slots)  # fresh from the allocator: marked held (its host mirror)
        off = 0
        now = core.tick()
        for c in chain:
            size = len(c.key)
            self.kv.attach(c, dev_slots[off:off + size])  # (kept as an array: its host mirror)
            off += size
            c.last_access_time = now
            self.refresh(c)
        if dev_state is not None:
            assert self.state is not None
            self.state.set_state(node, dev_state, now)  # stamps it at the watermark (GDS)
        for c in [anchor, *chain]:
            if c.parent is not None:
                core.refresh(c)
        self.counters["load_back_tokens"] += tokens
        return tokens

    def _load_state_only(self, node: TreeNode) -> int:
        """``node``'s KV is on device but its state only on host: one state slot back."""
        state = self.state
        assert state is not None and node.host_state_slot is not None
        self.kv.lock(node)  # protect the node while a state slot is made room for
        try:
            got = self._alloc_device(0, 1)
        finally:
            self.kv.unlock(node)
            self.core.refresh(node)
        if got is None:
            return 0
        _, dev_state = got
        assert dev_state is not None
        empty = torch.empty(0, dtype=torch.int64)
        self.controller.load(empty, empty, node.host_state_slot, dev_state)
        state.set_state(node, dev_state, self.core.tick())
        self.counters["load_back_states"] += 1
        return 0

    def _alloc_device(self, tokens: int, states: int) -> tuple[torch.Tensor, int | None] | None:
        """Device KV slots and a state slot, all or nothing, evicting once when short."""
        asks: list[tuple[Any, int]] = [(self.kv.allocator, tokens)]
        state = self.state
        if states:
            assert state is not None
            asks.append((state.allocator, states))
        got = alloc_all(asks)
        if got is None:
            self.collect_landed()
            self.core.evict(self.kv, max(tokens - self.kv.allocator.available_size(), 0))
            if states and state is not None and state.allocator.available_size() < states:
                self.core.evict(state, states)
            got = alloc_all(asks)
            if got is None:
                return None
        if not states:
            return got[0], None
        slot = host_int(got[1], "state slot")
        overwrite = getattr(asks[1][0], "overwrite", None)
        if overwrite is not None:  # the load writes the whole slot: no zeroing first
            overwrite(slot)
        return got[0], slot

    def describe(self, node: TreeNode) -> str:
        where = ("dev+host" if node.host_value is not None else "dev") if (
            node.kv_value is not None) else "host"
        return f" at={where} host_state={node.host_state_slot}"

    # ---------------------------------------------------------------- sizes
    def host_evictable_size(self) -> int:
        """Host tokens of host-only leaves no copy is in flight for."""
        return sum(len(n.key) for n in self.host_leaves)

    def check(self, nodes: list[TreeNode]) -> None:
        """Host copies: every node has KV somewhere, host-only nodes hold no device state,
        backed-up nodes form a prefix from the root, host slots held once and never free,
        ``host_tokens`` and the host-eviction order recomputed."""
        hc = self.controller
        host_tokens = 0
        host_slots = []
        host_states = []
        expected_leaves = set()
        for n in nodes:
            hv = n.host_value
            assert n.kv_value is not None or hv is not None, f"node with no KV anywhere: {n}"
            if n.kv_value is None:
                assert n.state_slot is None, f"device state on a host-only node: {n}"
                if not n.children:
                    expected_leaves.add(n.id)
            if hv is None:
                assert n.host_state_slot is None, f"host state without host KV: {n}"
                continue
            assert len(hv) == len(n.key), f"{n}: {len(hv)} host slots for {len(n.key)} tokens"
            p = n.parent
            assert p is not None
            if p.parent is not None:
                assert p.host_value is not None, f"backed up before its parent: {n}"
            host_tokens += len(hv)
            host_slots.append(hv)
            if n.host_state_slot is not None:
                host_states.append(n.host_state_slot)
        assert host_tokens == self.host_tokens, f"host tokens {self.host_tokens} != {host_tokens}"
        if host_slots:
            held = torch.cat(host_slots)
            assert held.unique().numel() == held.numel(), "a host slot is held by two nodes"
            host_kv = cast("_FreeListAllocator", hc.host_kv)  # mirror_kv: a Token/PagedAllocator
            assert not bool(host_kv.is_free(held).any()), "a host slot held by the tree is free"
        assert len(set(host_states)) == len(host_states), "a host state slot is held twice"
        if host_states and hc.host_state is not None:
            assert not bool(hc.host_state.is_free(torch.tensor(host_states)).any()), (
                "a host state slot held by the tree is free"
            )
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
    write-back victim (``demote``) raised ``CacheCore.pending`` by ``tokens`` and ``states``."""

    start: int
    tokens: int
    states: int
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


def _is_device_leaf(node: TreeNode) -> bool:
    return node.kv_value is not None and not any(
        c.kv_value is not None for c in node.children.values()
    )
