"""GreedyDual-Size with learned reuse weights for recurrent-state checkpoints (``gds_adaptive``).

Plain GDS (``components.gds``) ranks a state by ``stamp + cost(a, b)``, the prefill a hit on it
saves over the nearest shallower state. On conversation traffic that ranks backwards: when a
conversation continues, the new end state sits a few hundred tokens below the state the turn
resumed from, so its incremental cost is tiny and GDS evicts it first, while the old state
(expensive to rebuild from the root) stays, although the next turn will resume from the new
one. This walk keeps the GDS frame and multiplies the cost by a weight ``w(s)`` that estimates
how likely ``s`` is to be consumed again, from signals an online cache has::

    priority(s) = stamp(s) + w(s) * cost(a, b)

Kinds of state, from the tree around ``s`` (``below``: live states whose nearest shallower
live state is ``s``; ``extended``: a state was cached below ``s`` after ``s`` was; ``hits
below``: matches that consumed ``s`` while it had states below):

* ``leaf`` (nothing below): ``w`` = the learned reuse probability of its *seen-share bucket*
  relative to all leaves, times ``min(1, hit rate of leaves / hit rate of all states)``. The bucket is the share of ``s``'s prefix that other requests had
  inserted before (the deepest node on its path with ``hit_count >= 2``): under 30 %, 30-90 %,
  at least 90 %. A continuing conversation's new end state lies under a prefix seen before; a
  new conversation's lies under fresh tokens. On the Mooncake conversation trace the end state
  of a request whose prompt was >= 90 % seen is reused within 600 requests 60 % of the time,
  against 17 % under 30 % seen (whole-trace analysis, ``bench/README.md``, "Beyond GDS").
* ``chain`` (extended, no hit since it had states below): the turn moved past it. ``w = 0``
  (evicted first, oldest stamp first) while the learned hit rate of chain states is below that
  of leaves, else 1 (decided at every store; when it flips, every chain state is
  re-weighed). Conversations make chains dead weight (Mooncake, learned hit rates relative to
  the mean: chains 0.002, leaves 0.086); shared system prompts reached once and then extended
  make them hot (LMBench GMI: chains 0.68, leaves 0.024); the rule follows the workload.
* ``hub0`` (states below since it was cached, no hit since): ``w = 1`` (plain GDS).
* ``hub`` (consumed ``k >= 1`` times while it had states below: a shared prefix): ``w = 1 + k``
  (GreedyDual-Size-Frequency on those hits).

Learning, all online and without knobs a user must tune:

* *Seen-share buckets*: when a state is cached, remember its node, bucket and ``hit_count``;
  after ``2 x`` (states cached now) further stores, the outcome is whether another request
  inserted through the node meanwhile (``hit_count`` rose), whether or not the state itself
  survived: the estimate is not censored by the walk's own evictions (a state the walk evicts
  early would otherwise never be seen reused, and its bucket would look useless). Counts decay
  by ``1 - 1/2048`` per outcome; each bucket has a prior of 16 outcomes at the overall mean.
* *Hit rates per kind*: hits per state per store event, exposure and hits decayed with a
  half-life of 4,096 stores, prior 4 exposure units at the overall rate; they decide the
  chain rule and scale the leaves.

Sources: GreedyDual-Size (Cao & Irani, USITS 1997) and GDSF (Cherkasova, HPL-98-69, 1998) for
the frame and the frequency term; ARC's ghost idea and admission control were measured and
dropped (``bench/README.md``, issue 12). The constants (bucket edges, horizon, decays, priors)
were fixed once on the first 4,000 Mooncake requests and one LMBench run at 256 state slots,
then checked on the full traces at 64-4,096 slots and 16-64 sessions.

Semantics for the lazy heap: ``w(s)`` is evaluated when ``s`` is cached, consumed, changes
kind, is requeued, or (chains) when the chain rule flips, and kept until then (a leaf's
weight does not follow every later change of the bucket estimates); ``true_priority`` uses
that stored weight, so every entry is a lower bound of it exactly as under GDS (stamps only
rise, an evicted ancestor only raises ``cost``, a lower weight always comes with a fresh entry).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from components.gds import GDSStrategy, gds_cost

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["AdaptiveGDSStrategy", "seen_bucket"]

SEEN_EDGES = (0.3, 0.9)
"""Seen-share bucket edges: ``< 0.3`` -> 0, ``< 0.9`` -> 1, else 2."""
HORIZON = 2.0
"""Outcome horizon of a stored state, in multiples of the live states at its store."""
BUCKET_MEMORY = 2048.0
"""Outcomes after which an old one weighs ``1/e``."""
BUCKET_PRIOR = 16.0
"""Pseudo-outcomes per bucket at the overall reuse probability."""
RATE_HALF_LIFE = 4096.0
"""Stores after which a chain / leaf hit or exposure counts half."""
RATE_PRIOR = 4.0
"""Pseudo-exposure of the chain / leaf hit rates at the overall rate."""

LEAF, CHAIN, HUB0, HUB = 0, 1, 2, 3
KIND_NAMES = ("leaf", "chain", "hub0", "hub")


def seen_bucket(node: TreeNode) -> int:
    """0, 1 or 2: the share of ``node``'s prefix another request inserted before is under
    30 %, 30-90 %, or at least 90 % (the deepest node on its path, itself included, with
    ``hit_count >= 2``; ``hit_count`` counts the requests whose inserts passed)."""
    n: TreeNode | None = node
    while n is not None and n.parent is not None and n.hit_count < 2:
        n = n.parent
    seen = 0 if n is None else n.depth
    share = seen / max(node.depth, 1)
    return 0 if share < SEEN_EDGES[0] else 1 if share < SEEN_EDGES[1] else 2


class AdaptiveGDSStrategy(GDSStrategy):
    """The ``gds_adaptive`` walk (module docstring). Same interface and events as
    :class:`components.gds.GDSStrategy`; ``d``, ``e`` are the GDS cost coefficients."""

    def __init__(self, d: float, e: float, is_candidate: Callable[[TreeNode], bool]) -> None:
        super().__init__(d, e, is_candidate)
        self.below: dict[int, int] = {}  # live states whose nearest shallower state is this
        self.extended: dict[int, bool] = {}
        self.hits_below: dict[int, int] = {}
        self.bucket: dict[int, int] = {}
        self.kind: dict[int, int] = {}
        self.weight: dict[int, float] = {}  # the weight of the current heap entry
        # learned: seen-share buckets (decayed outcomes / reuses), chain vs leaf hit rates
        self.stores = 0
        # outcomes due: [store, weak ref to the node, hit_count at store, bucket, hit_count
        # when its state left (None while it is cached), node id]; weak, so that a node
        # leaving the tree is freed at once
        self._pending: deque[list] = deque()
        self._pending_of: dict[int, list] = {}
        self.outcomes = [0.0, 0.0, 0.0]
        self.reuses = [0.0, 0.0, 0.0]
        self._keep = 1.0 - 1.0 / BUCKET_MEMORY
        self._decay = 0.5 ** (1.0 / RATE_HALF_LIFE)
        self.count = [0, 0, 0, 0]  # live states per kind
        self.exposure = [0.0, 0.0, 0.0, 0.0]
        self.rate_hits = [0.0, 0.0, 0.0, 0.0]
        self.chain_weight = 1.0  # 0.0 while chains are hit less often than leaves

    # ---------------------------------------------------------------- weights
    def kind_of(self, nid: int) -> int:
        if self.below[nid] == 0:
            return LEAF
        if self.hits_below[nid]:
            return HUB
        return CHAIN if self.extended[nid] else HUB0

    def overall_rate(self) -> float:
        """Learned hits per state per store over every kind."""
        return (sum(self.rate_hits) + 1.0) / (sum(self.exposure) + 1.0)

    def rate(self, k: int) -> float:
        """Learned hits per state per store of kind ``k``."""
        return (self.rate_hits[k] + RATE_PRIOR * self.overall_rate()) / (
            self.exposure[k] + RATE_PRIOR)

    def leaf_scale(self) -> float:
        """``min(1, rate(leaf) / overall rate)``: leaves weigh less where they are hit less
        often than states in general (LMBench GMI: only shared prefixes are resumed)."""
        return min(1.0, self.rate(LEAF) / self.overall_rate())

    def bucket_weight(self, b: int) -> float:
        """Learned reuse probability of seen-share bucket ``b`` over that of all leaves."""
        mean = (sum(self.reuses) + 1.0) / (sum(self.outcomes) + 2.0)
        return (self.reuses[b] + BUCKET_PRIOR * mean) / (self.outcomes[b] + BUCKET_PRIOR) / mean

    def weight_of(self, nid: int) -> float:
        k = self.kind[nid]
        if k == LEAF:
            return self.bucket_weight(self.bucket[nid]) * self.leaf_scale()
        if k == CHAIN:
            return self.chain_weight
        if k == HUB:
            return 1.0 + self.hits_below[nid]
        return 1.0

    def true_priority(self, node: TreeNode) -> float:
        cost = gds_cost(self.nearest_shallower_pos(node), node.depth, self.d, self.e)
        return node.gds_stamp + self.weight.get(node.id, 1.0) * cost

    def _reweigh(self, node: TreeNode, force: bool = False) -> None:
        """Evaluate ``node``'s weight now; a fresh entry when it fell (or ``force``)."""
        nid = node.id
        old = self.weight.get(nid)
        w = self.weight_of(nid)
        self.weight[nid] = w
        if force or old is None or w < old:
            self._push(node, self.true_priority(node))

    def _set_kind(self, node: TreeNode) -> None:
        """Re-derive ``node``'s kind; keep the leaf / chain counts and its weight in step."""
        nid = node.id
        old = self.kind.get(nid)
        new = self.kind_of(nid)
        if old == new:
            return
        if old is not None:
            self.count[old] -= 1
        self.count[new] += 1
        self.kind[nid] = new
        if old is not None:
            self._reweigh(node)

    # --------------------------------------------------------------- tree helpers
    def _nearest_shallower(self, node: TreeNode) -> TreeNode | None:
        n = node.parent
        while n is not None and n.parent is not None:
            if n.state_slot is not None and n.id in self._live:
                return n
            n = n.parent
        return None

    def _direct_below(self, node: TreeNode) -> list[TreeNode]:
        """Live states whose nearest shallower state is ``node``."""
        out = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if n.id in self._live:
                out.append(n)
            else:
                stack.extend(n.children.values())
        return out

    # ------------------------------------------------------------------ learning
    def _tick(self) -> None:
        """One store: age the rates, then resolve the bucket outcomes that came due."""
        self.stores += 1
        f = self._decay
        for k in (LEAF, CHAIN, HUB0, HUB):
            self.exposure[k] = self.exposure[k] * f + self.count[k]
            self.rate_hits[k] *= f
        chain_weight = 0.0 if self.rate(CHAIN) < self.rate(LEAF) else 1.0
        if chain_weight != self.chain_weight:  # the learned rule flipped: every chain follows
            self.chain_weight = chain_weight
            for nid, k in self.kind.items():
                if k == CHAIN:
                    self._reweigh(self._live[nid])
        horizon = HORIZON * max(len(self._live), 1)
        pending = self._pending
        while pending and self.stores - pending[0][0] >= horizon:
            entry = pending.popleft()
            _, ref, hc0, b, hc_left, nid = entry
            if self._pending_of.get(nid) is entry:
                del self._pending_of[nid]
            node = ref()
            hc = node.hit_count if node is not None else hc0 if hc_left is None else hc_left
            keep = self._keep
            for i in range(3):
                self.outcomes[i] *= keep
                self.reuses[i] *= keep
            self.outcomes[b] += 1.0
            if hc > hc0:
                self.reuses[b] += 1.0

    # ------------------------------------------------------------ state events
    def on_set(self, node: TreeNode) -> None:
        self._tick()
        nid = node.id
        node.gds_stamp = self.watermark
        self._live[nid] = node
        direct = self._direct_below(node)
        above = self._nearest_shallower(node)
        self.below[nid] = len(direct)
        self.extended[nid] = False
        self.hits_below[nid] = 0
        b = seen_bucket(node)
        self.bucket[nid] = b
        entry = [self.stores, weakref.ref(node), node.hit_count, b, None, nid]
        self._pending.append(entry)
        self._pending_of[nid] = entry
        self._set_kind(node)
        self.weight[nid] = self.weight_of(nid)
        self._push(node, self.true_priority(node))
        for n in direct:  # a shorter rebuild distance: fresh entries
            self._push(n, self.true_priority(n))
        if above is not None:
            self.below[above.id] += 1 - len(direct)
            self.extended[above.id] = True
            self._set_kind(above)
        if len(self._heap) > 4 * len(self._live) + 1024:
            self._compact()

    def on_hit(self, node: TreeNode) -> None:
        nid = node.id
        node.gds_stamp = self.watermark
        self.rate_hits[self.kind[nid]] += 1.0
        if self.below[nid]:
            self.hits_below[nid] += 1
            self._set_kind(node)
        self._reweigh(node)

    def on_remove(self, node: TreeNode) -> None:
        nid = node.id
        if nid not in self._live:
            return
        entry = self._pending_of.pop(nid, None)
        if entry is not None:  # the node may leave the tree with its state: keep its count
            entry[4] = node.hit_count
        direct = self._direct_below(node)
        above = self._nearest_shallower(node)
        super().on_remove(node)
        self.count[self.kind.pop(nid)] -= 1
        for d in (self.below, self.extended, self.hits_below, self.bucket, self.weight):
            d.pop(nid, None)
        if above is not None:
            self.below[above.id] += len(direct) - 1
            self._set_kind(above)

    def requeue(self, node: TreeNode) -> None:
        if node.id in self._live:
            self._reweigh(node, force=True)

    def _compact(self) -> None:
        self._heap = []
        for n in self._live.values():
            self._push(n, self.true_priority(n))

    # ------------------------------------------------------------------- checks
    def check(self, state_nodes: list[TreeNode]) -> None:
        super().check(state_nodes)
        live = {n.id for n in state_nodes}
        for d in (self.below, self.extended, self.hits_below, self.bucket, self.weight, self.kind):
            assert set(d) == live, "gds_adaptive per-state maps out of step"
        for n in state_nodes:
            assert self.below[n.id] == len(self._direct_below(n)), f"below count wrong for {n}"
            assert self.kind[n.id] == self.kind_of(n.id), f"kind wrong for {n}"
        kinds = list(self.kind.values())
        assert self.count == [kinds.count(k) for k in (LEAF, CHAIN, HUB0, HUB)], "kind counts wrong"
