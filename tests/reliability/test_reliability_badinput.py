"""Bad input at the public boundary, table-driven: each entry raises the documented exception
with a message naming the argument, and leaves every cache and every pool of the environment
exactly as it was (``pretty_print()``, ``stats()``, every allocator's ``snapshot()``).

``tests/radix/test_cache_badinput.py``, ``test_cache_swa_badinput.py`` and ``test_hicache_badinput.py``
hold the first kinds; this table adds the missing ones: token ids past int64, wrapping uint64
arrays, 0-d tensors, sets and bytes as keys, a value on another device (``meta``), the padding
slot, typed knobs (bool / float priorities, ``upto``), request records that do not fit their
own key, use after ``reset`` and after eviction, a double unlock through the request helpers,
an SWA node passed where its lock is needed, component calls on caches without that component, and misuse found
by the reliability suite (once strict xfails, now refused): slots that are free, held by a
node or repeated handed to ``insert`` (also through SWA and HiCache revival, and as pages that
are not whole), request records with an out-of-range ``cached_len`` or a lock they do not
hold, an unhashable ``rid``, a state pool that is not one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, SWAAllocator, TokenAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, LockRef, RadixCache, RadixKey
from tests.helpers.cache_helpers import node_slots, tiny_state_pool

BAD_INPUTS_TRIED: list[str] = []


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


@dataclass
class Env:
    c: RadixCache  # KV + states: [1,2,3] an unlocked leaf, [5,6] locked once
    kv: TokenAllocator
    sp: MambaStatePool
    w: RadixCache  # KV + SWA + states, window 2: [1,2,3,4] locked once (its lock in w_start)
    wkv: SWAAllocator
    wsp: MambaStatePool
    w_node: Any
    w_start: LockRef
    hc: RadixCache  # KV + states + HiCache: [7,8,9,10] host-only; ``stale`` predates a reset
    hkv: TokenAllocator
    hsp: MambaStatePool
    host_only: Any
    stale: Any
    leaf: Any  # c's unlocked leaf [1,2,3]
    locked: Any  # c's locked node [5,6]
    evicted: Any  # a node of c removed by evict
    slot: int  # a state slot the caller owns
    fresh: torch.Tensor  # 3 KV slots of c the caller owns
    wslot: int  # a state slot of w the caller owns
    wfresh: torch.Tensor  # 2 KV slots of w the caller owns
    released: Any  # a node of c whose request lock cache_finished_req released

    def caches(self) -> list[RadixCache]:
        return [self.c, self.w, self.hc]

    def pools(self) -> list[Any]:
        out = [self.kv, self.sp, self.wkv, self.wsp, self.hkv, self.hsp]
        assert self.hc.hicache is not None
        return out + [self.hc.hicache.host_kv, self.hc.hicache.host_state]


def build() -> Env:
    kv, sp = TokenAllocator(32), tiny_state_pool(4)
    c = RadixCache(kv_allocator=kv, state_allocator=sp)
    c.insert([1, 2, 3], kv.alloc(3), state_slot=int(sp.alloc(1)[0]))
    c.insert([5, 6], kv.alloc(2), state_slot=int(sp.alloc(1)[0]))
    c.insert([8, 8], kv.alloc(2), state_slot=int(sp.alloc(1)[0]))
    leaf = c.match_prefix([1, 2, 3]).last_device_node
    locked = c.match_prefix([5, 6]).last_device_node
    c.inc_lock_ref(locked)
    c.inc_lock_ref(leaf)
    evicted = c.match_prefix([8, 8]).last_device_node
    assert c.evict(2).num_tokens == 2 and evicted.parent is None
    c.dec_lock_ref(leaf)

    wkv, wsp = SWAAllocator(32, 16), tiny_state_pool(4)
    w = RadixCache(CacheConfig(sliding_window_size=2), kv_allocator=wkv, state_allocator=wsp)
    w.insert([1, 2, 3, 4], wkv.alloc(4), state_slot=int(wsp.alloc(1)[0]))
    w_node = w.match_prefix([1, 2, 3, 4]).last_device_node
    w_start = w.inc_lock_ref(w_node)

    hkv, hsp = TokenAllocator(16), tiny_state_pool(4)
    hc = RadixCache(kv_allocator=hkv, state_allocator=hsp, hicache=HiCacheConfig(load_back_threshold=0))
    hc.insert([3, 3], hkv.alloc(2), state_slot=int(hsp.alloc(1)[0]))
    stale = hc.match_prefix([3, 3]).last_device_node
    hc.reset()
    hc.insert([7, 8, 9, 10], hkv.alloc(4), state_slot=int(hsp.alloc(1)[0]))
    assert hc.evict(4).num_tokens == 4
    m = hc.match_prefix([7, 8, 9, 10])
    assert m.host_hit_length == 4
    # a request that ran over [1, 2, 3] and finished: cache_finished_req released its lock
    mr = c.match_prefix([1, 2, 3])
    c.inc_lock_ref(mr.last_device_node)
    c.cache_finished_req(CacheRequest(key=[1, 2, 3], kv_indices=mr.device_indices.clone(),
                                      cached_len=3, last_node=mr.last_device_node))
    env = Env(c, kv, sp, w, wkv, wsp, w_node, w_start, hc, hkv, hsp, m.last_host_node, stale,
              leaf, locked, evicted, int(sp.alloc(1)[0]), kv.alloc(3), int(wsp.alloc(1)[0]),
              wkv.alloc(2), mr.last_device_node)
    for cache in env.caches():
        cache.sanity_check()
    return env


def fingerprint(env: Env) -> tuple:
    return (
        tuple(c.pretty_print() for c in env.caches()),
        tuple(tuple(sorted(c.stats().items(), key=str)) for c in env.caches()),
        tuple(p.snapshot() for p in env.pools()),
    )


NEW = [7, 8, 9]


def req(env: Env, key: list[int], kv: torch.Tensor, **kw: Any) -> CacheRequest:
    fields: dict[str, Any] = {"cached_len": 0, "last_node": env.c.root}
    fields.update(kw)
    return CacheRequest(key=key, kv_indices=kv, **fields)


def free_state_slot(e: Env) -> int:
    """A state slot of ``e.c``'s pool that is free (the one the evicted node held)."""
    return int(np.flatnonzero(e.sp.free_mask)[0])


