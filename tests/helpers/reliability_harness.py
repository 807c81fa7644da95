"""The engine-like driver of the reliability state machine: one whole cache, its pools, the
requests running against it, and the page-level reference model (``reliability_refmodel``).

Two configurations (the library refuses HiCache together with a sliding window):

* ``"swa"``: full KV + SWA KV (``SWAAllocator`` with real pools) + recurrent states;
* ``"host"``: KV + recurrent states + a HiCache host tier (write policy drawn).

Every library call goes through a checked wrapper: the model predicts the answer (exactly, or
as a set of legal outcomes for eviction choices), then :meth:`CacheModel.absorb` requires the
library's tree to equal the model's. After every rule :meth:`Harness.check` adds the slot
ledger (every slot of every pool is free, the tree's or one request's, exactly once), the
sizes, and the data: every slot holds the label of the ``(namespace, prefix)`` it was written
for, so a slot served across namespaces or a slot freed and reused under a holder is caught
by its contents, not by the library's own bookkeeping.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from allocators import KVPool, MambaStatePool, PagedAllocator, SWAAllocator, TokenAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, RadixCache
from tests.helpers.cache_helpers import node_slots
from tests.helpers.reliability_checks import HarnessChecks, t64
from tests.helpers.reliability_refmodel import CacheModel, InsertPred, ModelError, Page

NAMESPACES: tuple[Any, ...] = (None, "", "X", ("lora", "X"), ("salt", "X"))
DOCS: tuple[tuple[int, ...], ...] = (
    (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14),
    (1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6),
    (1, 2, 7, 7, 7, 7, 3, 3, 3, 3, 8, 8, 8, 8),
    (5, 5, 5, 5, 5, 5, 1, 2, 3, 4, 5, 6, 7, 8),
)
POLICIES: dict[str, dict[str, Any] | None] = {
    "lru": None, "lfu": None, "slru": None, "priority": None, "joint_lru": None,
    "gds": {"d": 1.0, "e": 1.0}, "tlru": {"threshold": 8, "next_prompt_estimate": 2},
}
MAX_REQUESTS = 3
F64 = torch.float64
#: What the runs exercised (how often each interesting outcome happened), for coverage reports.
EVENTS: Counter[str] = Counter()


_NS_PICK = (0, 0, 0, 2, 2, 1, 3, 4)  # None and "X" most often: more sharing per namespace
_CUTS = (14, 14, 12, 12, 10, 8, 8, 8, 6, 6, 4, 4, 3, 2, 1, 0)
_TAILS = (0, 0, 0, 1, 2, 2, 3, 4)
KEY_SEEDS = 8 * 4 * 16 * 8 * 81  # every key make_key can build


def make_key(seed: int) -> tuple[Any, list[int]]:
    """A key from one integer (one hypothesis draw): a namespace, a document cut somewhere,
    and a short tail of its own. Documents share prefixes with each other, and every
    namespace sees the same documents."""
    ns = NAMESPACES[_NS_PICK[seed % 8]]
    seed //= 8
    doc = DOCS[seed % 4]
    seed //= 4
    cut = _CUTS[seed % 16]
    seed //= 16
    n = _TAILS[seed % 8]
    seed //= 8
    tail = [1 + (seed // 3**j) % 3 for j in range(n)]
    return ns, list(doc[:cut]) + tail


@dataclass
class View:
    """The library's tree read page by page (what the model is compared with)."""

    dev: dict[Page, tuple[int, ...]] = field(default_factory=dict)
    host: set[Page] = field(default_factory=set)
    host_slots: dict[Page, tuple[int, ...]] = field(default_factory=dict)
    dstate: dict[Page, int] = field(default_factory=dict)
    hstate: set[Page] = field(default_factory=set)
    hstate_slots: dict[Page, int] = field(default_factory=dict)
    tomb: set[Page] = field(default_factory=set)
    ends: set[Page] = field(default_factory=set)
    swa_lock: dict[Page, int] = field(default_factory=dict)


