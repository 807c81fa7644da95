"""The cache's free of its own slots in one C pass (allocators/_release.c) against the numpy
path it replaces (and falls back to): the same free order, mask and counters after the same
frees, including a ring that wraps; a hand-worked case pins the order itself, and an id
outside the pool is refused with nothing written."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import allocators.free_list as free_list_mod
from allocators import PagedAllocator, TokenAllocator

needs_release_c = pytest.mark.skipif(free_list_mod._release_c is None,
                                     reason="C release not built")


def _make(ps: int, size: int) -> TokenAllocator | PagedAllocator:
    return TokenAllocator(size) if ps == 1 else PagedAllocator(size, ps)


@needs_release_c
def test_free_owned_order_by_hand() -> None:
    # the documented example, through the C pass: free appends at the back (FIFO reuse)
    a = TokenAllocator(4)
    got = a.alloc(3)
    assert got is not None and got.tolist() == [1, 2, 3]        # free list [4]
    a.free_owned(torch.tensor([2]))                             # free list [4, 2]
    assert a.snapshot().free_ids() == [4, 2]
    a.free_owned(torch.tensor([3, 1]))                          # free list [4, 2, 3, 1]
    assert a.snapshot().free_ids() == [4, 2, 3, 1]
    again = a.alloc(4)
    assert again is not None and again.tolist() == [4, 2, 3, 1]
    assert a.available_size() == 0 and a.used_size() == 4
    a.check()


@needs_release_c
def test_paged_free_owned_appends_page_ids_by_hand() -> None:
    a = PagedAllocator(12, 4)  # pages 1, 2, 3 = slots 4-7, 8-11, 12-15
    got = a.alloc(12)
    assert got is not None and got.tolist() == list(range(4, 16))
    a.free_owned(torch.tensor([12, 13, 14, 15, 4, 5, 6, 7]))  # pages 3 then 1
    assert a.snapshot().free_ids() == [3, 1]
    assert a.available_size() == 8
    a.check()


@needs_release_c
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_c_release_agrees_with_numpy(ps: int, seed: int) -> None:
    # twin allocators take the same allocations and free the same nodes' slots in the same
    # order, one through the C pass and one through numpy; after every step their complete
    # state (free order, mask, counters) is equal. Frees of most of the pool make the ring
    # wrap around.
    rng = random.Random(seed)
    size = 40 * ps
    c, ref = _make(ps, size), _make(ps, size)
    held: list[torch.Tensor] = []
    for _ in range(200):
        if held and (rng.random() < 0.5 or c.available_size() < ps):
            node = held.pop(rng.randrange(len(held)))
            c.free_owned(node)
            with pytest.MonkeyPatch.context() as m:
                m.setattr(free_list_mod, "_release_c", None)
                ref.free_owned(node.clone())
        else:
            k = rng.randint(1, max(1, c.available_size() // ps // 3)) * ps
            got_c, got_ref = c.alloc(k), ref.alloc(k)
            assert got_c is not None and got_ref is not None
            assert got_c.tolist() == got_ref.tolist()
            held.append(got_c)
        assert c.snapshot() == ref.snapshot()
    c.check()


@needs_release_c
def test_c_release_refuses_an_id_outside_the_pool() -> None:
    from allocators._release import release

    a = TokenAllocator(8)
    got = a.alloc(8)
    assert got is not None
    before = a.snapshot()
    pages = a._pages
    for bad in ([3, 9], [0], [-1, 2]):  # 9 > capacity; 0 is the padding id
        t = torch.tensor(bad, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"is not in 1\.\.8"):
            release(t.data_ptr(), len(bad), 1, pages._ring, 0, pages._is_free)
        with pytest.raises(ValueError, match=r"is not in 1\.\.8"):
            a.free_owned(t)
    assert a.snapshot() == before  # nothing written
    with pytest.raises(TypeError, match="int64"):
        release(got.data_ptr(), 1, 1, np.zeros(8, dtype=np.int32), 0, pages._is_free)
    with pytest.raises(ValueError, match="bad start"):
        release(got.data_ptr(), 1, 1, pages._ring, 8, pages._is_free)
    assert a.snapshot() == before


def test_free_owned_without_the_c_pass_keeps_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # the numpy fallback (no compiler at install time) frees in the same order
    monkeypatch.setattr(free_list_mod, "_release_c", None)
    a = TokenAllocator(4)
    assert a.alloc(3) is not None
    a.free_owned(torch.tensor([2]))
    a.free_owned(torch.tensor([3, 1])[::1])
    assert a.snapshot().free_ids() == [4, 2, 3, 1]
    a.check()
