"""Pieces of the ``gds_adaptive`` walk (:mod:`components.eviction.adaptive`): the ghosts of
evicted states that say which GreedyDual order was wrong, and the same duel over KV leaves.

Each candidate order ("expert") is one :class:`components.eviction.gds.GreedyDualHeap`, the
heap ``gds`` and ``gdsf`` run on, kept over the same live states as every other expert. The
leading expert's pops evict; the others pop *virtually*: their victim stays in the pool and
is only *excluded* from that expert's order, which then names its next victim at the next
eviction, as it would have had it been in charge.

:class:`Ghosts` remembers where the leader's victims were, so a later match can tell that it
would have found a state there:

* an **internal** state (its node has children) leaves its node and KV behind: the ghost is
  the node itself, found on the KV path of a later match;
* a **leaf** leaves with its node and the stateless single-child ancestors the pruning rule
  removes with it, up to the surviving ancestor ``A``: the ghost is ``(A, first token after
  A, depth, last token)``, found when a later match key passes ``A`` with those two tokens
  at those positions (a key that agrees with the lost path at its first and last token).

Both tables are bounded (oldest first out) and drop an entry whose node leaves the tree.
"""

from __future__ import annotations

import functools
import math
import weakref
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from components.eviction.gds import GreedyDualHeap

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["Ghosts", "KVOrderDuel"]


class Ghosts:
    """Where recently evicted states were (module docstring). Each ghost has an id (< 0) and
    ``owners``, a bit mask of the orders that evicted it (really or in their simulated pool).
    At most :attr:`limit` ghosts; ``on_drop(gid)`` is called for each one that goes
    unmatched (too old, or its node left the tree)."""

    def __init__(self, on_drop: Callable[[int], None]) -> None:
        self.limit = 256
        self._on_drop = on_drop
        self._next = -1
        #: gid -> [owners, depth, anchor id, first token, last token]; anchor id is the node
        #: itself for an internal ghost (first / last unused)
        self.records: OrderedDict[int, list[int]] = OrderedDict()
        self._inner: dict[int, int] = {}  # node id -> gid
        self._leaves: dict[int, list[int]] = {}  # anchor id -> gids
        self._refs: dict[int, weakref.ref] = {}  # node id -> weak ref (drops its ghosts)

    def __len__(self) -> int:
        return len(self.records)

    def owners(self, gid: int) -> int:
        return self.records[gid][0]

    def disown(self, gid: int, order: int) -> None:
        """Order ``order`` evicted ghost ``gid`` from its simulated pool too."""
        rec = self.records.get(gid)
        if rec is not None:
            rec[0] |= 1 << order

    def _watch(self, node: TreeNode) -> None:
        nid = node.id
        if nid not in self._refs:
            self._refs[nid] = weakref.ref(node, functools.partial(self._ref_gone, nid))

    def _ref_gone(self, nid: int, _ref: object) -> None:
        self._node_gone(nid)

    def _node_gone(self, nid: int) -> None:
        self._refs.pop(nid, None)
        gid = self._inner.pop(nid, None)
        gids = ([gid] if gid is not None else []) + self._leaves.pop(nid, [])
        for g in gids:
            if self.records.pop(g, None) is not None:
                self._on_drop(g)

    def _unlink(self, gid: int, rec: list[int]) -> None:
        _, _, anchor, first, _ = rec
        if first < 0:
            self._inner.pop(anchor, None)
        else:
            gids = self._leaves.get(anchor)
            if gids is not None and gid in gids:
                gids.remove(gid)

    def add(self, node: TreeNode, owners: int) -> int | None:
        """``node``'s state is being evicted (before the tree removes a leaf): its ghost id,
        or ``None`` when there is nothing a later key could be matched against."""
        gid = self._next
        if node.children:
            old = self._inner.pop(node.id, None)
            if old is not None and self.records.pop(old, None) is not None:
                self._on_drop(old)
            rec = [owners, node.depth, node.id, -1, -1]
            self._inner[node.id] = gid
            self._watch(node)
        else:
            child, a = node, node.parent
            while a is not None and a.parent is not None and a.state_slot is None \
                    and a.host_state_slot is None and len(a.children) == 1:
                child, a = a, a.parent
            if a is None or not len(child.key) or not len(node.key):
                return None
            rec = [owners, node.depth, a.id, int(child.key[0]), int(node.key[-1])]
            self._leaves.setdefault(a.id, []).append(gid)
            self._watch(a)
        self._next -= 1
        self.records[gid] = rec
        while len(self.records) > self.limit:
            old_gid, old_rec = self.records.popitem(last=False)
            self._unlink(old_gid, old_rec)
            self._on_drop(old_gid)
        return gid

    def bury(self, node: TreeNode, orders: Sequence[GreedyDualHeap], lead: int,
             live: int) -> None:
        """``node``'s state, order ``lead``'s victim, is being evicted: its ghost (:meth:`add`)
        is owned by the leader and by every order that had it excluded (evicted in its
        simulated pool already); each other order retains it at its true priority (it would
        have kept it). ``live``: states cached now; at most ``max(256, 2 * live)`` ghosts."""
        nid = node.id
        owners = 1 << lead
        keep: dict[int, float] = {}
        for i, o in enumerate(orders):
            if i == lead:
                continue
            if nid in o.excluded:
                owners |= 1 << i
            else:
                keep[i] = o.true_priority(node)
        self.limit = max(256, 2 * live)
        gid = self.add(node, owners)
        if gid is not None:
            for i, prio in keep.items():
                orders[i].retain(gid, prio)

    def forget(self, node: TreeNode) -> None:
        """A state is cached on ``node`` again: its internal ghost is no ghost any more."""
        gid = self._inner.pop(node.id, None)
        if gid is not None and self.records.pop(gid, None) is not None:
            self._on_drop(gid)

    def match(self, kv_end: TreeNode, consumed: TreeNode | None, key: Sequence[int],
              end: int) -> tuple[int, int] | None:
        """The deepest ghost a match (KV path ending at ``kv_end``, key ``key[:end]``) would
        have consumed below ``consumed``: ``(gid, depth)``; ``None`` if none. The ghost stays
        until :meth:`release`."""
        best: tuple[int, int] | None = None
        records, inner, leaves = self.records, self._inner, self._leaves
        n: TreeNode | None = kv_end
        while n is not None:
            top = n is consumed or n.parent is None  # the last node to look at
            if not top and best is None and inner:
                gid = inner.get(n.id)
                if gid is not None:
                    best = (gid, n.depth)
            gids = leaves.get(n.id) if leaves else None
            if gids:
                base = n.depth
                for gid in gids:
                    _, depth, _, first, last = records[gid]
                    if depth <= end and key[base] == first and key[depth - 1] == last \
                            and (best is None or depth > best[1]):
                        best = (gid, depth)
            if top:
                break
            n = n.parent
        return best

    def release(self, gid: int) -> None:
        """Ghost ``gid`` was matched: it is gone (its state is being rebuilt)."""
        rec = self.records.pop(gid, None)
        if rec is not None:
            self._unlink(gid, rec)
            self._on_drop(gid)


