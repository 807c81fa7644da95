"""A node split while its device -> host copy is in flight still reaches L3 whole.

On a GPU the copy of a backup is asynchronous, so a match or an insert that ends inside the
node (and splits it) usually runs before the copy lands. The copy covers the node's whole
span; when it lands, every piece of that span (the upper halves the splits cut off and the
lower half that kept the node's identity) goes to L3. ``hold_completions`` reproduces an
in-flight copy on the CPU. A fresh cache over the same store then finds the whole prefix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.storage.test_storage_common import (
    L3,
    WAIT_S,
    drop_everything,
    fresh_model,
    make,
    put_random,
)


def key_of(n: int, base: int = 5000) -> list[int]:
    return [base + 3 * i for i in range(n)]


def pages_in_l3(h: L3) -> int:
    st = h.cache.stats()
    return int(st["l3_backup_written"] + st["l3_backup_already_present"])


def fresh_cache_finds(where: str, model: str, key: list[int], page_size: int,
                      states: int, caches: list[L3]) -> int:
    """Tokens of ``key`` a new cache over the same store gets back as a host hit."""
    g = make("file", where=where, page_size=page_size, model=model, states=states, size=64)
    caches.append(g)
    m = g.cache.match_prefix(key + [1] * page_size)
    g.cache.sanity_check()
    return int(m.prefix_len + m.host_hit_length)


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("split_by", ["match", "insert", "both", "twice"])
@pytest.mark.parametrize("states", [0, 4], ids=["kv", "hybrid"])
def test_split_during_an_inflight_copy_backs_up_both_halves(
        tmp_path: Any, caches: list[L3], page_size: int, split_by: str, states: int) -> None:
    where, model = str(tmp_path / "l3"), fresh_model()
    h = make("file", where=where, page_size=page_size, model=model, states=states, size=64)
    caches.append(h)
    c = h.cache
    hc = c.hicache
    assert hc is not None
    key = key_of(24)
    hc.hold_completions = True
    put_random(h, key, torch.Generator().manual_seed(page_size))  # write_through: one copy held
    assert hc.num_inflight == 1
    # Splits while the copy is in flight (each cut at a page multiple inside the node).
    if split_by in ("match", "both", "twice"):
        c.match_prefix(key[:8] + [7] * page_size)  # ends inside: upper [0, 8)
    if split_by == "twice":
        c.match_prefix(key[:4] + [9] * page_size)  # cuts the upper again: [0, 4), [4, 8)
    if split_by in ("insert", "both"):
        other = key[:16] + [11] * 8  # diverges at 16: the node splits at 16
        slots = h.kv.alloc(len(other))  # computed in full (a hybrid match stops at 0 here)
        assert slots is not None
        res = c.insert(other, slots, state_slot=None if not states else _state(h))
        assert res.prefix_len == 16
        c.kv.allocator.free(res.duplicate_indices)
    c.sanity_check()
    assert hc.num_inflight >= 1
    hc.release_held()
    hc.hold_completions = False
    c.poll_transfers()
    assert c.flush_storage(WAIT_S)
    c.sanity_check()
    # Every page of the 24 tokens went to L3 (the insert's own new leaf adds its pages).
    assert pages_in_l3(h) >= 24 // page_size + (1 if states else 0)
    drop_everything(h)
    # A fresh engine finds all 24 tokens: the chain's first page (the shared prefix) is there.
    found = fresh_cache_finds(where, model, key, page_size, states, caches)
    assert found == 24


def _state(h: L3) -> int:
    assert h.sp is not None
    got = h.sp.alloc(1)
    assert got is not None
    return int(got[0])


@pytest.mark.parametrize("page_size", [1, 2])
def test_write_back_victim_split_in_flight_settles_its_pending_counts(
        tmp_path: Any, caches: list[L3], page_size: int) -> None:
    """A write-back eviction copies a leaf; a match splits it before the copy lands. When the
    copy lands the pending counters go back to zero (they were raised by the whole span) and
    both halves are on host, the lower demoted, and in L3."""
    where, model = str(tmp_path / "l3"), fresh_model()
    h = make("file", where=where, page_size=page_size, model=model, policy="write_back", size=64)
    caches.append(h)
    c = h.cache
    hc = c.hicache
    assert hc is not None
    key = key_of(16)
    put_random(h, key, torch.Generator().manual_seed(3))
    hc.hold_completions = True
    res = c.evict(16)  # write_back: the copy is issued, the slots freed when it lands
    assert res.num_tokens == 0 and c.core.pending[0] == 16
    c.match_prefix(key[:8] + [5] * page_size)  # splits the in-flight leaf at 8
    c.sanity_check()
    hc.release_held()
    hc.hold_completions = False
    c.poll_transfers()
    assert c.core.pending == [0, 0, 0]
    c.sanity_check()
    assert c.host_size() == 16
    assert c.flush_storage(WAIT_S)
    assert pages_in_l3(h) == 16 // page_size
    drop_everything(h)
    assert fresh_cache_finds(where, model, key, page_size, 0, caches) == 16


def test_a_prefetch_never_evicts_its_own_anchor_to_make_room(tmp_path: Any,
                                                            caches: list[L3]) -> None:
    """Engine B holds a 4-token prefix P on host only, with one host-only child Q (host pool
    16 tokens, 8 used); A stored P + X (14 more tokens) in L3. B's match of P + X prefetches
    X, which lands below P: making room evicts Q, which leaves P a childless host-only leaf.
    P must stay (the leaf goes below it): there is then no room (12 free), and the prefetch
    is dropped, counted. Evicting P too would attach X under a node gone from the tree."""
    where, model = str(tmp_path / "l3"), fresh_model()
    gen = torch.Generator().manual_seed(3)
    p, x = key_of(4), key_of(14, base=9000)
    a = make("file", where=where, size=32, model=model)
    b = make("file", where=where, size=8, model=model)
    caches += [a, b]
    put_random(a, p + x, gen)
    assert a.cache.flush_storage(WAIT_S)
    put_random(b, p + key_of(4, base=7000), gen)
    assert b.cache.flush_storage(WAIT_S)
    b.cache.match_prefix(p + key_of(4, base=8000))  # splits P off: P -> Q
    b.cache.poll_transfers()
    b.cache.evict(8)  # both demoted to host only
    assert b.cache.hicache is not None and b.cache.hicache.host_kv.size == 16
    assert b.cache.host_evictable_size() == 4 and b.cache.stats()["num_nodes"] == 2
    m = b.cache.match_prefix(p + x)
    b.cache.sanity_check()  # unpinned: "num_nodes 1 != 0" (X attached under an evicted P)
    st = b.cache.stats()
    assert st["num_nodes"] == 1  # P alone: Q went to make room, in vain
    assert st["l3_prefetch_dropped"] == 14 and st["l3_prefetch_pages"] == 0
    assert m.prefix_len == 0 and m.host_hit_length == 4
