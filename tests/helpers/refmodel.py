"""A brute-force reference model of the prefix cache, sharing no code with the library.

The model is an *uncompressed* page trie (``tests/helpers/refmodel_tree.py``, shared with the SWA
model): one entry per cached page-aligned prefix ``(extra_key, tokens)``, a page marked
``boundary`` where the library would have a node end. Every question (longest cached prefix,
deepest state, evictable leaves, victims) is answered by scanning all pages.

Rules mirrored (the tree, the KV and state components, the policies of ``radix.policies``):

* matching and inserting walk whole pages; a walk that ends inside a node splits it there
  (both halves take the new stamp: the walk entered the node); every page passed is stamped
  with a logical clock that ticks once per match / insert;
* a hybrid match is usable only up to the deepest matched page holding a state, and only that
  state's stamps are refreshed; ``branching_seqlen`` is the KV hit when it exceeds that;
* KV eviction: unlocked childless nodes, least recent first; on a hybrid cache a removed leaf
  takes its state and every stateless, childless, unlocked ancestor with it;
* state eviction: candidates are unlocked states (a leaf's KV unlocked too); ``lru`` orders
  by the state's own stamp, ``joint`` by the node stamp, ``gds`` by
  ``stamp + cost(nearest shallower state, position)`` (ties resolved by the caller);
  an internal node keeps its KV, a leaf leaves whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tests.helpers.refmodel_tree import EvictOut, InsertOut, MatchOut, PageTrie, Prefix, pick_tied
from tests.helpers.refmodel_tree import Page as TreePage

__all__ = ["EvictOut", "InsertOut", "MatchOut", "Page", "Prefix", "RefCache", "cost"]


def cost(a: int, b: int, d: float, e: float) -> float:
    """GreedyDual-Size rebuild cost from position ``a`` to ``b`` (written out independently)."""
    return d * (b - a) + e * (b * b - a * a) / 200000.0


@dataclass
class Page(TreePage):
    stamp: float = 0.0  # the GDS watermark when the state was last touched


class RefCache(PageTrie[Page]):
    """The whole cache as a dict of pages.

    Args:
        page_size: tokens per page.
        hybrid: whether nodes carry recurrent states.
        state_walk: ``"lru"``, ``"joint"`` or ``"gds"``.
        d, e: GDS cost coefficients.
    """

    def __init__(
        self, page_size: int, hybrid: bool, state_walk: str = "lru", d: float = 1.0, e: float = 0.0
    ) -> None:
        super().__init__(page_size, hybrid)
        self.state_walk = state_walk
        self.d = d
        self.e = e
        self.watermark = 0.0

    # ------------------------------------------------------------------ structure
    def view(self) -> dict[Prefix, tuple[list[int], int | None, int, int]]:
        """Node end -> (the node's slots, state, KV lock, state lock)."""
        out = {}
        for end in self.node_ends():
            pg = self.pages[end]
            out[end] = (self.node_slots(end), pg.state, pg.lock, pg.state_lock if self.hybrid else 0)
        return out

    def sizes(self) -> tuple[int, int, int, int]:
        """(KV evictable, KV protected) tokens and (state evictable, state protected) slots."""
        ev = sum(self.ps for pg in self.pages.values() if pg.lock == 0)
        pr = sum(self.ps for pg in self.pages.values() if pg.lock > 0)
        sev = sum(1 for pg in self.pages.values() if pg.state is not None and pg.state_lock == 0)
        spr = sum(1 for pg in self.pages.values() if pg.state is not None and pg.state_lock > 0)
        return ev, pr, sev, spr

    def check(self) -> None:
        """The model's own consistency: non-boundary pages have exactly one child."""
        for p, pg in self.pages.items():
            par = self.parent(p)
            assert par is None or par in self.pages, p
            if not pg.boundary:
                assert len(self.children(p)) == 1, p
            if pg.state is not None:
                assert pg.boundary, p

    # ------------------------------------------------------------------ operations
    def match(self, key: list[int], extra: object = None) -> MatchOut:
        k, _ = self._walk(key, extra)
        now = self._tick()
        self._stamp_walk(key, extra, k, now)
        usable = k
        if self.hybrid:
            while usable > 0 and self.pages[(extra, tuple(key[:usable]))].state is None:
                usable -= self.ps
        node = (extra, tuple(key[:usable])) if usable else None
        slot = None
        if self.hybrid and node is not None:
            pg = self.pages[node]
            pg.state_t = now
            pg.stamp = self.watermark
            slot = pg.state
        idx = self._slots_to(key, extra, usable)
        branching = k if self.hybrid and k > usable else None
        return MatchOut(usable, k, idx, slot, branching, node)

    def insert(
        self, key: list[int], value: list[int], extra: object = None, state_slot: int | None = None
    ) -> InsertOut:
        assert len(value) == len(key)
        k, end = self._walk(key, extra)
        assert not (self.hybrid and k < end and state_slot is None), "the library refuses this"
        now = self._tick()
        self._stamp_walk(key, extra, k, now)
        tree = self._slots_to(key, extra, k)
        dup = [v for v, t in zip(value[:k], tree, strict=True) if v != t]
        for j in range(k + self.ps, end + 1, self.ps):
            self.pages[(extra, tuple(key[:j]))] = Page(list(value[j - self.ps : j]), now)
        node = (extra, tuple(key[:end])) if end else None
        if node is not None:
            self.pages[node].boundary = True
        adopted = False
        if state_slot is not None and self.hybrid and node is not None and self.pages[node].state is None:
            pg = self.pages[node]
            pg.state, pg.state_t, pg.stamp = state_slot, now, self.watermark
            adopted = True
        return InsertOut(k, end, dup, list(value[k:end]), list(value[end:]), adopted, node)

    def lock(self, node: Prefix | None) -> None:
        if node is None:
            return
        for p in self.path(node):
            self.pages[p].lock += 1
        if self.hybrid:
            self.pages[node].state_lock += 1

    def unlock(self, node: Prefix | None) -> EvictOut:
        out = EvictOut()
        if node is None:
            return out
        for p in self.path(node):
            self.pages[p].lock -= 1
            assert self.pages[p].lock >= 0
        if self.hybrid:
            pg = self.pages[node]
            pg.state_lock -= 1
            if pg.state_lock == 0 and pg.state is not None:
                pg.stamp = self.watermark
            if not self.has_children(node) and pg.state is None and pg.lock == 0:
                self._remove_leaf(node, out)
        return out

    def _parent_goes(self, par: Prefix) -> bool:
        """On a hybrid cache a removed leaf takes every stateless, childless, unlocked
        ancestor with it; a KV-only cache keeps them (they are leaves of their own)."""
        ppg = self.pages[par]
        return self.hybrid and not self.has_children(par) and ppg.state is None and ppg.lock == 0

    def nearest_shallower(self, p: Prefix) -> int:
        q = self.parent(p)
        while q is not None:
            if self.pages[q].state is not None:
                return len(q[1])
            q = self.parent(q)
        return 0

    def true_priority(self, p: Prefix) -> float:
        return self.pages[p].stamp + cost(self.nearest_shallower(p), len(p[1]), self.d, self.e)

    def evict_states(
        self, num_states: int, choose: Callable[[list[Prefix]], Prefix] | None = None
    ) -> EvictOut:
        """Evict states; ``choose`` picks among tied minimal victims (default: none may tie)."""
        out = EvictOut()
        while out.num_states < num_states:
            cands = self.state_candidates()
            if not cands:
                break
            if self.state_walk == "gds":
                prio = {p: self.true_priority(p) for p in cands}
                best = min(prio.values())
                tied = [p for p in cands if prio[p] <= best + 1e-9]
            else:
                field_ = "t" if self.state_walk == "joint" else "state_t"
                best_t = min(getattr(self.pages[p], field_) for p in cands)
                tied = [p for p in cands if getattr(self.pages[p], field_) == best_t]
            victim = pick_tied(tied, choose, "state")
            if self.state_walk == "gds":
                self.watermark = max(self.watermark, prio[victim])
            if self.has_children(victim):
                self._drop_state(victim, out)
            else:
                self._remove_leaf(victim, out)
        return out

    def reset(self) -> EvictOut:
        out = EvictOut()
        for pg in self.pages.values():
            out.freed_slots.extend(pg.slots)
            if pg.state is not None:
                out.freed_states.append(pg.state)
        self.pages.clear()
        self.watermark = 0.0
        return out