Case = tuple[str, Callable[[Env], Any], type[Exception], str]

CASES: list[Any] = [
    # ---- keys: types, shapes, ranges
    ("key token id past int64", lambda e: e.c.match_prefix([1, 2**63]), ValueError, "key"),
    ("key uint64 array wrapping negative",
     lambda e: e.c.match_prefix(np.array([1, 2**64 - 1], dtype=np.uint64)), ValueError, "key"),
    ("key 0-d tensor", lambda e: e.c.match_prefix(torch.tensor(3)), TypeError, "key"),
    ("key a set", lambda e: e.c.match_prefix({1, 2}), TypeError, "key"),
    ("key bytes", lambda e: e.c.match_prefix(b"\x01\x02"), TypeError, "key"),
    ("match extra_key a dict", lambda e: e.c.match_prefix([1], {"lora": "X"}), TypeError, "extra_key"),
    ("RadixKey unhashable extra_key", lambda e: RadixKey([1], ["X"]), TypeError, "extra_key"),
    ("RadixKey indexed by an int", lambda e: RadixKey([1, 2])[0], TypeError, "RadixKey"),
    # ---- values: devices, padding, negative, shapes
    ("value on the meta device",
     lambda e: e.c.insert(NEW, torch.empty(3, dtype=torch.int64, device="meta"), state_slot=e.slot),
     ValueError, "value"),
    ("value holds the padding slot 0", lambda e: e.c.insert(NEW, t64(0, 30, 31), state_slot=e.slot),
     ValueError, "value"),
    ("value holds a negative slot", lambda e: e.c.insert(NEW, t64(-1, 30, 31), state_slot=e.slot),
     ValueError, "value"),
    ("value 0-d", lambda e: e.c.insert([7], torch.tensor(5), state_slot=e.slot), ValueError, "value"),
    ("SWA value past the full pool", lambda e: e.w.insert([9, 9], t64(40, 41), state_slot=e.wslot),
     ValueError, "value"),
    # ---- knobs
    ("priority bool", lambda e: e.c.insert(NEW, e.fresh, state_slot=e.slot, priority=True), TypeError, "priority"),
    ("priority float", lambda e: e.c.insert(NEW, e.fresh, state_slot=e.slot, priority=1.5), TypeError, "priority"),
    ("kv_allocator None", lambda e: RadixCache(kv_allocator=None),  # type: ignore[arg-type]
     ValueError, "kv_allocator"),
    ("upto float", lambda e: e.c.cache_finished_req(req(e, NEW, e.fresh), state_slot=e.slot, upto=2.0),
     TypeError, "upto"),
    ("upto bool", lambda e: e.c.cache_unfinished_req(req(e, NEW, e.fresh), state_slot=e.slot, upto=True),
     TypeError, "upto"),
    ("req priority str", lambda e: e.c.cache_finished_req(req(e, NEW, e.fresh, priority="hi"), state_slot=e.slot),
     TypeError, "priority"),
    # ---- request records that do not fit
    ("req kv_indices longer than its key",
     lambda e: e.c.cache_finished_req(req(e, [7, 8], e.fresh), state_slot=e.slot), ValueError, "kv_indices"),
    ("req extra_key unhashable",
     lambda e: e.c.cache_finished_req(req(e, NEW, e.fresh, extra_key=["X"]), state_slot=e.slot),
     TypeError, "extra_key"),
    ("req kv_indices int32",
     lambda e: e.c.cache_finished_req(req(e, NEW, e.fresh.int()), state_slot=e.slot), TypeError, "int64"),
    # ---- locks, handles, use after reset / eviction
    ("double unlock: the engine releases a lock cache_finished_req released",
     lambda e: e.c.dec_lock_ref(e.released), ValueError, "lock"),
    ("lock a node evicted meanwhile", lambda e: e.c.inc_lock_ref(e.evicted), ValueError, "node"),
    ("cache_unfinished_req with a last_node from before reset",
     lambda e: e.hc.cache_unfinished_req(CacheRequest(key=[3, 3], kv_indices=t64(1, 2), cached_len=2,
                                                      last_node=e.stale)), ValueError, "node"),
    ("load_back a node from before reset", lambda e: e.hc.load_back(e.stale), ValueError, "node"),
    ("lock a host-only node through the request helper",
     lambda e: e.hc.cache_finished_req(CacheRequest(key=[7, 8, 9, 10], kv_indices=t64(1, 2, 3, 4),
                                                    cached_len=4, last_node=e.host_only)),
     ValueError, "host-only"),
    ("SWA dec_lock_ref with the node, not its lock", lambda e: e.w.dec_lock_ref(e.w_node),
     ValueError, "LockRef"),
    ("SWA dec_lock_ref with a bool", lambda e: e.w.dec_lock_ref(True), TypeError, "lock"),
    ("evict_swa without a sliding window", lambda e: e.c.evict_swa(1), ValueError, "sliding-window"),
    ("release_swa without a sliding window",
     lambda e: e.c.release_swa(req(e, NEW, e.fresh), 0), ValueError, "sliding-window"),
    ("evict_host without HiCache", lambda e: e.w.evict_host(1), ValueError, "HiCache"),
    # ---- misuse: slots the caller does not hold, request records that lie, bad handles
    ("insert KV slots that are free in the allocator",
     lambda e: e.c.insert(NEW, t64(30, 31, 32), state_slot=e.slot), ValueError, "value"),
    ("insert a state slot that is free in the pool",
     lambda e: e.c.insert(NEW, e.fresh, state_slot=free_state_slot(e)), ValueError, "state_slot"),
    ("insert repeating a KV slot",
     lambda e: e.c.insert(NEW, torch.cat([e.fresh[:2], e.fresh[:1]]), state_slot=e.slot),
     ValueError, "value"),
    ("insert new tokens on slots the tree holds",
     lambda e: e.c.insert([4, 4, 4], node_slots(e.leaf).clone(), state_slot=e.slot),
     ValueError, "value"),
    ("SWA insert of new tokens on slots the tree holds",
     lambda e: e.w.insert([9, 9], node_slots(e.w_node)[:2].clone(), state_slot=e.wslot),
     ValueError, "value"),
    ("SWA insert repeating a slot among its new tokens",
     lambda e: e.w.insert([1, 2, 3, 4, 5, 6], torch.cat([node_slots(e.w_node), e.wfresh[:1], e.wfresh[:1]]),
                          state_slot=e.wslot), ValueError, "value"),
    ("HiCache insert reviving a host-only node with free slots",
     lambda e: e.hc.insert([7, 8, 9, 10], t64(1, 2, 3, 4)), ValueError, "value"),
    ("req cached_len negative",
     lambda e: e.c.cache_finished_req(req(e, NEW, e.fresh, cached_len=-1), state_slot=e.slot),
     ValueError, "cached_len"),
    ("req cached_len past kv_indices",
     lambda e: e.c.cache_finished_req(req(e, NEW, e.fresh, cached_len=9), state_slot=e.slot),
     ValueError, "cached_len"),
    ("req last_node it does not hold a lock on",
     lambda e: e.c.cache_finished_req(
         req(e, [1, 2, 3, 4], torch.cat([node_slots(e.leaf), e.fresh[:1]]),
             cached_len=3, last_node=e.leaf), state_slot=e.slot), ValueError, "lock"),
    ("SWA req without its lock",
     lambda e: e.w.cache_finished_req(
         CacheRequest(key=[1, 2, 3, 4, 5, 6], kv_indices=torch.cat([node_slots(e.w_node), e.wfresh]),
                      cached_len=4, last_node=e.w_node),
         state_slot=e.wslot), ValueError, "lock"),
    ("SWA req with another node's lock",
     lambda e: e.w.cache_finished_req(
         CacheRequest(key=[1, 2, 3, 4, 5, 6], kv_indices=torch.cat([node_slots(e.w_node), e.wfresh]),
                      cached_len=4, last_node=e.w_node, lock=e.w.root),
         state_slot=e.wslot), ValueError, "lock"),
    ("insert with an unhashable rid",
     lambda e: e.c.insert([1, 2, 9], e.fresh, state_slot=e.slot, rid=["r"]), TypeError, "rid"),
    ("release_swa with a request that is not a CacheRequest",
     lambda e: e.w.release_swa("req", 0), TypeError, "req"),  # type: ignore[arg-type]
    ("req key None",
     lambda e: e.c.cache_finished_req(req(e, None, e.fresh), state_slot=e.slot),  # type: ignore[arg-type]
     TypeError, "key"),
    ("state_allocator not a state pool",
     lambda e: RadixCache(kv_allocator=TokenAllocator(4), state_allocator="pool"),  # type: ignore[arg-type]
     TypeError, "state_allocator"),
]