class KVOrderDuel:
    """The KV-leaf order of ``gds_adaptive``: the same duel over unlocked KV leaves, between
    ``lru`` (GreedyDual with no value: recency alone) and ``gdsize`` (GreedyDual-Size with the
    per-token prefill of rebuilding the leaf's whole prefix, ``cost(0, b) / b``: a long
    context's tokens are dearer to rebuild). Charges: the leader's victims through
    :class:`Ghosts` (a later key passing where the leaf was), the other order's when a match
    ends on a leaf it excluded. The part of the ``radix.ordered.OrderedNodeSet`` interface
    :class:`components.kv.KVComponent` uses (``update``, ``discard``, ``pop_first``,
    membership, iteration, ``len``, ``check``); ``update`` is a use (stamped at the
    watermark).

    Args:
        d, e: GDS cost coefficients.
        state_depth: node -> depth of the state a request would resume from if this leaf's
            chain were gone (the nearest live state at or above its surviving ancestor).
    """

    def __init__(self, d: float, e: float, state_depth: Callable[[TreeNode], int]) -> None:
        self._d = d
        self._e = e
        self._state_depth = state_depth
        self._start()

    def _start(self) -> None:
        d, e = self._d, self._e
        # each order's watermark history, by access stamp: a leaf is stamped with the
        # watermark in effect at its last access (``node.last_access_time``), whenever the
        # KV component files it (a lock and a release are no use)
        self._clock = 0
        self._marks: list[list[tuple[int, float]]] = [[(0, 0.0)], [(0, 0.0)]]
        self._seen: dict[int, int] = {}
        self.orders = (
            GreedyDualHeap("lru", lambda nid: 1.0, lambda n: 0.0, clock=True),
            GreedyDualHeap("gdsize", lambda nid: 1.0,
                           lambda n: (d * n.depth + e * n.depth * n.depth / 2e5) / max(n.depth, 1)),
        )
        self.leader = 0
        self.regret = [0.0, 0.0]
        self._keep = 0.5 ** (1.0 / 2048.0)
        self.switches = 0
        self.members: dict[int, TreeNode] = {}
        self.ghosts = Ghosts(self._dropped)

    def __len__(self) -> int:
        return len(self.members)

    def clear(self) -> None:
        """Every leaf is gone (the cache was reset): back to the state of a new order."""
        self._start()

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self.members

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(list(self.members.values()))

    def _dropped(self, gid: int) -> None:
        for o in self.orders:
            o.retained.pop(gid, None)

    def _stamp_at(self, i: int, t: int) -> float:
        marks = self._marks[i]
        k = bisect_right(marks, (t, math.inf)) - 1
        return marks[k][1]

    def update(self, node: TreeNode) -> None:
        nid = node.id
        t = node.last_access_time
        if t > self._clock:
            self._clock = t
        if nid in self.members:
            if self._seen.get(nid) == t:
                return  # filed again without a use
            self._seen[nid] = t
            for o in self.orders:
                o.touch(node, t if o.clock else None)
                o.reseed(node)
            return
        self.members[nid] = node
        self._seen[nid] = t
        for i, o in enumerate(self.orders):
            o.add(node, t if o.clock else self._stamp_at(i, t))

    def discard(self, node: TreeNode) -> None:
        nid = node.id
        if self.members.pop(nid, None) is None:
            return
        del self._seen[nid]
        for i, o in enumerate(self.orders):
            if nid in o.excluded and i != self.leader:
                o.remove(nid)
                self._rebalance(i)
            else:
                o.remove(nid)

    def pop_first(self) -> TreeNode | None:
        """The leader's victim (removed from the set); the other order follows in its own
        simulated pool."""
        lead = self.leader
        victim = self.orders[lead].pop(self.members, _always, virtual=False)
        if victim is None or isinstance(victim, int):
            return None
        nid = victim.id
        self.ghosts.bury(victim, self.orders, lead, len(self.members))
        del self.members[nid]
        del self._seen[nid]
        for o in self.orders:
            o.remove(nid)
        for i in range(len(self.orders)):
            if i != lead:
                self._rebalance(i)
        for i, o in enumerate(self.orders):
            marks = self._marks[i]
            if o.watermark > marks[-1][1]:
                if marks[-1][0] == self._clock:
                    marks[-1] = (self._clock, o.watermark)
                else:
                    marks.append((self._clock, o.watermark))
        r, k = self.regret, self._keep
        for i in range(len(r)):
            r[i] *= k
        best = min(range(len(r)), key=lambda i: (r[i], i != lead))
        if best != lead and r[lead] > 1.5 * r[best]:
            self.leader = best
            self.switches += 1
            for o in self.orders:
                o.clear_exclusions(self.members)
        return victim

    def _rebalance(self, i: int) -> None:
        o = self.orders[i]
        while o.balance > 0:
            c = o.pop(self.members, _always, virtual=True)
            if c is None:
                break
            if isinstance(c, int):
                self.ghosts.disown(c, i)

    def on_match(self, kv_end: TreeNode, consumed: TreeNode | None, key: Sequence[int],
                 end: int) -> None:
        """Charge the orders that evicted KV this match would have used."""
        used = 0 if consumed is None else consumed.depth
        if len(self.ghosts):
            g = self.ghosts.match(kv_end, consumed, key, end)
            if g is not None:
                gid, depth = g
                owners = self.ghosts.owners(gid)
                for i in range(len(self.orders)):
                    if owners >> i & 1:
                        self.regret[i] += depth - used
                self.ghosts.release(gid)
        nid = kv_end.id
        for i, o in enumerate(self.orders):
            if nid in o.excluded and i != self.leader:  # it would have evicted this leaf
                self.regret[i] += max(0, used - self._state_depth(kv_end))
                o.readmit(kv_end)
                self._rebalance(i)

    def check(self) -> None:
        nodes = list(self.members.values())
        for o in self.orders:
            o.check(nodes)


def _always(_: TreeNode) -> bool:
    return True
