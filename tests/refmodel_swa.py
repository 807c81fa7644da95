"""A brute-force reference model of the prefix cache with a sliding-window (SWA) component.

A copy of the page-trie idea of ``tests/refmodel.py``, extended for SWA; it shares no code with
the library (nor with refmodel.py). One entry per cached page-aligned prefix
``(extra_key, tokens)``; a page marked ``boundary`` ends a library node (the end of an inserted
key, a split point, a branch point, the live/tombstone border of an insert, a revival split).
Every question is answered by scanning the pages.

Rules mirrored (SPEC 1, 2.2, 2.3; the docstrings of components/swa.py and radix/cache.py):

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

Prefix = tuple  # (extra_key, tuple of token ids)


@dataclass
class Page:
    slots: list[int]
    t: int
    boundary: bool = False
    lock: int = 0
    tomb: bool = False
    swa_lock: int = 0
    state: int | None = None
    state_lock: int = 0
    state_t: int = 0


@dataclass
class MatchOut:
    prefix_len: int
    kv_hit_length: int
    device_indices: list[int]
    state_slot: int | None
    branching_seqlen: int | None
    swa_miss_tokens: int
    node: Prefix | None


@dataclass
class InsertOut:
    prefix_len: int
    inserted_len: int
    duplicate_indices: list[int]
    adopted_indices: list[int]
    remainder_indices: list[int]
    revived_indices: list[int]
    freed_old: list[int]  # full slots the tree freed when it revived a tombstone
    state_adopted: bool
    node: Prefix | None


@dataclass
class EvictOut:
    num_tokens: int = 0
    num_states: int = 0
    num_swa_tokens: int = 0
    freed_slots: list[int] = field(default_factory=list)  # full side, in the order freed
    freed_swa: list[int] = field(default_factory=list)  # full ids whose SWA side went, in order
    freed_states: list[int] = field(default_factory=list)


class SWARefCache:
    """The whole cache as a dict of pages.

    Args:
        page_size: tokens per page.
        window: ``sliding_window_size``.
        hybrid: whether nodes carry recurrent states (state eviction: LRU on the state stamp).
    """

    def __init__(self, page_size: int, window: int, hybrid: bool) -> None:
        self.ps = page_size
        self.w = window
        self.hybrid = hybrid
        self.pages: dict[Prefix, Page] = {}
        self.dead: set[int] = set()
        self.clock = 0

    # ------------------------------------------------------------------ structure
    def parent(self, p: Prefix) -> Prefix | None:
        extra, toks = p
        return None if len(toks) == self.ps else (extra, toks[: -self.ps])

    def has_children(self, p: Prefix) -> bool:
        extra, toks = p
        n = len(toks) + self.ps
        return any(q[0] == extra and len(q[1]) == n and q[1][: len(toks)] == toks for q in self.pages)

    def children(self, p: Prefix) -> list[Prefix]:
        extra, toks = p
        n = len(toks) + self.ps
        return [q for q in self.pages if q[0] == extra and len(q[1]) == n and q[1][: len(toks)] == toks]

    def segment(self, end: Prefix) -> list[Prefix]:
        """Pages of the node ending at boundary ``end``, deepest first."""
        out = [end]
        p = self.parent(end)
        while p is not None and not self.pages[p].boundary:
            out.append(p)
            p = self.parent(p)
        return out

    def path(self, p: Prefix) -> list[Prefix]:
        out = []
        q: Prefix | None = p
        while q is not None:
            out.append(q)
            q = self.parent(q)
        return out[::-1]

    def node_ends(self) -> list[Prefix]:
        return [p for p, pg in self.pages.items() if pg.boundary]

    def node_slots(self, end: Prefix) -> list[int]:
        return [x for p in reversed(self.segment(end)) for x in self.pages[p].slots]

    def node_slots_path(self, end: Prefix | None) -> list[int]:
        """Slots of every page from the root down to ``end`` (none for the root)."""
        return [] if end is None else [x for p in self.path(end) for x in self.pages[p].slots]

    def held_slots(self) -> list[int]:
        return [s for pg in self.pages.values() for s in pg.slots]

    def held_states(self) -> list[int]:
        return [pg.state for pg in self.pages.values() if pg.state is not None]

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
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _walk(self, key: list[int], extra: object) -> tuple[int, int]:
        end = len(key) - len(key) % self.ps
        k = 0
        while k < end and (extra, tuple(key[: k + self.ps])) in self.pages:
            k += self.ps
        return k, end

    def _split_at(self, p: Prefix, now: int | None) -> None:
        """Make ``p`` a node end; a walk that split the node stamps both halves ``now``."""
        if self.pages[p].boundary:
            return
        end = p
        while not self.pages[end].boundary:
            (end,) = self.children(end)
        if now is not None:
            for q in self.segment(end):
                self.pages[q].t = now
        self.pages[p].boundary = True

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
        if k:
            self._split_at((extra, tuple(key[:k])), now)
        for j in range(self.ps, k + 1, self.ps):
            self.pages[(extra, tuple(key[:j]))].t = now
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
        idx = [s for j in range(self.ps, usable + 1, self.ps)
               for s in self.pages[(extra, tuple(key[:j]))].slots]
        branching = k if self.hybrid and k > usable else None
        return MatchOut(usable, k, idx, slot, branching, state_ok - usable, node)

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
        if k:
            self._split_at((extra, tuple(key[:k])), now)
        revived: list[int] = []
        freed_old: list[int] = []
        self._revive(key, value, extra, k, revived, freed_old)
        tree = []
        for j in range(self.ps, k + 1, self.ps):
            pg = self.pages[(extra, tuple(key[:j]))]
            pg.t = now
            tree.extend(pg.slots)
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
                         revived, freed_old, adopted, node)

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

    def _remove_leaf(self, end: Prefix, out: EvictOut) -> None:
        while True:
            seg = self.segment(end)
            top = seg[-1]
            pg = self.pages[end]
            if pg.state is not None:
                out.num_states += 1
                out.freed_states.append(pg.state)
            for p in reversed(seg):
                page = self.pages.pop(p)
                out.num_tokens += self.ps
                out.freed_slots.extend(page.slots)
                if not page.tomb:
                    out.num_swa_tokens += self.ps
                    out.freed_swa.extend(page.slots)
                self.dead.difference_update(page.slots)
            par = self.parent(top)
            if par is None or not self._dead_leaf(par):
                return
            end = par

    @staticmethod
    def _pick(tied: list[Prefix], out: EvictOut, choose: Callable | None, what: str) -> Prefix:
        if len(tied) == 1:
            return tied[0]
        assert choose is not None, f"model: tied {what} victims {tied}"
        victim = choose(tied, out)
        assert victim in tied, f"{victim} is not one of the least recent {what} victims {tied}"
        return victim

    def evict(self, num_tokens: int, choose: Callable | None = None) -> EvictOut:
        out = EvictOut()
        while out.num_tokens < num_tokens:
            leaves = [p for p in self.node_ends()
                      if self.pages[p].lock == 0 and not self.has_children(p)]
            if not leaves:
                break
            best = min(self.pages[p].t for p in leaves)
            tied = [p for p in leaves if self.pages[p].t == best]
            self._remove_leaf(self._pick(tied, out, choose, "KV"), out)
        return out

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
            victim = self._pick(tied, out, choose, "SWA")
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
            cands = [p for p in self.node_ends()
                     if self.pages[p].state is not None and self.pages[p].state_lock == 0
                     and (self.has_children(p) or self.pages[p].lock == 0)]
            if not cands:
                break
            best = min(self.pages[p].state_t for p in cands)
            tied = [p for p in cands if self.pages[p].state_t == best]
            victim = self._pick(tied, out, choose, "state")
            if self.has_children(victim):
                pg = self.pages[victim]
                out.num_states += 1
                out.freed_states.append(pg.state)  # type: ignore[arg-type]
                pg.state = None
            else:
                self._remove_leaf(victim, out)
        return out

    def reset(self) -> None:
        for pg in self.pages.values():
            self.dead.difference_update(pg.slots)
        self.pages.clear()
