"""``gds_adaptive``: the recurrent-state walk that picks, online, the GreedyDual order that is
making the fewest costly mistakes on the workload at hand.

Every order here is GreedyDual-Size (:mod:`components.eviction.gds`)::

    priority(s) = stamp(s) + w(s) * cost(a, b)        evict the least; watermark := its priority

with ``cost(a, b)`` the prefill that rebuilds ``s`` (at position ``b``) from the nearest
shallower live state (at ``a``). The orders differ in ``w``:

* ``gds``: ``w = 1`` (FlashState).
* ``gdsf``: ``w = 1 + hits`` (GreedyDual-Size-Frequency, Cherkasova 1998).
* ``signals``: a weight from what the tree says about the state (below). Conversations make
  plain GDS rank backwards (a continued turn's new end state is cheap over the old one, so GDS
  evicts it and keeps the old one the next turn will not use); this order fixes that.

No single order is best everywhere (measured, ``bench/results/2026-12-02-beyond-gds.md``): ``signals`` saves 1.5-2x
the tokens of ``gds`` on conversation traffic, ``gds`` / ``gdsf`` win by a point or two where
every question on a document resumes from one fork state. So all three are kept over the same
live states, each with its own lazy heap and watermark (:class:`components.eviction.gds.
GreedyDualHeap`); the *leader* evicts, the others name the victim they would have evicted
and exclude it from their own order (a miniature simulation of each order on the real
pool; Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations",
USENIX ATC 2017, simulate whole caches on sampled keys; here the shared tree makes the whole
pool cheap to shadow, one heap per order). Each order is charged, in prefill tokens, for its
mistakes:

* the leader, when a later match would have consumed one of its victims (a *ghost*,
  :class:`components.eviction.duel.Ghosts`; a leaf's ghost is found through the match key, since
  its KV left with it): ``depth(victim) - depth(state consumed instead)``;
* another order, when a match consumes one of the states it excluded (it would have lost
  ``depth - a``), or when it agreed with the leader's victim that turns out needed.

Charges decay with a half-life of :data:`REGRET_HALF_LIFE` stores; the leader changes when
another order's charge is below the leader's by the factor :data:`SWITCH_MARGIN` *and* by
more than the mean matched key length (one mistake on an average request is no evidence that
an order is worse: on a small pool the first such charge decided the lead by chance). The
other orders then forget their exclusions (the pool is what the old leader left).

The ``signals`` weight, from the tree around ``s`` (``below``: live states whose nearest
shallower live state is ``s``):

* ``leaf`` (nothing below): the learned reuse probability of its *seen-share bucket* (the
  share of its prefix other requests had inserted before: under 30 %, 30-90 %, at least
  90 %) relative to all leaves, times ``1 + hits`` (the state's own hits since it was
  cached, GDSF's frequency: a leaf consumed without being extended, such as a shared
  prompt's end state, is worth more each time). Outcomes are read from KV-level reuse
  (``hit_count`` of the node after ``2 x`` live-states stores), so the walk's own evictions
  do not censor them.
* ``chain`` (consumed by a request that then cached a state below it: the conversation
  moved past it; not consumed since): ``w = 0`` while chains are learned to be hit less often
  than leaves, else 1.
* ``spine`` (states below it were cached without it being consumed in between: the chunk
  checkpoints of one long prompt, a fork state and its own request's end): its learned hit
  rate relative to the leaves', capped at 1 (``w = min(1, rate(spine) / rate(leaf))``, the
  relative reuse a leaf's bucket weight is too). The two are apart because a document's
  chunk checkpoints are what its next questions resume from, while a conversation's old
  turns are not (measured: one rule for both loses either Mooncake's conversations or
  document QA); and spines are graded, not cut to 0, because the rate of spines is censored
  by their own evictions (a spine at weight 0 is gone before it can be hit), so a 0 / 1 rule
  locked document QA into evicting the states its next questions need.
* ``hub0`` (born with states below: a fork checkpoint; not consumed since): ``w = 1``.
* ``hub`` (consumed ``k >= 1`` times while it had states below: a shared prefix): ``w = 1 + k``.

With the session hint (an engine passes ``extra={"session_id": ...}`` per request,
:mod:`radix.hints`), a fourth order joins the duel at the first request carrying a session:
``sessions``, the ``signals`` weight times the learned weight of the state's *session tag*
(:mod:`components.eviction.sessions`): ``latest`` (the most recent live state its session
stored: where a conversation or agent loop resumes) or ``stale`` (its session stored a later
one since). It starts as a copy of the leader's pool, charged as much as the leader, so it
evicts only once its own mistakes are fewer: the hint can change a victim only on evidence.
(Multiplying the tag weight into ``signals`` directly lost 7.8 points on document QA, whose
session is the document and whose "stale" states are the chunk checkpoints new questions
resume from: ``bench/results/2026-12-05-eviction-round3.md``, which also shows that the
order never took the lead on the generated workloads: the tree's ``chain`` kind already
says what the session says there.) Without hints the walk is the three-order one, decision
for decision.

Hit rates per kind are hits per state per store (exposure and hits decayed, half-life
:data:`RATE_HALF_LIFE` stores; prior: :data:`RATE_PRIOR` stores of the whole live pool's
exposure at the leaves' rate, so a kind is believed as hot as leaves until it has been
watched for as long as a pool's worth of states would take to show it).

Constants were fixed once on the exploration set named in
``bench/results/2026-12-02-beyond-gds.md``; none is a knob
a user sets. Lazy heaps: every entry is a lower bound of its order's true priority (stamps
only rise, an evicted ancestor only raises ``cost``, a lower weight comes with a fresh entry,
a new state re-seeds the states directly below it in every order).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from components.eviction.duel import Ghosts, KVOrderDuel
from components.eviction.gds import GreedyDualHeap, gds_cost
from components.eviction.sessions import SessionEvidence

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["CHAIN", "HUB", "HUB0", "KIND_NAMES", "LEAF", "SPINE", "AdaptiveGDSStrategy", "seen_bucket"]

SEEN_EDGES = (0.3, 0.9)
"""Seen-share bucket edges: ``< 0.3`` -> 0, ``< 0.9`` -> 1, else 2."""
HORIZON = 2.0
"""Outcome horizon of a stored state, in multiples of the live states at its store."""
BUCKET_MEMORY = 2048.0
"""Outcomes after which an old one weighs ``1/e``."""
BUCKET_PRIOR = 16.0
"""Pseudo-outcomes per bucket at the overall reuse probability."""
RATE_HALF_LIFE = 4096.0
"""Stores after which a per-kind hit or exposure counts half."""
RATE_PRIOR = 4.0
"""Pseudo-exposure of each kind's hit rate at the leaves' rate, in stores of the live pool
(``RATE_PRIOR x live states`` state-stores)."""
REGRET_HALF_LIFE = 2048.0
"""Stores after which an order's charged mistakes count half."""
SWITCH_MARGIN = 1.5
"""Another order leads once the leader's charge exceeds its own by this factor (and by more
than the mean matched key length)."""

