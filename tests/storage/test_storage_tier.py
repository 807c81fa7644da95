"""The L3 tier inside the cache: backup after the host copy, prefetch on a miss, load back.

device -> host -> L3 -> (device and host evicted) -> prefetch -> load_back must give back every
bit of the KV (random bit patterns, NaN payloads included) and of the state, on every backend,
at page sizes 1 and 4; two caches sharing one Redis or one Mooncake Store share pages;
namespaces never mix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache.storage import state_key
from tests.helpers.mooncake_helpers import MOONCAKE_ENV, need_mooncake
from tests.storage.test_storage_common import (
    CLUSTER_ENV,
    L3,
    REDIS_ENV,
    WAIT_S,
    assert_same_kv,
    assert_same_state,
    bits,
    drop_everything,
    fresh_model,
    make,
    make_pair,
    need_env,
    put_random,
    wrap_flaky,
)


@pytest.fixture(params=["file", REDIS_ENV, CLUSTER_ENV, MOONCAKE_ENV],
                ids=["file", "redis-single", "redis-cluster", "mooncake"])
def backend(request: Any, tmp_path: Any) -> tuple[str, str]:
    """(backend name, where)."""
    if request.param == "file":
        return "file", str(tmp_path / "l3")
    if request.param == MOONCAKE_ENV:
        return "mooncake", need_mooncake()[0]
    return "redis", need_env(request.param)


def key_of(n: int, base: int = 1000) -> list[int]:
    return [base + 7 * i for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("states", [0, 4], ids=["kv", "hybrid"])
def test_round_trip_through_l3_is_bit_exact(backend: tuple[str, str], caches: list[L3],
                                            page_size: int, states: int) -> None:
    name, where = backend
    round_trip(name, where, caches, page_size, states)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("states", [0, 4], ids=["kv", "hybrid"])
def test_round_trip_through_mooncake_without_zero_copy(caches: list[L3], page_size: int,
                                                       states: int) -> None:
    round_trip("mooncake-copying", need_mooncake()[0], caches, page_size, states)


def round_trip(name: str, where: str, caches: list[L3], page_size: int, states: int) -> None:
    gen = torch.Generator().manual_seed(7 * page_size + states)
    h = make(name, where=where, page_size=page_size, states=states)
    caches.append(h)
    c = h.cache
    key = key_of(16)
    w = put_random(h, key, gen)
    assert c.flush_storage(WAIT_S)
    st = c.stats()
    assert st["l3_backup_written"] == 16 // page_size + (1 if states else 0)
    assert st["l3_backend_errors"] == 0
    drop_everything(h)
    h.pool.k_all.fill_(3.0)  # whatever comes back can only come from L3
    h.pool.v_all.fill_(-3.0)
    m = c.match_prefix(key + [1, 2])  # continues past the tree (empty) into L3
    assert (m.prefix_len, m.host_hit_length) == (0, 16)
    st = c.stats()
    assert (st["l3_prefetch_tokens"], st["l3_prefetch_pages"]) == (16, 16 // page_size)
    assert st["l3_prefetch_states"] == (1 if states else 0)
    assert c.load_back(m.last_host_node) == 16
    c.sanity_check()
    m = c.match_prefix(key + [1, 2])
    assert m.prefix_len == 16 and m.host_hit_length == 0
    assert_same_kv(h, m.device_indices, w, 16)
    if states:
        assert m.state_slot is not None
        assert_same_state(h, m.state_slot, w)
    # The page keys were remembered: backing the reloaded pages up again sends nothing.
    before = c.stats()["l3_backend_written"]
    c.evict(h.kv.size)
    assert c.flush_storage(WAIT_S)
    assert c.stats()["l3_backend_written"] == before
    c.sanity_check()


@pytest.mark.parametrize("env", [REDIS_ENV, CLUSTER_ENV, MOONCAKE_ENV],
                         ids=["redis-single", "redis-cluster", "mooncake"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_two_engines_share_pages_through_one_store(env: str, page_size: int, caches: list[L3]) -> None:
    name, url = ("mooncake", need_mooncake()[0]) if env == MOONCAKE_ENV else ("redis", need_env(env))
    model = fresh_model()
    gen = torch.Generator().manual_seed(11)
    # B's first match opens its client (a cluster: the slot map too) inside the prefetch's
    # one deadline; on a loaded machine that alone can pass 1 s: make's deadline is WAIT_S.
    a = make(name, where=url, page_size=page_size, states=4, model=model)
    b = make(name, where=url, page_size=page_size, states=4, model=model)
    caches += [a, b]
    key = key_of(24)
    w = put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    b.pool.k_all.fill_(9.0)
    m = b.cache.match_prefix(key)  # B never saw this prompt
    assert m.host_hit_length == 24 and m.prefix_len == 0
    assert b.cache.load_back(m.last_host_node) == 24
    m = b.cache.match_prefix(key)
    assert m.prefix_len == 24
    assert_same_kv(b, m.device_indices, w, 24)
    assert_same_state(b, m.state_slot, w)  # type: ignore[arg-type]
    b.cache.sanity_check()
    # B inserting a longer prompt sends only its new pages (the shared ones exist already).
    tail = key + key_of(8, base=5000)
    slots = b.kv.alloc(8)
    got = b.sp.alloc(1)  # type: ignore[union-attr]
    assert slots is not None and got is not None
    res = b.cache.insert(tail, torch.cat([m.device_indices, slots]), state_slot=int(got[0]))
    assert res.prefix_len == 24
    assert b.cache.flush_storage(WAIT_S)
    st = b.cache.stats()
    assert st["l3_backend_written"] == 8 // page_size + 1  # the new pages and their state


def test_a_second_engine_with_another_layout_or_model_gets_nothing(backend: tuple[str, str],
                                                                    caches: list[L3]) -> None:
    name, where = backend
    model = fresh_model()
    gen = torch.Generator().manual_seed(2)
    a = make(name, where=where, page_size=4, model=model)
    caches.append(a)
    key = key_of(16)
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    for other in (make(name, where=where, page_size=4, model=model + "-other"),
                  make(name, where=where, page_size=4, model=model, layers=3),
                  make(name, where=where, page_size=4, model=model, dtype=torch.bfloat16)):
        caches.append(other)
        m = other.cache.match_prefix(key)
        assert m.host_hit_length == 0 and other.cache.stats()["l3_prefetch_tokens"] == 0
    # a fresh engine's first match opens its store client inside the prefetch deadline (a
    # Redis Cluster client asks every node for its slots): a generous one, this test is not
    # about latency
    same = make(name, where=where, page_size=4, model=model, timeout_s=WAIT_S)
    caches.append(same)
    assert same.cache.match_prefix(key).host_hit_length == 16


def test_namespaces_never_share_pages(backend: tuple[str, str], caches: list[L3]) -> None:
    name, where = backend
    model = fresh_model()
    gen = torch.Generator().manual_seed(3)
    a = make(name, where=where, page_size=2, model=model)
    b = make(name, where=where, page_size=2, model=model)
    caches += [a, b]
    key = key_of(8)
    put_random(a, key, gen, extra_key="tenant-a")
    assert a.cache.flush_storage(WAIT_S)
    for ns in (None, "tenant-b", ("tenant-a",), b"tenant-a", 1):
        m = b.cache.match_prefix(key, ns)
        assert m.host_hit_length == 0, ns
    assert b.cache.stats()["l3_prefetch_tokens"] == 0
    m = b.cache.match_prefix(key, "tenant-a")
    assert m.host_hit_length == 8
    b.cache.sanity_check()
    # And under a non-storable namespace nothing is written or looked up.
    c = make(name, where=where, page_size=2, model=model)
    caches.append(c)
    odd = frozenset({1})
    put_random(c, key_of(4, 77), gen, extra_key=odd)
    assert c.cache.flush_storage(WAIT_S)
    assert c.cache.stats()["l3_backup_written"] == 0 and c.cache.stats()["l3_unkeyable"] >= 1
    assert c.cache.match_prefix(key_of(4, 77), odd).prefix_len == 4


def test_prefetch_continues_below_a_partial_match(tmp_path: Any, caches: list[L3]) -> None:
    """B holds the first pages itself: only the continuation comes from L3, attached below
    B's node (split where the key leaves it)."""
    where = str(tmp_path)
    gen = torch.Generator().manual_seed(4)
    a, b = make_pair(caches, "file", where=where, page_size=2)
    key = key_of(12)
    w = put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    wb = put_random(b, key[:4] + [1, 2, 3, 4], gen)  # shares 4 tokens, then forks inside a node
    m = b.cache.match_prefix(key)
    assert (m.prefix_len, m.host_hit_length) == (4, 8)
    assert b.cache.stats()["l3_prefetch_tokens"] == 8
    assert b.cache.load_back(m.last_host_node) == 8
    m = b.cache.match_prefix(key)
    assert m.prefix_len == 12
    assert torch.equal(m.device_indices[:4], wb.slots[:4])  # B's own first pages
    pool = b.pool
    assert torch.equal(bits(pool.k_all[:, m.device_indices[4:]]), bits(w.k[:, 4:]))
    b.cache.sanity_check()


