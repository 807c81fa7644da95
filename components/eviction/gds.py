"""GreedyDual-Size eviction of recurrent-state checkpoints.

GreedyDual-Size is Cao and Irani's cost-aware cache replacement ("Cost-Aware WWW Proxy Caching
Algorithms", USENIX USITS 1997); applying it to recurrent-state checkpoints, with the cost
below, follows the FlashState paper.

    cost(a, b) = d * (b - a) + e * (b*b - a*a) / 2e5

is the prefill cost of rebuilding a state at token position ``b`` from the nearest shallower
surviving state at ``a`` (0 if none): a per-token linear term plus an attention term that grows
with context. Defaults ``d = 1.862e-5``, ``e = 3.33e-6`` (GLM fit); only ``d:e`` changes the order.

    priority(s) = stamp(s) + cost(a, b)

``stamp(s)`` is the global watermark ``L`` when ``s`` was last used (cached, matched, loaded
back, released by its last request). The walk evicts the lowest priority and raises ``L`` to it,
so states nobody resumes age out however costly.

GreedyDual-Size-Frequency (``gdsf``) scales the cost by ``1 + hits(s)``; ``gds_adaptive``
(:mod:`components.eviction.adaptive`) duels several such weights. All run on one structure,
:class:`GreedyDualHeap`: ``priority(s) = stamp(s) + w(s) * cost(a, b)``.

Lazy heap with a lower-bound invariant: each state has one *current* heap entry whose priority
is <= its true priority. Stamps only rise and an evicted ancestor only raises ``cost``, so
neither needs a new entry. A new state shortens the distance ``b - a`` of the states directly
below it, lowering their true priority: those (and the new state) get fresh entries. A popped
entry is recomputed; if it rose it is pushed back, else the state goes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["GDS_WALKS", "GDSFStrategy", "GDSStrategy", "GreedyDualHeap", "gds_cost"]

_EPS = 1e-12

#: ``StateComponent`` walks built from ``(d, e)`` (``components.state.make_gds_walk``).
GDS_WALKS = ("gds", "gdsf", "gds_adaptive")


def gds_cost(a: int, b: int, d: float, e: float) -> float:
    """Prefill cost of rebuilding a state at position ``b`` from one at ``a`` [cost units].

    Positions in tokens, ``0 <= a <= b``. Units: the GLM fit's seconds when ``d``, ``e`` are the
    defaults; any consistent unit otherwise.
    """
    return d * (b - a) + e * (b * b - a * a) / 2e5


class GreedyDualHeap:
    """One GreedyDual-Size order ``priority(s) = stamp(s) + w(s) * cost(a, b)`` over the live
    states, with its own weights, stamps, watermark and lazy heap: the ``gds`` and ``gdsf``
    walks run on one, ``gds_adaptive`` on one per candidate order (the duel's experts:
    :mod:`components.eviction.duel`), where pops may be *virtual* (module docstring there).

    Args:
        name: what the expert is called in reports.
        weight: node id -> ``w(s)`` (evaluated when a state is added, touched by a hit or
            reweighed; kept with the heap entry until then).
        cost: node -> ``cost(a, b)`` against the nearest shallower live state.

    Lazy heap with the lower-bound invariant (module docstring): stamps only rise, an evicted
    ancestor only raises ``cost``, a lower weight always comes with a fresh entry, and the
    owner re-seeds the states whose ``cost`` fell (:meth:`reseed`).
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

    def entry(self, nid: int) -> float | None:
        """The priority of state ``nid``'s current heap entry (a lower bound of its true
        priority), ``None`` when it has none. O(heap): for checks and tests."""
        ver = self._ver.get(nid)
        for prio, _, v, n in self._heap:
            if n == nid and v == ver:
                return prio
        return None

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


