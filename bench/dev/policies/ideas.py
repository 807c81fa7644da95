"""Replay-only experimental state walks: online ideas measured against ``belady``.

Each is a :class:`components.state.StateWalk` given to the cache through ``state_walk=``
(run with ``python -m bench simulate --policy idea:NAME``). They favour clarity over speed:
``pop_victim`` scans every candidate (O(states) per eviction), so no lazy-heap invariant is
needed while weights are learned. Priorities follow GreedyDual: ``stamp + weight x cost``,
``stamp`` the watermark at the state's last use, the watermark raised to each victim's
priority. Findings (hit rates, why an idea failed) are in ``bench/README.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterator

from bench.policies.baselines import Baseline, register
from components.gds import gds_cost
from radix.node import TreeNode
from radix.policies import GDS_DEFAULT_D, GDS_DEFAULT_E

__all__ = ["IDEAS", "IdeaWalk"]



def live_states_below(node: TreeNode, live: Container[int]) -> Iterator[TreeNode]:
    """Nodes strictly below ``node`` whose id is in ``live`` (depth-first, lazily)."""
    stack = list(node.children.values())
    while stack:
        m = stack.pop()
        if m.id in live:
            yield m
        stack.extend(m.children.values())

class IdeaWalk:
    """Generic GreedyDual walk with switchable terms (see :data:`IDEAS`).

    Args:
        full_cost: cost from the root, ``cost(0, b)``, instead of from the nearest shallower
            state, ``cost(a, b)``.
        freq: multiply by ``1 + hits``.
        superseded: weight of a state that has a live state below it (``None``: no rule).
        learn: learn a hit rate per class online and weight the cost by it.
        admit: admission control: a new state whose expected value is below the cheapest
            resident's goes first.
        ghosts: ARC-like: remember evicted states; a state set again on a ghost node counts
            as a reuse the walk missed and raises its class's weight.
    """

    def __init__(self, is_candidate: Callable[[TreeNode], bool], *, full_cost: bool = False,
                 freq: bool = False, superseded: float | None = None, learn: bool = False,
                 admit: bool = False, ghosts: bool = False, half_life: float = 4096.0,
                 classes: str = "hsl", suph: bool = False, suph_freq: bool = False,
                 rw: tuple[float, float, float] | None = None) -> None:
        self._ok = is_candidate
        self.d, self.e = GDS_DEFAULT_D, GDS_DEFAULT_E
        self.full_cost, self.freq, self.superseded = full_cost, freq, superseded
        self.learn, self.admit, self.ghosts, self.classes = learn, admit, ghosts, classes
        self.suph, self.suph_freq = suph, suph_freq
        self.rw = rw
        self.watermark = 0.0
        self.live: dict[int, TreeNode] = {}
        self.stamp: dict[int, float] = {}
        self.hits: dict[int, int] = {}
        self.sup_hits: dict[int, int] = {}  # hits while a live state was below
        self.seen: dict[int, int] = {}  # share of the prefix other requests had inserted, bucketed
        self.below: dict[int, int] = {}  # live states strictly below a state node
        self.cls: dict[int, tuple] = {}
        self.t = 0.0  # event clock: states set
        # learned hit rates per class: exponentially decayed hits and exposure
        self.decay = 0.5 ** (1.0 / half_life)
        self.c_hits: dict[tuple, float] = {}
        self.c_exp: dict[tuple, float] = {}
        self.c_n: dict[tuple, int] = {}
        self._t_last = 0.0
        self.ghost: OrderedDict[int, tuple] = OrderedDict()
        self.penalised: set[int] = set()

    # ----------------------------------------------------------- classes, rates
    def klass(self, n: TreeNode) -> tuple:
        k = []
        if "h" in self.classes:
            k.append(min(self.hits.get(n.id, 0), 2))
        if "s" in self.classes:
            k.append(self.below.get(n.id, 0) > 0)
        if "l" in self.classes:
            k.append(not n.children)
        if "S" in self.classes:
            k.append(min(self.sup_hits.get(n.id, 0), 2))
        if "r" in self.classes:
            k.append(self.seen.get(n.id, 0))
        return tuple(k)

    def _advance(self, dt: float) -> None:
        if dt <= 0:
            return
        f = self.decay ** dt
        for c in self.c_exp:
            self.c_exp[c] = self.c_exp[c] * f + self.c_n.get(c, 0) * (1 - f) / (1 - self.decay)
        for c in self.c_hits:
            self.c_hits[c] *= f

    def _reclass(self, n: TreeNode) -> None:
        if not self.learn or n.id not in self.live:
            return
        old = self.cls.get(n.id)
        new = self.klass(n)
        if old == new:
            return
        if old is not None:
            self.c_n[old] -= 1
        self.c_n[new] = self.c_n.get(new, 0) + 1
        self.c_exp.setdefault(new, 0.0)
        self.c_hits.setdefault(new, 0.0)
        self.cls[n.id] = new

    def rate(self, c: tuple) -> float:
        """Hits per state per unit time of class ``c`` (Bayesian prior: the overall rate)."""
        tot_h = sum(self.c_hits.values())
        tot_e = sum(self.c_exp.values())
        base = (tot_h + 1.0) / (tot_e + 1.0)
        return (self.c_hits.get(c, 0.0) + 4 * base) / (self.c_exp.get(c, 0.0) + 4.0)

    # ----------------------------------------------------------------- priority
    def shallower(self, n: TreeNode) -> TreeNode | None:
        p = n.parent
        while p is not None and p.parent is not None:
            if p.state_slot is not None:
                return p
            p = p.parent
        return None

    def weight(self, n: TreeNode) -> float:
        w = 1.0
        if self.freq:
            w *= 1 + self.hits.get(n.id, 0)
        if self.superseded is not None and self.below.get(n.id, 0) > 0:
            w *= self.superseded
        if self.rw is not None and self.below.get(n.id, 0) == 0:
            w *= self.rw[self.seen[n.id]]
        if self.suph and self.below.get(n.id, 0) > 0:
            sh = self.sup_hits.get(n.id, 0)
            if sh == 0:
                return 0.0
            if self.suph_freq:
                w *= 1 + sh
        if self.learn:
            r = self.rate(self.cls[n.id])
            tot = sum(self.c_hits.values()) + 1.0
            mean = tot / (sum(self.c_exp.values()) + 1.0)
            w *= r / mean
        return w

    def priority(self, n: TreeNode) -> float:
        s = self.shallower(n)
        a = 0 if self.full_cost or s is None else s.depth
        return self.stamp[n.id] + self.weight(n) * gds_cost(a, n.depth, self.d, self.e)

    # ------------------------------------------------------------------- events
    def _tick(self) -> None:
        self.t += 1
        if self.learn:
            self._advance(self.t - self._t_last)
            self._t_last = self.t

    def on_set(self, node: TreeNode) -> None:
        self._tick()
        nid = node.id
        self.live[nid] = node
        self.stamp[nid] = self.watermark
        self.hits[nid] = 0
        self.seen[nid] = self.seen_bucket(node)
        self.below[nid] = sum(1 for _ in self._states_below(node))
        p = node.parent
        while p is not None:
            if p.id in self.live:
                self.below[p.id] += 1
                self._reclass(p)
            p = p.parent
        self._reclass(node)
        if self.ghosts and nid in self.ghost:
            c = self.ghost.pop(nid)
            if self.learn:  # a missed reuse: count it as a hit of the class it was evicted in
                self.c_hits[c] = self.c_hits.get(c, 0.0) + 1.0
        if self.admit and self.live:
            # expected value below the cheapest resident's: file it at the watermark
            cands = [m for m in self.live.values() if m is not node]
            if cands:
                lo = min(self.priority(m) for m in cands)
                if self.priority(node) < lo:
                    self.penalised.add(nid)

    @staticmethod
    def seen_bucket(node: TreeNode) -> int:
        """0 / 1 / 2: under 30 %, 30-90 %, at least 90 % of ``node``'s prefix was inserted by
        another request before (the deepest node on the path with ``hit_count >= 2``)."""
        n: TreeNode | None = node
        while n is not None and n.parent is not None and n.hit_count < 2:
            n = n.parent
        seen = 0 if n is None else n.depth
        r = seen / max(node.depth, 1)
        return 0 if r < 0.3 else 1 if r < 0.9 else 2

    def _states_below(self, node: TreeNode) -> Iterator[TreeNode]:
        return live_states_below(node, self.live)

    def on_hit(self, node: TreeNode) -> None:
        if self.learn:
            c = self.cls[node.id]
            self.c_hits[c] = self.c_hits.get(c, 0.0) + 1.0
        self.stamp[node.id] = self.watermark
        self.hits[node.id] += 1
        if self.below.get(node.id, 0) > 0:
            self.sup_hits[node.id] = self.sup_hits.get(node.id, 0) + 1
        self.penalised.discard(node.id)
        self._reclass(node)

    def on_use(self, node: TreeNode) -> None:
        self.stamp[node.id] = self.watermark

    def on_remove(self, node: TreeNode) -> None:
        nid = node.id
        if nid not in self.live:
            return
        if self.ghosts:
            self.ghost[nid] = self.cls.get(nid, ())
            while len(self.ghost) > 2 * max(len(self.live), 64):
                self.ghost.popitem(last=False)
        del self.live[nid]
        del self.stamp[nid], self.hits[nid], self.below[nid]
        self.sup_hits.pop(nid, None)
        self.seen.pop(nid, None)
        self.penalised.discard(nid)
        if self.learn:
            c = self.cls.pop(nid)
            self.c_n[c] -= 1
        p = node.parent
        while p is not None:
            if p.id in self.live:
                self.below[p.id] -= 1
                self._reclass(p)
            p = p.parent

    def requeue(self, node: TreeNode) -> None:
        """Nothing to do: the scan sees every live state."""

    def before_admit(self, index: int) -> None:
        # leaf status changes (a child appears) are not events: re-class lazily here
        if self.learn and "l" in self.classes:
            for n in self.live.values():
                self._reclass(n)

    def pop_victim(self) -> TreeNode | None:
        best, best_p = None, 0.0
        for n in self.live.values():
            if not self._ok(n):
                continue
            p = self.watermark - 1 if n.id in self.penalised else self.priority(n)
            if best is None or p < best_p:
                best, best_p = n, p
        if best is not None:
            self.watermark = max(self.watermark, best_p)
        return best

    def check(self, state_nodes: list[TreeNode]) -> None:
        assert {n.id for n in state_nodes} == set(self.live)




class AdaptiveWalk(IdeaWalk):
    """GDS + a superseded rule + reuse probability per seen-share bucket learned from KV-level
    outcomes (uncensored: a prefix counts as reused when another request inserts through
    its node within ``len(live)`` state sets, whether or not its state was still cached).

    ``superseded``: a state extended after its birth (a state was set below it) and not
    consumed since it had a state below: weight 0. ``freq``: weight x (1 + hits since
    superseded) for the others that have states below (hot shared prefixes).
    """

    def __init__(self, is_candidate: Callable[[TreeNode], bool], *, learn_r: bool = True,
                 sup_rule: str = "ext", freq_sup: bool = True, freq_all: bool = False,
                 memory: float = 2048.0, hazard: str = "", horizon: float = 1.0,
                 prior: float = 1.0) -> None:
        super().__init__(is_candidate, learn=bool(hazard), classes=hazard or "hsl")
        self.hazard = hazard
        self.horizon, self.prior = horizon, prior
        self.learn_r, self.sup_rule = learn_r, sup_rule
        self.freq_sup, self.freq_all = freq_sup, freq_all
        self.ext: dict[int, int] = {}
        self.pending: list[tuple[float, TreeNode, int, int]] = []
        self.p_head = 0
        self.n_b = [0.0, 0.0, 0.0]
        self.r_b = [0.0, 0.0, 0.0]
        self.keep = 1.0 - 1.0 / memory

    def weight(self, n: TreeNode) -> float:
        nid = n.id
        below = self.below.get(nid, 0) > 0
        sh = self.sup_hits.get(nid, 0)
        if below:
            sup = self.ext.get(nid, 0) > 0 if self.sup_rule == "ext" else self.sup_rule == "below"
            if sup and sh == 0:
                return 0.0
            if self.hazard:
                return self._hz(n)
            return (1.0 + sh) if self.freq_sup else 1.0
        w = (1.0 + self.hits.get(nid, 0)) if self.freq_all else 1.0
        if self.hazard == "sS+":
            w *= self._hz(n)
        if self.learn_r:
            tot_n, tot_r = sum(self.n_b), sum(self.r_b)
            mean = (tot_r + 1.0) / (tot_n + 2.0)
            b = self.seen[nid]
            w *= (self.r_b[b] + mean) / (self.n_b[b] + 1.0) / mean
        return w

    def _hz(self, n: TreeNode) -> float:
        tot = sum(self.c_hits.values()) + 1.0
        mean = tot / (sum(self.c_exp.values()) + 1.0)
        return self.rate(self.cls[n.id]) / mean

    def on_set(self, node: TreeNode) -> None:
        super().on_set(node)
        s = self.shallower(node)
        if s is not None:
            self.ext[s.id] = self.ext.get(s.id, 0) + 1
        self.ext[node.id] = 0
        if self.learn_r:
            self.pending.append((self.t, node, node.hit_count, self.seen[node.id]))
            horizon = max(len(self.live), 1) * self.horizon
            while self.p_head < len(self.pending) and self.t - self.pending[self.p_head][0] >= horizon:
                _, m, hc0, b = self.pending[self.p_head]
                self.p_head += 1
                for i in range(3):
                    self.n_b[i] *= self.keep
                    self.r_b[i] *= self.keep
                self.n_b[b] += 1.0
                self.r_b[b] += 1.0 if m.hit_count > hc0 else 0.0
            if self.p_head > 4096:
                del self.pending[: self.p_head]
                self.p_head = 0

    def on_remove(self, node: TreeNode) -> None:
        super().on_remove(node)
        self.ext.pop(node.id, None)



class AdaptiveWalk2(AdaptiveWalk):
    """Like :class:`AdaptiveWalk`, but the weight of a state with states below is learned:
    a hit rate per kind (``chain``: extended since birth, not hit since; ``hub0``: states
    below from birth, not hit since; ``hub1`` / ``hub2``: hit once / more while states were
    below), relative to the rate of states without states below (``leaf``)."""

    def __init__(self, is_candidate: Callable[[TreeNode], bool], **kw) -> None:
        super().__init__(is_candidate, hazard="k", **kw)

    def klass(self, n: TreeNode) -> tuple:
        nid = n.id
        if self.below.get(nid, 0) == 0:
            return ("leaf",)
        sh = self.sup_hits.get(nid, 0)
        if sh == 0:
            return ("chain",) if self.ext.get(nid, 0) > 0 else ("hub0",)
        return ("hub1",) if sh == 1 else ("hub2",)

    def weight(self, n: TreeNode) -> float:
        nid = n.id
        c = self.cls[nid]
        if c[0] == "leaf":
            w = 1.0
            if self.learn_r:
                tot_n, tot_r = sum(self.n_b), sum(self.r_b)
                mean = (tot_r + 1.0) / (tot_n + 2.0)
                b = self.seen[nid]
                w *= (self.r_b[b] + self.prior * mean) / (self.n_b[b] + self.prior) / mean
            return w
        return self.rate(c) / self.rate(("leaf",))

    def on_set(self, node: TreeNode) -> None:
        s = self.shallower(node)
        super().on_set(node)
        if s is not None:
            self._reclass(s)



class AdaptiveWalk3(AdaptiveWalk2):
    """:class:`AdaptiveWalk2` with hub weights ``1 + hits since states were below`` (GDSF)
    and the chain weight ``min(1, learned rate(chain) / rate(leaf))``."""

    def __init__(self, is_candidate: Callable[[TreeNode], bool], cap: float = 1.0, **kw) -> None:
        super().__init__(is_candidate, **kw)
        self.cap = cap

    def weight(self, n: TreeNode) -> float:
        c = self.cls[n.id]
        if c[0] == "leaf":
            return super().weight(n)
        if c[0] == "chain":
            return min(self.cap, self.rate(c) / self.rate(("leaf",)))
        return 1.0 + self.sup_hits.get(n.id, 0)



class AdaptiveWalk4(AdaptiveWalk3):
    """:class:`AdaptiveWalk3` with a binary chain weight: 0 while extended states are hit
    less often than leaves (learned), else 1. ``skip_chains``: a state's cost is counted
    from the nearest shallower state that is not a weight-0 chain (those go first)."""

    def __init__(self, is_candidate: Callable[[TreeNode], bool], skip_chains: bool = False,
                 leaf_scale: bool = False, **kw) -> None:
        super().__init__(is_candidate, **kw)
        self.skip_chains = skip_chains
        self.leaf_scale = leaf_scale

    def shallower(self, n: TreeNode) -> TreeNode | None:
        p = n.parent
        while p is not None and p.parent is not None:
            if p.state_slot is not None and not (
                    self.skip_chains and self.cls.get(p.id) == ("chain",)
                    and self.rate(("chain",)) < self.rate(("leaf",))):
                return p
            p = p.parent
        return None

    def weight(self, n: TreeNode) -> float:
        c = self.cls[n.id]
        if c[0] == "chain":
            return 0.0 if self.rate(c) < self.rate(("leaf",)) else 1.0
        w = super().weight(n)
        if self.leaf_scale and c == ("leaf",):
            overall = (sum(self.c_hits.values()) + 1.0) / (sum(self.c_exp.values()) + 1.0)
            w *= min(1.0, self.rate(("leaf",)) / overall)
        return w


#: name -> factory; figures for each (256 slots) in bench/README.md, "Beyond GDS".
IDEAS: dict[str, Callable[[Callable[[TreeNode], bool]], IdeaWalk]] = {
    # the scan re-implementation of gds (must equal the library's gds) and of gdsf
    "idea:gds": lambda ok: IdeaWalk(ok),
    "idea:gdsf": lambda ok: IdeaWalk(ok, freq=True),
    # cost from the root instead of from the nearest shallower state
    "idea:full": lambda ok: IdeaWalk(ok, full_cost=True),
    # path history: a state with a live state below (the conversation moved on) goes first
    "idea:sup0": lambda ok: IdeaWalk(ok, superseded=0.0),
    "idea:sup01": lambda ok: IdeaWalk(ok, superseded=0.1),
    #   ... unless it was hit while it had states below (a shared prefix)
    "idea:suph": lambda ok: IdeaWalk(ok, suph=True),
    # reuse rate learned online per class (hits so far, state below, leaf / hits below)
    "idea:learn_hsl": lambda ok: IdeaWalk(ok, learn=True),
    "idea:learn_sS": lambda ok: IdeaWalk(ok, learn=True, classes="sS"),
    "idea:learn_sS_h1k": lambda ok: IdeaWalk(ok, learn=True, classes="sS", half_life=1024),
    "idea:learn_sS_h16k": lambda ok: IdeaWalk(ok, learn=True, classes="sS", half_life=16384),
    #   ... plus ARC-like ghosts, admission control, the seen-share bucket as a class
    "idea:learn_sS_ghost": lambda ok: IdeaWalk(ok, learn=True, classes="sS", ghosts=True),
    "idea:learn_sS_admit": lambda ok: IdeaWalk(ok, learn=True, classes="sS", admit=True),
    "idea:learn_sSr": lambda ok: IdeaWalk(ok, learn=True, classes="sSr"),
    # superseded-first with fixed weights per seen-share bucket (is the signal worth it?)
    "idea:sup0_seen": lambda ok: IdeaWalk(ok, superseded=0.0, rw=(1.0, 2.0, 3.5)),
    # seen-share weights learned from KV-level outcomes; chains weight 0 / hubs 1 + hits
    "idea:ad": lambda ok: AdaptiveWalk(ok),
    "idea:ad_nosup": lambda ok: AdaptiveWalk(ok, sup_rule="none"),
    #   ... with the chain weight learned (0 while chains are hit less than leaves)
    "idea:ad4": lambda ok: AdaptiveWalk4(ok),
    #   ... with the library's constants (horizon 2 x live, prior 16): gds_adaptive, by scan
    "idea:ad4_h2p16": lambda ok: AdaptiveWalk4(ok, horizon=2.0, prior=16.0),
    "idea:ad4_leafscale": lambda ok: AdaptiveWalk4(ok, horizon=2.0, prior=16.0, leaf_scale=True),
    "idea:ad4_skip": lambda ok: AdaptiveWalk4(ok, horizon=2.0, prior=16.0, skip_chains=True),
}


def _idea(name: str) -> Baseline:
    make = IDEAS[name]
    return Baseline(name, lambda ctx: make)


for _name in IDEAS:
    register(_idea(_name))