def test_best_effort_attaches_at_a_later_match(tmp_path: Any, caches: list[L3]) -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = make_pair(caches, "file", where=str(tmp_path), page_size=2,
                     reader={"prefetch": "best_effort"})
    key = key_of(8)
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    flaky = wrap_flaky(b)
    flaky.gate.clear()  # L3 reads stall
    m = b.cache.match_prefix(key)
    assert m.host_hit_length == 0  # not waited for
    m = b.cache.match_prefix(key)  # the same miss again: one job, not two
    assert b.cache.stats()["l3_prefetch_started"] == 1
    flaky.gate.set()
    assert b.cache.flush_storage(WAIT_S)
    m = b.cache.match_prefix(key)
    assert m.host_hit_length == 8 and b.cache.stats()["l3_prefetch_tokens"] == 8
    b.cache.sanity_check()


def test_timeout_policy_gives_up_waiting_then_attaches_later(tmp_path: Any, caches: list[L3]) -> None:
    where, model = str(tmp_path), fresh_model()
    gen = torch.Generator().manual_seed(6)
    a = make("file", where=where, page_size=2, model=model)
    b = make("file", where=where, page_size=2, model=model, prefetch="timeout", timeout_s=0.05)
    caches += [a, b]
    key = key_of(8)
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    flaky = wrap_flaky(b)
    flaky.gate.clear()
    m = b.cache.match_prefix(key)
    assert m.host_hit_length == 0 and b.cache.stats()["l3_prefetch_timeouts"] == 1
    flaky.gate.set()
    assert b.cache.flush_storage(WAIT_S)
    assert b.cache.match_prefix(key).host_hit_length == 8
    # Unblocked, the timeout policy returns with the pages.
    c = make("file", where=where, page_size=2, model=model, prefetch="timeout", timeout_s=WAIT_S)
    caches.append(c)
    assert c.cache.match_prefix(key).host_hit_length == 8
    assert c.cache.stats()["l3_prefetch_timeouts"] == 0


