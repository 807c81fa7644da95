"""Allocation fault injection everywhere a step allocates, checked by the reference model.

Each case is an engine step run through the reliability harness (``reliability_harness``) on
a populated cache: a one-shot insert (device KV and state for the caller, host KV and state for
write-through backups), a chunked prefill step (``cache_unfinished_req``: a checkpoint state,
backups), a finish (``cache_finished_req``), ``evict`` and ``evict_states`` under write-back
(host KV and state for the copy), ``load_back`` (device KV and state, evicting when short), a
request start that loads back first, and with a sliding window the engine's own multi-pool
allocations (full + SWA KV, states) with their evict-and-retry.

For every ``k`` up to the number of ``alloc`` calls the step makes without faults, and for both
modes (``from``: the k-th call and every later one fail, a shortage eviction cannot cure;
``once``: only the k-th fails), a fresh copy of the cache runs the step with the fault:

* every multi-pool allocation that fails (``alloc_all``) leaves every pool's ``snapshot()``
  (free-list order included), ``pretty_print()`` and ``stats()`` exactly as just before it;
* a ``load_back`` that fails with nothing evictable leaves the whole cache as it was;
* the outcome is one the model allows (the tree equals the model's, the slot ledger of every
  pool holds, every slot's contents are right), and once idle nothing leaked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import hicache.controller
import radix.tiers.host
from allocators import KVPool, MambaStatePool, TokenAllocator
from allocators import alloc_all as real_alloc_all
from hicache import HiCacheConfig
from radix import RadixCache
from tests.helpers.cache_helpers import FailAllocs
from tests.helpers.reliability_harness import DOCS, Harness

#: Counts for the report: faulty runs, ``alloc`` calls failed on purpose (by pool), and failed
#: multi-pool allocations inside the library whose atomicity was checked.
FAULTS: Counter[str] = Counter()


def pools(h: Harness) -> dict[str, Any]:
    out = {"device kv": h.kv, "device state": h.sp}
    if h.kind == "host":
        out["host kv"] = h.hc.host_kv
        out["host state"] = h.hc.host_state
    return out


def fingerprint(h: Harness) -> tuple:
    c = h.cache
    return (c.pretty_print(), c.stats(), tuple(p.snapshot() for p in pools(h).values()))


class FailAt(FailAllocs):
    """:class:`FailAllocs` over every pool of ``h`` (a harness, or a dict of pools by name),
    each injected failure counted in :data:`FAULTS`."""

    def __init__(self, h: Harness | dict[str, Any], k: int = 0, mode: str = "from") -> None:
        super().__init__(h if isinstance(h, dict) else pools(h), k, mode)

    def on_fail(self, name: str) -> None:
        FAULTS["injected"] += 1
        FAULTS[f"injected into {name}"] += 1


@contextmanager
def atomic_alloc_all(h: Harness, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every ``alloc_all`` the library makes that fails must leave every pool and the tree
    exactly as before it; yields a one-element list counting such failures."""
    failed = [0]

    def checked(requests: Any) -> Any:
        before = fingerprint(h)
        got = real_alloc_all(requests)
        if got is None:
            failed[0] += 1
            FAULTS["library alloc_all failed, atomicity checked"] += 1
            assert fingerprint(h) == before, "a failed multi-pool allocation changed the cache"
        return got

    monkeypatch.setattr(radix.tiers.host, "alloc_all", checked)
    monkeypatch.setattr(hicache.controller, "alloc_all", checked)
    yield failed


# ======================================================================== scenarios
A, B, C, D = (list(d) for d in DOCS)


def host_cache(ps: int, write_policy: str) -> Harness:
    """Four namespaces, host copies (under write_back: after evictions), one request running
    with a computed but uncached tail, device and host pools nearly full."""
    h = Harness("host", ps, "lru", write_policy=write_policy, threshold=0)
    h.raw_insert(None, A[:12], 0)
    h.raw_insert("X", A[:8], 1)
    h.raw_insert(None, B[:10], 0)
    h.evict(6)
    h.raw_insert(("lora", "X"), C[:12], 2)
    h.start(("salt", "X"), D[:12], load=False)
    h.extend(h.reqs[0], 2)
    h.evict(4)
    h.raw_insert("", A[:6], 0)
    h.check()
    return h