def _ids() -> list[str]:
    return [c.values[0] if hasattr(c, "values") else c[0] for c in CASES]


@pytest.mark.parametrize(("name", "call", "exc", "word"), CASES, ids=_ids())
def test_bad_input_raises_names_the_argument_and_changes_nothing(
        name: str, call: Callable[[Env], Any], exc: type[Exception], word: str) -> None:
    BAD_INPUTS_TRIED.append(name)
    env = build()
    before = fingerprint(env)
    with pytest.raises(exc) as info:
        call(env)
    assert word in str(info.value), f"{name}: message {str(info.value)!r} does not name {word!r}"
    assert fingerprint(env) == before, f"{name}: the refused call changed the cache"
    for cache in env.caches():
        cache.sanity_check()


def test_the_table_is_long_enough_and_its_environment_is_sound() -> None:
    assert len(CASES) >= 20
    env = build()
    assert env.leaf.kv_lock == 0 and env.locked.kv_lock == 1 and env.evicted.parent is None
    assert env.leaf.parent is env.c.root and env.leaf.key.tolist() == [1, 2, 3]  # kv_value: all 3
    assert free_state_slot(env) not in (env.slot, *env.c.state.slot_to_node)  # type: ignore[union-attr]
    assert env.host_only.kv_value is None and env.host_only.host_value is not None
    assert env.w_node.lock_ref == 1 and isinstance(env.w_start, LockRef)
    # the good versions of a few refused calls work
    res = env.c.insert(NEW, env.fresh, state_slot=env.slot, priority=2)
    assert res.inserted_len == 3 and res.state_adopted
    env.w.dec_lock_ref(env.w_start)
    assert env.hc.load_back(env.host_only) == 4
    for cache in env.caches():
        cache.sanity_check()


