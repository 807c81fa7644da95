"""The threading contract: engine calls on one thread, the library's own threads beside it.

* The L3 prefetch thread fills jobs and the writer thread stores backups while the engine
  thread keeps matching, inserting, loading back and evicting; prefetched pages land at
  whatever call comes next. Every step is followed by ``sanity_check`` and every KV slot the
  cache hands out holds the bytes of exactly the tokens it stands for (labels computed from
  the tokens), whoever wrote them.
* ``LockedCache`` serialises the calls of several engine threads.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from allocators import TokenAllocator
from radix import CacheConfig, RadixCache
from radix.locked import LockedCache
from tests.storage.test_storage_common import L3, WAIT_S, fresh_model, make, wrap_flaky


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    """Start ``threads`` and wait for each, at most ``timeout_s`` [s]: every one must finish."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive()


def label(ns: Any, tokens: list[int]) -> float:
    """The KV value of the last token of ``tokens`` (its whole prefix decides it): exact in
    float32."""
    return float(hash((ns, tuple(tokens))) % (1 << 20))


def fill(h: L3, slots: torch.Tensor, key: list[int], ns: Any, lo: int = 0) -> None:
    vals = torch.tensor([label(ns, key[: i + 1]) for i in range(lo, lo + len(slots))])
    h.pool.k_all[:, slots] = vals.view(1, -1, 1, 1)
    h.pool.v_all[:, slots] = -vals.view(1, -1, 1, 1)


def check_served(h: L3, key: list[int], ns: Any, m: Any) -> None:
    n = m.prefix_len
    if not n:
        return
    want = torch.tensor([label(ns, key[: i + 1]) for i in range(n)])
    got = h.pool.k_all[0, m.device_indices, 0, 0]
    assert torch.equal(got, want), "a slot holds another prefix's KV"
    assert torch.equal(h.pool.v_all[1, m.device_indices, 0, 0], -want)


def compute(h: L3, key: list[int], ns: Any) -> None:
    """What an engine does for one request: match, load what the host has, compute the rest,
    insert, free what the tree does not keep."""
    c = h.cache
    m = c.match_prefix(key, ns)
    check_served(h, key, ns, m)
    if m.host_hit_length:
        c.load_back(m.last_host_node)
        m = c.match_prefix(key, ns)
        check_served(h, key, ns, m)
    need = len(key) - m.prefix_len
    if need <= 0:
        return
    lock = c.inc_lock_ref(m.last_device_node)  # an eviction for room never frees the match
    try:
        slots = h.kv.alloc(need)
        if slots is None:
            c.evict(need)
            slots = h.kv.alloc(need)
        if slots is None:
            return
        fill(h, slots, key, ns, m.prefix_len)
        res = c.insert(key, torch.cat([m.device_indices, slots]), ns)
    finally:
        c.dec_lock_ref(lock)
    if len(res.duplicate_indices):
        h.kv.free(res.duplicate_indices)


@pytest.mark.parametrize("seed", range(3))
def test_prefetches_and_backups_land_while_the_engine_thread_works(
        tmp_path: Any, caches: list[L3], seed: int) -> None:
    rng = random.Random(seed)
    where, model = str(tmp_path / "l3"), fresh_model()
    prefixes = [[rng.randint(1, 50) for _ in range(8)] for _ in range(4)]
    keys = [p + [rng.randint(1, 50) for _ in range(rng.choice([4, 8, 12]))]
            for p in prefixes for _ in range(3)]
    spaces = [None, "tenant"]
    a = make("file", where=where, model=model, size=128, prefetch="best_effort")
    caches.append(a)
    for k in keys[::2]:
        compute(a, k, rng.choice(spaces))
    assert a.cache.flush_storage(WAIT_S)
    b = make("file", where=where, model=model, size=48, prefetch="best_effort")
    caches.append(b)
    flaky = wrap_flaky(b)
    landed_late = 0
    for step in range(160):
        if step % 20 == 0:
            flaky.gate.clear()  # the prefetch thread stalls on its next read ...
        if step % 20 == 7:
            flaky.gate.set()  # ... and lands while the engine goes on
        key, ns = rng.choice(keys), rng.choice(spaces)
        op = rng.random()
        before = b.cache.stats()["l3_prefetch_pages"]
        if op < 0.55:
            compute(b, key, ns)
        elif op < 0.75:
            m = b.cache.match_prefix(key, ns)
            check_served(b, key, ns, m)
        elif op < 0.85:
            b.cache.evict(rng.randint(1, 16))
        elif op < 0.93:
            b.cache.evict_host(rng.randint(1, 16))
        else:
            b.cache.poll_storage()
        if b.cache.stats()["l3_prefetch_pages"] > before:
            landed_late += 1
        b.cache.sanity_check()
    flaky.gate.set()
    assert b.cache.flush_storage(WAIT_S)
    b.cache.sanity_check()
    st = b.cache.stats()
    assert st["l3_prefetch_pages"] > 0 and st["l3_backup_written"] > 0 and landed_late > 0
    assert st["l3_faults"] == 0 and st["l3_backend_corrupt"] == 0
    for k in keys:  # every slot still holds its own prefix's bytes
        for ns in spaces:
            check_served(b, k, ns, b.cache.match_prefix(k, ns))


