"""Pieces of the ``gds_adaptive`` walk (:mod:`components.gds_adaptive`): one GreedyDual
order per candidate formula, and the ghosts of evicted states that say which order was wrong.

:class:`GreedyDualHeap` is one candidate ("expert"): the GreedyDual-Size order
``priority(s) = stamp(s) + w(s) * cost(a, b)`` of :mod:`components.gds` with its own weight
function, watermark, stamps and lazy heap, kept over the same live states as every other
expert. The leading expert's pops evict; the others pop *virtually*: their victim stays in
the pool and is only *excluded* from that expert's order, which then names its next victim
at the next eviction, as it would have had it been in charge.

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
import heapq
import math
import weakref
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["GreedyDualHeap", "Ghosts", "KVOrderDuel"]

_EPS = 1e-12


class GreedyDualHeap:
    """One GreedyDual-Size order over the live states (module docstring).

    Args:
        name: what the expert is called in reports.
        weight: node id -> ``w(s)`` (evaluated when a state is added, touched by a hit or
            reweighed; kept with the heap entry until then).
        cost: node -> ``cost(a, b)`` against the nearest shallower live state.

    Lazy heap with the lower-bound invariant of :mod:`components.gds`: stamps only rise, an
    evicted ancestor only raises ``cost``, a lower weight always comes with a fresh entry, and
    the owner re-seeds the states whose ``cost`` fell (:meth:`reseed`).
    """

    def __init__(self, name: str, weight: Callable[[int], float],
                 cost: Callable[[TreeNode], float], clock: bool = False) -> None:
        self.name = name
        #: Stamps are access times (``node.last_access_time``) set by the owner, not the
        #: watermark: with ``cost = 0`` the order is least recently used first.
        self.clock = clock
        self._weight = weight
        self._cost = cost
        self.watermark = 0.0
        self._heap: list[tuple[float, int, int, int]] = []  # (priority, seq, version, id)
        self._seq = 0
        #: Node id -> the seq of its current entry. Versions are the heap's own sequence
        #: numbers, unique over the heap's life: an entry left from a state's earlier stay on
        #: the same node can never pass for the current one.
        self._ver: dict[int, int] = {}
        self.stamp: dict[int, float] = {}
        self.w: dict[int, float] = {}
        #: Virtual victims still in the pool (this expert would have evicted them).
        self.excluded: dict[int, None] = {}
        #: Ghosts this expert still holds (the real pool evicted them, this order would not
        #: have yet): ghost id (< 0) -> its priority in this order when it left.
        self.retained: dict[int, float] = {}

    @property
    def balance(self) -> int:
        """Size of this order's simulated pool minus the real pool's."""
        return len(self.retained) - len(self.excluded)

    def true_priority(self, node: TreeNode) -> float:
        nid = node.id
        return self.stamp[nid] + self.w[nid] * self._cost(node)

    def _push(self, node: TreeNode) -> None:
        nid = node.id
        self._seq += 1
        self._ver[nid] = self._seq
        heapq.heappush(self._heap, (self.true_priority(node), self._seq, self._seq, nid))

    # ------------------------------------------------------------------ events
    def add(self, node: TreeNode, stamp: float | None = None) -> None:
        """A state was cached on ``node``: stamped (at the watermark unless ``stamp`` says
        when it was last used), weighed, seeded."""
        nid = node.id
        self.stamp[nid] = self.watermark if stamp is None else stamp
        self.w[nid] = self._weight(nid)
        self.excluded.pop(nid, None)
        self._push(node)

    def touch(self, node: TreeNode, stamp: float | None = None) -> None:
        """Used (a hit, a release): stamped at the watermark, or at ``stamp`` (not lower
        than the old one: the priority only rises)."""
        self.stamp[node.id] = self.watermark if stamp is None else stamp

    def reweigh(self, node: TreeNode, force: bool = False) -> None:
        """Evaluate the weight again; a fresh entry when it fell (or ``force``)."""
        nid = node.id
        old = self.w[nid]
        new = self._weight(nid)
        self.w[nid] = new
        if (force or new < old) and nid not in self.excluded:
            self._push(node)

    def reseed(self, node: TreeNode) -> None:
        """``node``'s cost fell (a state was cached between it and its old anchor)."""
        if node.id not in self.excluded:
            self._push(node)

    def remove(self, nid: int) -> None:
        """The state left (its entries go stale)."""
        self.stamp.pop(nid, None)
        self.w.pop(nid, None)
        self._ver.pop(nid, None)
        self.excluded.pop(nid, None)

    def readmit(self, node: TreeNode) -> None:
        """A virtual victim was consumed: it is in this expert's order again."""
        if self.excluded.pop(node.id, 0) is None:
            self._push(node)

    def retain(self, gid: int, prio: float) -> None:
        """Keep ghost ``gid`` (id < 0) in this order's pool at priority ``prio``."""
        self.retained[gid] = prio
        self._seq += 1
        heapq.heappush(self._heap, (prio, self._seq, 0, gid))

    def clear_exclusions(self, live: dict[int, TreeNode]) -> None:
        """Back to the real pool: nothing excluded, no ghost retained."""
        for nid in list(self.excluded):
            del self.excluded[nid]
            self._push(live[nid])
        self.retained.clear()

    def compact(self, live: dict[int, TreeNode]) -> None:
        """Rebuild the heap from the live, not excluded states and the retained ghosts."""
        self._heap = []
        for nid, node in live.items():
            if nid not in self.excluded:
                self._push(node)
        for gid, prio in self.retained.items():
            self._seq += 1
            self._heap.append((prio, self._seq, 0, gid))
        heapq.heapify(self._heap)

    # -------------------------------------------------------------------- pops
    def pop(self, live: dict[int, TreeNode], is_candidate: Callable[[TreeNode], bool],
            virtual: bool) -> TreeNode | int | None:
        """The state of least priority, removed from this order; raises the watermark.

        ``virtual``: the victim stays in the pool (recorded in :attr:`excluded`), and a
        retained ghost may be the victim (its id, ``< 0``, is returned and it is released).
        ``None`` if nothing can go."""
        heap = self._heap
        held: list[tuple[float, int, int, int]] = []
        victim: TreeNode | int | None = None
        while heap:
            entry = heapq.heappop(heap)
            prio, _, ver, nid = entry
            if nid < 0:
                if virtual and nid in self.retained:
                    del self.retained[nid]
                    victim = nid
                    self.watermark = max(self.watermark, prio)
                    break
                continue
            node = live.get(nid)
            if node is None or self._ver.get(nid) != ver or nid in self.excluded:
                continue  # stale
            if not is_candidate(node):
                held.append(entry)
                continue
            true = self.true_priority(node)
            if true > prio + _EPS:
                self._push(node)
                continue
            victim = node
            self.watermark = max(self.watermark, true)
            break
        for entry in held:
            heapq.heappush(heap, entry)
        if victim is not None and not isinstance(victim, int):
            if virtual:
                self.excluded[victim.id] = None
            self._ver.pop(victim.id, None)  # out of this order: every entry of it is stale
        return victim

    def __len__(self) -> int:
        return len(self._heap)

    def fallback_depth(self, node: TreeNode, live: dict[int, TreeNode]) -> int:
        """Depth of the state this order would resume from instead of ``node``'s: the nearest
        shallower live state it does not exclude (0: none)."""
        n = node.parent
        while n is not None and n.parent is not None:
            if n.id in live and n.id not in self.excluded:
                return n.depth
            n = n.parent
        return 0

    def check(self, state_nodes: Sequence[TreeNode]) -> None:
        ids = {n.id for n in state_nodes}
        assert set(self.stamp) == ids and set(self.w) == ids, f"{self.name}: tracked set differs"
        assert set(self.excluded) <= ids, f"{self.name}: excludes a state that left"
        current = {}
        for prio, _, ver, nid in self._heap:
            if self._ver.get(nid) == ver:
                current[nid] = prio
        for n in state_nodes:
            if n.id in self.excluded:
                continue
            assert n.id in current, f"{self.name}: state on {n} has no current heap entry"
            assert current[n.id] <= self.true_priority(n) + _EPS, (
                f"{self.name}: entry {current[n.id]} above the true priority of {n}")
            assert self.clock or self.stamp[n.id] <= self.watermark + _EPS


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
        owners = 1 << lead
        keep = {}
        for i, o in enumerate(self.orders):
            if i == lead:
                continue
            if nid in o.excluded:
                owners |= 1 << i
            else:
                keep[i] = o.true_priority(victim)
        self.ghosts.limit = max(256, 2 * len(self.members))
        gid = self.ghosts.add(victim, owners)
        del self.members[nid]
        del self._seen[nid]
        for o in self.orders:
            o.remove(nid)
        if gid is not None:
            for i, prio in keep.items():
                self.orders[i].retain(gid, prio)
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
