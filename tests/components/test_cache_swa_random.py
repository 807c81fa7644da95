"""Seeded random-operation stress of an SWA RadixCache (full + SWA, and full + SWA + state)
against the brute-force model in refmodel_swa.py.

Operations: plain insert (with or without a matched, locked prefix; sometimes with the caller's
leading slots SWA-released first), match (+ lock), unlock, evict, evict_swa, evict_states,
requests driven through release_swa / cache_unfinished_req / cache_finished_req, caller-held
slots (some SWA-released), reset.

After every step: ``sanity_check()``; the library's nodes equal the model's (slots, state,
locks, tombstones, SWA locks); every answer equals the model's (the usable prefix of each match
is the model's brute-force token-level computation); what each call freed, in order, equals
the model's; and each pool's accounting law holds with exact sets:

* full: ``full_available + evictable + protected + caller-held == size``
* SWA:  ``swa_available + swa_evictable + swa_protected + caller-held-live == swa_size``
* states: ``available + state_evictable + state_protected + caller-held == size``
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from allocators import SWAAllocator
from radix import CacheConfig, CacheRequest, LockRef, RadixCache
from tests.helpers.cache_helpers import draw_key, node_slots, tiny_state_pool
from tests.helpers.refmodel_swa import EvictOut, Prefix, SWARefCache


def t64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def library_view(cache: RadixCache) -> dict[tuple, tuple]:
    """Node end -> (slots, state, KV lock, state lock, tombstone, SWA lock)."""
    out = {}
    stack = [(c, ()) for c in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        toks = above + tuple(int(x) for x in node.key)
        out[(node.extra_key, toks)] = (node_slots(node).tolist(), node.state_slot, node.kv_lock,
                                       node.state_lock, node.swa_tombstone, node.swa_lock)
        stack.extend((c, toks) for c in node.children.values())
    return out


def expand(page_ids: list[int], ps: int) -> list[int]:
    return [p * ps + i for p in page_ids for i in range(ps)]


def swa_start(lock: Any) -> int | None:
    """Where a lock's sliding-window part starts [tokens] (None: the root's lock)."""
    return lock.part("swa") if isinstance(lock, LockRef) else None


@dataclass(eq=False)
class Req:
    req: CacheRequest
    node: Prefix | None  # the model's mirror of req.last_node
    computed: int


class SWAHarness:
    def __init__(self, seed: int, page_size: int, hybrid: bool, window: int,
                 full: int = 40, swa: int = 24, states: int = 6, extra_pages: int = 0) -> None:
        self.rng = random.Random(seed)
        self.ps = page_size
        self.w = window
        self.extra = extra_pages  # pages release_swa keeps live past max(window, page)
        self.kv = SWAAllocator(full, swa, page_size)
        self.pool = tiny_state_pool(states) if hybrid else None
        self.cache = RadixCache(CacheConfig(page_size=page_size, sliding_window_size=window,
                                            swa_release_extra_pages=extra_pages),
                                kv_allocator=self.kv, state_allocator=self.pool)
        self.model = SWARefCache(page_size, window, hybrid)
        self.hybrid = hybrid
        self.keys: list[tuple[list[int], Any]] = []
        self.locks: list[tuple[Any, Prefix | None, int | None]] = []
        self.reqs: list[Req] = []
        self.held: list[list[int]] = []
        self.held_states: list[int] = []
        self.counts = {"revived": 0, "tomb_match": 0, "release": 0, "swa_evicted": 0}

    # ------------------------------------------------------------------ observation
    def full_free(self) -> list[int]:
        return expand(self.kv.snapshot().free_ids(), self.ps)

    def swa_free(self) -> list[int]:
        return expand(self.kv.snapshot().swa.free_ids(), self.ps)

    def caller_slots(self) -> list[int]:
        own = [s for r in self.reqs for s in r.req.kv_indices[r.req.cached_len:].tolist()]
        for r in self.reqs:  # own live copies kept below cached_len (the tree has a tombstone)
            tree = self.model.node_slots_path(r.node) if r.node is not None else []
            head = r.req.kv_indices[: r.req.cached_len].tolist()
            own += [c for c, t in zip(head, tree, strict=True) if c != t]
        return own + [s for h in self.held for s in h]

    # ------------------------------------------------------------------ keys
    def gen_key(self) -> tuple[list[int], Any]:
        return draw_key(self.rng, self.keys, recent=12, grow=(0, 6), fresh=(0, 10), cap=16,
                        extras=[None, None, "lora"], switch=0.05)

    # ------------------------------------------------------------------ checked calls
    def match(self, toks: list[int], extra: Any):
        m = self.cache.match_prefix(toks, extra)
        e = self.model.match(toks, extra)
        got = (m.prefix_len, m.kv_hit_length, m.device_indices.tolist(), m.state_slot,
               m.branching_seqlen, m.swa_miss_tokens)
        assert got == (e.prefix_len, e.kv_hit_length, e.device_indices, e.state_slot,
                       e.branching_seqlen, e.swa_miss_tokens), (toks, extra)
        assert (m.last_device_node is self.cache.root) == (e.node is None)
        assert m.last_device_node.depth == m.prefix_len or e.node is None
        if e.swa_miss_tokens:
            self.counts["tomb_match"] += 1
        return m, e

    def lock(self, node: Any, mnode: Prefix | None) -> Any:
        lock = self.cache.inc_lock_ref(node)
        assert swa_start(lock) == self.model.lock(mnode)
        return lock

    def unlock(self, node: Any, mnode: Prefix | None, lock: Any) -> None:
        before = len(self.full_free())
        self.cache.dec_lock_ref(lock)
        out = self.model.unlock(mnode, swa_start(lock))
        assert self.full_free()[before:] == out.freed_slots

    def evict(self, kind: str, n: int) -> None:
        """Run one library eviction and the model's; ties (equal stamps) resolved by what the
        library freed, in order (full slots, or the full ids whose SWA slots went back)."""
        held = self.model.held_slots()
        inv = dict(zip(self.kv.translate(t64(held)).tolist(), held, strict=True)) if held else {}
        f0, s0 = len(self.full_free()), len(self.swa_free())
        p0 = len(self.pool.snapshot().free_ids()) if self.pool is not None else 0
        r = getattr(self.cache, kind)(n)
        freed = self.full_free()[f0:]
        freed_swa = [inv[s] for s in self.swa_free()[s0:]]

        def choose(tied: list[Prefix], out: EvictOut) -> Prefix:
            if kind == "evict":
                seq, at = freed, len(out.freed_slots)
            else:
                seq, at = freed_swa, len(out.freed_swa)
            hits = [p for p in tied if seq[at: at + len(self.model.node_slots(p))]
                    == self.model.node_slots(p)]
            assert len(hits) == 1, f"{kind}: the library freed {seq[at:]}, none of {tied}"
            return hits[0]

        e = getattr(self.model, kind)(n, choose)
        assert (r.num_tokens, r.num_states, r.num_swa_tokens) == (
            e.num_tokens, e.num_states, e.num_swa_tokens), kind
        assert freed == e.freed_slots and freed_swa == e.freed_swa, kind
        if self.pool is not None:
            assert self.pool.snapshot().free_ids()[p0:] == e.freed_states
        self.counts["swa_evicted"] += e.num_swa_tokens

    def ensure_kv(self, n: int) -> list[int] | None:
        if self.kv.full_available_size() < n:
            self.evict("evict", n - self.kv.full_available_size())
        if self.kv.swa_available_size() < n:
            self.evict("evict_swa", n - self.kv.swa_available_size())
        got = self.kv.alloc(n)
        return None if got is None else got.tolist()

    def ensure_state(self) -> int | None:
        assert self.pool is not None
        if self.pool.available_size() < 1:
            self.evict("evict_states", 1)
        got = self.pool.alloc(1)
        return None if got is None else int(got[0])

    def free(self, slots: list[int]) -> None:
        if slots:
            self.kv.free(t64(slots))
            self.model.freed(slots)

    def check_insert(self, res: Any, e: Any) -> None:
        assert (res.prefix_len, res.inserted_len, res.state_adopted) == (
            e.prefix_len, e.inserted_len, e.state_adopted)
        assert res.duplicate_indices.tolist() == e.duplicate_indices
        assert res.adopted_indices.tolist() == e.adopted_indices
        assert res.remainder_indices.tolist() == e.remainder_indices
        assert res.revived_indices.tolist() == e.revived_indices
        assert (res.last_node is self.cache.root) == (e.node is None)
        self.counts["revived"] += len(e.revived_indices)

    # ------------------------------------------------------------------ operations
    def op_insert(self) -> None:
        toks, extra = self.gen_key()
        if self.hybrid:  # the state is valid at a page end (insert refuses others)
            toks = toks[: len(toks) // self.ps * self.ps]
        rng = self.rng
        prefix: list[int] = []
        locked = None
        if rng.random() < 0.6:
            m, e = self.match(toks, extra)
            prefix = m.device_indices.tolist()
            locked = (m.last_device_node, e.node, self.lock(m.last_device_node, e.node))
        need = len(toks) - len(prefix)
        fresh = self.ensure_kv(-(-need // self.ps) * self.ps)
        slot = None
        if fresh is not None and self.hybrid:
            slot = self.ensure_state()
            if slot is None:
                self.free(fresh)
                fresh = None
        if fresh is not None:
            if fresh and rng.random() < 0.35:  # the caller's leading pages slid out already
                r = rng.randint(1, len(fresh) // self.ps) * self.ps
                self.kv.free_swa(t64(fresh[:r]))
                self.model.free_swa(fresh[:r])
            value = prefix + fresh[:need]
            f0 = len(self.full_free())
            res = self.cache.insert(toks, t64(value), extra, state_slot=slot)
            e = self.model.insert(toks, value, extra, state_slot=slot)
            self.check_insert(res, e)
            assert self.full_free()[f0:] == e.freed_old
            self.free(e.duplicate_indices)
            self.free(value[res.inserted_len:] + fresh[need:])
            if slot is not None and not res.state_adopted:
                if rng.random() < 0.7:
                    self.pool.free(t64([slot]))  # type: ignore[union-attr]
                else:
                    self.held_states.append(slot)
        if locked is not None:
            self.unlock(*locked)

    def op_match(self) -> None:
        toks, extra = self.gen_key()
        m, e = self.match(toks, extra)
        if self.rng.random() < 0.4:
            self.locks.append((m.last_device_node, e.node, self.lock(m.last_device_node, e.node)))

    def op_unlock(self) -> None:
        if self.locks:
            self.unlock(*self.locks.pop(self.rng.randrange(len(self.locks))))

    def op_evict(self) -> None:
        self.evict("evict", self.rng.randint(0, 8))

    def op_evict_swa(self) -> None:
        self.evict("evict_swa", self.rng.randint(0, 8))

    def op_evict_states(self) -> None:
        if self.hybrid:
            self.evict("evict_states", self.rng.randint(0, 3))

    def op_hold(self) -> None:
        got = self.kv.alloc(self.ps * self.rng.randint(1, 3))
        if got is not None:
            slots = got.tolist()
            if self.rng.random() < 0.4:  # held slots may have released their SWA side
                self.kv.free_swa(t64(slots[: self.ps]))
                self.model.free_swa(slots[: self.ps])
            self.held.append(slots)

    def op_release(self) -> None:
        if self.held:
            self.free(self.held.pop(self.rng.randrange(len(self.held))))
        if self.held_states:
            self.pool.free(t64([self.held_states.pop()]))  # type: ignore[union-attr]

    def op_reset(self) -> None:
        if not self.locks and not self.reqs:
            self.cache.reset()
            self.model.reset()

    # ------------------------------------------------------------------ requests
    def op_req_start(self) -> None:
        if len(self.reqs) >= 3:
            return
        toks, extra = self.gen_key()
        toks = toks[: len(toks) // self.ps * self.ps]
        if not toks:
            return
        m, e = self.match(toks, extra)
        start = self.lock(m.last_device_node, e.node)
        req = CacheRequest(key=toks, kv_indices=m.device_indices.clone(), cached_len=m.prefix_len,
                           last_node=m.last_device_node, extra_key=extra, lock=start,
                           rid=self.rng.randint(0, 3))
        self.reqs.append(Req(req, e.node, m.prefix_len))

    def release(self, r: Req) -> None:
        req = r.req
        upto = max(r.computed - max(self.w, self.ps) - self.extra * self.ps, 0) // self.ps * self.ps
        lo = max(req.swa_evicted_seqlen, req.cached_len)
        want = max(0, upto - lo)
        slots = req.kv_indices[lo:upto].tolist() if want else []
        swa = self.kv.translate(t64(slots)).tolist() if slots else []
        s0 = len(self.swa_free())
        assert self.cache.release_swa(req, r.computed) == want
        assert self.swa_free()[s0:] == swa
        self.model.free_swa(slots)
        self.counts["release"] += want

    def op_req_step(self) -> None:
        if not self.reqs:
            return
        r = self.rng.choice(self.reqs)
        left = len(r.req.key) - r.computed
        if left == 0:
            self.finish(r)
            return
        fresh = self.ensure_kv(self.rng.randint(1, left // self.ps) * self.ps)
        if fresh is None:
            return
        r.req.kv_indices = torch.cat([r.req.kv_indices, t64(fresh)])
        r.computed += len(fresh)
        if self.rng.random() < 0.7:
            self.release(r)
        if self.rng.random() < 0.6:
            self.cache_req(r, finished=False)

    def op_req_finish(self) -> None:
        if self.reqs:
            self.finish(self.rng.choice(self.reqs))

    def finish(self, r: Req) -> None:
        if self.rng.random() < 0.5:
            self.release(r)
        if self.cache_req(r, finished=True):
            self.reqs.remove(r)

    def cache_req(self, r: Req, finished: bool) -> bool:
        req = r.req
        slot = None
        if self.hybrid:
            slot = self.ensure_state()
            if slot is None:
                return False
        old_kv = req.kv_indices.tolist()
        live_before = self.kv.has_swa(req.kv_indices).tolist() if old_kv else []
        old_node, old_start = r.node, swa_start(req.lock)
        f0 = len(self.full_free())
        p0 = len(self.pool.snapshot().free_ids()) if self.pool is not None else 0
        call = self.cache.cache_finished_req if finished else self.cache.cache_unfinished_req
        res = call(req, state_slot=slot)
        key = req.key[: len(old_kv)]
        e = self.model.insert(key, old_kv, req.extra_key, state_slot=slot)
        self.check_insert(res, e)
        freed = list(e.freed_old)
        # Duplicates over the whole prefix: a running request keeps its own live copy where the
        # tree only holds a tombstone (it still needs that SWA KV); it frees it when it finishes.
        tree_now = self.model.node_slots_path(e.node)[: e.prefix_len]
        tree_live = self.kv.has_swa(torch.tensor(tree_now, dtype=torch.int64)).tolist() if tree_now else []
        kept = [
            i for i, t in enumerate(tree_now)
            if not finished and old_kv[i] != t and live_before[i] and not tree_live[i]
        ]
        freed += [c for i, c in enumerate(old_kv[: e.prefix_len]) if c != tree_now[i] and i not in kept]
        if finished:
            freed += old_kv[e.inserted_len:]
            out = self.model.unlock(old_node, old_start)
            assert (req.last_node, req.lock, req.cached_len) == (self.cache.root, None, 0)
            assert req.kv_indices.tolist() == []
        else:
            start = self.model.lock(e.node)
            out = self.model.unlock(old_node, old_start)
            assert swa_start(req.lock) == start and req.cached_len == e.inserted_len
            tree = self.model.node_slots_path(e.node)
            for i in kept:
                tree[i] = old_kv[i]
            assert req.kv_indices.tolist() == tree + old_kv[e.inserted_len:]
            r.node = e.node
        freed += out.freed_slots
        assert self.full_free()[f0:] == freed
        self.model.freed(freed)
        if self.pool is not None:
            back = [] if res.state_adopted else [slot]
            assert self.pool.snapshot().free_ids()[p0:] == back + out.freed_states
        return True

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        cache, model, kv = self.cache, self.model, self.kv
        cache.sanity_check()
        model.check()
        assert library_view(cache) == model.view(), cache.pretty_print()
        ev, pr, sev, spr, stev, stpr = model.sizes()
        assert (cache.evictable_size(), cache.protected_size()) == (ev, pr)
        assert (cache.swa_evictable_size(), cache.swa_protected_size()) == (sev, spr)
        assert (cache.state_evictable_size(), cache.state_protected_size()) == (stev, stpr)
        tree, caller, free = model.held_slots(), self.caller_slots(), self.full_free()
        assert len(tree) + len(caller) + len(free) == kv.size
        assert set(tree) | set(caller) | set(free) == set(range(self.ps, self.ps + kv.size))
        assert kv.full_available_size() + ev + pr + len(caller) == kv.size
        live_caller = [s for s in caller if s not in model.dead]
        assert kv.swa_available_size() + sev + spr + len(live_caller) == kv.swa_size
        held = tree + caller
        if held:
            has = kv.has_swa(t64(held)).tolist()
            assert {s for s, h in zip(held, has, strict=True) if not h} == model.dead
        if self.pool is not None:
            sfree = self.pool.snapshot().free_ids()
            assert self.pool.available_size() + stev + stpr + len(self.held_states) == self.pool.size
            assert (sorted(model.held_states() + self.held_states + sfree)
                    == list(range(1, self.pool.size + 1)))
        for r in self.reqs:  # a request's first cached_len slots are the tree's, locked,
            # except its own live copies kept where the tree holds a tombstone
            tree_path = model.node_slots_path(r.node)
            head = r.req.kv_indices[: r.req.cached_len].tolist()
            tree_live = kv.has_swa(t64(tree_path)).tolist() if tree_path else []
            for c, t, live in zip(head, tree_path, tree_live, strict=True):
                assert c == t or (not live and c not in model.dead), (c, t)

    def run(self, steps: int) -> None:
        ops = [(self.op_insert, 25), (self.op_match, 14), (self.op_unlock, 10),
               (self.op_evict, 6), (self.op_evict_swa, 8), (self.op_evict_states, 5),
               (self.op_req_start, 8), (self.op_req_step, 12), (self.op_req_finish, 4),
               (self.op_hold, 3), (self.op_release, 3), (self.op_reset, 1)]
        fns = [f for f, _ in ops]
        weights = [w for _, w in ops]
        self.check()
        for _ in range(steps):
            self.rng.choices(fns, weights)[0]()
            self.check()
        while self.reqs:  # drain: every request finishes, every lock goes, every slot back
            if self.cache_req(self.reqs[0], finished=True):
                self.reqs.pop(0)
            else:
                self.evict("evict_states", 1)
            self.check()
        while self.locks:
            self.op_unlock()
            self.check()
        self.evict("evict", 10**6)
        self.check()
        assert self.cache.total_size() == 0 and not self.model.pages and not self.model.dead - {
            s for h in self.held for s in h}
        for h in self.held:
            self.kv.free(t64(h))
        assert (self.kv.full_available_size(), self.kv.swa_available_size()) == (
            self.kv.size, self.kv.swa_size)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full+swa", "full+swa+state"])
@pytest.mark.parametrize("extra_pages", [0, 1])
def test_random_swa_against_model(seed: int, page_size: int, hybrid: bool,
                                  extra_pages: int) -> None:
    # Windows below, at and above the page size (with an extra page, smaller ones: the keys
    # of at most 16 tokens must still slide past the larger margin).
    window = ([1, 2, 3, 1, 2, 3] if extra_pages else [1, 2, 3, 4, 5, 6])[seed]
    h = SWAHarness(1000 + 10 * seed + page_size + 100 * hybrid + 7 * extra_pages, page_size,
                   hybrid, window, extra_pages=extra_pages)
    h.run(300)
    # The run must have exercised what it is about.
    assert h.counts["swa_evicted"] > 0 and h.counts["release"] > 0, h.counts