def test_hybrid_prefetch_stops_at_the_deepest_stored_state(tmp_path: Any, caches: list[L3]) -> None:
    gen = torch.Generator().manual_seed(8)
    a, b = make_pair(caches, "file", where=str(tmp_path), page_size=2, states=4)
    key = key_of(8)
    w = put_random(a, key[:6], gen)  # a state at 6
    slots, got = a.kv.alloc(2), a.sp.alloc(1)  # type: ignore[union-attr]
    assert slots is not None and got is not None
    a.cache.insert(key, torch.cat([w.slots, slots]), state_slot=int(got[0]))  # and one at 8
    assert a.cache.flush_storage(WAIT_S)
    store = a.cache.storage.backend  # type: ignore[union-attr]
    assert len([k for k in store.keys_lru() if k.endswith(".s")]) == 2
    node8 = a.cache.match_prefix(key).last_device_node
    h8 = a.cache._storage._node_hashes(node8)[-1]  # type: ignore[index, union-attr]
    store._delete_raw(state_key(h8), b"")  # L3 keeps every page, but the state at 8 is gone
    m = b.cache.match_prefix(key + [5, 6])  # pages up to 8 asked; only 6 has pages and a state
    assert (m.prefix_len, m.host_hit_length) == (0, 6)
    assert b.cache.load_back(m.last_host_node) == 6
    m = b.cache.match_prefix(key)
    assert m.prefix_len == 6
    assert_same_state(b, m.state_slot, w)  # type: ignore[arg-type]
    b.cache.sanity_check()


def test_file_store_cap_under_a_working_cache(tmp_path: Any, caches: list[L3]) -> None:
    """Fill the file store far past its cap: the cache keeps working, the store stays under
    the cap, and what is still stored comes back exact."""
    where = str(tmp_path)
    model = fresh_model()
    gen = torch.Generator().manual_seed(9)
    page_bytes = 88 + 2 * 2 * 2 * 2 * 4  # header + K and V of 2 tokens, 2 layers, 1x2 floats
    cap = 10 * page_bytes
    a = make("file", where=where, page_size=2, model=model, max_bytes=cap, size=64)
    caches.append(a)
    keys = [key_of(8, base=100 * i) for i in range(12)]  # 48 pages in all
    for k in keys:
        put_random(a, k, gen)
        assert a.cache.flush_storage(WAIT_S)
        a.cache.evict(a.kv.size)
    store = a.cache.storage.backend  # type: ignore[union-attr]
    assert store.total_bytes <= cap and store.evicted == 48 - 10
    b = make("file", where=where, page_size=2, model=model, size=64)
    caches.append(b)
    hits = [b.cache.match_prefix(k).host_hit_length for k in keys]
    assert hits[:-3] == [0] * 9  # their first pages were evicted: a gap hides the rest
    assert hits[-2:] == [8, 8]
    b.cache.sanity_check()


def test_prefetch_below_a_device_only_node_backs_it_up_first(tmp_path: Any, caches: list[L3]) -> None:
    """write_back: B's own prefix is on device only; backed-up nodes must form a prefix from
    the root, so B backs its prefix up before attaching the L3 pages below it."""
    gen = torch.Generator().manual_seed(10)
    a, b = make_pair(caches, "file", where=str(tmp_path), page_size=2,
                     reader={"policy": "write_back"})
    key = key_of(12)
    w = put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    put_random(b, key[:4], gen)
    own = b.cache.match_prefix(key[:4]).last_device_node
    assert own.host_value is None
    m = b.cache.match_prefix(key)
    assert (m.prefix_len, m.host_hit_length) == (4, 8)
    assert own.host_value is not None  # backed up on the way
    b.cache.poll_transfers()
    b.cache.sanity_check()
    assert b.cache.load_back(m.last_host_node) == 8
    m = b.cache.match_prefix(key)
    assert m.prefix_len == 12
    assert torch.equal(bits(b.pool.k_all[:, m.device_indices[4:]]), bits(w.k[:, 4:]))
    b.cache.sanity_check()
