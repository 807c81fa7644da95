"""A brute-force reference model of the prefix cache with a sliding-window (SWA) component.

The page trie of ``tests/helpers/refmodel_tree.py`` (shared with ``tests/helpers/refmodel.py``), extended for
SWA; it shares no code with the library. One entry per cached page-aligned prefix
``(extra_key, tokens)``; a page marked ``boundary`` ends a library node (the end of an inserted
key, a split point, a branch point, the live/tombstone border of an insert, a revival split).
Every question is answered by scanning the pages.

Rules mirrored (the tree, the sliding-window and state components; the docstrings of
components/swa.py and radix/cache.py):

* one logical clock, ticking once per match / insert; a walk stamps every page it passes, and
  a walk ending inside a node splits it there (both halves take the new stamp);
* SWA liveness is per page (``tomb``); the model also knows which full slots have had their
  SWA side released (``dead``), by the tree or by a caller (``free_swa``);
* usable end (brute force over tokens): a node end ``e`` on the matched path whose ``W``
  tokens before it are all live, or whose whole path ``[0, e)`` is live; with states, it also
  needs a state at ``e``. ``swa_miss`` = deepest end allowed by the state rule alone (the KV hit
  without states) minus the usable end;
* window-bounded locks: from the locked node up, whole nodes, while fewer than ``W`` tokens are
  covered and the node is live; the start of the topmost locked node is returned; the unlock
  releases the pages above that start;
* ``evict_swa``: live nodes, not SWA-locked, internal or KV-unlocked, least recent first; an
  internal node becomes a tombstone, a leaf leaves whole;
* removing a leaf takes every ancestor left childless, KV-unlocked and dead (a tombstone, or
  stateless on a hybrid cache);
* insert over a tombstone not KV-locked, where none of the caller's slots equals the tree's and
  the caller's slots are live from page ``t`` on: split at ``t``, ``[t, end)`` takes the caller's
  slots (revived), the old full slots are freed; new tokens before the caller's last released
  slot (page-rounded) become one tombstone node above one live leaf; no live new token at all:
  nothing is added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tests.helpers.refmodel_tree import EvictOut as TreeEvictOut
from tests.helpers.refmodel_tree import InsertOut as TreeInsertOut
from tests.helpers.refmodel_tree import MatchOut as TreeMatchOut
from tests.helpers.refmodel_tree import Page as TreePage
from tests.helpers.refmodel_tree import PageTrie, Prefix, pick_tied

__all__ = ["EvictOut", "InsertOut", "MatchOut", "Page", "Prefix", "SWARefCache"]


@dataclass
class Page(TreePage):
    tomb: bool = False
    swa_lock: int = 0


@dataclass
class MatchOut(TreeMatchOut):
    swa_miss_tokens: int


@dataclass
class InsertOut(TreeInsertOut):
    revived_indices: list[int]
    freed_old: list[int]  # full slots the tree freed when it revived a tombstone


@dataclass
class EvictOut(TreeEvictOut):
    num_swa_tokens: int = 0
    freed_swa: list[int] = field(default_factory=list)  # full ids whose SWA side went, in order


class SWARefCache(PageTrie[Page]):
    """The whole cache as a dict of pages.

    Args:
        page_size: tokens per page.
        window: ``sliding_window_size``.
        hybrid: whether nodes carry recurrent states (state eviction: LRU on the state stamp).
    """

    def __init__(self, page_size: int, window: int, hybrid: bool) -> None:
        super().__init__(page_size, hybrid)
        self.w = window
        self.dead: set[int] = set()

    # ------------------------------------------------------------------ structure
    def node_slots_path(self, end: Prefix | None) -> list[int]:
        """Slots of every page from the root down to ``end`` (none for the root)."""
        return [] if end is None else [x for p in self.path(end) for x in self.pages[p].slots]

    def view(self) -> dict[Prefix, tuple]:
        """Node end -> (slots, state, KV lock, state lock, tombstone, SWA lock)."""
        out = {}
        for end in self.node_ends():
            pg = self.pages[end]
            out[end] = (self.node_slots(end), pg.state, pg.lock,
                        pg.state_lock if self.hybrid else 0, pg.tomb, pg.swa_lock)
        return out

    def sizes(self) -> tuple[int, ...]:
        """KV (evictable, protected), SWA (evictable, protected) tokens; states likewise."""
        pgs = self.pages.values()
        ps = self.ps
        return (
            sum(ps for pg in pgs if pg.lock == 0),
            sum(ps for pg in pgs if pg.lock > 0),
            sum(ps for pg in pgs if not pg.tomb and pg.swa_lock == 0),
            sum(ps for pg in pgs if not pg.tomb and pg.swa_lock > 0),
            sum(1 for pg in pgs if pg.state is not None and pg.state_lock == 0),
            sum(1 for pg in pgs if pg.state is not None and pg.state_lock > 0),
        )

    def check(self) -> None:
        """The model's own consistency: one value per node for the per-node fields."""
        for p, pg in self.pages.items():
            par = self.parent(p)
            assert par is None or par in self.pages, p
            if not pg.boundary:
                (child,) = self.children(p)
                c = self.pages[child]
                assert (c.tomb, c.swa_lock, c.lock) == (pg.tomb, pg.swa_lock, pg.lock), p
                assert pg.state is None, p
            if pg.tomb:
                assert pg.swa_lock == 0 and self.dead.issuperset(pg.slots), p
            else:
                assert self.dead.isdisjoint(pg.slots), p

    # ------------------------------------------------------------------ caller's slots
    def free_swa(self, slots: list[int]) -> None:
        """The caller released the SWA side of its own slots."""
        self.dead.update(slots)

    def freed(self, slots: list[int]) -> None:
        """The caller freed slots (both sides)."""
        self.dead.difference_update(slots)

    # ------------------------------------------------------------------ helpers
    def _ends_on(self, key: list[int], extra: object, k: int) -> list[int]:
        return [j for j in range(self.ps, k + 1, self.ps)
                if self.pages[(extra, tuple(key[:j]))].boundary]

    def _swa_ok(self, key: list[int], extra: object, e: int) -> bool:
        """Brute force, token by token: the W tokens before ``e`` live, or all of [0, e)."""
        live = [not self.pages[(extra, tuple(key[: (i // self.ps + 1) * self.ps]))].tomb
                for i in range(e)]
        return all(live) or all(live[max(0, e - self.w):])

    def _live_from(self, value: list[int], lo: int, hi: int) -> int:
        dead = [i for i in range(lo, hi) if value[i] in self.dead]
        if not dead:
            return lo
        t = dead[-1] + 1
        return min(hi, -(-t // self.ps) * self.ps)

    def _dead_leaf(self, p: Prefix) -> bool:
        pg = self.pages[p]
        return (not self.has_children(p) and pg.lock == 0
                and (pg.tomb or (self.hybrid and pg.state is None)))

    # ------------------------------------------------------------------ operations
    def match(self, key: list[int], extra: object = None) -> MatchOut:
        k, _ = self._walk(key, extra)
        now = self._tick()
        self._stamp_walk(key, extra, k, now)
        ends = self._ends_on(key, extra, k)

        def has_state(e: int) -> bool:
            return not self.hybrid or self.pages[(extra, tuple(key[:e]))].state is not None

        state_ok = max([e for e in ends if has_state(e)], default=0)
        usable = max([e for e in ends if has_state(e) and self._swa_ok(key, extra, e)], default=0)
        node = (extra, tuple(key[:usable])) if usable else None
        slot = None
        if self.hybrid and node is not None:
            pg = self.pages[node]
            pg.state_t = now
            slot = pg.state
        idx = self._slots_to(key, extra, usable)
        branching = k if self.hybrid and k > usable else None
        return MatchOut(usable, k, idx, slot, branching, node, swa_miss_tokens=state_ok - usable)

    def _revive(self, key: list[int], value: list[int], extra: object, k: int,
                revived: list[int], freed_old: list[int]) -> None:
        lo = 0
        for hi in self._ends_on(key, extra, k):
            end = (extra, tuple(key[:hi]))
            pg = self.pages[end]
            node_lo = lo
            lo = hi
            if not pg.tomb or pg.lock > 0:
                continue
            tree = self.node_slots(end)
            if any(a == b for a, b in zip(value[node_lo:hi], tree, strict=True)):
                continue
            t = self._live_from(value, node_lo, hi)
            if t >= hi:
                continue
            if t > node_lo:
                self._split_at((extra, tuple(key[:t])), None)
            for j in range(t + self.ps, hi + 1, self.ps):
                p = self.pages[(extra, tuple(key[:j]))]
                freed_old.extend(p.slots)
                self.dead.difference_update(p.slots)
                p.slots = list(value[j - self.ps: j])
                p.tomb = False
            revived.extend(value[t:hi])

    def insert(self, key: list[int], value: list[int], extra: object = None,
               state_slot: int | None = None) -> InsertOut:
        assert len(value) == len(key)
        k, end = self._walk(key, extra)
        assert not (self.hybrid and k < end and state_slot is None), "the library refuses this"
        now = self._tick()
        self._stamp_walk(key, extra, k, now)  # stamps only: the revival below reads none
        revived: list[int] = []
        freed_old: list[int] = []
        self._revive(key, value, extra, k, revived, freed_old)
        tree = self._slots_to(key, extra, k)
        dup = [v for v, t in zip(value[:k], tree, strict=True) if v != t]
        inserted = end
        if k < end:
            live_from = self._live_from(value, k, end)
            if live_from >= end:
                inserted = k
            else:
                for j in range(k + self.ps, end + 1, self.ps):
                    self.pages[(extra, tuple(key[:j]))] = Page(
                        list(value[j - self.ps: j]), now, tomb=j <= live_from)
                if live_from > k:
                    self.pages[(extra, tuple(key[:live_from]))].boundary = True
                self.pages[(extra, tuple(key[:end]))].boundary = True
        node = (extra, tuple(key[:inserted])) if inserted else None
        adopted = False
        if (state_slot is not None and self.hybrid and inserted == end and node is not None
                and self.pages[node].state is None):
            pg = self.pages[node]
            pg.state, pg.state_t = state_slot, now
            adopted = True
        return InsertOut(k, inserted, dup, list(value[k:inserted]), list(value[inserted:]),
                         adopted, node, revived_indices=revived, freed_old=freed_old)

    def lock(self, node: Prefix | None) -> int | None:
        if node is None:
            return None
        for p in self.path(node):
            self.pages[p].lock += 1
        if self.hybrid:
            self.pages[node].state_lock += 1
        start = len(node[1])
        covered = 0
        n: Prefix | None = node
        while n is not None and covered < self.w and not self.pages[n].tomb:
            seg = self.segment(n)
            for p in seg:
                self.pages[p].swa_lock += 1
            covered += len(seg) * self.ps
            start = len(seg[-1][1]) - self.ps
            n = self.parent(seg[-1])
        return start

    def unlock(self, node: Prefix | None, start: int | None) -> EvictOut:
        out = EvictOut()
        if node is None:
            return out
        assert start is not None
        for p in self.path(node):
            pg = self.pages[p]
            pg.lock -= 1
            assert pg.lock >= 0
            if len(p[1]) > start:
                pg.swa_lock -= 1
                assert pg.swa_lock >= 0
        if self.hybrid:
            self.pages[node].state_lock -= 1
        if self._dead_leaf(node):
            self._remove_leaf(node, out)
        return out

    def _new_out(self) -> EvictOut:
        """Eviction records here count the SWA side too."""
        return EvictOut()

    def _free_page(self, page: Page, out: TreeEvictOut) -> None:
        super()._free_page(page, out)
        assert isinstance(out, EvictOut)
        if not page.tomb:
            out.num_swa_tokens += self.ps
            out.freed_swa.extend(page.slots)
        self.dead.difference_update(page.slots)

    def _parent_goes(self, par: Prefix) -> bool:
        return self._dead_leaf(par)

    def evict_swa(self, num_tokens: int, choose: Callable | None = None) -> EvictOut:
        out = EvictOut()
        while out.num_swa_tokens < num_tokens:
            cands = [p for p in self.node_ends()
                     if not self.pages[p].tomb and self.pages[p].swa_lock == 0
                     and (self.has_children(p) or self.pages[p].lock == 0)]
            if not cands:
                break
            best = min(self.pages[p].t for p in cands)
            tied = [p for p in cands if self.pages[p].t == best]
            victim = pick_tied(tied, choose, "SWA", out)
            if not self.has_children(victim):
                self._remove_leaf(victim, out)
                continue
            for p in reversed(self.segment(victim)):
                pg = self.pages[p]
                pg.tomb = True
                self.dead.update(pg.slots)
                out.num_swa_tokens += self.ps
                out.freed_swa.extend(pg.slots)
        return out

    def evict_states(self, num_states: int, choose: Callable | None = None) -> EvictOut:
        out = EvictOut()
        while out.num_states < num_states:
            cands = self.state_candidates()
            if not cands:
                break
            best = min(self.pages[p].state_t for p in cands)
            tied = [p for p in cands if self.pages[p].state_t == best]
            victim = pick_tied(tied, choose, "state", out)
            if self.has_children(victim):
                self._drop_state(victim, out)
            else:
                self._remove_leaf(victim, out)
        return out

    def reset(self) -> None:
        for pg in self.pages.values():
            self.dead.difference_update(pg.slots)
        self.pages.clear()