def swa_cache(ps: int) -> Harness:
    h = Harness("swa", ps, "lru", window=2)
    h.raw_insert(None, A[:12], 0)
    h.raw_insert("X", A[:12], 0)
    h.raw_insert(None, B[:14], 0)
    h.evict_swa(8)
    h.start(("lora", "X"), C[:14], load=False)
    h.extend(h.reqs[0], 3)
    h.release_swa(h.reqs[0])
    h.raw_insert("", D[:12], 0)
    h.check()
    return h


def load_target(h: Harness, ns: Any, key: list[int]) -> None:
    m = h.match(ns, key)
    if m.host_hit_length:
        h.load_back(m.last_host_node)


def start_with_load_back(h: Harness) -> None:
    """A new request whose prefix is on host: the running one gives way (abort), then the
    new one loads its prefix back before locking it."""
    if h.reqs:
        h.abort(h.reqs[0])
    h.start(None, B[:10], load=True)


STEPS: dict[str, Callable[[Harness], None]] = {
    "insert": lambda h: h.raw_insert(None, A[:14], 3),
    "insert new namespace": lambda h: h.raw_insert(("salt", "X"), A[:14], 0),
    "chunk": lambda h: h.chunk(h.reqs[0]),
    "finish": lambda h: h.finish(h.reqs[0]),
    "extend": lambda h: h.extend(h.reqs[0], 4),
    "evict": lambda h: h.evict(10),
    "evict_states": lambda h: h.evict_states(2),
    "load_back": lambda h: load_target(h, None, A[:12]),
    "start with load_back": lambda h: start_with_load_back(h),
}
HOST_CASES = [
    (ps, wp, step)
    for ps in (1, 2)
    for wp in ("write_through", "write_through_selective", "write_back")
    for step in STEPS
]
SWA_CASES = [(ps, step) for ps in (1, 2) for step in ("insert", "chunk", "finish", "extend",
                                                       "evict", "evict_states")]


def run_with_faults(build: Callable[[], Harness], step: Callable[[Harness], None],
                    monkeypatch: pytest.MonkeyPatch) -> int:
    """Run ``step`` once to count its ``alloc`` calls, then once per ``k`` and mode with the
    fault; return how many faulty runs were made."""
    h = build()
    with FailAt(h) as probe:
        step(h)
    h.check()
    h.wind_down()
    h.check_idle_leaks()
    n = len(probe.calls)
    runs = 0
    for k in range(1, n + 1):
        for mode in ("from", "once"):
            h = build()
            with atomic_alloc_all(h, monkeypatch), FailAt(h, k, mode) as f:
                step(h)
            assert any(failed for _, _, failed in f.calls), (k, mode, f.calls)
            h.check()
            h.wind_down()
            h.check_idle_leaks()
            runs += 1
    FAULTS["cases"] += runs
    return n