def test_locked_cache_serialises_calls_from_several_threads() -> None:
    kv = TokenAllocator(256)
    lc = LockedCache(RadixCache(CacheConfig(), kv_allocator=kv))
    errors: list[BaseException] = []
    alloc_lock = threading.Lock()  # the allocator is the engine's: guarded by the engine

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                key = [rng.randint(1, 4) for _ in range(rng.randint(1, 10))]
                with lc.lock:  # one request's match + insert as one step
                    m = lc.match_prefix(key)
                    lock = lc.inc_lock_ref(m.last_device_node)
                    with alloc_lock:
                        fresh = kv.alloc(len(key) - m.prefix_len)
                        if fresh is None:
                            lc.evict(len(key))
                            fresh = kv.alloc(len(key) - m.prefix_len)
                    if fresh is not None:
                        res = lc.insert(key, torch.cat([m.device_indices, fresh]))
                        if len(res.duplicate_indices):
                            kv.free(res.duplicate_indices)
                    lc.dec_lock_ref(lock)
                lc.stats()
                if rng.random() < 0.1:
                    lc.evict(rng.randint(1, 8))
        except BaseException as exc:  # reported below
            errors.append(exc)

    join_all([threading.Thread(target=worker, args=(i,)) for i in range(3)], 10 * WAIT_S)
    assert not errors, errors
    lc.sanity_check()
    assert lc.evictable_size() + kv.available_size() == 256  # nothing leaked, nothing locked


def test_locked_cache_holds_its_lock_around_a_call() -> None:
    lc = LockedCache(RadixCache(CacheConfig(), kv_allocator=TokenAllocator(16)))
    done = threading.Event()
    t = threading.Thread(target=lambda: (lc.match_prefix([1, 2]), done.set()))
    with lc.lock:
        t.start()
        time.sleep(0.2)  # (a late start only makes the check weaker, never wrong)
        assert not done.is_set()  # the call waits for the lock
    t.join(WAIT_S)
    assert done.is_set()
    assert lc.page_size == 1 and lc.cache.page_size == 1  # plain attributes pass through
    with pytest.raises(TypeError, match="RadixCache"):
        LockedCache(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------ issue 36, item 10
def hybrid_locked(kv_size: int = 96, states: int = 12) -> tuple[LockedCache, Any]:
    from allocators import MambaStatePool

    sp = MambaStatePool(states, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))
    # (lfu: a node just matched may be the next victim, as it may not be under lru)
    cache = RadixCache(CacheConfig(radix_eviction_policy="lfu"),
                       kv_allocator=TokenAllocator(kv_size), state_allocator=sp)
    return LockedCache(cache), sp


