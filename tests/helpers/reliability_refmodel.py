"""A page-level reference model of the whole prefix cache, for the reliability state machine.

Shares no code with the library: plain dicts and sets of *pages*. A page is
``(namespace, token ids from the root to the page's end)``, its length a multiple of the page
size; a cached prefix is the run of its pages. Where the cache is on each tier:

* ``dev``: page -> its device KV slots (the tree's slots, one per token);
* ``host``: pages with a host copy (HiCache);
* ``dstate`` / ``hstate``: pages at whose end a device state slot / a host state copy sits;
* ``tomb``: pages whose SWA KV was freed while the full KV stays (SWA tombstones);
* ``locks``: lock points held by requests (a lock protects the page and every page above it);
* ``inflight``: pages whose device -> host copy has not landed (they lock like requests).

The model is exact where the cache's behaviour is a function of these sets (what a match
returns, what an insert adds, revives and hands back, which dead leaves are pruned) and a
legality check where the library chooses by its eviction policy (which victims an eviction
takes, which host leaves a backup evicts): :meth:`absorb` checks each observed change is one
the chosen operation may make, then adopts it. It never asks the library why.

Rules mirrored (the library's documented rules: tree, components, host tier, L3):

* matching walks whole pages; the usable prefix ends at the deepest device page holding a
  state whose SWA window is intact (no tombstone on the path, or ``window`` live tokens
  right before it); ``kv_hit_length`` also counts host-only pages; the host hit ends at the
  deepest page with a state on either tier;
* a leaf (a page without children) that is unlocked and can never be resumed (no state on
  either tier, or an SWA tombstone) does not stay in the tree, nor do the ancestors that
  become such leaves;
* nothing locked ever leaves the device; the KV slots of a page on device never change,
  except an SWA tombstone taking an inserting caller's live slots (revival) and a host-only
  page taking a caller's slots or loaded-back slots.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

Page = tuple  # (namespace, tuple of token ids)


@dataclass
class MatchPred:
    prefix_len: int
    kv_hit_length: int
    dev_hit: int
    branching_seqlen: int | None
    host_depth: int  # depth of the deepest page with a state on either tier (<= kv hit)
    host_hit_length: int
    state_slot: int | None
    device_indices: list[int]


@dataclass
class InsertPred:
    prefix_len: int
    inserted_len: int
    state_adopted: bool
    duplicates: list[int]  # caller slots below prefix_len that differ from the tree's
    adopted: list[int]  # caller slots the tree took for new pages
    revived_caller: list[int]  # caller slots the tree took over tombstones / host-only pages
    tree_freed: list[int]  # the tree's old slots it freed (tombstone revival)
    swa_released: list[int]  # caller slots whose SWA KV the insert freed (new tombstone)
    new_tomb_pages: int  # new pages inserted as SWA tombstones (the caller released their KV)
    tree_prefix: list[int] = field(default_factory=list)  # tree slots of [0, prefix_len) after


class ModelError(AssertionError):
    """The library made a change the model does not allow."""


class CacheModel:
    """The whole cache as sets of pages (see the module docstring).

    Args:
        page_size: tokens per page.
        window: sliding window [tokens], or ``None`` without SWA.
        hybrid: nodes carry recurrent states (a leaf needs one).
        host: a host tier exists.
    """

    def __init__(self, page_size: int, window: int | None, hybrid: bool, host: bool) -> None:
        self.ps = page_size
        self.window = window
        self.hybrid = hybrid
        self.has_host = host
        self.clear()

    def clear(self) -> None:
        self.dev: dict[Page, tuple[int, ...]] = {}
        self.host: set[Page] = set()
        self.dstate: dict[Page, int] = {}
        self.hstate: set[Page] = set()
        self.tomb: set[Page] = set()
        self.locks: Counter[Page] = Counter()
        self.inflight: set[Page] = set()

    # ------------------------------------------------------------ structure
    def pages_of(self, ns: Any, key: list[int], end: int) -> list[Page]:
        ps = self.ps
        return [(ns, tuple(key[:n])) for n in range(ps, end + 1, ps)]

    def in_tree(self, p: Page) -> bool:
        return p in self.dev or p in self.host

    def tree_pages(self) -> set[Page]:
        return set(self.dev) | self.host

    def parent(self, p: Page) -> Page | None:
        ns, toks = p
        return None if len(toks) == self.ps else (ns, toks[: -self.ps])

    def child_counts(self) -> Counter[Page]:
        counts: Counter[Page] = Counter()
        for p in self.tree_pages():
            q = self.parent(p)
            if q is not None:
                counts[q] += 1
        return counts

    @staticmethod
    def _extends(q: Page, p: Page) -> bool:
        """``q`` is ``p`` or below it."""
        return q[0] == p[0] and len(q[1]) >= len(p[1]) and q[1][: len(p[1])] == p[1]

    def locked(self, p: Page) -> bool:
        """A request's lock point or a copy in flight at or below ``p``."""
        return any(self._extends(q, p) for q in self.locks) or any(
            self._extends(q, p) for q in self.inflight
        )

    def locked_pages(self) -> set[Page]:
        """Every page :meth:`locked` is true of (one pass over the lock points)."""
        out: set[Page] = set()
        ps = self.ps
        for ns, toks in list(self.locks) + list(self.inflight):
            for n in range(ps, len(toks) + 1, ps):
                out.add((ns, toks[:n]))
        return out

    def dead(self, p: Page, children: Counter[Page]) -> bool:
        if children[p] or self.locked(p):
            return False
        no_state = self.hybrid and p not in self.dstate and p not in self.hstate
        return no_state or p in self.tomb

    def remove_page(self, p: Page) -> None:
        self.dev.pop(p, None)
        self.host.discard(p)
        self.dstate.pop(p, None)
        self.hstate.discard(p)
        self.tomb.discard(p)

    def prune(self) -> list[Page]:
        """Remove dead leaves to a fixpoint; return them."""
        children = self.child_counts()
        work = [p for p in self.tree_pages() if not children[p]]
        gone = []
        while work:
            p = work.pop()
            if not self.in_tree(p) or not self.dead(p, children):
                continue
            self.remove_page(p)
            gone.append(p)
            q = self.parent(p)
            if q is not None:
                children[q] -= 1
                if not children[q]:
                    work.append(q)
        return gone

    # --------------------------------------------------------------- match
    def swa_ok(self, path: list[Page], i: int) -> bool:
        """May a match end after ``path[i]`` under the sliding-window rule?"""
        if self.window is None:
            return True
        if path[i] in self.tomb:
            return False
        run = 0
        j = i
        while j >= 0 and path[j] not in self.tomb:
            run += self.ps
            j -= 1
        return j < 0 or run >= self.window

    def match(self, ns: Any, key: list[int]) -> MatchPred:
        ps = self.ps
        end = len(key) - len(key) % ps
        path = []
        for p in self.pages_of(ns, key, end):
            if not self.in_tree(p):
                break
            path.append(p)
        dev = 0
        while dev < len(path) and path[dev] in self.dev:
            dev += 1
        if any(p in self.dev for p in path[dev:]):
            raise ModelError(f"device page below a host-only one on {path}")
        usable = dev
        while usable > 0 and not (
            (not self.hybrid or path[usable - 1] in self.dstate) and self.swa_ok(path, usable - 1)
        ):
            usable -= 1
        prefix_len = usable * ps
        h = len(path)
        while h > usable and path[h - 1] not in self.dstate and path[h - 1] not in self.hstate:
            h -= 1
        host_depth = h * ps if h > usable else prefix_len
        slots: list[int] = []
        for p in path[:usable]:
            slots.extend(self.dev[p])
        kv_hit = len(path) * ps
        return MatchPred(
            prefix_len=prefix_len,
            kv_hit_length=kv_hit,
            dev_hit=dev * ps,
            branching_seqlen=kv_hit if self.hybrid and kv_hit > prefix_len else None,
            host_depth=host_depth,
            host_hit_length=host_depth - prefix_len,
            state_slot=self.dstate.get(path[usable - 1]) if usable and self.hybrid else None,
            device_indices=slots,
        )

    # -------------------------------------------------------------- insert
    def _live_from(self, live: list[bool], lo: int, hi: int) -> int:
        """First page boundary in ``[lo, hi]`` from which every caller slot is SWA-live."""
        dead = [j for j in range(lo, hi) if not live[j]]
        if not dead:
            return lo
        t = dead[-1] + 1
        return min(hi, -(-t // self.ps) * self.ps)

    def insert(self, ns: Any, key: list[int], value: list[int], live: list[bool],
               state_slot: int | None, node_ends: set[Page]) -> InsertPred:
        """Apply an insert of ``key`` with caller slots ``value`` (``live[j]``: slot ``j`` has
        SWA KV). ``node_ends``: where the library's nodes end before the call (the grouping a
        tombstone revival works on)."""
        ps = self.ps
        end = len(key) - len(key) % ps
        pages = self.pages_of(ns, key, end)
        k = 0
        while k < len(pages) and self.in_tree(pages[k]):
            k += 1
        prefix_len = k * ps
        revived_caller: list[int] = []
        tree_freed: list[int] = []
        if self.window is not None and k:
            ends = set(node_ends) | {pages[k - 1]}
            group: list[int] = []
            for i in range(k):
                group.append(i)
                if pages[i] in ends:
                    self._revive_group(pages, group, value, live, revived_caller, tree_freed)
                    group = []
        if self.has_host:
            for i in range(k):
                if pages[i] not in self.dev:
                    self.dev[pages[i]] = tuple(value[i * ps:(i + 1) * ps])
                    revived_caller.extend(value[i * ps:(i + 1) * ps])
        inserted = end
        swa_released: list[int] = []
        new_tomb = 0
        if prefix_len < end:
            live_from = prefix_len if self.window is None else self._live_from(live, prefix_len, end)
            if live_from >= end:
                inserted = prefix_len
            else:
                for i in range(k, len(pages)):
                    self.dev[pages[i]] = tuple(value[i * ps:(i + 1) * ps])
                    if i * ps < live_from:
                        self.tomb.add(pages[i])
                swa_released = [value[j] for j in range(prefix_len, live_from) if live[j]]
                new_tomb = (live_from - prefix_len) // ps
        adopted = (
            self.hybrid and state_slot is not None and inserted == end and end > 0
            and pages[-1] not in self.dstate
        )
        if adopted:
            self.dstate[pages[-1]] = state_slot  # type: ignore[assignment]
        tree_prefix: list[int] = []
        for p in pages[:k]:
            tree_prefix.extend(self.dev[p])
        dups = [v for v, t in zip(value[:prefix_len], tree_prefix, strict=True) if v != t]
        return InsertPred(prefix_len, inserted, adopted, dups, list(value[prefix_len:inserted]),
                          revived_caller, tree_freed, swa_released, new_tomb, tree_prefix)

    def _revive_group(self, pages: list[Page], group: list[int], value: list[int],
                      live: list[bool], revived_caller: list[int], tree_freed: list[int]) -> None:
        ps = self.ps
        first, last = pages[group[0]], pages[group[-1]]
        if first not in self.tomb or self.locked(last):
            return
        lo, hi = group[0] * ps, (group[-1] + 1) * ps
        tree = [s for i in group for s in self.dev[pages[i]]]
        if any(v == t for v, t in zip(value[lo:hi], tree, strict=True)):
            return
        t = self._live_from(live, lo, hi)
        for i in group:
            if i * ps >= t:
                p = pages[i]
                tree_freed.extend(self.dev[p])
                self.dev[p] = tuple(value[i * ps:(i + 1) * ps])
                revived_caller.extend(self.dev[p])
                self.tomb.discard(p)

    # -------------------------------------------------------------- absorb
    def absorb(self, view: Any, *, dev_evict: bool = False, state_evict: bool = False,
               tombstone: bool = False, backup: bool = False, host_evict: bool = False,
               load: bool = False, inflight_new: bool = False,
               state_backup: bool = False) -> dict[str, set[Page]]:
        """Check that ``view`` (the library after a call) differs from the model only by
        changes of the allowed kinds, adopt them, prune dead leaves, and require equality.

        ``state_backup`` allows only host copies of states, onto pages already on host (an
        eviction copies a backed-up page's state before demoting it, under every write
        policy). Returns the changes: ``dev_lost`` (pages that left the device), ``removed`` (pages
        that left the tree), ``states_lost``, ``tombstoned``, ``backed_up``, ``loaded``,
        ``host_lost`` (host copies freed).
        """
        before_tree, before_dev = self.tree_pages(), set(self.dev)
        before_host, before_dstate = set(self.host), set(self.dstate)
        before_tomb = set(self.tomb)
        after_tree = set(view.dev) | view.host
        if not after_tree <= before_tree:
            raise ModelError(f"pages appeared without an insert: {sorted(after_tree - before_tree, key=repr)[:4]}")
        # (a) host copies: of device pages, from the root down
        for p in sorted(view.host - self.host, key=lambda q: len(q[1])):
            if not backup:
                raise ModelError(f"backup of {p} during a call that backs up nothing")
            if p not in self.dev:
                raise ModelError(f"host copy of a page not on device: {p}")
            q = self.parent(p)
            if q is not None and q not in self.host:
                raise ModelError(f"{p} backed up before its parent")
            self.host.add(p)
            if inflight_new:
                self.inflight.add(p)
        for p in view.hstate - self.hstate:  # state_backup: a state copy only, to a page on host
            if not (backup or state_backup) or p not in self.host or (
                    p not in self.dstate and p not in view.dstate):
                raise ModelError(f"host state on {p} without a device state to copy")
            self.hstate.add(p)
        # (b) host-only leaves evicted from the host
        if host_evict or dev_evict:
            for p in before_tree - after_tree:
                if p not in self.dev:
                    self.remove_page(p)
        # (c) device pages evicted: removed, or demoted to host-only
        if dev_evict:
            for p in before_dev - set(view.dev):
                if self.locked(p):
                    raise ModelError(f"locked page {p} left the device")
                if p in view.host:
                    if p not in self.host:
                        raise ModelError(f"{p} demoted without a host copy")
                    del self.dev[p]
                    self.dstate.pop(p, None)
                    self.tomb.discard(p)
                else:
                    self.remove_page(p)
        # (d) states freed on pages that stay on device
        if state_evict or dev_evict:
            for p in before_dstate - set(view.dstate):
                if p in view.dev and p in self.dstate:
                    if self.locks[p]:
                        raise ModelError(f"state on {p} freed under a request's lock")
                    del self.dstate[p]
        # (e) SWA tombstones
        if tombstone:
            for p in view.tomb - self.tomb:
                if p in self.dev:
                    self._check_tombstone_allowed(p, before_tomb)
                    self.tomb.add(p)
        # (f) host-only pages back on device, with their state
        if load:
            for p in set(view.dev) - set(self.dev):
                if p not in self.host:
                    raise ModelError(f"{p} loaded back without a host copy")
                self.dev[p] = view.dev[p]
            for p in set(view.dstate) - set(self.dstate):
                if p not in self.hstate or p not in self.dev:
                    raise ModelError(f"device state loaded on {p} without a host state")
                self.dstate[p] = view.dstate[p]
        self.prune()
        self.require_equal(view)
        after_dev = set(self.dev)
        return {
            "dev_lost": before_dev - after_dev,
            "removed": before_tree - after_tree,
            "states_lost": {p for p in before_dstate if p not in self.dstate},
            "tombstoned": self.tomb - before_tomb,
            "backed_up": self.host - before_host,
            "host_lost": before_host - self.host,
            "loaded": after_dev - before_dev,
        }

    def _check_tombstone_allowed(self, p: Page, tomb_before: set[Page]) -> None:
        """``p`` may not lose its SWA KV while a lock point has it inside the live window
        right before it (every page from ``p`` down to the lock point live)."""
        w = self.window
        assert w is not None
        ps = self.ps
        for q in self.locks:
            if not self._extends(q, p) or len(q[1]) - len(p[1]) >= w:
                continue
            between = [(q[0], q[1][:n]) for n in range(len(p[1]), len(q[1]) + 1, ps)]
            if not any(b in tomb_before for b in between):
                raise ModelError(f"{p} tombstoned inside the window of lock {q}")

    def require_equal(self, view: Any) -> None:
        for name in ("dev", "host", "dstate", "hstate", "tomb"):
            mine, theirs = getattr(self, name), getattr(view, name)
            if mine != theirs:
                raise ModelError(f"{name} differs: model-only {_diff(mine, theirs)}, "
                                 f"library-only {_diff(theirs, mine)}")

    # ------------------------------------------------------------- sizes
    def device_leaves_unlocked(self) -> list[Page]:
        devs = set(self.dev)
        has_dev_child = {self.parent(p) for p in devs}
        return [p for p in devs if p not in has_dev_child and not self.locked(p)]

    def state_candidates(self) -> list[Page]:
        children = self.child_counts()
        return [p for p in self.dstate if not self.locks[p] and (children[p] or not self.locked(p))]

    def host_only_leaves(self) -> list[Page]:
        children = self.child_counts()
        return [p for p in self.host if p not in self.dev and not children[p] and p not in self.inflight]


def _diff(a: Any, b: Any) -> list:
    if isinstance(a, dict):
        return sorted(((k, a[k]) for k in a if k not in b or b[k] != a[k]), key=repr)[:4]
    return sorted(a - b, key=repr)[:4]
