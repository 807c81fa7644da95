"""A brute-force reference model of the prefix cache, sharing no code with the library.

The model is an *uncompressed* page trie: one entry per cached page-aligned prefix
``(extra_key, tokens)``. Where the library would have a node end (the end of an inserted key,
a split point, a branch point) the page is marked ``boundary``; a library node is the run of
pages from just after the previous boundary down to a boundary page. Every question (longest
cached prefix, deepest state, evictable leaves, victims) is answered by scanning all pages.

Rules mirrored (SPEC 1, 2.1, 2.3; POLICIES.md):

* matching and inserting walk whole pages; a walk that ends inside a node splits it there
  (both halves take the new stamp: the walk entered the node); every page passed is stamped with a logical clock that ticks once per match / insert;
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
from dataclasses import dataclass, field

Prefix = tuple  # (extra_key, tuple of token ids)


def cost(a: int, b: int, d: float, e: float) -> float:
    """GreedyDual-Size rebuild cost from position ``a`` to ``b`` (written out independently)."""
    return d * (b - a) + e * (b * b - a * a) / 200000.0


@dataclass
class Page:
    slots: list[int]
    t: int
    boundary: bool = False
    lock: int = 0
    state: int | None = None
    state_lock: int = 0
    state_t: int = 0
    stamp: float = 0.0


@dataclass
class MatchOut:
    prefix_len: int
    kv_hit_length: int
    device_indices: list[int]
    state_slot: int | None
    branching_seqlen: int | None
    node: Prefix | None  # boundary prefix at prefix_len, None for the root


@dataclass
class InsertOut:
    prefix_len: int
    inserted_len: int
    duplicate_indices: list[int]
    adopted_indices: list[int]
    remainder_indices: list[int]
    state_adopted: bool
    node: Prefix | None


@dataclass
class EvictOut:
    num_tokens: int = 0
    num_states: int = 0
    freed_slots: list[int] = field(default_factory=list)
    freed_states: list[int] = field(default_factory=list)


class RefCache:
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
        self.ps = page_size
        self.hybrid = hybrid
        self.state_walk = state_walk
        self.d = d
        self.e = e
        self.pages: dict[Prefix, Page] = {}
        self.clock = 0
        self.watermark = 0.0

    # ------------------------------------------------------------------ structure
    def parent(self, p: Prefix) -> Prefix | None:
        extra, toks = p
        return None if len(toks) == self.ps else (extra, toks[: -self.ps])

    def children(self, p: Prefix) -> list[Prefix]:
        extra, toks = p
        n = len(toks) + self.ps
        return [q for q in self.pages if q[0] == extra and len(q[1]) == n and q[1][: len(toks)] == toks]

    def has_children(self, p: Prefix) -> bool:
        extra, toks = p
        n = len(toks) + self.ps
        return any(q[0] == extra and len(q[1]) == n and q[1][: len(toks)] == toks for q in self.pages)

    def segment(self, end: Prefix) -> list[Prefix]:
        """Pages of the node ending at boundary ``end``, deepest first."""
        out = [end]
        p = self.parent(end)
        while p is not None and not self.pages[p].boundary:
            out.append(p)
            p = self.parent(p)
        return out

    def node_ends(self) -> list[Prefix]:
        return [p for p, pg in self.pages.items() if pg.boundary]

    def path(self, p: Prefix) -> list[Prefix]:
        """Pages from the first one down to ``p``."""
        out = []
        q: Prefix | None = p
        while q is not None:
            out.append(q)
            q = self.parent(q)
        return out[::-1]

    def held_slots(self) -> list[int]:
        return [s for pg in self.pages.values() for s in pg.slots]

    def held_states(self) -> list[int]:
        return [pg.state for pg in self.pages.values() if pg.state is not None]

    def view(self) -> dict[Prefix, tuple[list[int], int | None, int, int]]:
        """Node end -> (the node's slots, state, KV lock, state lock)."""
        out = {}
        for end in self.node_ends():
            seg = self.segment(end)[::-1]
            slots = [s for p in seg for s in self.pages[p].slots]
            pg = self.pages[end]
            out[end] = (slots, pg.state, pg.lock, pg.state_lock if self.hybrid else 0)
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
    def _walk(self, key: list[int], extra: object) -> tuple[int, int]:
        """(cached whole-page prefix length, key length cut to whole pages)."""
        end = len(key) - len(key) % self.ps
        k = 0
        while k < end and (extra, tuple(key[: k + self.ps])) in self.pages:
            k += self.ps
        return k, end

    def _split(self, key: list[int], k: int, extra: object, now: int) -> None:
        """A walk ending at ``k`` inside a node splits it there. The walk entered that node, so
        both halves carry the new stamp (SGLang stamps the node before splitting it)."""
        if k == 0:
            return
        p = (extra, tuple(key[:k]))
        if self.pages[p].boundary:
            return
        end = p
        while not self.pages[end].boundary:
            (end,) = self.children(end)
        for q in self.segment(end):
            self.pages[q].t = now
        self.pages[p].boundary = True

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, key: list[int], extra: object = None) -> MatchOut:
        k, _ = self._walk(key, extra)
        now = self._tick()
        self._split(key, k, extra, now)
        for j in range(self.ps, k + 1, self.ps):
            self.pages[(extra, tuple(key[:j]))].t = now
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
        idx = [s for j in range(self.ps, usable + 1, self.ps) for s in self.pages[(extra, tuple(key[:j]))].slots]
        branching = k if self.hybrid and k > usable else None
        return MatchOut(usable, k, idx, slot, branching, node)

    def insert(
        self, key: list[int], value: list[int], extra: object = None, state_slot: int | None = None
    ) -> InsertOut:
        assert len(value) == len(key)
        k, end = self._walk(key, extra)
        assert not (self.hybrid and k < end and state_slot is None), "the library refuses this"
        now = self._tick()
        self._split(key, k, extra, now)
        tree = []
        for j in range(self.ps, k + 1, self.ps):
            pg = self.pages[(extra, tuple(key[:j]))]
            pg.t = now
            tree.extend(pg.slots)
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

    def _remove_leaf(self, end: Prefix, out: EvictOut) -> None:
        while True:
            seg = self.segment(end)
            top = seg[-1]
            pg = self.pages[end]
            if pg.state is not None:
                out.num_states += 1
                out.freed_states.append(pg.state)
            for p in reversed(seg):  # the node's slots in position order
                out.num_tokens += self.ps
                out.freed_slots.extend(self.pages.pop(p).slots)
            par = self.parent(top)
            if par is None:
                return
            ppg = self.pages[par]
            if self.hybrid and not self.has_children(par) and ppg.state is None and ppg.lock == 0:
                end = par
                continue
            return

    def kv_leaves(self) -> list[Prefix]:
        return [p for p in self.node_ends() if self.pages[p].lock == 0 and not self.has_children(p)]

    def node_slots(self, end: Prefix) -> list[int]:
        return [x for p in reversed(self.segment(end)) for x in self.pages[p].slots]

    def evict(
        self, num_tokens: int, choose: Callable[[list[Prefix], EvictOut], Prefix] | None = None
    ) -> EvictOut:
        """Evict KV leaves, least recent first; ``choose(tied, out_so_far)`` picks among leaves
        with the same stamp (one walk stamps both halves of a node it splits)."""
        out = EvictOut()
        while out.num_tokens < num_tokens:
            leaves = self.kv_leaves()
            if not leaves:
                break
            best = min(self.pages[p].t for p in leaves)
            tied = [p for p in leaves if self.pages[p].t == best]
            if len(tied) == 1:
                victim = tied[0]
            else:
                assert choose is not None, f"model: tied LRU leaves {tied}"
                victim = choose(tied, out)
                assert victim in tied, f"{victim} is not one of the least recent leaves {tied}"
            self._remove_leaf(victim, out)
        return out

    def state_candidates(self) -> list[Prefix]:
        return [
            p
            for p in self.node_ends()
            if self.pages[p].state is not None
            and self.pages[p].state_lock == 0
            and (self.has_children(p) or self.pages[p].lock == 0)
        ]

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
            if len(tied) == 1:
                victim = tied[0]
            else:
                assert choose is not None, f"model: tied state victims {tied}"
                victim = choose(tied)
                assert victim in tied, f"{victim} is not one of the minimal states {tied}"
            if self.state_walk == "gds":
                self.watermark = max(self.watermark, prio[victim])
            if self.has_children(victim):
                pg = self.pages[victim]
                out.num_states += 1
                out.freed_states.append(pg.state)  # type: ignore[arg-type]
                pg.state = None
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