def test_a_request_step_under_locked_guards_the_cache_and_its_allocators() -> None:
    """Two engine threads, each request step (match -> lock -> allocate with evict-and-retry ->
    write the state -> insert -> free -> unlock) inside ``with lc.locked()``, allocating
    through ``lc.kv_allocator`` / ``lc.state_allocator``: no refusal, and every state a match
    serves holds the signature of exactly its prefix (a slot handed to both threads would
    hold the other's). Before: no ``locked()`` and no guarded allocators (a lock per call:
    72 refusals in 5,000 operations, 10 wrong states with the allocators unlocked)."""
    lc, sp = hybrid_locked(kv_size=24, states=4)  # small: evictions at most steps
    assert lc.state_allocator is not None
    errors: list[BaseException] = []
    served = [0, 0]

    def step(rng: random.Random, who: int) -> None:
        key = [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
        with lc.locked():
            m = lc.match_prefix(key)
            if m.state_slot is not None:
                assert float(sp.conv[0, m.state_slot, 0]) == label(None, key[:m.prefix_len])
                served[who] += 1
            time.sleep(0)  # the other thread runs meanwhile: it must wait for this step
            lock = lc.inc_lock_ref(m.last_device_node)
            need = len(key) - m.prefix_len
            fresh = lc.kv_allocator.alloc(need)
            if fresh is None:
                lc.evict(need)
                fresh = lc.kv_allocator.alloc(need)
            slot = lc.state_allocator.alloc_slot()
            if slot is None:
                lc.evict_states(1)
                slot = lc.state_allocator.alloc_slot()
            if fresh is None or slot is None:
                if fresh is not None:
                    lc.kv_allocator.free(fresh)
                if slot is not None:
                    lc.state_allocator.free_slot(slot)
                lc.dec_lock_ref(lock)
                return
            time.sleep(0)
            sp.conv[0, slot, 0] = label(None, key)
            res = lc.insert(key, torch.cat([m.device_indices, fresh]), state_slot=slot)
            if len(res.duplicate_indices):
                lc.kv_allocator.free(res.duplicate_indices)
            if not res.state_adopted:
                lc.state_allocator.free_slot(slot)
            lc.dec_lock_ref(lock)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(600):
                step(rng, seed)
        except BaseException as exc:  # reported below
            errors.append(exc)

    join_all([threading.Thread(target=worker, args=(i,)) for i in range(2)], 10 * WAIT_S)
    assert not errors, errors[:3]
    assert min(served) > 0  # both threads were served states (checked above)
    lc.sanity_check()
    assert lc.evictable_size() + lc.kv_allocator.available_size() == 24
    assert lc.state_evictable_size() + sp.available_size() == 4


def test_locked_holds_other_threads_allocator_calls_until_the_step_ends() -> None:
    lc, _ = hybrid_locked()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(lc.kv_allocator.alloc(4)))
    with lc.locked() as same:
        assert same is lc
        m = lc.match_prefix([1, 2, 3])
        t.start()
        time.sleep(0.2)  # (a late start only makes the check weaker, never wrong)
        assert not got  # the other thread's alloc waits for this step
        assert lc.kv_allocator.available_size() == 96 and m.prefix_len == 0
    t.join(WAIT_S)
    assert len(got) == 1 and got[0] is not None and len(got[0]) == 4
    assert repr(lc.kv_allocator).startswith("Guarded(")


def test_a_node_matched_inside_locked_cannot_be_evicted_before_it_is_locked() -> None:
    """Thread A matches a cached prefix and locks it a moment later; thread B asks for an
    eviction of everything in between. Inside ``with lc.locked()`` B waits, so A's lock is
    taken on a node still in the tree and B's eviction then spares it. With a lock per call
    only, B evicts the node first and A's ``inc_lock_ref`` is refused (``not in this
    cache``). A holds its lock until B's eviction has returned (before: 0.2 s, and a B
    scheduled later evicted the unlocked node)."""
    lc, sp = hybrid_locked()
    kv = lc.kv_allocator
    slot = lc.state_allocator.alloc_slot() if lc.state_allocator is not None else None
    lc.insert([1, 2, 3, 4], kv.alloc(4), state_slot=slot)
    matched, asking, evicted = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    freed: list[int] = []

    def a() -> None:
        try:
            with lc.locked():
                m = lc.match_prefix([1, 2, 3, 4])
                matched.set()
                assert asking.wait(WAIT_S)
                time.sleep(0.2)  # B's eviction is asked for now (a late one: still after)
                lock = lc.inc_lock_ref(m.last_device_node)
            assert evicted.wait(WAIT_S)  # B's eviction ran while A held the node
            lc.dec_lock_ref(lock)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def b() -> None:
        try:
            assert matched.wait(WAIT_S)
            asking.set()
            freed.append(lc.evict(100).num_tokens)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            evicted.set()

    join_all([threading.Thread(target=a), threading.Thread(target=b)], 2 * WAIT_S)
    assert not errors, errors
    assert freed == [0]  # the locked node was spared
    assert lc.match_prefix([1, 2, 3, 4]).prefix_len == 4
    lc.sanity_check()