@pytest.mark.parametrize("page_size,write_policy,step", HOST_CASES)
def test_host_tier_steps_survive_every_allocation_failure(page_size: int, write_policy: str,
                                                         step: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    n = run_with_faults(lambda: host_cache(page_size, write_policy), STEPS[step], monkeypatch)
    assert n >= 0


@pytest.mark.parametrize("page_size,step", SWA_CASES)
def test_swa_engine_steps_survive_every_allocation_failure(page_size: int, step: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run_with_faults(lambda: swa_cache(page_size), STEPS[step], monkeypatch)


def test_the_scenarios_allocate_inside_the_library() -> None:
    """The cases above are only worth something if the library itself allocates in them:
    count the library's own ``alloc`` calls (not the driver's) per step."""
    seen: dict[str, int] = {}
    for wp in ("write_through", "write_back"):
        for step in ("insert", "chunk", "finish", "evict", "evict_states", "load_back"):
            h = host_cache(2, wp)
            with FailAt(h) as probe:
                STEPS[step](h)
            seen[f"{wp}:{step}"] = sum(1 for name, _, _ in probe.calls if name.startswith("host"))
    assert seen["write_through:insert"] > 0 and seen["write_back:evict"] > 0, seen
    assert seen["write_through:chunk"] > 0 and seen["write_through:finish"] > 0, seen
    assert seen["write_back:evict_states"] > 0, seen


# ======================================================================== load_back: all or nothing
def locked_device_with_a_host_chain(page_size: int) -> tuple[Harness, Any]:
    """A host-only chain (with its host state) and one device node, pinned: nothing on device
    can be evicted to make room."""
    h = Harness("host", page_size, "lru", write_policy="write_through", threshold=0)
    h.raw_insert(None, A[:12], 0)
    h.evict(100)  # demoted: host-only, with a host state
    h.raw_insert("X", B[:12], 0)
    h.pin("X", B[:12])
    h.check()
    m = h.match(None, A[:12])
    assert m.host_hit_length == 12 and m.prefix_len == 0
    return h, m.last_host_node


@pytest.mark.parametrize("page_size", [1, 2])
def test_load_back_that_cannot_allocate_changes_nothing(page_size: int) -> None:
    """A shortage eviction cannot cure: load_back returns 0 and the cache (tree, stats, every
    pool) is exactly as before. A single failure: the retry after the (empty) eviction loads
    the chain, exactly as the model says."""
    h, node = locked_device_with_a_host_chain(page_size)
    with FailAt(h) as probe:
        assert h.cache.load_back(node) == 12
    assert [name for name, _, _ in probe.calls] == ["device kv", "device state"]
    for k in (1, 2):
        for mode in ("from", "once"):
            h, node = locked_device_with_a_host_chain(page_size)
            before = fingerprint(h)
            with FailAt(h, k, mode) as f:
                got = h.cache.load_back(node)
            assert f.calls[k - 1][2]
            if mode == "from":
                assert got == 0 and fingerprint(h) == before
            else:
                assert got == 12
                h.absorb(dev_evict=True, state_evict=True, backup=True, host_evict=True, load=True)
            h.check()
            h.wind_down()
            h.check_idle_leaks()


# ======================================================================== L3 prefetch
def _l3_engine(directory: str) -> RadixCache:
    pool = KVPool(32, 1, 1, 1, torch.float64)
    return RadixCache(kv_allocator=TokenAllocator(32, pool=pool),
                      state_allocator=MambaStatePool(4, num_layers=1, conv_state_shape=(1,),
                                                     ssm_state_shape=(1,)),
                      hicache=HiCacheConfig(load_back_threshold=0, hicache_storage_backend="file",
                                            hicache_storage_dir=directory,
                                            hicache_storage_prefetch_policy="wait_complete"))


def _l3_pools(c: RadixCache) -> dict[str, Any]:
    assert c.hicache is not None and c.state is not None
    return {"device kv": c.kv.allocator, "device state": c.state.allocator,
            "host kv": c.hicache.host_kv, "host state": c.hicache.host_state}


@pytest.mark.parametrize("mode", ["from", "once"])
def test_l3_prefetch_that_cannot_get_host_memory_attaches_nothing(tmp_path: Any, mode: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine B prefetches a key engine A stored in L3; its host allocation fails. ``from``:
    nothing is attached (a miss), every pool and the tree as before; ``once``: the retry after
    the (empty) host eviction attaches the pages."""
    key = list(range(1, 9))
    a = _l3_engine(str(tmp_path))
    kv = a.kv.allocator
    assert a.state is not None
    slots = kv.alloc(8)
    assert slots is not None
    a.insert(key, slots, state_slot=int(a.state.allocator.alloc(1)[0]))
    assert a.flush_storage(30.0)
    b = _l3_engine(str(tmp_path))
    pools_b = _l3_pools(b)
    before = (b.pretty_print(), tuple(p.snapshot() for p in pools_b.values()))
    checked = [0]

    def atomic(requests: Any) -> Any:
        snap = tuple(p.snapshot() for p in pools_b.values())
        got = real_alloc_all(requests)
        if got is None:
            checked[0] += 1
            FAULTS["library alloc_all failed, atomicity checked"] += 1
            assert tuple(p.snapshot() for p in pools_b.values()) == snap
        return got

    monkeypatch.setattr(hicache.controller, "alloc_all", atomic)
    with FailAt(pools_b, 1, mode) as f:
        m = b.match_prefix(key)
    assert f.calls[0][0] == "host kv" and f.calls[0][2] and checked[0] >= 1
    b.sanity_check()
    if mode == "from":
        assert (m.prefix_len, m.host_hit_length) == (0, 0)
        assert (b.pretty_print(), tuple(p.snapshot() for p in pools_b.values())) == before
        assert b.stats()["l3_prefetch_dropped"] >= 1
    else:
        assert m.host_hit_length == 8 and m.last_host_node is not None
        assert b.load_back(m.last_host_node) == 8
    for c in (a, b):
        c.evict(100)
        c.evict_host(100)
        c.sanity_check()
        assert all(p.available_size() == p.size for p in _l3_pools(c).values())
        c.close_storage()
