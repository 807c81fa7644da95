"""Ids of the other kind's chunks, given to an arena view or to a cache over the views.

In a ``MemoryArena`` an id of a chunk the other kind owns is *withdrawn* from a view's free
list: the view counts it as used. Every entry point that accepts "an id handed out" must
therefore also check the chunk's owner, else the other kind's bytes are read or written
through the wrong view, or the id is later freed into the wrong free list. The same holds
for what takes chunk ids (``lowest_free_kv_pages``' ``exclude``), for ``clear()`` (a view
frees only its own chunks), and for the shapes' int fields (kept as Python ints, so the
sizes derived from them are ints a cache accepts).

Shapes as tests/allocators/test_arena.py: 64 B per KV token, page_size 2, 3 pages per chunk
(6 tokens, 384 B); budget 3,616 B -> chunks 0..9; ``state_slots=3``: chunks 7, 8, 9 states,
1..6 KV. Chunk c holds pages 3c .. 3c+2, i.e. slots 6c .. 6c+5: chunk 7's slots are 42..47.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from allocators import AllocTxn
from allocators.arena import KVShape, MemoryArena, StateShape
from radix.cache import RadixCache
from radix.config import CacheConfig

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))
CFG = CacheConfig(page_size=2, radix_eviction_policy="unified")


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def arena() -> MemoryArena:
    a = MemoryArena(3616, KV, ST, state_slots=3)
    g = torch.Generator().manual_seed(0)  # every byte known: a stray write shows
    a.buffer.copy_(torch.randint(0, 256, a.buffer.shape, dtype=torch.uint8, generator=g))
    return a


def snaps(a: MemoryArena) -> tuple[object, ...]:
    return (a.kv_allocator.snapshot(), a.state_pool.snapshot(), a.owner.tobytes(),
            a.kv_free_per_chunk.tobytes(), a.buffer.clone())


def assert_same(x: tuple[object, ...], y: tuple[object, ...]) -> None:
    assert x[:4] == y[:4]
    assert isinstance(x[4], torch.Tensor) and isinstance(y[4], torch.Tensor)
    assert torch.equal(x[4], y[4])


def test_state_access_to_a_kv_chunk_is_refused() -> None:
    # Chunk 2 is KV's: as a state slot it is withdrawn (counts as used), yet it is not a
    # state. Reading it would return KV bytes as a state; writing it would overwrite KV.
    a = arena()
    st = a.state_pool
    s = st.alloc_slot()
    assert s == 7
    before = snaps(a)
    conv, ssm = torch.ones(4, 3), torch.ones(2, 4, 4)
    for call, name in (
        (lambda: st.get_state(2, 0), "slot"),
        (lambda: st.set_state(2, 0, conv, ssm), "slot"),
        (lambda: st.copy(7, 2), "dst"),
        (lambda: st.copy(2, 7), "src"),
        (lambda: st.copy(t(7, 7), t(7, 2)), "dst"),
        (lambda: st.copy(torch.tensor(2), torch.tensor(7)), "src"),
    ):
        with pytest.raises(ValueError, match=f"{name}: foreign index: arena chunk 2 belongs to KV"):
            call()
        assert_same(snaps(a), before)
    a.check()


def test_undo_alloc_of_the_other_kinds_ids_is_refused() -> None:
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    before = snaps(a)
    with pytest.raises(ValueError, match="indices: foreign index: arena chunk 7 belongs to the states"):
        kv.undo_alloc(t(42, 43))  # page 21: chunk 7
    with pytest.raises(ValueError, match="indices: foreign index: arena chunk 2 belongs to KV"):
        st.undo_alloc(t(2))
    assert_same(snaps(a), before)
    a.check()
    # the views' own ids still undo exactly (AllocTxn's rollback; the bookkeeping: the
    # state slots taken were zeroed by their alloc)
    with AllocTxn() as txn:
        assert txn.alloc(kv, 4) is not None and txn.alloc(st, 2) is not None
    assert snaps(a)[:4] == before[:4]


def test_a_cache_does_not_adopt_the_other_kinds_ids() -> None:
    # Adopted, such an id would be freed into the wrong view when its node is evicted:
    # chunk 7 would get free KV pages, chunk 2 would become a free state slot.
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    cache = RadixCache(CFG, kv_allocator=kv, state_allocator=st)
    own = kv.alloc(2)
    slot = st.alloc_slot()
    assert own is not None and own.tolist() == [6, 7] and slot == 7
    before = snaps(a)
    with pytest.raises(ValueError, match="value: foreign index: arena chunk 7 belongs to the states"):
        cache.insert([1, 2], t(42, 43), state_slot=slot)
    with pytest.raises(ValueError, match="state_slot: foreign index: arena chunk 2 belongs to KV"):
        cache.insert([1, 2], own, state_slot=2)
    with pytest.raises(ValueError, match="value: foreign index: arena chunk 7"):
        cache.insert([1, 2, 3, 4], torch.cat([own, t(42, 43)]), state_slot=slot)
    assert_same(snaps(a), before)
    assert cache.tree.num_nodes == 0 and cache.evictable_size() == 0  # nothing adopted
    cache.sanity_check()
    # the cache's own ids are adopted and freed back to their own view
    assert cache.insert([1, 2], own, state_slot=slot).state_adopted
    assert cache.evict(2).num_tokens == 2
    assert (kv.available_size(), st.available_size()) == (36, 3)
    a.check()
    cache.sanity_check()


def test_lowest_free_kv_pages_refuses_chunk_ids_it_cannot_skip() -> None:
    # KV chunks 1..6 all free: pages 3..20; excluding chunk 1 the lowest two are 6, 7
    a = arena()
    assert a.lowest_free_kv_pages(2, np.array([1], dtype=np.int64)).tolist() == [6, 7]
    assert a.lowest_free_kv_pages(2, np.array([], dtype=np.int64)).tolist() == [3, 4]
    before = snaps(a)
    bad: list[tuple[object, type[Exception]]] = [
        (np.array([10]), ValueError),  # chunks are 0..9
        (np.array([-1]), ValueError),  # would wrap round to chunk 9
        (np.array([True, False]), TypeError),  # a mask, not chunk ids
        (np.array([1.0]), TypeError),
        (np.array([[1]]), ValueError),
        ("1", TypeError),
    ]
    for exclude, err in bad:
        with pytest.raises(err, match="exclude"):
            a.lowest_free_kv_pages(1, exclude)
    assert_same(snaps(a), before)


def test_clear_frees_only_the_views_own_chunks() -> None:
    # clear(): every id of the chunks the view owns free, in the initial order; the other
    # kind's chunks and the padding chunk stay withdrawn, the other view untouched.
    a = arena()
    kv, st = a.kv_allocator, a.state_pool
    assert kv.alloc(10) is not None and st.alloc(2) is not None
    assert a.kv_to_state(1)  # chunk 6 (pages 18..20) becomes a state: KV owns chunks 1..5
    st_before = st.snapshot()
    kv.clear()
    assert (kv.available_size(), kv.owned_size()) == (30, 30)
    assert kv.snapshot().free_ids() == list(range(3, 18))  # pages of chunks 1..5
    assert st.snapshot() == st_before
    a.check()
    kv_before = kv.snapshot()
    st.clear()
    assert st.snapshot().free_ids() == [6, 7, 8, 9] and st.available_size() == 4
    assert kv.snapshot() == kv_before
    a.check()


def test_shapes_keep_numpy_ints_as_python_ints() -> None:
    # numpy ints are accepted (check_int); kept as numpy, they made every size derived from
    # the shapes numpy, and the unified cache refused the arena's byte sizes as not ints.
    kv = KVShape(np.int64(2), np.int64(2), np.int64(4), torch.float16, np.int64(2))
    st = StateShape(np.int64(2), (4, 3), (2, 4, 4))
    assert kv == KV and st == ST
    assert all(type(getattr(kv, f)) is int
               for f in ("num_layers", "num_heads", "head_dim", "page_size"))
    assert type(st.num_layers) is int
    a = MemoryArena(3616, kv, st, state_slots=3)
    assert (a.chunk_bytes, a.pages_per_chunk, kv.bytes_per_token) == (384, 3, 64)
    assert all(type(v) is int for v in (a.chunk_bytes, a.pages_per_chunk, kv.bytes_per_token))
    cache = RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    cache.sanity_check()
