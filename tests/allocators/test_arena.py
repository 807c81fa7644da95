"""MemoryArena: one byte budget, KV pages and state slots as views, a movable boundary.

Shapes used throughout (accounting by hand):

* KV: 2 layers x 2 heads x 4 dims, float16, page_size 2: 2 * 2*2*4 * 2 B = 64 B per token,
  128 B per page.
* State: 2 layers, conv (4, 3), ssm (2, 4, 4), float32: 2 * (12 + 32) * 4 B = 352 B.
* pages_per_chunk = ceil(352 / 128) = 3, chunk = 384 B; budget 4000 B -> 10 chunks
  (3840 B), tail 160 B.
* state_slots=3: chunks 7, 8, 9 are states, 1..6 KV (18 pages, 36 tokens), chunk 0 padding.
* waste = 160 (tail) + 384 (padding chunk) + 3 * (384 - 352) = 640 B = 0.16 of the budget.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from allocators import AllocTxn
from allocators.arena import KVShape, MemoryArena, StateShape
from radix.cache import RadixCache
from radix.config import CacheConfig

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def arena(state_slots: int = 3) -> MemoryArena:
    return MemoryArena(3616, KV, ST, state_slots=state_slots)


def snaps(a: MemoryArena) -> tuple[object, ...]:
    return (a.kv_allocator.snapshot(), a.state_pool.snapshot(), a.owner.tobytes())


def test_accounting_by_hand() -> None:
    a = arena()
    assert (KV.bytes_per_token, KV.page_bytes, ST.bytes) == (64, 128, 352)
    assert (a.pages_per_chunk, a.chunk_bytes, a.num_chunks, a.arena_bytes) == (3, 384, 10, 3840)
    assert a.owner.tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert a.buffer.dtype == torch.uint8 and a.buffer.numel() == 3840
    kv, st = a.kv_allocator, a.state_pool
    assert (kv.owned_size(), kv.available_size()) == (36, 36)
    assert kv.size == (10 * 3 - 1) * 2  # the whole id range; other chunks' ids withdrawn
    assert (st.owned_size(), st.available_size(), st.size) == (3, 3, 9)
    # budget 3,616 = 9 usable chunks (3,456) + a 160 B tail; the padding chunk is on top
    assert a.budget_bytes == 3616 and a.padding_bytes == 384
    assert a.waste_bytes() == 160 + 3 * 32
    assert a.waste_fraction() == pytest.approx(256 / 3616)
    assert a.stats()["waste_fraction"] == pytest.approx(256 / 3616)
    assert a.tokens_per_chunk == 6
    a.check()


def test_default_split_is_half_the_usable_chunks() -> None:
    a = MemoryArena(3616, KV, ST)
    assert (a.num_state_chunks, a.num_kv_chunks) == (4, 5)


def test_views_hand_out_their_chunks_in_order() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    # chunk 1 holds pages 3, 4, 5 (page 0..2 are chunk 0's): slots 6..11 first.
    assert kv.alloc(6).tolist() == [6, 7, 8, 9, 10, 11]
    assert st.alloc(2).tolist() == [7, 8]
    assert kv.alloc(32) is None and st.alloc(2) is None  # 30 tokens and 1 slot left
    assert (kv.available_size(), st.available_size()) == (30, 1)
    a.check()


def test_memory_is_the_arena_and_kinds_do_not_overlap() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    slots = kv.alloc(36)
    states = st.alloc(3)
    assert slots is not None and states is not None
    pool = kv.pool
    # KV slot s is the 64 bytes at s * 64: [K/V, 2 layers, 2 heads, 4 dims] of float16.
    pool.k_buffer(1)[6] = torch.full((2, 4), 3.0, dtype=torch.float16)
    token = a.buffer[6 * 64:7 * 64].view(torch.float16).view(2, 2, 2, 4)
    assert torch.equal(token[0, 1], torch.full((2, 4), 3.0, dtype=torch.float16))
    assert int(torch.count_nonzero(token[1])) == 0 and int(torch.count_nonzero(token[0, 0])) == 0
    # State slot c is chunk c: conv of both layers, then ssm of both layers.
    conv = torch.arange(12, dtype=torch.float32).view(4, 3)
    ssm = torch.full((2, 4, 4), -1.0)
    st.set_state(8, 1, conv, ssm)
    chunk = a.buffer[8 * 384:8 * 384 + 352].view(torch.float32)
    assert torch.equal(chunk[12:24], conv.reshape(-1))
    assert torch.equal(chunk[24 + 32:24 + 64], ssm.reshape(-1))
    # Fill every KV token and every state with distinct values; all read back intact.
    a.buffer.zero_()
    for layer in range(2):
        vals = (slots.to(torch.float16) + 100 * layer)[:, None, None].expand(36, 2, 4)
        pool.k_buffer(layer)[slots] = vals
        pool.v_buffer(layer)[slots] = -vals
    for s in states.tolist():
        for layer in range(2):
            st.set_state(s, layer, torch.full((4, 3), float(s * 10 + layer)),
                         torch.full((2, 4, 4), float(-s * 10 - layer)))
    for layer in range(2):
        got = pool.k_buffer(layer)[slots][:, 0, 0]
        assert torch.equal(got, slots.to(torch.float16) + 100 * layer)
        assert torch.equal(pool.v_buffer(layer)[slots][:, 1, 3], -got)
    for s in states.tolist():
        c, m = st.get_state(s, 1)
        assert bool((c == s * 10 + 1).all()) and bool((m == -s * 10 - 1).all())


def test_kv_to_state_moves_wholly_free_chunks_all_or_nothing() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    assert kv.alloc(2).tolist() == [6, 7]  # page 3: chunk 1 is no longer wholly free
    assert st.alloc(2).tolist() == [7, 8]
    assert a.movable_kv_chunks() == 5
    assert a.stranded_bytes() == 2 * 128  # pages 4, 5 free in a used chunk
    before = snaps(a)
    assert a.kv_to_state(6) is False
    assert snaps(a) == before
    assert a.kv_to_state(5) is True
    # highest chunk ids first, appended to the back of the state free list
    assert st.snapshot().free_ids() == [9, 6, 5, 4, 3, 2]
    assert a.owner.tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert (kv.available_size(), kv.owned_size()) == (4, 6)
    assert a.waste_bytes() == 160 + 8 * 32
    assert st.alloc(6).tolist() == [9, 6, 5, 4, 3, 2]
    a.check()


def test_state_to_kv_and_back_keeps_free_capacity() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    assert st.alloc(1).tolist() == [7]
    before = snaps(a)
    assert a.state_to_kv(3) is False and snaps(a) == before
    assert a.state_to_kv(2) is True  # lowest free state chunks: 8, 9
    assert a.owner.tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 1, 1]
    assert kv.available_size() == 36 + 12
    assert kv.snapshot().free_ids()[-6:] == [24, 25, 26, 27, 28, 29]  # chunk 8's, 9's pages
    assert a.kv_to_state(2) is True  # back: the highest wholly free KV chunks are 9, 8
    assert a.owner.tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert (kv.available_size(), st.available_size()) == (36, 2)
    a.check()


def test_ensure_moves_as_few_chunks_as_needed() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    assert a.ensure_kv(36) is True and a.num_state_chunks == 3  # already there
    assert a.ensure_kv(37) is True and a.num_state_chunks == 2  # one chunk: 6 more tokens
    assert kv.available_size() == 42
    before = snaps(a)
    assert a.ensure_kv(42 + 13) is False and snaps(a) == before  # 3 chunks needed, 2 free
    assert a.ensure_states(4) is True and st.available_size() == 4
    assert a.num_state_chunks == 4
    with pytest.raises(ValueError, match="num_tokens"):
        a.ensure_kv(-1)
    a.check()


def test_transactions_roll_back_exactly_over_the_views() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    kv.alloc(4)
    before = snaps(a)
    with AllocTxn() as txn:
        assert txn.alloc(kv, 8) is not None
        assert txn.alloc(st, 3) is not None
        assert txn.alloc(st, 1) is None
    assert snaps(a) == before
    with pytest.raises(ValueError, match="double free"):
        kv.free(t(12, 13))  # a free page of an owned chunk
    a.check()


def test_freeing_the_other_kinds_ids_is_refused() -> None:
    # A withdrawn id counts as used in the view that does not own it; freeing it there would
    # hand the other kind's memory out twice: refused, nothing changes.
    a = arena()
    before = snaps(a)
    with pytest.raises(ValueError, match="indices: foreign index: arena chunk 2 belongs to KV"):
        a.state_pool.free(t(2))
    with pytest.raises(ValueError, match="slot: foreign index: arena chunk 0 belongs to the padding"):
        a.state_pool.free_slot(0)
    with pytest.raises(ValueError, match="arena chunk 7 belongs to the states"):
        a.kv_allocator.free(t(42, 43))  # page 21: chunk 7
    assert snaps(a) == before
    a.check()


def test_a_radix_cache_runs_over_the_views() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    cache = RadixCache(CacheConfig(page_size=2), kv_allocator=kv, state_allocator=st)
    slots = kv.alloc(8)
    s = st.alloc_slot()
    assert slots is not None and s is not None
    res = cache.insert(list(range(8)), slots, state_slot=s)
    assert res.state_adopted
    m = cache.match_prefix(list(range(8)) + [99, 98])
    assert m.device_indices.tolist() == slots.tolist() and m.state_slot == s
    assert cache.evict(8).num_tokens == 8
    assert (kv.available_size(), st.available_size()) == (36, 3)
    cache.sanity_check()
    a.check()


def test_bad_input_names_the_argument() -> None:
    # two usable chunks (one state, one KV) at least; the padding chunk comes on top
    with pytest.raises(ValueError, match="budget_bytes=767 .*need >= 768"):
        MemoryArena(2 * 384 - 1, KV, ST)
    small = MemoryArena(2 * 384, KV, ST)
    assert (small.num_chunks, small.arena_bytes, small.num_state_chunks) == (3, 3 * 384, 1)
    with pytest.raises(ValueError, match="budget_bytes"):
        MemoryArena(0, KV, ST)
    with pytest.raises(ValueError, match="state_slots=10"):
        MemoryArena(3616, KV, ST, state_slots=10)
    with pytest.raises(ValueError, match="state_slots"):
        MemoryArena(4000, KV, ST, state_slots=-1)
    with pytest.raises(TypeError, match="kv_shape"):
        MemoryArena(4000, cast(KVShape, "kv"), ST)
    with pytest.raises(TypeError, match="state_shape"):
        MemoryArena(4000, KV, cast(StateShape, None))


def test_shapes_that_do_not_divide_are_refused() -> None:
    kv = KVShape(1, 1, 5, torch.float16, 1)  # 20 B per token
    st = StateShape(1, (1,), (1,), torch.float64)  # 16 B, 8-byte elements
    with pytest.raises(ValueError, match="do not divide"):
        MemoryArena(1000, kv, st)  # chunk of 20 B is not whole float64s
    with pytest.raises(ValueError, match="num_heads"):
        KVShape(1, 0, 4)
    with pytest.raises(ValueError, match="conv_state_shape"):
        StateShape(1, (0,), (1,))


def test_kv_alloc_takes_the_lowest_free_pages_so_high_chunks_empty() -> None:
    a = arena()
    kv = a.kv_allocator
    first = kv.alloc(18)  # pages 3..11: chunks 1..3
    assert first is not None and first.tolist() == list(range(6, 24))
    kv.free(first[:6])  # chunk 1 free again (pages 3, 4, 5), appended at the back
    # the lowest free pages come first whatever the free-list order: chunk 1's
    assert kv.alloc(4).tolist() == [6, 7, 8, 9]
    # chunks 4..6 never held a page: they are the ones that can become states
    assert a.movable_kv_chunks() == 3 and a.kv_to_state(3) is True
    before = kv.snapshot()
    with AllocTxn() as txn:
        assert txn.alloc(kv, 2) is not None
    assert kv.snapshot() == before
    a.check()


def test_free_list_withdraw_keeps_the_rest_in_order_and_refuses_misuse() -> None:
    import numpy as np

    from allocators.free_list import FreeList

    fl = FreeList(6, "page")
    fl.take(1)  # 1 used
    before = fl.snapshot("x", 1)
    for bad, msg in (([2, 2], "repeated"), ([1], "not free"), ([7], "outside")):
        with pytest.raises(ValueError, match=msg):
            fl.withdraw(np.array(bad, dtype=np.int64))
        assert fl.snapshot("x", 1) == before
    fl.withdraw(np.array([5, 3], dtype=np.int64))
    assert fl.free_order().tolist() == [2, 4, 6] and (fl.num_free, fl.num_used) == (3, 3)
    fl.release(torch.tensor([3], dtype=torch.int64))  # given back at the back
    assert fl.free_order().tolist() == [2, 4, 6, 3]
    fl.check("x")


def test_kv_free_list_is_lowest_first_whatever_the_free_order() -> None:
    a = MemoryArena(19 * 384, KV, ST, state_slots=2)  # KV chunks 1..17: pages 3..53
    kv = a.kv_allocator
    got = kv.alloc(2 * 30)  # pages 3..32
    assert got is not None and got.tolist() == list(range(6, 66))
    kv.free(t(40, 41, 12, 13, 58, 59))  # pages 20, 6, 29 in that order
    assert kv.snapshot().free_ids()[:4] == [6, 20, 29, 33]
    assert kv.alloc(6).tolist() == [12, 13, 40, 41, 58, 59]
    assert kv.alloc(2).tolist() == [66, 67]  # then the first page never handed out
    kv.free_owned(t(12, 13))  # the cache's unchecked path
    assert kv.alloc(2).tolist() == [12, 13]
    with pytest.raises(ValueError, match="double free"):
        kv.free(t(68, 69))  # page 34: free already
    a.check()