LEAF, CHAIN, HUB0, HUB, SPINE = 0, 1, 2, 3, 4
KINDS = (LEAF, CHAIN, HUB0, HUB, SPINE)
KIND_NAMES = ("leaf", "chain", "hub0", "hub", "spine")
ORDERS = ("signals", "gds", "gdsf")


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


class AdaptiveGDSStrategy:
    """The ``gds_adaptive`` walk (module docstring): a :class:`components.state.StateWalk`
    with the optional ``on_match``. ``d``, ``e``: the GDS cost coefficients."""

    def __init__(self, d: float, e: float, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.d = float(d)
        self.e = float(e)
        self._is_candidate = is_candidate
        self._live: dict[int, TreeNode] = {}
        # per-state signals
        self.below: dict[int, int] = {}
        self.superseded: dict[int, bool] = {}
        self.consumed: dict[int, bool] = {}
        self.born_below: dict[int, bool] = {}
        self.hits: dict[int, int] = {}
        self.hits_below: dict[int, int] = {}
        self.bucket: dict[int, int] = {}
        self.kind: dict[int, int] = {}
        # learned: seen-share buckets, per-kind hit rates and the chain / spine rules
        self.stores = 0
        self._pending: deque[list] = deque()  # [store, weak ref, hit_count, bucket, left, id]
        self._pending_of: dict[int, list] = {}
        self.outcomes = [0.0, 0.0, 0.0]
        self.reuses = [0.0, 0.0, 0.0]
        self._keep = 1.0 - 1.0 / BUCKET_MEMORY
        self._decay = 0.5 ** (1.0 / RATE_HALF_LIFE)
        self.count = [0] * len(KINDS)
        self.exposure = [0.0] * len(KINDS)
        self.rate_hits = [0.0] * len(KINDS)
        self.chain_weight = 1.0
        self.spine_weight = 1.0
        #: The session hint's evidence (:mod:`components.eviction.sessions`).
        self.sessions = SessionEvidence(self._decay)
        # the orders, the leader and the charges
        self.orders: tuple[GreedyDualHeap, ...] = (
            GreedyDualHeap("signals", self.weight_of, self.cost),
            GreedyDualHeap("gds", lambda nid: 1.0, self.cost),
            GreedyDualHeap("gdsf", lambda nid: 1.0 + self.hits[nid], self.cost),
        )
        self.leader = 0
        #: The largest of the orders' watermarks (never decreases; ``RadixCache.watermark``).
        self.watermark = 0.0
        self.regret = [0.0] * len(self.orders)
        self._regret_keep = 0.5 ** (1.0 / REGRET_HALF_LIFE)
        self.switches = 0
        self.matches = 0
        self.matched_tokens = 0
        self.ghosts = Ghosts(self._ghost_dropped)
        self._victim: TreeNode | None = None
        #: The orders whose weight reads the kinds (``signals``, and ``sessions`` once joined).
        self._signal_orders: tuple[GreedyDualHeap, ...] = self.orders[:1]
        #: The ``sessions`` order, from the first request that carried a session hint.
        self._session_order: GreedyDualHeap | None = None
        #: The KV-leaf order the cache adopts (``RadixCache`` without a host tier).
        self.kv_leaves = KVOrderDuel(self.d, self.e, self.resume_depth_without)


    # ----------------------------------------------------------------- costs
    def nearest_shallower(self, node: TreeNode) -> TreeNode | None:
        n = node.parent
        while n is not None and n.parent is not None:
            if n.state_slot is not None and n.id in self._live:
                return n
            n = n.parent
        return None

    def cost(self, node: TreeNode) -> float:
        above = self.nearest_shallower(node)
        return gds_cost(0 if above is None else above.depth, node.depth, self.d, self.e)

    def true_priority(self, node: TreeNode) -> float:
        """The leading order's priority of ``node``'s state."""
        return self.orders[self.leader].true_priority(node)

    def _direct_below(self, node: TreeNode) -> list[TreeNode]:
        """Live states whose nearest shallower live state is ``node``."""
        out = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if n.id in self._live:
                out.append(n)
            else:
                stack.extend(n.children.values())
        return out

    # --------------------------------------------------------------- signals
    def kind_of(self, nid: int) -> int:
        if self.below[nid] == 0:
            return LEAF
        if self.hits_below[nid]:
            return HUB
        if self.superseded[nid]:
            return CHAIN
        return HUB0 if self.born_below[nid] else SPINE

    def rate(self, k: int) -> float:
        """Learned hits per state per store of kind ``k`` (prior: the leaves' rate)."""
        leaf = (self.rate_hits[LEAF] + 1.0) / (self.exposure[LEAF] + 1.0)
        if k == LEAF:
            return leaf
        prior = RATE_PRIOR * max(len(self._live), 1)
        return (self.rate_hits[k] + prior * leaf) / (self.exposure[k] + prior)

    def bucket_weight(self, b: int) -> float:
        """Learned reuse probability of seen-share bucket ``b`` over that of all leaves."""
        mean = (sum(self.reuses) + 1.0) / (sum(self.outcomes) + 2.0)
        return (self.reuses[b] + BUCKET_PRIOR * mean) / (self.outcomes[b] + BUCKET_PRIOR) / mean

    def weight_of(self, nid: int) -> float:
        """The ``signals`` order's weight of the state on node ``nid``."""
        k = self.kind[nid]
        if k == LEAF:
            return self.bucket_weight(self.bucket[nid]) * (1.0 + self.hits[nid])
        if k == CHAIN:
            return self.chain_weight
        if k == SPINE:
            return self.spine_weight
        if k == HUB:
            return 1.0 + self.hits_below[nid]
        return 1.0

    def session_weight_of(self, nid: int) -> float:
        """The ``sessions`` order's weight: ``signals``' times the session tag's."""
        return self.weight_of(nid) * self.sessions.weight(nid)

    def _join_sessions(self) -> None:
        """The first session hint: the ``sessions`` order joins the duel, a copy of the
        leader's pool (its stamps and watermark), charged as much as the leader so far (it
        leads only once its own mistakes are fewer)."""
        lead = self.orders[self.leader]
        o = GreedyDualHeap("sessions", self.session_weight_of, self.cost)
        o.watermark = lead.watermark
        for nid, node in self._live.items():
            if nid in lead.stamp:
                o.add(node, stamp=lead.stamp[nid])
        self.orders = (*self.orders, o)
        self.regret.append(self.regret[self.leader])
        self._signal_orders = (*self._signal_orders, o)
        self._session_order = o

    def _set_kind(self, node: TreeNode) -> None:
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
            for o in self._signal_orders:
                o.reweigh(node)

    def _rules(self) -> None:
        """The chain rule (0 while chains are hit less often than leaves, else 1) and the
        spine weight (``min(1, rate(spine) / rate(leaf))``)."""
        leaf = self.rate(LEAF)
        for k, attr in ((CHAIN, "chain_weight"), (SPINE, "spine_weight")):
            rel = self.rate(k) / leaf
            w = min(1.0, rel) if k == SPINE else 0.0 if rel < 1.0 else 1.0
            if w != getattr(self, attr):
                setattr(self, attr, w)
                for nid, kind in self.kind.items():
                    if kind == k:
                        for o in self._signal_orders:
                            o.reweigh(self._live[nid])

    def _tick(self) -> None:
        """One store: age rates and charges, resolve due bucket outcomes, maybe switch."""
        self.stores += 1
        f = self._decay
        for k in KINDS:
            self.exposure[k] = self.exposure[k] * f + self.count[k]
            self.rate_hits[k] *= f
        self._rules()
        order = self._session_order
        if order is not None:
            changed = self.sessions.tick(RATE_PRIOR * max(len(self._live), 1))
            if changed:
                tag = self.sessions.tag
                for nid, node in self._live.items():
                    if tag(nid) in changed:
                        order.reweigh(node)
        horizon = HORIZON * max(len(self._live), 1)
        pending = self._pending
        keep = self._keep
        while pending and self.stores - pending[0][0] >= horizon:
            entry = pending.popleft()
            _, ref, hc0, b, hc_left, nid = entry
            if self._pending_of.get(nid) is entry:
                del self._pending_of[nid]
            node = ref()
            hc = node.hit_count if node is not None else hc0 if hc_left is None else hc_left
            for i in range(3):
                self.outcomes[i] *= keep
                self.reuses[i] *= keep
            self.outcomes[b] += 1.0
            if hc > hc0:
                self.reuses[b] += 1.0
        r = self.regret
        g = self._regret_keep
        for i in range(len(r)):
            r[i] *= g
        self._maybe_switch()

    # ------------------------------------------------------------ selection
    def _charge(self, owners: int, tokens: float) -> None:
        for i in range(len(self.orders)):
            if owners >> i & 1:
                self.regret[i] += tokens

    def _maybe_switch(self) -> None:
        r = self.regret
        lead = self.leader
        best = min(range(len(r)), key=lambda i: (r[i], i != lead))
        if best == lead or r[lead] <= SWITCH_MARGIN * r[best]:
            return
        if r[lead] - r[best] > self.matched_tokens / max(self.matches, 1):
            self.leader = best
            self.switches += 1
            for o in self.orders:
                o.clear_exclusions(self._live)

    # ------------------------------------------------------------ state events
    def on_hint(self, extra: Mapping[str, Any] | None) -> None:
        """The hints of the request served next (:mod:`radix.hints`): its session."""
        self.sessions.on_hint(extra)

    def on_set(self, node: TreeNode) -> None:
        self._tick()
        if self.sessions.current is not None and self._session_order is None:
            self._join_sessions()
        nid = node.id
        self._live[nid] = node
        stale = self.sessions.on_set(nid)
        if stale is not None and self._session_order is not None:  # its session moved on
            self._session_order.reweigh(self._live[stale])
        self.ghosts.forget(node)
        direct = self._direct_below(node)
        above = self.nearest_shallower(node)
        self.below[nid] = len(direct)
        self.superseded[nid] = False
        self.consumed[nid] = False
        self.born_below[nid] = bool(direct)
        self.hits[nid] = 0
        self.hits_below[nid] = 0
        b = seen_bucket(node)
        self.bucket[nid] = b
        entry = [self.stores, weakref.ref(node), node.hit_count, b, None, nid]
        self._pending.append(entry)
        self._pending_of[nid] = entry
        self._set_kind(node)
        for o in self.orders:
            o.add(node)
            for n in direct:  # a shorter rebuild distance: fresh entries
                o.reseed(n)
        if above is not None:
            aid = above.id
            self.below[aid] += 1 - len(direct)
            if self.consumed[aid]:  # the request that consumed it moved past it
                self.superseded[aid] = True
                self.consumed[aid] = False
            self._set_kind(above)
        if len(self.orders[0]) > 4 * len(self._live) + 1024:
            for o in self.orders:
                o.compact(self._live)

    def on_hit(self, node: TreeNode) -> None:
        nid = node.id
        self.rate_hits[self.kind[nid]] += 1.0
        self.sessions.on_hit(nid)
        self.consumed[nid] = True
        self.hits[nid] += 1
        if self.below[nid]:
            self.hits_below[nid] += 1
            self._set_kind(node)
        for i, o in enumerate(self.orders):
            o.touch(node)
            o.reweigh(node)  # gdsf: one more hit; signals: maybe a new kind
            if nid in o.excluded:  # it would have evicted what this match consumes
                self.regret[i] += node.depth - o.fallback_depth(node, self._live)
                o.readmit(node)
                self._rebalance(i)

    def on_use(self, node: TreeNode) -> None:
        for o in self.orders:
            o.touch(node)

    def resume_depth_without(self, leaf: TreeNode) -> int:
        """Depth of the state a request would resume from had ``leaf`` and the stateless
        single-child ancestors pruned with it been evicted (0: none)."""
        a = leaf.parent
        while a is not None and a.parent is not None and a.state_slot is None \
                and len(a.children) == 1:
            a = a.parent
        while a is not None and a.parent is not None:
            if a.id in self._live:
                return a.depth
            a = a.parent
        return 0

    def on_match(self, kv_end: TreeNode | None, consumed: TreeNode | None,
                 key: Sequence[int], end: int) -> None:
        """Charge the orders (state and KV) that evicted what this match would have used."""
        self.matches += 1
        self.matched_tokens += end
        if kv_end is None:
            return
        self.kv_leaves.on_match(kv_end, consumed, key, end)
        if not len(self.ghosts):
            return
        g = self.ghosts.match(kv_end, consumed, key, end)
        if g is not None:
            gid, depth = g
            self._charge(self.ghosts.owners(gid), depth - (0 if consumed is None else consumed.depth))
            self.ghosts.release(gid)

    def _ghost_dropped(self, gid: int) -> None:
        for o in self.orders:
            o.retained.pop(gid, None)

    def _rebalance(self, i: int) -> None:
        """Order ``i`` (not leading) evicts in its simulated pool until it is no larger than
        the real one."""
        o = self.orders[i]
        live, ok = self._live, self._is_candidate
        while o.balance > 0:
            c = o.pop(live, ok, virtual=True)
            if c is None:
                break
            if isinstance(c, int):
                self.ghosts.disown(c, i)
        self.watermark = max(self.watermark, o.watermark)

    def on_remove(self, node: TreeNode) -> None:
        nid = node.id
        if nid not in self._live:
            return
        lead = self.leader
        others = [i for i in range(len(self.orders)) if i != lead]
        if node is self._victim:  # the leader's choice: a ghost, kept by who would keep it
            self._victim = None
            self.ghosts.bury(node, self.orders, lead, len(self._live))
        entry = self._pending_of.pop(nid, None)
        if entry is not None:  # the node may leave the tree with its state: keep its count
            entry[4] = node.hit_count
        direct = self._direct_below(node)
        above = self.nearest_shallower(node)
        del self._live[nid]
        promoted = self.sessions.on_remove(nid)
        self.count[self.kind.pop(nid)] -= 1
        for m in (self.below, self.superseded, self.consumed, self.born_below, self.hits,
                  self.hits_below, self.bucket):
            del m[nid]
        for o in self.orders:
            o.remove(nid)
        if promoted is not None and self._session_order is not None:  # its session's latest
            self._session_order.reweigh(self._live[promoted])
        if above is not None:
            self.below[above.id] += len(direct) - 1
            self._set_kind(above)
        for i in others:
            self._rebalance(i)

    def requeue(self, node: TreeNode) -> None:
        if node.id in self._live:
            self._victim = None
            for o in self.orders:
                o.reseed(node)

    def pop_victim(self) -> TreeNode | None:
        """The leading order's victim (the others follow in :meth:`on_remove`)."""
        lead = self.orders[self.leader]
        victim = lead.pop(self._live, self._is_candidate, virtual=False)
        self.watermark = max(self.watermark, lead.watermark)
        self._victim = None if isinstance(victim, int) else victim
        return self._victim

    # ------------------------------------------------------------------ checks
    def check(self, state_nodes: list[TreeNode]) -> None:
        live = {n.id for n in state_nodes}
        assert live == set(self._live), f"gds_adaptive live set differs: {live ^ set(self._live)}"
        for m in (self.below, self.superseded, self.consumed, self.born_below, self.hits,
                  self.hits_below, self.bucket, self.kind):
            assert set(m) == live, "gds_adaptive per-state maps out of step"
        for n in state_nodes:
            assert self.below[n.id] == len(self._direct_below(n)), f"below count wrong for {n}"
            assert self.kind[n.id] == self.kind_of(n.id), f"kind wrong for {n}"
        kinds = list(self.kind.values())
        assert self.count == [kinds.count(k) for k in KINDS], "kind counts wrong"
        self.sessions.check(live)
        for o in self.orders:
            o.check(state_nodes)
