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

Lazy heap with a lower-bound invariant: each state has one *current* heap entry (``gds_ver``)
whose priority is <= its true priority. Stamps only rise and an evicted ancestor only raises
``cost``, so neither needs a new entry. A new state shortens the distance ``b - a`` of the
states directly below it, lowering their true priority: those (and the new state) get fresh
entries. A popped entry is recomputed; if it rose it is pushed back, else the state goes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radix.node import TreeNode

_EPS = 1e-12

#: ``StateComponent`` walks built from ``(d, e)`` (``components.state.make_gds_walk``).
GDS_WALKS = ("gds", "gdsf", "gds_adaptive")


def gds_cost(a: int, b: int, d: float, e: float) -> float:
    """Prefill cost of rebuilding a state at position ``b`` from one at ``a`` [cost units].

    Positions in tokens, ``0 <= a <= b``. Units: the GLM fit's seconds when ``d``, ``e`` are the
    defaults; any consistent unit otherwise.
    """
    return d * (b - a) + e * (b * b - a * a) / 2e5


class GDSStrategy:
    """The GDS walk over the nodes that hold device states.

    Args:
        d, e: cost coefficients (validated by ``radix.policies`` when the cache is built).
        is_candidate: whether a node's state may be evicted now (unlocked, and a leaf's KV too).
    """

    def __init__(self, d: float, e: float, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.d = float(d)
        self.e = float(e)
        self.watermark = 0.0
        self._is_candidate = is_candidate
        # (priority, seq, version, node id): ids, not nodes, so that an evicted node is not
        # kept alive by its stale entries.
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._live: dict[int, TreeNode] = {}

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

    def true_priority(self, node: TreeNode) -> float:
        return node.gds_stamp + gds_cost(self.nearest_shallower_pos(node), node.depth, self.d, self.e)

    def _push(self, node: TreeNode, prio: float) -> None:
        node.gds_ver += 1
        node.gds_prio = prio
        self._seq += 1
        heapq.heappush(self._heap, (prio, self._seq, node.gds_ver, node.id))

    def _reseed_below(self, node: TreeNode) -> None:
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if n.state_slot is not None:
                self._push(n, self.true_priority(n))
            else:
                stack.extend(n.children.values())

    # ------------------------------------------------------------ state events
    def on_set(self, node: TreeNode) -> None:
        """A state was cached on ``node``: stamp it, seed it and re-seed the states below."""
        node.gds_stamp = self.watermark
        self._live[node.id] = node
        self._push(node, self.true_priority(node))
        self._reseed_below(node)
        if len(self._heap) > 4 * len(self._live) + 1024:
            self._compact()

    def on_use(self, node: TreeNode) -> None:
        """Loaded back or released by its last request: stamp at the watermark.

        The true priority can only rise, so the current entry stays a lower bound.
        """
        node.gds_stamp = self.watermark

    def on_hit(self, node: TreeNode) -> None:
        """Consumed by a match: the same as :meth:`on_use` under plain GDS."""
        node.gds_stamp = self.watermark

    def on_remove(self, node: TreeNode) -> None:
        """The state left ``node`` (its entry becomes stale; nothing below gets cheaper)."""
        self._live.pop(node.id, None)
        node.gds_ver += 1

    def requeue(self, node: TreeNode) -> None:
        """Give ``node`` a current heap entry again (it was popped but kept its state)."""
        if node.id in self._live:
            self._push(node, self.true_priority(node))

    def _compact(self) -> None:
        self._heap = []
        for n in self._live.values():
            self._push(n, self.true_priority(n))

    # --------------------------------------------------------------------- walk
    def pop_victim(self) -> TreeNode | None:
        """The evictable state of lowest priority, removed from the heap; raises the watermark.

        Returns ``None`` when no state can be evicted. The caller frees the state (internal
        node) or the whole leaf, and must then call :meth:`on_remove`.
        """
        heap = self._heap
        live = self._live
        held: list[tuple[float, int, int, int]] = []
        victim: TreeNode | None = None
        while heap:
            entry = heapq.heappop(heap)
            prio, _, ver, nid = entry
            node = live.get(nid)
            if node is None or ver != node.gds_ver:
                continue  # stale
            if not self._is_candidate(node):
                held.append(entry)
                continue
            true = self.true_priority(node)
            if true > prio + _EPS:
                self._push(node, true)
                continue
            victim = node
            self.watermark = max(self.watermark, true)
            break
        for entry in held:
            heapq.heappush(heap, entry)
        return victim

    # ------------------------------------------------------------------- checks
    def check(self, state_nodes: list[TreeNode]) -> None:
        live = {n.id for n in state_nodes}
        assert live == set(self._live), f"gds live set differs: {live ^ set(self._live)}"
        current = {}
        for prio, _, ver, nid in self._heap:
            node = self._live.get(nid)
            if node is not None and ver == node.gds_ver:
                current[nid] = prio
        for n in state_nodes:
            assert n.id in current, f"state on {n} has no current GDS heap entry"
            true = self.true_priority(n)
            assert current[n.id] <= true + _EPS, (
                f"GDS entry {current[n.id]} above true priority {true} for {n}"
            )
            assert n.gds_stamp <= self.watermark + _EPS
            assert math.isfinite(true)


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

    def __init__(self, d: float, e: float, is_candidate: Callable[[TreeNode], bool]) -> None:
        super().__init__(d, e, is_candidate)
        self.hits: dict[int, int] = {}

    def true_priority(self, node: TreeNode) -> float:
        cost = gds_cost(self.nearest_shallower_pos(node), node.depth, self.d, self.e)
        return node.gds_stamp + cost * (1 + self.hits.get(node.id, 0))

    def on_set(self, node: TreeNode) -> None:
        self.hits[node.id] = 0
        super().on_set(node)

    def on_hit(self, node: TreeNode) -> None:
        node.gds_stamp = self.watermark
        self.hits[node.id] = self.hits.get(node.id, 0) + 1

    def on_remove(self, node: TreeNode) -> None:
        super().on_remove(node)
        self.hits.pop(node.id, None)

    def check(self, state_nodes: list[TreeNode]) -> None:
        super().check(state_nodes)
        assert set(self.hits) == {n.id for n in state_nodes}, "gdsf hit counts out of step"
