"""Sliding-window attention (SWA) component.

SWA layers only need the last ``sliding_window_size`` tokens. Nodes hold full-pool slot ids
(``node.kv_value``, owned by the KV component); the SWA slot of each token is found through the
allocator's full-to-SWA mapping. When the SWA KV of a node is freed while its full KV stays,
the node becomes a **tombstone** (``node.swa_tombstone``).

Usable prefix: a match may end after node ``i`` only if the ``sliding_window_size`` tokens
before that end all have live SWA KV, or no tombstone lies on the path from the root::

    root ── A [0, 8) live ── B [8, 16) tombstone ── C [16, 40) live      window W = 16
    ends usable: A (path live), C (24 live tokens >= W); not B.

Locks are window-bounded: ``lock(node)`` protects SWA only for nodes whose span reaches into
the last W tokens before ``node``'s end, and returns the start position of the topmost locked
node; ``unlock`` releases exactly the nodes with ``depth > start`` (splits in between copy the
lock to both halves, and both lie below ``start``).

Eviction (``evict_swa``): live, unlocked nodes in LRU order of ``last_access_time``; an internal
node becomes a tombstone, a leaf leaves whole (a tombstoned leaf could never be used).

With a host tier, an insert over host-only nodes gives them the caller's slots (the host
tier revives them): each is cut where the caller's SWA KV turns live (a tombstone before, live
after), and with no new tail below them the insert stops above those whose end the window
rule excludes (:meth:`SWAComponent.plan_host_revival`).

Planning reads the host copy of the full-to-SWA map (``SWAAllocator.has_swa_host``) at the
host copies of the caller's slots (``KVComponent.host_slots``), never the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from components.base import Component, InsertPlan
from components.ordered import OrderedNodeSet

if TYPE_CHECKING:
    from allocators.swa import SWAAllocator
    from components.kv import KVComponent, KVValue
    from radix.node import TreeNode


def _lru_key(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


class SWAComponent(Component):
    """Owns ``node.swa_tombstone`` and ``node.swa_lock``; counters in tokens of live nodes.

    Layered on the full-attention KV component (``kv``): nodes hold full-pool slots, whose
    SWA side the allocator maps. ``evicted`` counts SWA tokens freed (tombstoned or removed
    with their node), ``revived`` those an insert brought back over tombstones.
    """

    name = "swa"
    evict_field = "num_swa_tokens"
    miss_field = "swa_miss_tokens"
    lock_data = True
    revives = True

    def __init__(self, allocator: SWAAllocator, sliding_window_size: int,
                 kv: KVComponent, release_extra_pages: int = 0) -> None:
        if not (hasattr(allocator, "free_swa") and hasattr(allocator, "has_swa_host")):
            raise TypeError(
                "sliding_window_size needs an SWA allocator (allocators.SWAAllocator) as "
                f"kv_allocator, got {type(allocator).__name__}"
            )
        self.allocator = allocator
        self.window = sliding_window_size
        self.kv = kv
        #: A load-back gives full slots without SWA slots (tombstones) unless this component
        #: restores a host copy of their SWA KV (:meth:`restore`: it maps SWA slots to them).
        kv.restore_allocator = allocator.full_side
        self.restore_allocator = allocator.swa_side
        self.release_extra_pages = release_extra_pages
        self.order = OrderedNodeSet(_lru_key)
        self._evictable = 0
        self._protected = 0
        self.evicted = 0
        self.revived = 0

    @staticmethod
    def is_candidate(node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.kv_value is not None
            and not node.swa_tombstone
            and node.swa_lock == 0
            and (bool(node.children) or node.kv_lock == 0)
        )

    def refresh(self, node: TreeNode) -> None:
        if self.is_candidate(node):
            self.order.update(node)
        else:
            self.order.discard(node)

    # ------------------------------------------------------------------ values
    def on_new_node(self, node: TreeNode, plan: InsertPlan, lo: int, hi: int) -> None:
        """A node the insert created (unlocked): live SWA KV from the planned live start on,
        a tombstone before it (whose still-live caller slots are released here: live slots
        before released ones would be SWA KV no window can use)."""
        live = lo >= plan.note(self.name, lo)
        if not live:
            dead = self.kv.host_slots(plan.value)[lo:hi]
            still = dead[self.allocator.has_swa_host(dead)]
            if len(still):
                self.allocator.free_swa(torch.from_numpy(still))
        node.swa_tombstone = not live
        if live:
            self._evictable += len(node.key)
        self.refresh(node)

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        upper.swa_tombstone = lower.swa_tombstone
        upper.swa_lock = lower.swa_lock
        self.refresh(upper)
        self.refresh(lower)

    def on_remove(self, node: TreeNode) -> int:
        """The KV component frees both sides of the slots; only the counters move here.
        Returns the live SWA tokens that left."""
        assert node.swa_lock == 0, node
        self.order.discard(node)
        was_live = not node.swa_tombstone
        # demoted to host (or leaving): live on host only with a host copy of its SWA KV
        node.swa_tombstone = node.host_swa_value is None
        if not was_live:
            return 0
        n = len(node.key)
        self._evictable -= n
        self.evicted += n
        return n

    def is_dead(self, node: TreeNode) -> bool:
        """A tombstoned leaf: no window of SWA KV could ever end a match there."""
        return node.swa_tombstone

    def tombstone(self, node: TreeNode) -> int:
        """Free ``node``'s SWA KV (full KV stays). The node must be live and unlocked.
        Returns the SWA tokens freed."""
        assert not node.swa_tombstone and node.swa_lock == 0 and node.kv_value is not None, node
        self.allocator.free_swa(self.kv.host_path_slots([node]))  # (on the host: no CUDA call)
        node.swa_tombstone = True
        n = len(node.key)
        self._evictable -= n
        self.evicted += n
        self.order.discard(node)
        return n

    def evict_internal(self, node: TreeNode) -> int:
        """An internal victim becomes a tombstone (its full KV stays)."""
        return self.tombstone(node)

    def revive(self, node: TreeNode, slots: KVValue) -> None:
        """Insert over a tombstone (unlocked): ``node`` takes the caller's ``slots`` (with live
        SWA KV; claimed), the tree frees its old full slots, and the node is live again."""
        assert node.swa_tombstone and node.swa_lock == 0, node
        self.kv.replace(node, slots)  # the node keeps ``slots`` (as its own) as its kv_value
        node.swa_tombstone = False
        n = len(node.key)
        self._evictable += n
        self.revived += n
        self.refresh(node)

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> int:
        """Protect the live nodes covering the last ``window`` tokens before ``node``'s end.

        Returns the start position [tokens] of the topmost locked node (pass it to
        :meth:`unlock`); ``node.depth`` when nothing was locked.
        """
        start = node.depth
        covered = 0
        n = node
        while n.parent is not None and covered < self.window and not n.swa_tombstone:
            if n.swa_lock == 0:
                size = len(n.key)
                self._evictable -= size
                self._protected += size
            n.swa_lock += 1
            self.order.discard(n)
            covered += len(n.key)
            start = n.depth - len(n.key)
            n = n.parent
        starts = node.swa_lock_starts
        if starts is None:
            starts = node.swa_lock_starts = {}
        starts[start] = starts.get(start, 0) + 1
        return start

    def unlock_error(self, node: TreeNode, data: Any) -> str | None:
        if isinstance(data, bool) or not isinstance(data, int) or not self.can_unlock(node, data):
            return f"the sliding-window lock starting at {data!r} is not held on node {node.id}"
        return None

    def unlock(self, node: TreeNode, start: int) -> None:
        """Release the SWA lock taken by :meth:`lock` (``start`` as it returned)."""
        starts = node.swa_lock_starts
        assert starts is not None and starts.get(start, 0) > 0, (node, start)
        if starts[start] == 1:
            del starts[start]
            if not starts:
                node.swa_lock_starts = None
        else:
            starts[start] -= 1
        n = node
        while n.parent is not None and n.depth > start:
            n.swa_lock -= 1
            if n.swa_lock == 0:
                size = len(n.key)
                self._evictable += size
                self._protected -= size
            self.refresh(n)
            n = n.parent

    @staticmethod
    def can_unlock(node: TreeNode, start: int) -> bool:
        """Whether a lock taken on ``node`` returned ``start`` and is still held."""
        starts = node.swa_lock_starts
        return starts is not None and starts.get(start, 0) > 0

    # ------------------------------------------------------------------- rules
    def usable_ends(self, path: list[TreeNode]) -> list[bool]:
        """For each node of a matched path: may the match end after it?"""
        out = []
        live_run = 0
        seen_tombstone = False
        w = self.window
        for n in path:
            if n.swa_tombstone:
                seen_tombstone = True
                live_run = 0
                out.append(False)
            else:
                live_run += len(n.key)
                out.append(not seen_tombstone or live_run >= w)
        return out

    def usable(self, path: list[TreeNode], n: int) -> int:
        ok = self.usable_ends(path)
        while n > 0 and not ok[n - 1]:
            n -= 1
        return n

    def on_touch(self, path: list[TreeNode]) -> None:
        """Stamps moved: re-file the live nodes of the path in the LRU order."""
        for n in path:
            self.refresh(n)

    def pop_victim(self) -> TreeNode | None:
        return self.order.pop_first()

    # ------------------------------------------------------------------ insert
    def live_suffix_start(self, host: np.ndarray, lo: int, hi: int) -> int:
        """First page-aligned position in ``[lo, hi]`` from which every caller slot of
        ``host[lo:hi]`` (the host copy of the caller's slots, in range) still has live SWA KV
        (``hi`` when the last one has none)."""
        live = self.allocator.has_swa_host(host[lo:hi])
        if live.all():
            return lo
        t = lo + int(np.flatnonzero(~live)[-1]) + 1
        ps = self.kv.page_size
        return min(hi, -(-t // ps) * ps)

    def plan_insert(self, plan: InsertPlan) -> None:
        """Plan, before anything changes: the caller's slots must lie in the pool (the SWA map
        is read at every position); tombstoned, unlocked matched nodes whose tokens the caller
        holds with live SWA KV of its own (not the tree's slots) are revived from the page where
        the caller's slots are live (the node the walk ends inside counts with its matched
        part, split there first); the new tail is live from the page where the caller's slots
        are, a tombstone before it, and not cached at all when none of it is live. Matched
        host-only nodes (the host tier revives them with the caller's slots) are planned by
        :meth:`plan_host_revival`."""
        end, walk = plan.end, plan.walk
        host = self.kv.host_slots(plan.value)
        self.kv.check_range(host[:end])
        spans = [(n, n.start, n.depth, n.kv_value) for n in walk.path]
        part = walk.partial
        if part is not None:
            lo, kvv = part.start, part.kv_value
            spans.append((part, lo, lo + walk.partial_len,
                          None if kvv is None else kvv[: walk.partial_len]))
        for n, lo, hi, kvv in spans:
            if not n.swa_tombstone or n.kv_lock > 0 or kvv is None:
                continue  # live, in use, or host-only (planned below)
            if (host[lo:hi] == self.kv.host_slots(kvv)).any():
                continue  # the caller got (some of) these slots from the tree
            t = self.live_suffix_start(host, lo, hi)
            if t < hi:
                plan.add_revival(hi, t, self)
        p = plan.prefix_len
        if p < end:
            live_from = self.live_suffix_start(host, p, end)
            plan.set_note(self.name, live_from)
            if live_from >= end:
                plan.insert_end = p  # no live SWA KV at all: nothing worth caching
            elif live_from > p:
                plan.add_cut(live_from)
        if spans and spans[-1][3] is None:  # host-only nodes (the device ones form a prefix)
            first = next(i for i, sp in enumerate(spans) if sp[3] is None)
            self.plan_host_revival(plan, host, spans, first)

    def plan_host_revival(self, plan: InsertPlan, host: np.ndarray,
                          spans: list[tuple[TreeNode, int, int, KVValue | None]],
                          first: int) -> None:
        """Matched host-only nodes (``spans[first:]``: node, start, end, device slots) take
        the caller's slots (``host``: their host copy); the host tier revives them, one piece
        per cut planned here. Each node is cut where the caller's SWA KV turns live (page
        aligned, :meth:`live_suffix_start`): a tombstone before, live from there on::

            host-only [0, 8), the caller's SWA KV released on [0, 6), window 4
            no new tail:  [0, 6) tomb, [6, 8) live: 2 live tokens < 4, not a usable end:
                          the insert stops at 0 (prefix_len = inserted_len = 0), the node
                          stays host-only (live on host: a load-back serves it)
            new tail [8, 12) below: every host node comes to device (the device set is
                          prefix-closed): [0, 6) tomb, [6, 8) live, then the tail

        With no new tail, the insert stops above the host-only nodes whose end the window
        rule excludes (after the revival): ``prefix_len`` and ``insert_end`` drop to the end
        of the deepest usable one (or to the start of the host-only part); the caller keeps
        its slots past it. A revived tombstone leaf would be dead, a revived live node that
        is no usable end would trade a host copy a load-back serves for a device copy no
        match can end on."""
        pieces = [(lo, self.live_suffix_start(host, lo, hi), hi) for _, lo, hi, _ in spans[first:]]
        stop = plan.prefix_len
        if plan.insert_end <= stop:
            stop = self._deepest_usable_end(plan, spans[:first], pieces)
            if stop < plan.prefix_len:
                plan.prefix_len = plan.insert_end = stop
        for lo, t, hi in pieces:
            if hi > stop:
                break
            if lo < t < hi:
                plan.add_cut(t)

    def _deepest_usable_end(self, plan: InsertPlan,
                            device: list[tuple[TreeNode, int, int, KVValue | None]],
                            pieces: list[tuple[int, int, int]]) -> int:
        """The window rule (:meth:`usable_ends`) over the matched path as the insert would
        leave it (device nodes with their planned revivals, host-only nodes ``(start, live
        from, end)`` revived): the end of the deepest usable host-only node, else the start
        of the host-only part."""
        revive = plan.revive or {}
        w = self.window
        run, seen = 0, False
        for n, lo, hi, _ in device:
            r = revive.get(hi)
            t = r[0] if r is not None else (hi if n.swa_tombstone else lo)
            if t > lo:
                seen, run = True, 0
            run += hi - t
        best = pieces[0][0]
        for lo, t, hi in pieces:
            if t > lo:
                seen, run = True, 0
            run += hi - t
            if t < hi and (not seen or run >= w):
                best = hi
        return best

    # --------------------------------------------------------- request helpers
    def request_keeps(self, caller: np.ndarray, tree: np.ndarray, dup: np.ndarray) -> np.ndarray:
        """Of a running request's duplicate slots ``caller[dup]`` (the tree holds the same
        tokens in ``tree``; host copies of both), those it keeps: its own live copy where the
        tree only has a tombstone (it still needs that SWA KV for its window; it frees the
        copy when it finishes). Returns a bool mask over ``caller``."""
        has_swa = self.allocator.has_swa_host
        return dup & has_swa(caller) & ~has_swa(tree)

    def release_margin(self) -> int:
        """Tokens kept live before a release boundary: ``max(window, page_size)`` (a page
        larger than the window never tombstones the leaf the request inserts) plus
        ``release_extra_pages`` pages (a later match that ends one page earlier, at a
        divergence inside the last page or on a prompt minus its last token, still has its
        whole window live)::

            window 4, page 2, boundary 12, one extra page:
            tokens  0 1 2 3 4 5 | 6 7 8 9 10 11      released | live (margin 6)
            a match ending at 10 needs [6, 10) live; with margin 4 it would end at 0
        """
        ps = self.kv.page_size
        return max(self.window, ps) + self.release_extra_pages * ps

    def release(self, kv_indices: torch.Tensor, start: int, seq_len: int) -> int:
        """Free the SWA KV of ``kv_indices[start:upto]``, the request's own tokens that slid
        out of its window, where ``upto`` keeps the last :meth:`release_margin` tokens before
        ``seq_len``'s whole pages live (page aligned): an insert up to ``seq_len`` caches only
        those pages, so the margin counts back from their end (counted from an unaligned
        ``seq_len``, a window larger than a page and not a multiple of it would leave fewer
        than a window of live tokens before the cached end: a prompt no match could use)::

            window 5, page 4, seq_len 10: cached end 8, 8 - 5 = 3 -> upto 0 (not 4)

        Returns ``upto`` (<= start: nothing freed)."""
        ps = self.kv.page_size
        upto = max(seq_len // ps * ps - self.release_margin(), 0) // ps * ps
        if upto > start:
            self.allocator.free_swa(kv_indices[start:upto])
        return upto

    def describe(self, node: TreeNode) -> str:
        return f" swa={'tomb' if node.swa_tombstone else 'live'} swa_lock={node.swa_lock}"

    # ------------------------------------------------------------------- tiers
    # ``node.host_swa_value``: host SWA-pool slots holding a copy of a live node's SWA KV,
    # one per token. Backed up: the SWA KV of live nodes, as the device keeps it (whole live
    # nodes: what the window rule reads); a tombstone has none to back up. Host-only, a node
    # is live (``swa_tombstone`` false) exactly when it has that copy; a load-back gives it
    # SWA slots again (``restore``), a node without one comes back a tombstone.
    def host_pool(self, config: Any) -> tuple[Any, Any, Any]:
        from hicache.host_pools import kv_lanes, mirror_kv

        side = self.allocator.swa_side
        host = mirror_kv(side, config)
        return side, host, kv_lanes(side, host)

    def host_demand(self) -> tuple[int, int, int]:
        from hicache.host_pools import kv_demand

        return kv_demand(self.allocator.swa_side)

    def has_device(self, node: TreeNode) -> bool:
        return node.kv_value is not None and not node.swa_tombstone

    def host_copy(self, node: TreeNode) -> torch.Tensor | None:
        return node.host_swa_value

    def backup_size(self, node: TreeNode) -> int:
        return len(node.key) if (node.kv_value is not None and not node.swa_tombstone
                                 and node.host_swa_value is None) else 0

    def backup(self, node: TreeNode, host: torch.Tensor) -> torch.Tensor:
        node.host_swa_value = host
        return self.allocator.translate(self.kv.slots(node))  # the node's SWA slots

    def restore_size(self, node: TreeNode, last: bool) -> int:
        return len(node.key) if node.host_swa_value is not None and node.swa_tombstone is False \
            and node.kv_value is None else 0

    def restore(self, node: TreeNode, device: torch.Tensor, now: int) -> torch.Tensor:
        """``node`` (its full slots just restored, without SWA slots) takes the fresh SWA
        slots ``device``: live again."""
        assert node.host_swa_value is not None
        self.allocator.map_swa(self.kv.slots(node), device)
        self._evictable += len(node.key)
        self.refresh(node)
        return node.host_swa_value

    def drop_host(self, node: TreeNode) -> None:
        hv = node.host_swa_value
        if hv is not None:
            self.host_allocator.free_owned(hv)
            node.host_swa_value = None

    def undo_host(self, node: TreeNode) -> None:
        hv = node.host_swa_value
        if hv is not None:
            node.host_swa_value = None
            self.host_allocator.undo_alloc(hv)

    def split_host(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        hv = lower.host_swa_value
        if hv is not None:
            upper.host_swa_value = hv[:split_len]
            lower.host_swa_value = hv[split_len:]

    def revive_host(self, node: TreeNode, slots: KVValue) -> None:
        """An insert gave host-only ``node`` the caller's slots: live when all of them hold SWA
        KV; else a tombstone (the still-live ones are released: live SWA KV before released
        KV is no window's)."""
        host = self.kv.host_slots(slots)
        live = self.allocator.has_swa_host(host)
        if live.all():
            node.swa_tombstone = False
            self._evictable += len(node.key)
        else:
            if live.any():
                self.allocator.free_swa(torch.from_numpy(host[live]))
            node.swa_tombstone = True
        self.refresh(node)

    def host_usable(self, path: list[TreeNode], n: int) -> int:
        """The window rule over device and host-only nodes (a host-only node is live when
        its SWA KV is on host)."""
        return self.usable(path, n)

    def check_host(self, nodes: list[TreeNode]) -> None:
        held = [n.host_swa_value for n in nodes if n.host_swa_value is not None]
        for n in nodes:
            hv = n.host_swa_value
            if hv is not None:
                assert len(hv) == len(n.key), f"{n}: {len(hv)} host SWA slots"
                assert n.host_value is not None, f"host SWA KV without host KV: {n}"
        if held:
            slots = torch.cat(held)
            assert slots.unique().numel() == slots.numel(), "a host SWA slot is held twice"
            assert not bool(self.host_allocator.is_free(slots).any()), (
                "a host SWA slot held by the tree is free")

    # ---------------------------------------------------------------------- L3
    # The record at a node's end holds the SWA KV of the last ``l3_span()`` tokens before it
    # (the window in whole pages: ``ceil(window / page_size)`` pages), sections ``(K, V)``,
    # each ``[layers, span, heads, head_dim]`` of the host SWA pool's dtype, layers
    # outermost; an end shallower than the span leaves the leading tokens zero. A usable end
    # has that much live SWA KV (live runs are whole pages) or no tombstone above it, so the
    # record is exactly what a match ending there reads. Read back, the chain's last
    # ``min(span, chain)`` tokens are live, the nodes above tombstones, as a device tree
    # keeps a node further from the end than the window.
    def _host_pool(self) -> Any:
        return getattr(self.host_allocator, "pool", None)

    def l3_span(self) -> int:
        """The window in whole pages [tokens]: ``ceil(window / page_size) * page_size``."""
        ps = self.kv.page_size
        return -(-self.window // ps) * ps

    def l3_layout(self) -> str:
        """``swa=<layers>x<heads>x<head_dim>:<dtype>,last=<span>`` (``swa=none,...``
        index-only)."""
        from hicache.storage.keys import kv_layout

        return "swa" + kv_layout(self._host_pool())[2:] + f",last={self.l3_span()}"

    def l3_sections(self) -> tuple[int, int]:
        """``(K, V)``: ``span`` tokens of every SWA layer each (``(0, 0)`` index-only)."""
        pool = self._host_pool()
        if pool is None:
            return (0, 0)
        elem = torch.empty((), dtype=pool.dtype).element_size()
        n = pool.num_layers * self.l3_span() * pool.num_heads * pool.head_dim * elem
        return (n, n)

    def pack_end(self, node: TreeNode) -> tuple[bytes, bytes] | None:
        """The host SWA KV of the last ``min(span, node.depth)`` tokens before ``node``'s
        end (``node`` and the ancestors the span reaches), or ``None`` when one of them has
        no host SWA copy (a tombstone, or not backed up yet)."""
        span = self.l3_span()
        need = min(span, node.depth)
        held: list[torch.Tensor] = []
        got = 0
        n: TreeNode | None = node
        while got < need:
            assert n is not None
            hv = n.host_swa_value
            if hv is None:
                return None
            held.append(hv)
            got += len(hv)
            n = n.parent
        pool = self._host_pool()
        if pool is None:
            return (b"", b"")
        idx = torch.cat(held[::-1])[got - need:].to(pool.device)
        out = []
        for every in (pool.k_all, pool.v_all):
            buf = torch.zeros((every.shape[0], span, *every.shape[2:]), dtype=every.dtype)
            buf[:, span - need:] = every[:, idx]
            out.append(buf.view(torch.uint8).numpy().tobytes())
        return out[0], out[1]

    def unpack_end(self, nodes: Sequence[TreeNode], host: torch.Tensor,
                   sections: Sequence[bytes | memoryview]) -> None:
        """The chain's last ``len(host)`` tokens (whole nodes: the storage tier cut the
        chain there) take the record's last ``len(host)`` tokens of SWA KV in ``host``
        (fresh host SWA slots) and are live on host; the nodes above are tombstones.

        Raises:
            ValueError: ``host`` does not cover whole nodes at the chain's end.
        """
        cover = len(host)
        live: list[tuple[TreeNode, torch.Tensor]] = []
        o = cover
        for n in reversed(nodes):
            if o <= 0:
                break
            k = len(n.key)
            if k > o:
                raise ValueError(f"{cover} host SWA slots do not cover whole nodes at the "
                                 "end of the chain read from L3")
            live.append((n, host[o - k:o]))
            o -= k
        pool = self._host_pool()
        if pool is not None and cover:
            span = self.l3_span()
            idx = host.to(pool.device)
            for every, section in ((pool.k_all, sections[0]), (pool.v_all, sections[1])):
                shape = (every.shape[0], span, *every.shape[2:])
                t = torch.frombuffer(bytearray(section), dtype=torch.uint8).view(
                    every.dtype).reshape(shape)
                every[:, idx] = t[:, span - cover:]
        for n in nodes:
            n.swa_tombstone = True
        for n, hv in live:
            n.host_swa_value = hv
            n.swa_tombstone = False

    # ---------------------------------------------------------------- counters
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def stats(self) -> dict[str, Any]:
        return {"evicted_swa_tokens": self.evicted, "revived_swa_tokens": self.revived,
                "swa_evictable": self._evictable, "swa_protected": self._protected}

    def reset(self) -> None:
        self.order.clear()
        self._evictable = self._protected = self.evicted = self.revived = 0

    def check(self, nodes: list[TreeNode]) -> None:
        ev = pr = 0
        expected = set()
        for n in nodes:
            assert n.swa_lock >= 0, n
            held = sum(n.swa_lock_starts.values()) if n.swa_lock_starts else 0
            assert held == n.lock_ref, f"SWA lock handles {held} != direct locks {n.lock_ref}: {n}"
            if n.kv_value is None:  # host-only: live exactly when its SWA KV is on host
                assert n.swa_lock == 0, f"host-only node under an SWA lock: {n}"
                assert n.swa_tombstone == (n.host_swa_value is None), (
                    f"host-only node's SWA flag disagrees with its host copy: {n}")
                continue
            live = self.allocator.has_swa(self.kv.slots(n))
            if n.swa_tombstone:
                assert n.swa_lock == 0, f"tombstone under an SWA lock: {n}"
                assert not bool(live.any()), f"tombstone still maps SWA slots: {n}"
                if not n.children:
                    assert n.kv_lock > 0, f"unlocked tombstoned leaf: {n}"
                continue
            assert bool(live.all()), f"live node with unmapped SWA slots: {n}"
            if n.swa_lock == 0:
                ev += len(n.key)
            else:
                pr += len(n.key)
            if self.is_candidate(n):
                expected.add(n.id)
        assert ev == self._evictable, f"swa evictable {self._evictable} != recomputed {ev}"
        assert pr == self._protected, f"swa protected {self._protected} != recomputed {pr}"
        got = {n.id for n in self.order}
        assert got == expected, f"SWA eviction set differs: {got ^ expected}"
        self.order.check()