def test_paged_insert_refuses_slots_that_are_not_whole_pages_and_repeated_pages() -> None:
    kv, sp = PagedAllocator(32, 4), tiny_state_pool(4)
    c = RadixCache(CacheConfig(page_size=4), kv_allocator=kv, state_allocator=sp)
    mine, slot = kv.alloc(8), int(sp.alloc(1)[0])
    key = list(range(1, 9))
    before = c.pretty_print(), kv.snapshot(), sp.snapshot()
    bad_values = [
        ("of one page", torch.cat([mine[1:4], mine[:1], mine[4:]])),  # a page out of order
        ("of one page", torch.cat([mine[:2], mine[6:8], mine[4:]])),  # halves of two pages
        ("repeats page", torch.cat([mine[:4], mine[:4]])),
        ("free in the KV allocator", torch.cat([mine[:4], t64(28, 29, 30, 31)])),
        ("outside the KV pool", torch.cat([mine[:4], t64(36, 37, 38, 39)])),
    ]
    for why, value in bad_values:
        with pytest.raises(ValueError, match="value") as info:
            c.insert(key, value, state_slot=slot)
        assert why in str(info.value), (why, str(info.value))
        assert (c.pretty_print(), kv.snapshot(), sp.snapshot()) == before, why
    res = c.insert(key, mine, state_slot=slot)
    assert res.inserted_len == 8 and res.state_adopted
    with pytest.raises(ValueError, match="already holds"):  # the tree's pages for new tokens
        c.insert(list(range(11, 19)), mine.clone(), state_slot=int(sp.alloc(1)[0]))
    c.sanity_check()

