# Mixin of RadixCache: its methods annotate ``self: RadixCache`` so their bodies are checked
# against the full cache. mypy reports such a self type, not a supertype of the mixin, as [misc]
# (RadixCache cannot be a base here: it inherits this mixin), so that one code is off in this file.
# mypy: disable-error-code="misc"
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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from allocators import alloc_all
from radix.node import TreeNode
from radix.ordered import OrderedNodeSet

if TYPE_CHECKING:
    from radix.cache import RadixCache


def _lru(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class HostTier:
    """Mixed into :class:`RadixCache` (all methods are no-ops or errors without HiCache)."""

    def _init_host(self: RadixCache) -> None:
        self.host_leaves = OrderedNodeSet(_lru)
        self._host_tokens = 0
        self._host_pinned: set[int] = set()  # node ids a load_back is bringing to device
        self._evict_pending = [0, 0]  # write-back tokens / states in flight for eviction

    # ------------------------------------------------------------ residency
    @staticmethod
    def _on_device(node: TreeNode) -> bool:
        return node.kv_value is not None

    def _host_refresh(self: RadixCache, node: TreeNode) -> None:
        if (
            node.parent is not None
            and node.kv_value is None
            and node.host_value is not None
            and not node.children
            and node.id not in self._host_pinned
        ):
            self.host_leaves.update(node)
        else:
            self.host_leaves.discard(node)

    def _host_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        hv = lower.host_value
        if hv is not None:
            upper.host_value = hv[:split_len]
            lower.host_value = hv[split_len:]

    # -------------------------------------------------------------- backups
    def _backup_chain(self: RadixCache, node: TreeNode, demote_after: bool = False) -> bool:
        """Back up ``node`` and every ancestor not yet on host, root first. Returns whether
        ``node`` is backed up (or its copy is in flight) afterwards."""
        chain = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None and n.host_value is None:
            chain.append(n)
            n = n.parent
        for n in reversed(chain):
            if not self._backup_node(n, demote_after and n is node):
                return False
        if node.host_value is not None:
            self._backup_state(node)
        return node.host_value is not None

    def _backup_node(self: RadixCache, node: TreeNode, demote_after: bool) -> bool:
        hc = self.hicache
        assert hc is not None and node.kv_value is not None
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
        node.host_value = host_slots
        node.host_state_slot = host_state
        self._host_tokens += size
        self.kv.lock(node)  # until the copy has landed
        self._refresh(node)
        hc.write(node.kv_value, host_slots, node.state_slot if with_state else None, host_state,
                 lambda: self._on_write_done(node, demote_after))
        self._stats["backup_tokens"] += size
        return True

    def _backup_state(self: RadixCache, node: TreeNode) -> None:
        """Give a backed-up node's device state a host copy too (a state set after its KV)."""
        hc = self.hicache
        if hc is None or node.state_slot is None or node.host_state_slot is not None:
            return
        hs = hc.host_state
        assert hs is not None
        got = hs.alloc(1)
        if got is None:
            return
        node.host_state_slot = int(got[0])
        hc.save_state(node.state_slot, node.host_state_slot)
        self._l3_backup(node)  # L3 hook: the state joins the node's pages; never raises

    def _on_write_done(self: RadixCache, node: TreeNode, demote_after: bool) -> None:
        self._l3_backup(node)  # L3 hook: host copy landed -> pages to L3; never raises
        if demote_after:
            self._evict_pending[0] -= len(node.key)
            self._evict_pending[1] -= int(node.state_slot is not None)
        if node.kv_value is None or not self.tree.is_attached(node):
            return
        self.kv.unlock(node)
        self._refresh(node)
        if self._dead_leaf(node):  # its children left while the copy was in flight
            self._remove_leaf(node)
            return
        if demote_after and node.kv_lock == 0 and self._is_device_leaf(node):
            self._demote(node)
        if self.state is not None and node.state_slot is not None:
            self.state.requeue(node)

    def poll_transfers(self: RadixCache) -> int:
        """Finish completed device -> host copies (unlock, demote); returns how many."""
        return self.hicache.poll() if self.hicache is not None else 0

    # ------------------------------------------------------------- eviction
    @staticmethod
    def _is_device_leaf(node: TreeNode) -> bool:
        return node.kv_value is not None and not any(
            c.kv_value is not None for c in node.children.values()
        )

    def _evict_device_leaf(self: RadixCache, node: TreeNode) -> tuple[int, int, int]:
        """Free a device leaf: demote it when it is (or can be) backed up, else remove it.

        Returns (device KV tokens, device states, SWA tokens) freed now, counted from the
        ``evicted_*`` stats around the whole step: a write-back backup may itself evict on
        host, and that cascade can remove a stateless device parent of the host-only leaves
        it frees; copies landing meanwhile demote nodes too. (A write-back copy still in
        flight frees its slots when it lands.)
        """
        if self.hicache is None:
            return self._remove_leaf(node)
        st = self._stats
        tokens, states = st["evicted_tokens"], st["evicted_states"]
        self._evict_device_leaf_host(node)
        return st["evicted_tokens"] - tokens, st["evicted_states"] - states, 0

    def _evict_device_leaf_host(self: RadixCache, node: TreeNode) -> None:
        hc = self.hicache
        assert hc is not None
        if node.host_value is None and hc.config.hicache_write_policy == "write_back":
            if self._backup_chain(node, demote_after=True):
                self._evict_pending[0] += len(node.key)
                self._evict_pending[1] += int(node.state_slot is not None)
                self.poll_transfers()
                return
        if node.host_value is not None:
            self._backup_state(node)
            self._demote(node)
        elif node.children:  # host-only children below: keep the node, drop its state only
            if self.state is not None and node.state_slot is not None:
                self.state.remove_state(node)
                self._stats["evicted_states"] += 1
        else:
            self._remove_leaf(node)

    def _demote(self: RadixCache, node: TreeNode) -> tuple[int, int, int]:
        """Free ``node``'s device KV and state; it stays in the tree, host-only."""
        assert node.kv_lock == 0 and node.host_value is not None, node
        states = 0
        if self.state is not None and node.state_slot is not None:
            self.state.remove_state(node)
            states = 1
        size = len(node.key)
        self.kv.on_remove(node)
        parent = node.parent
        self._refresh(node)
        self._host_refresh(node)
        if parent is not None and parent.parent is not None:
            self._refresh(parent)
        st = self._stats
        st["evicted_tokens"] += size
        st["evicted_states"] += states
        st["demoted_tokens"] += size
        if not node.children and self._dead_leaf(node):
            self._remove_host_leaf(node)
        return size, states, 0

    def evict_host(self: RadixCache, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host KV tokens: host-only leaves, least recently used
        first; a parent that becomes a host-only leaf may follow in the same call.

        Returns the host tokens freed. Raises ``ValueError`` without HiCache or on a bad count.
        """
        self._check_count(num_tokens, "num_tokens")
        if self.hicache is None:
            raise ValueError("evict_host on a cache without HiCache")
        freed = 0
        while freed < num_tokens:
            node = self.host_leaves.pop_first()
            if node is None:
                break
            freed += self._remove_host_leaf(node)
        return freed

    def _remove_host_leaf(self: RadixCache, node: TreeNode) -> int:
        """Remove a host-only leaf: free its host slots and host state; cascade."""
        hc = self.hicache
        assert hc is not None and node.kv_value is None and not node.children, node
        before = self._host_tokens
        while True:
            self.host_leaves.discard(node)
            self._free_host(node)
            parent = self.tree.remove_leaf(node)
            if parent is self.root:
                break
            if parent.kv_value is None:
                self._host_refresh(parent)
                if not parent.children and self._dead_leaf(parent):
                    node = parent
                    continue
                break
            self._refresh(parent)
            if self._dead_leaf(parent):  # a device node left a dead leaf: its host copy goes too
                self._remove_leaf(parent)
            break
        freed = before - self._host_tokens
        self._stats["host_evicted_tokens"] += freed
        return freed

    def _free_host(self: RadixCache, node: TreeNode) -> None:
        hc = self.hicache
        assert hc is not None
        if node.host_value is not None:
            hc.host_kv.free_owned(node.host_value)
            self._host_tokens -= len(node.key)
            node.host_value = None
        if node.host_state_slot is not None:
            assert hc.host_state is not None
            hc.host_state.free_owned(node.host_state_slot)
            node.host_state_slot = None

    # ------------------------------------------------------------ load back
    def load_back(self: RadixCache, node: TreeNode) -> int:
        """Bring the host-only chain ending at ``node`` (``MatchResult.last_host_node``) back
        to device, all or nothing, with ``node``'s host state when it has one.

        Skipped (returns 0) below ``load_back_threshold`` tokens or when device memory cannot
        be had even after evicting; otherwise returns the KV tokens copied to device. When
        ``node``'s KV is already on device and only its state is on host, the state alone is
        loaded (returns 0; ``stats()["load_back_states"]`` counts it). Re-match afterwards. Evicts on device
        first when short (the device ancestor of the chain is protected meanwhile).

        Raises:
            ValueError: without HiCache, or ``node`` not in this cache.
        """
        hc = self.hicache
        if hc is None:
            raise ValueError("load_back on a cache without HiCache")
        node = self._check_node(node, device=False)
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
        if tokens < hc.config.load_back_threshold:
            return 0
        if anchor is not self.root:
            self.kv.lock(anchor)
        pinned = {c.id for c in chain}
        self._host_pinned |= pinned  # making room must not evict the chain from host
        for c in chain:
            self.host_leaves.discard(c)
        try:
            got = self._alloc_device(tokens, int(want_state))
        finally:
            self._host_pinned -= pinned
            for c in chain:
                self._host_refresh(c)
            if anchor is not self.root:
                self.kv.unlock(anchor)
                self._refresh(anchor)
        if got is None:
            return 0
        dev_slots, dev_state = got
        host_slots = torch.cat([c.host_value for c in chain])  # type: ignore[misc]
        self.kv.claim(dev_slots.cpu())  # fresh from the allocator: marked held
        hc.load(host_slots, dev_slots, node.host_state_slot if want_state else None, dev_state)
        off = 0
        now = self._tick()
        for c in chain:
            size = len(c.key)
            self.kv.attach(c, dev_slots[off:off + size].clone())
            off += size
            c.last_access_time = now
            self._host_refresh(c)
        if dev_state is not None:
            assert self.state is not None
            self.state.set_state(node, dev_state, now)  # stamps it at the watermark (GDS)
        for c in [anchor, *chain]:
            if c.parent is not None:
                self._refresh(c)
        self._stats["load_back_tokens"] += tokens
        return tokens

    def _load_state_only(self: RadixCache, node: TreeNode) -> int:
        """``node``'s KV is on device but its state only on host: one state slot back."""
        hc, state = self.hicache, self.state
        assert hc is not None and state is not None and node.host_state_slot is not None
        self.kv.lock(node)  # protect the node while a state slot is made room for
        try:
            got = self._alloc_device(0, 1)
        finally:
            self.kv.unlock(node)
            self._refresh(node)
        if got is None:
            return 0
        _, dev_state = got
        assert dev_state is not None
        hc.load(self._empty, self._empty, node.host_state_slot, dev_state)
        state.set_state(node, dev_state, self._tick())
        self._stats["load_back_states"] += 1
        return 0

    def _alloc_device(self: RadixCache, tokens: int, states: int
                      ) -> tuple[torch.Tensor, int | None] | None:
        """Device KV slots and a state slot, all or nothing, evicting once when short."""
        asks: list[tuple[Any, int]] = [(self.kv.allocator, tokens)]
        if states:
            assert self.state is not None
            asks.append((self.state.allocator, states))
        got = alloc_all(asks)
        if got is None:
            self.evict(max(tokens - self.kv.allocator.available_size(), 0))
            if states and self.state is not None and self.state.allocator.available_size() < states:
                self.evict_states(states)
            got = alloc_all(asks)
            if got is None:
                return None
        return got[0], (int(got[1][0]) if states else None)

    # ---------------------------------------------------------------- sizes
    def host_size(self: RadixCache) -> int:
        """KV tokens backed up on host (0 without HiCache)."""
        return self._host_tokens

    def host_evictable_size(self: RadixCache) -> int:
        """Host tokens of host-only leaves no copy is in flight for."""
        return sum(len(n.key) for n in self.host_leaves)