class GDSStrategy:
    """The ``gds`` walk over the nodes that hold device states: one :class:`GreedyDualHeap`
    with ``w = 1`` (:attr:`heap`; its stamps, entries and watermark are the walk's).

    Args:
        d, e: cost coefficients (validated by ``components.eviction.registry`` when the cache
            is built).
        is_candidate: whether a node's state may be evicted now (unlocked, and a leaf's KV too).
    """

    name = "gds"

    def __init__(self, d: float, e: float, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.d = float(d)
        self.e = float(e)
        self._is_candidate = is_candidate
        self._live: dict[int, TreeNode] = {}
        self.heap = GreedyDualHeap(self.name, self.weight, self.cost)

    @property
    def watermark(self) -> float:
        """The heap's watermark ``L`` (``RadixCache.watermark``)."""
        return self.heap.watermark

    # --------------------------------------------------------------- priority
    @staticmethod
    def nearest_shallower_pos(node: TreeNode) -> int:
        """Position [tokens] of the nearest ancestor holding a device state, 0 if none."""
        n = node.parent
        while n is not None and n.parent is not None:
            if n.state_slot is not None:
                return n.depth
            n = n.parent
        return 0

    def cost(self, node: TreeNode) -> float:
        """``cost(a, b)`` of ``node``'s state against the nearest shallower one."""
        return gds_cost(self.nearest_shallower_pos(node), node.depth, self.d, self.e)

    def weight(self, nid: int) -> float:
        """``w(s)``: 1 under plain GDS."""
        return 1.0

    def true_priority(self, node: TreeNode) -> float:
        return self.heap.true_priority(node)

    # ------------------------------------------------------------ state events
    def on_set(self, node: TreeNode) -> None:
        """A state was cached on ``node``: stamp it, seed it and re-seed the states below."""
        heap = self.heap
        self._live[node.id] = node
        heap.add(node)
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if n.state_slot is not None:
                heap.reseed(n)
            else:
                stack.extend(n.children.values())
        if len(heap) > 4 * len(self._live) + 1024:
            heap.compact(self._live)

    def on_use(self, node: TreeNode) -> None:
        """Loaded back or released by its last request: stamp at the watermark.

        The true priority can only rise, so the current entry stays a lower bound.
        """
        self.heap.touch(node)

    def on_hit(self, node: TreeNode) -> None:
        """Consumed by a match: the same as :meth:`on_use` under plain GDS."""
        self.heap.touch(node)

    def on_remove(self, node: TreeNode) -> None:
        """The state left ``node`` (its entry becomes stale; nothing below gets cheaper)."""
        self._live.pop(node.id, None)
        self.heap.remove(node.id)

    def requeue(self, node: TreeNode) -> None:
        """Give ``node`` a current heap entry again (it was popped but kept its state)."""
        if node.id in self._live:
            self.heap.reseed(node)

    # --------------------------------------------------------------------- walk
    def pop_victim(self) -> TreeNode | None:
        """The evictable state of lowest priority, removed from the heap; raises the watermark.

        Returns ``None`` when no state can be evicted. The caller frees the state (internal
        node) or the whole leaf, and must then call :meth:`on_remove`.
        """
        victim = self.heap.pop(self._live, self._is_candidate, virtual=False)
        return None if isinstance(victim, int) else victim

    # ------------------------------------------------------------------- checks
    def check(self, state_nodes: Sequence[TreeNode]) -> None:
        live = {n.id for n in state_nodes}
        assert live == set(self._live), f"{self.name} live set differs: {live ^ set(self._live)}"
        self.heap.check(state_nodes)


class GDSFStrategy(GDSStrategy):
    """GreedyDual-Size-Frequency (Cherkasova 1998, "Improving WWW proxies performance with
    Greedy-Dual-Size-Frequency caching policy", HPL-98-69): the GDS walk with the cost scaled
    by how often the state was consumed while cached::

        priority(s) = stamp(s) + cost(a, b) * (1 + hits(s))

    ``hits(s)`` counts matches that consumed ``s`` (``on_hit``) since it was cached; a
    release by the last request (``on_use``) is not a hit. The count starts at 0 when a state
    is cached (also when loaded back from host) and is forgotten when it leaves. Hits only
    rise, so a hit keeps the current heap entry a lower bound, as a stamp does under GDS.
    Rationale: on conversation traffic a prefix that was resumed once (a system prompt, a
    long shared document) is likelier to be resumed again than one that never was; the count
    lets such states outlive equally costly one-off checkpoints.
    """

    name = "gdsf"

    def __init__(self, d: float, e: float, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.hits: dict[int, int] = {}
        super().__init__(d, e, is_candidate)

    def weight(self, nid: int) -> float:
        """``w(s) = 1 + hits(s)``."""
        return 1.0 + self.hits.get(nid, 0)

    def on_set(self, node: TreeNode) -> None:
        self.hits[node.id] = 0
        super().on_set(node)

    def on_hit(self, node: TreeNode) -> None:
        self.hits[node.id] = self.hits.get(node.id, 0) + 1
        self.heap.touch(node)
        self.heap.reweigh(node)  # a higher weight: the entry stays a lower bound

    def on_remove(self, node: TreeNode) -> None:
        super().on_remove(node)
        self.hits.pop(node.id, None)

    def check(self, state_nodes: Sequence[TreeNode]) -> None:
        super().check(state_nodes)
        assert set(self.hits) == {n.id for n in state_nodes}, "gdsf hit counts out of step"