def read_view(cache: RadixCache) -> View:
    v = View()
    ps = cache.page_size
    stack = [(c, ()) for c in cache.root.children.values()]
    while stack:
        n, above = stack.pop()
        toks = above + tuple(n.key)
        ns = n.extra_key
        kv = node_slots(n).tolist() if n.kv_value is not None else None
        hv = n.host_value.tolist() if n.host_value is not None else None
        for i in range(len(n.key) // ps):
            p = (ns, toks[: len(above) + (i + 1) * ps])
            if kv is not None:
                v.dev[p] = tuple(kv[i * ps:(i + 1) * ps])
            if hv is not None:
                v.host.add(p)
                v.host_slots[p] = tuple(hv[i * ps:(i + 1) * ps])
            if n.swa_tombstone:
                v.tomb.add(p)
            v.swa_lock[p] = n.swa_lock
        end = (ns, toks)
        v.ends.add(end)
        if n.state_slot is not None:
            v.dstate[end] = n.state_slot
        if n.host_state_slot is not None:
            v.hstate.add(end)
            v.hstate_slots[end] = n.host_state_slot
        stack.extend((c, toks) for c in n.children.values())
    return v


@dataclass(eq=False)
class Req:
    """One running request: the library's record plus what the driver knows of it."""

    cr: CacheRequest
    ns: Any
    key: list[int]
    lock: Page | None  # the model's lock point (None: the root)
    run: int  # its running state slot
    vals: list[float]  # the label each of its KV slots holds, by position
    vals_state: float  # the label its running state holds
    own: set[int] = field(default_factory=set)  # KV slots it owns (not the tree's)


@dataclass(eq=False)
class Pin:
    node: Any
    lock: Page | None
    start: Any  # what inc_lock_ref returned


class Harness(HarnessChecks):
    """The cache, its pools, the running requests and pins, and the model (see the module
    docstring); every public method is one engine step, checked against the model."""

    def __init__(self, kind: str, page_size: int, policy: str, window: int = 2,
                 write_policy: str = "write_through", threshold: int = 0) -> None:
        self.kind = kind
        self.ps = ps = page_size
        self.window = window if kind == "swa" else None
        self.write_policy = write_policy
        self.threshold = threshold
        cfg = CacheConfig(page_size=ps, radix_eviction_policy=policy,
                          radix_eviction_policy_config=POLICIES[policy],
                          sliding_window_size=self.window)
        self.sp = MambaStatePool(6, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,),
                                 dtype=F64)
        if kind == "swa":
            self.kvpool = KVPool(64, 1, 1, 1, F64, page_size=ps)
            self.swapool = KVPool(24, 1, 1, 1, F64, page_size=ps)
            self.kv: Any = SWAAllocator(64, 24, ps, full_pool=self.kvpool, swa_pool=self.swapool)
            self.cache = RadixCache(cfg, kv_allocator=self.kv, state_allocator=self.sp)
        else:
            self.kvpool = KVPool(32, 1, 1, 1, F64, page_size=ps)
            self.kv = (TokenAllocator(32, pool=self.kvpool) if ps == 1
                       else PagedAllocator(32, ps, pool=self.kvpool))
            self.cache = RadixCache(cfg, kv_allocator=self.kv, state_allocator=self.sp,
                                    hicache=HiCacheConfig(hicache_ratio=1.5,
                                                          hicache_write_policy=write_policy,
                                                          load_back_threshold=threshold))
            assert self.cache.hicache is not None
            self.hc = self.cache.hicache
        self.model = CacheModel(ps, self.window, hybrid=True, host=kind == "host")
        self.labels: dict[tuple[Any, tuple[int, ...]], int] = {}
        self._page_labels: dict[Page, list[float]] = {}
        self.reqs: list[Req] = []
        self.pins: list[Pin] = []
        self.dead_own: set[int] = set()  # request-owned slots whose SWA KV was released
        self.all_slots = set(range(ps, self.kv.size + ps))

    # ================================================================ labels
    def label(self, ns: Any, toks: tuple[int, ...]) -> int:
        return self.labels.setdefault((ns, toks), len(self.labels) + 1)

    def write_kv(self, slots: list[int], ns: Any, key: list[int], start: int) -> None:
        """Slot ``j`` of ``slots`` holds token ``start + j`` of ``key`` (full and SWA KV)."""
        if not slots:
            return
        vals = torch.tensor([float(self.label(ns, tuple(key[:start + j + 1])))
                             for j in range(len(slots))], dtype=F64)
        idx = t64(slots)
        self.kvpool.k_all[0, idx, 0, 0] = vals
        if self.kind == "swa":
            self.swapool.k_all[0, self.kv.translate(idx), 0, 0] = vals

    def write_state(self, slot: int, ns: Any, toks: tuple[int, ...]) -> None:
        self.sp.conv[0, slot, 0] = float(self.label(ns, toks))

    # =========================================================== allocation
    def alloc_kv(self, n: int) -> list[int] | None:
        """``n`` KV slots (whole pages), evicting once when short, as an engine does."""
        got = self.kv.alloc(n)
        if got is None:
            EVENTS["kv alloc short"] += 1
            if self.kind != "swa":
                self.evict(max(n - self.kv.available_size(), 0))
            else:  # each side short evicts its own way: SWA KV first tombstones
                if self.kv.full_available_size() < n:
                    self.evict(n - self.kv.full_available_size())
                if self.kv.swa_available_size() < n:
                    self.evict_swa(n - self.kv.swa_available_size())
            got = self.kv.alloc(n)
        EVENTS["kv alloc failed"] += got is None
        return None if got is None else got.tolist()

    def alloc_state(self) -> int | None:
        got = self.sp.alloc(1)
        if got is None:
            EVENTS["state alloc short"] += 1
            self.evict_states(1)
            got = self.sp.alloc(1)
        EVENTS["state alloc failed"] += got is None
        return None if got is None else int(got[0])

    def free_kv(self, slots: list[int]) -> None:
        if slots:
            self.kv.free(t64(slots))
            self.dead_own -= set(slots)

    def free_state(self, slot: int) -> None:
        self.sp.free(t64([slot]))

    # ========================================================= checked calls
    def view(self) -> View:
        return read_view(self.cache)

    def absorb(self, **allow: bool) -> dict[str, set[Page]]:
        if self.kind == "host":
            allow.setdefault("inflight_new", self.hc.num_inflight > 0)
        ch = self.model.absorb(self.view(), **allow)
        EVENTS["copy in flight"] += bool(allow.get("inflight_new") and ch["backed_up"])
        EVENTS["backup"] += bool(ch["backed_up"])
        return ch

    def host_flags(self) -> dict[str, bool]:
        if self.kind != "host":
            return {}
        return {"backup": True, "host_evict": True}

    def match(self, ns: Any, key: list[int]) -> Any:
        m = self.cache.match_prefix(key, ns)
        want = self.model.match(ns, key)
        got = (m.prefix_len, m.kv_hit_length, m.branching_seqlen, m.state_slot,
               m.device_indices.tolist(), m.last_device_node.depth)
        exp = (want.prefix_len, want.kv_hit_length, want.branching_seqlen, want.state_slot,
               want.device_indices, want.prefix_len)
        assert got == exp, f"match {ns!r} {key}: library {got}, model {exp}"
        if self.kind == "host":
            assert m.host_hit_length == want.host_hit_length, (m.host_hit_length, want)
            assert m.last_host_node is not None and m.last_host_node.depth == want.host_depth, (
                m.last_host_node, want)
        self.check_match_data(ns, key, m)
        EVENTS["match hit"] += m.prefix_len > 0
        EVENTS["match state-miss"] += m.kv_hit_length > m.prefix_len
        EVENTS["match host hit"] += self.kind == "host" and want.host_hit_length > 0
        return m

    def check_match_data(self, ns: Any, key: list[int], m: Any) -> None:
        """Tenant isolation by contents: every served slot holds this namespace's prefix."""
        n = m.prefix_len
        if n:
            want = [float(self.label(ns, tuple(key[:j + 1]))) for j in range(n)]
            got = self.kvpool.k_all[0, m.device_indices, 0, 0].tolist()
            assert got == want, f"match {ns!r} {key[:n]} served foreign KV {got} != {want}"
            if self.kind == "swa":  # the window before the usable end is live and right
                w = min(self.window, n)  # type: ignore[type-var]
                idx = m.device_indices[n - w:]
                sw = self.kv.translate(idx)
                assert bool((sw != 0).all()), f"SWA window of {key[:n]} not live: {sw.tolist()}"
                assert self.swapool.k_all[0, sw, 0, 0].tolist() == want[n - w:]
        if m.state_slot is not None:
            got_s = float(self.sp.conv[0, m.state_slot, 0])
            assert got_s == self.label(ns, tuple(key[:n])), f"state of {key[:n]} under {ns!r}"

    def lock(self, node: Any, page: Page | None) -> Any:
        start = self.cache.inc_lock_ref(node)
        if page is not None:
            self.model.locks[page] += 1
        return start

    def unlock(self, node: Any, page: Page | None, start: Any) -> None:
        assert start is node or start.node is node
        self.cache.dec_lock_ref(start)
        if page is not None:
            self.model.locks[page] -= 1
            if not self.model.locks[page]:
                del self.model.locks[page]
            self.model.prune()

    def page_at(self, ns: Any, key: list[int], n: int) -> Page | None:
        return (ns, tuple(key[:n])) if n else None

    def live(self, slots: list[int]) -> list[bool]:
        if self.kind != "swa":
            return [True] * len(slots)
        tree = {s: p for p, ss in self.model.dev.items() for s in ss}
        return [(tree[s] not in self.model.tomb) if s in tree else (s not in self.dead_own)
                for s in slots]

    def check_insert(self, res: Any, pred: InsertPred, value: list[int],
                     released: bool = False) -> None:
        """``released``: the call also released the caller's lock (``cache_finished_req``),
        so ``res.last_node`` may have left the tree since (a dead leaf, pruned: checked by
        the caller against the model once the model has released the lock too)."""
        got = (res.prefix_len, res.inserted_len, res.state_adopted,
               res.duplicate_indices.tolist(), res.adopted_indices.tolist(),
               res.remainder_indices.tolist(), res.revived_indices.tolist())
        exp = (pred.prefix_len, pred.inserted_len, pred.state_adopted, pred.duplicates,
               pred.adopted, value[pred.inserted_len:], pred.revived_caller)
        assert got == exp, f"insert: library {got}, model {exp}"
        if released and not self.cache.tree.is_attached(res.last_node):
            return
        assert res.last_node.depth == pred.inserted_len or (
            pred.inserted_len == 0 and res.last_node is self.cache.root)
        EVENTS["insert new pages"] += pred.inserted_len > pred.prefix_len
        EVENTS["insert duplicates"] += bool(pred.duplicates)
        EVENTS["insert revival"] += bool(pred.revived_caller)
        EVENTS["insert new tombstone"] += pred.new_tomb_pages > 0
        EVENTS["insert frees live SWA above dead"] += bool(pred.swa_released)
        EVENTS["insert nothing live"] += pred.inserted_len < len(value) - len(value) % self.ps

    # ============================================================= evictions
    def evict(self, n: int) -> None:
        before_tomb = set(self.model.tomb)
        res = self.cache.evict(n)
        wb = self.kind == "host" and self.write_policy == "write_back"
        ch = self.absorb(dev_evict=True, backup=wb, host_evict=self.kind == "host",
                         state_backup=self.kind == "host")
        self.check_freed(res, ch)
        if self.kind == "swa":
            live_removed = [p for p in ch["removed"] if p not in before_tomb]
            assert res.num_swa_tokens == self.ps * len(live_removed), (res, ch)
        EVENTS["evict freed"] += res.num_tokens > 0
        EVENTS["evict demoted"] += bool(ch["dev_lost"] - ch["removed"])
        EVENTS["evict short"] += res.num_tokens < n
        flying = self.wb_flying(ch)
        EVENTS["evict write-back in flight"] += bool(flying)
        assert res.num_tokens + self.ps * len(flying) >= n or not self.model.device_leaves_unlocked(), (
            f"evict({n}) freed {res.num_tokens} with unlocked device leaves left")

    def wb_flying(self, ch: dict[str, set[Page]]) -> set[Page]:
        """Pages an eviction backed up under write_back whose copies are still in flight
        (copies held): the victims among them leave the device when the copies land
        (``release_poll``); the eviction counts them towards its target, not as freed."""
        if self.kind != "host" or self.write_policy != "write_back":
            return set()
        return ch["backed_up"] & self.model.inflight

    def check_freed(self, res: Any, ch: dict[str, set[Page]]) -> None:
        """An eviction reports exactly the device tokens and states it freed (under
        write_back too, where a backup's host eviction may also remove a stateless device
        parent)."""
        lost_tokens, lost_states = self.ps * len(ch["dev_lost"]), len(ch["states_lost"])
        assert (res.num_tokens, res.num_states) == (lost_tokens, lost_states), (res, ch)

    def evict_states(self, n: int) -> None:
        res = self.cache.evict_states(n)
        wb = self.kind == "host" and self.write_policy == "write_back"
        ch = self.absorb(dev_evict=True, state_evict=True, backup=wb,
                         host_evict=self.kind == "host", state_backup=self.kind == "host")
        self.check_freed(res, ch)
        EVENTS["evict_states internal"] += bool(ch["states_lost"] - ch["dev_lost"])
        EVENTS["evict_states leaf"] += bool(ch["dev_lost"])
        flying = len(self.wb_flying(ch) & self.model.dstate.keys())
        assert res.num_states + flying >= n or not self.model.state_candidates(), (
            f"evict_states({n}) freed {res.num_states} with candidates left")

    def evict_swa(self, n: int) -> None:
        before_tomb = set(self.model.tomb)
        res = self.cache.evict_swa(n)
        ch = self.absorb(dev_evict=True, tombstone=True)
        ps = self.ps
        live_removed = [p for p in ch["removed"] if p not in before_tomb]
        assert res.num_swa_tokens == ps * (len(ch["tombstoned"]) + len(live_removed)), (res, ch)
        assert res.num_tokens == ps * len(ch["removed"]), (res, ch)
        assert res.num_states == len(ch["states_lost"]), (res, ch)
        EVENTS["evict_swa tombstoned"] += bool(ch["tombstoned"])
        EVENTS["evict_swa removed"] += bool(ch["removed"])
        if res.num_swa_tokens < n:
            v = self.view()
            kids = self.model.child_counts()
            for p in v.dev:
                if p in v.tomb or v.swa_lock[p]:
                    continue
                assert not kids[p] and self.model.locked(p), (
                    f"evict_swa({n}) freed {res.num_swa_tokens} while {p} was a candidate")

    def evict_host(self, n: int) -> None:
        host_only = {p for p in self.model.host if p not in self.model.dev}
        freed = self.cache.evict_host(n)
        ch = self.absorb(host_evict=True)
        ps = self.ps
        lo = ps * len(ch["host_lost"] & host_only)
        assert lo <= freed <= ps * len(ch["host_lost"]), (freed, ch)
        EVENTS["evict_host freed"] += freed > 0
        assert freed >= n or not self.model.host_only_leaves(), (
            f"evict_host({n}) freed {freed} with host-only leaves left")

    # ============================================================== inserts
    def insert_checked(self, ns: Any, key: list[int], value: list[int], state: int,
                       prio: int = 0) -> tuple[Any, InsertPred]:
        ends = self.view().ends
        live = self.live(value)
        res = self.cache.insert(key, t64(value), ns, state_slot=state, priority=prio)
        pred = self.model.insert(ns, key, value, live, state, ends)
        self.check_insert(res, pred, value)
        return res, pred

    def raw_insert(self, ns: Any, key: list[int], prio: int) -> None:
        """A one-shot caller: match, lock, compute the rest, insert, free what it is left.
        Its state is the one at the key's last page end, so it inserts whole pages."""
        key = key[: len(key) - len(key) % self.ps]
        m = self.match(ns, key)
        page = self.page_at(ns, key, m.prefix_len)
        start = self.lock(m.last_device_node, page)
        try:
            need = len(key) - m.prefix_len
            fresh = self.alloc_kv(-(-need // self.ps) * self.ps)
            if fresh is None:
                return
            state = self.alloc_state()
            if state is None:
                self.free_kv(fresh)
                return
            self.write_kv(fresh[:need], ns, key, m.prefix_len)
            end = len(key) - len(key) % self.ps
            self.write_state(state, ns, tuple(key[:end]))
            value = m.device_indices.tolist() + fresh[:need]
            res, pred = self.insert_checked(ns, key, value, state, prio)
            self.free_kv(pred.duplicates)
            self.free_kv(value[pred.inserted_len:] + fresh[need:])
            self.dead_own -= set(pred.swa_released)
            if not pred.state_adopted:
                self.free_state(state)
            if self.kind == "host":
                self.absorb(**self.host_flags())
        finally:
            self.unlock(m.last_device_node, page, start)

    # ============================================================== requests
    def start(self, ns: Any, key: list[int], load: bool) -> None:
        key = key[: len(key) - len(key) % self.ps]
        if not key or len(self.reqs) >= MAX_REQUESTS:
            return
        m = self.match(ns, key)
        if load and self.kind == "host" and m.host_hit_length:
            self.load_back(m.last_host_node)
            m = self.match(ns, key)
        page = self.page_at(ns, key, m.prefix_len)
        start = self.lock(m.last_device_node, page)
        run = self.alloc_state()
        if run is None:
            self.unlock(m.last_device_node, page, start)
            return
        self.write_state(run, ns, tuple(key[:m.prefix_len]))  # copy-on-write of the match
        cr = CacheRequest(key=key, kv_indices=m.device_indices.clone(), cached_len=m.prefix_len,
                          last_node=m.last_device_node, extra_key=ns, rid=object(),
                          lock=start)
        vals = [float(self.label(ns, tuple(key[:j + 1]))) for j in range(m.prefix_len)]
        self.reqs.append(Req(cr, ns, key, page, run, vals,
                             float(self.label(ns, tuple(key[:m.prefix_len])))))

    def extend(self, r: Req, pages: int) -> None:
        pos = len(r.cr.kv_indices)
        n = min(pages * self.ps, len(r.key) - pos)
        if n <= 0:
            return
        got = self.alloc_kv(n)
        if got is None:
            return
        self.write_kv(got, r.ns, r.key, pos)
        r.own |= set(got)
        r.cr.kv_indices = torch.cat([r.cr.kv_indices, t64(got)])
        r.vals.extend(float(self.label(r.ns, tuple(r.key[:pos + j + 1]))) for j in range(n))
        self.write_state(r.run, r.ns, tuple(r.key[:pos + n]))
        r.vals_state = float(self.label(r.ns, tuple(r.key[:pos + n])))

    def release_swa(self, r: Req) -> None:
        cr = r.cr
        seq = len(cr.kv_indices)
        margin = max(self.window or 0, self.ps)
        upto = max(seq - margin, 0) // self.ps * self.ps
        start = max(cr.swa_evicted_seqlen, cr.cached_len)
        got = self.cache.release_swa(cr, seq)
        assert got == max(upto - start, 0), (got, upto, start)
        EVENTS["release_swa freed"] += upto > start
        if upto > start:
            dead = set(cr.kv_indices[start:upto].tolist())
            assert dead <= r.own
            self.dead_own |= dead

    def _cache_req(self, r: Req, finished: bool) -> None:
        cr = r.cr
        value = cr.kv_indices.tolist()
        upto = len(value)
        if finished:
            state = r.run
        else:
            got = self.alloc_state()
            if got is None:
                return
            state = got
            self.write_state(state, r.ns, tuple(r.key[:upto]))
        ends = self.view().ends
        live = self.live(value)
        old_lock, old_node, old_start = r.lock, cr.last_node, cr.lock
        if finished:
            res = self.cache.cache_finished_req(cr, state_slot=state)
        else:
            res = self.cache.cache_unfinished_req(cr, state_slot=state)
        pred = self.model.insert(r.ns, r.key[:upto], value, live, state, ends)
        self.check_insert(res, pred, value, released=finished)
        p = pred.prefix_len
        tree_live = self.live(pred.tree_prefix) if self.kind == "swa" else []
        keep = [
            j for j in range(p)
            if not finished and self.kind == "swa" and value[j] != pred.tree_prefix[j]
            and live[j] and not tree_live[j]
        ]
        freed = [value[j] for j in range(p) if value[j] != pred.tree_prefix[j] and j not in keep]
        EVENTS["finish" if finished else "chunk"] += 1
        EVENTS["chunk keeps own live copy"] += bool(keep)
        r.own -= set(freed) | set(pred.adopted) | set(pred.revived_caller)
        self.dead_own -= set(freed) | set(pred.adopted) | set(pred.revived_caller)
        if finished:
            tail = value[pred.inserted_len:]
            assert set(tail) <= r.own, "the finished tail holds slots the request does not own"
            r.own -= set(tail)
            self.dead_own -= set(tail)
            assert not r.own, f"finished request still owns {sorted(r.own)}"
            assert cr.kv_indices.numel() == 0 and cr.cached_len == 0
            self.reqs.remove(r)
            new_lock: Page | None = None
        else:
            merged = list(pred.tree_prefix)
            for j in keep:
                merged[j] = value[j]
            assert cr.kv_indices.tolist() == merged + value[p:], "unfinished kv_indices rewrite"
            assert cr.cached_len == pred.inserted_len
            new_lock = self.page_at(r.ns, r.key, pred.inserted_len)
            r.lock = new_lock
            if new_lock is not None:
                self.model.locks[new_lock] += 1
        del old_node, old_start
        if old_lock is not None:
            self.model.locks[old_lock] -= 1
            if not self.model.locks[old_lock]:
                del self.model.locks[old_lock]
        self.model.prune()
        if finished and not self.cache.tree.is_attached(res.last_node):
            last = self.page_at(r.ns, r.key, pred.inserted_len)
            assert last is not None and not self.model.in_tree(last), (
                f"cache_finished_req pruned {last}, which the model keeps")
            EVENTS["finish prunes its dead leaf"] += 1
        if self.kind == "host":
            self.absorb(**self.host_flags())

    def chunk(self, r: Req) -> None:
        self._cache_req(r, finished=False)

    def finish(self, r: Req) -> None:
        self._cache_req(r, finished=True)

    def abort(self, r: Req) -> None:
        """Drop the request without caching anything: unlock, free its own slots."""
        cr = r.cr
        self.unlock(cr.last_node, r.lock, cr.lock if cr.lock is not None else cr.last_node)
        own = [s for s in cr.kv_indices.tolist() if s in r.own]
        assert set(own) == r.own
        self.free_kv(own)
        self.free_state(r.run)
        self.reqs.remove(r)
        EVENTS["abort"] += 1
        self.cache.release_rid(cr.rid)

    # ================================================================ pins
    def pin(self, ns: Any, key: list[int]) -> None:
        m = self.match(ns, key)
        page = self.page_at(ns, key, m.prefix_len)
        self.pins.append(Pin(m.last_device_node, page, self.lock(m.last_device_node, page)))

    def unpin(self, i: int) -> None:
        p = self.pins.pop(i % len(self.pins))
        self.unlock(p.node, p.lock, p.start)

    # ================================================================ host
    def load_back(self, node: Any) -> None:
        model = self.model
        chain = []
        n = node
        while n.parent is not None and n.kv_value is None:
            chain.append(n)
            n = n.parent
        tokens = sum(len(c.key) for c in chain)
        got = self.cache.load_back(node)
        ch = self.absorb(dev_evict=True, state_evict=True, backup=True, host_evict=True,
                         load=True)
        if chain and tokens < self.threshold:
            assert got == 0 and not ch["loaded"] and not ch["dev_lost"], (got, ch)
            EVENTS["load_back below threshold"] += 1
            return
        EVENTS["load_back done" if got else "load_back refused"] += 1
        EVENTS["load_back state only"] += not chain and bool(ch["loaded"] or node.state_slot)
        assert got in (0, tokens), (got, tokens)
        assert self.ps * len(ch["loaded"]) == got, (got, ch)
        if got:
            assert node.kv_value is not None and (node.host_state_slot is None
                                                   or node.state_slot is not None)
        del model

    def hold(self, on: bool) -> None:
        self.hc.hold_completions = on

    def release_poll(self) -> None:
        """Land every copy. Under write_back, a copy an eviction started demotes its victim
        when it lands (and a dead leaf left behind goes): only pages whose copies were in
        flight may be demoted."""
        flying = set(self.model.inflight)
        self.hc.release_held()
        self.cache.poll_transfers()
        assert self.hc.num_inflight == 0
        self.model.inflight.clear()
        wb = self.write_policy == "write_back"
        ch = self.absorb(dev_evict=wb, state_evict=wb, host_evict=wb)
        demoted = ch["dev_lost"] - ch["removed"]
        assert demoted <= flying, f"pages demoted without a write-back copy landing: {demoted - flying}"
        EVENTS["write-back demoted on landing"] += bool(demoted)

    def reset(self) -> None:
        self.cache.reset()
        self.model.clear()
        self.absorb()


__all__ = ["DOCS", "Harness", "ModelError", "NAMESPACES", "POLICIES", "make_key", "read_view"]
