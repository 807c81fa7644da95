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


needs_checked_c = pytest.mark.skipif(free_list_mod._checked_c is None,
                                     reason="C release not built")


@needs_checked_c
def test_checked_free_by_hand_and_its_refusals_change_nothing() -> None:
    # the public free through the C pass: the same FIFO order as free_owned, and each misuse
    # refused with the numpy check's message, the allocator exactly as before
    a = TokenAllocator(6)
    got = a.alloc(5)
    assert got is not None and got.tolist() == [1, 2, 3, 4, 5]  # free list [6]
    a.free(torch.tensor([4, 2]))                                 # free list [6, 4, 2]
    assert a.snapshot().free_ids() == [6, 4, 2]
    before = a.snapshot()
    cases = [
        ([1, 7], r"foreign index: slot 7 is not in 1\.\.6"),
        ([0], r"foreign index: slot 0"),
        ([3, 2], r"double free: slot 2 is already free"),
        ([3, 5, 3], r"double free: slot 3 appears more than once"),
        ([1, 6], r"double free: slot 6 is already free"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            a.free(torch.tensor(bad, dtype=torch.int64))
        assert a.snapshot() == before  # marks undone, nothing written
    a.free(torch.tensor([5, 1, 3]))
    assert a.snapshot().free_ids() == [6, 4, 2, 5, 1, 3]
    a.check()


@needs_checked_c
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_checked_free_agrees_with_numpy(ps: int, seed: int) -> None:
    # twin allocators, one freeing through the C pass and one through numpy, get the same
    # frees, including bad ones (a repeat, an id already free, one outside the pool), and
    # end every step in the same state with the same error
    rng = random.Random(seed)
    size = 30 * ps
    c, ref = _make(ps, size), _make(ps, size)
    held: list[torch.Tensor] = []
    freed: list[int] = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            orig = held.pop(rng.randrange(len(held)))
            node = orig
            r = rng.random()
            if r < 0.1 and freed:  # slip in a page already free
                node = torch.cat([node, torch.arange(freed[-1] * ps, (freed[-1] + 1) * ps)])
            elif r < 0.2:
                node = torch.cat([node, node[:ps]])  # a repeated page
            elif r < 0.25:
                node = torch.cat([node, torch.arange((size // ps + 1) * ps,
                                                     (size // ps + 2) * ps)])  # outside
            errs = []
            for alloc, patch in ((c, False), (ref, True)):
                with pytest.MonkeyPatch.context() as m:
                    if patch:
                        m.setattr(free_list_mod, "_checked_c", None)
                    try:
                        alloc.free(node.clone())
                        errs.append("")
                    except ValueError as e:
                        errs.append(str(e))
            assert errs[0] == errs[1]
            if errs[0]:
                held.append(orig)  # refused: nothing freed, the slots are still held
            else:
                freed.extend(int(s) // ps for s in node[::ps])
        elif c.available_size() >= ps:
            k = rng.randint(1, max(1, c.available_size() // ps // 3)) * ps
            got_c, got_ref = c.alloc(k), ref.alloc(k)
            assert got_c is not None and got_ref is not None
            assert got_c.tolist() == got_ref.tolist()
            held.append(got_c)
            freed = [p for p in freed if p not in set(int(s) // ps for s in got_c[::ps])]
        assert c.snapshot() == ref.snapshot()
    c.check()
    ref.check()


# ------------------------------------------------------------ release_held: free + unmark
needs_release_held_c = pytest.mark.skipif(free_list_mod._release_held_c is None,
                                          reason="C release not built")


def _at(held: np.ndarray) -> tuple[int, int]:
    """The held marks' address and size, as ``owned_release()`` takes them."""
    return held.ctypes.data, len(held)


def _mark(held: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_or.at(held, ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8))


def _ref_release_held(a: TokenAllocator | PagedAllocator, held: np.ndarray,
                      slots: torch.Tensor) -> bool:
    """The reference of ``owned_release()``: refuse (nothing changed) unless every id is in
    range, held, in use and appears once; else clear the marks (numpy) and free the ids
    through the numpy ``release_owned``."""
    ps = a.page_size
    arr = slots.numpy()
    ids = arr[::ps] // ps
    pages = a._pages
    limit = min(pages.capacity, 8 * len(held) - 1)
    for i in ids.tolist():
        if not 1 <= i <= limit or not held[i >> 3] >> (i & 7) & 1 or pages._is_free[i]:
            return False
    if len(set(ids.tolist())) != len(ids):
        return False
    np.bitwise_and.at(held, ids >> 3, ~np.left_shift(1, ids & 7).astype(np.uint8))
    pages.release_owned(ids)
    return True


@needs_release_held_c
def test_release_held_by_hand() -> None:
    a = TokenAllocator(6)
    got = a.alloc(6)
    assert got is not None and got.tolist() == [1, 2, 3, 4, 5, 6]
    held = np.zeros(1, dtype=np.uint8)
    _mark(held, np.array([2, 3, 5, 6]))  # held by nodes: 2, 3, 5, 6 (1 and 4 a caller's)
    rel = a.owned_release()
    assert rel is not None
    before = a.snapshot()
    for bad in ([5, 4], [0], [7], [3, 2, 3], [-1]):  # not held / padding / outside / repeat
        t = torch.tensor(bad, dtype=torch.int64)
        assert rel(t.data_ptr(), len(bad), 1, *_at(held)) is False
        assert a.snapshot() == before and held.tolist() == [0b01101100]  # nothing changed
    t = torch.tensor([5, 2], dtype=torch.int64)
    assert rel(t.data_ptr(), 2, 1, *_at(held)) is True  # appended at the back, in order
    assert a.snapshot().free_ids() == [5, 2] and held.tolist() == [0b01001000]
    assert rel(t.data_ptr(), 2, 1, *_at(held)) is False  # now free and unmarked: refused
    empty = torch.empty(0, dtype=torch.int64)
    assert rel(empty.data_ptr(), 0, 1, *_at(held)) is True
    from allocators._release import release_held

    pages = a._pages
    with pytest.raises(ValueError, match="bad start"):  # the call's own checks
        release_held(t.data_ptr(), 2, 1, *_at(held), pages._ring_at, 6, 6, pages._free_at)
    with pytest.raises(ValueError, match="more ids than the ring"):
        release_held(t.data_ptr(), 2, 1, *_at(held), pages._ring_at, 1, 0, pages._free_at)
    with pytest.raises(ValueError, match="bad length"):
        release_held(t.data_ptr(), 3, 2, *_at(held), pages._ring_at, 6, 0, pages._free_at)
    assert a.snapshot().free_ids() == [5, 2] and a.used_size() == 4
    a.check()


def test_owned_release_only_for_the_allocators_own_free_owned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Watching(TokenAllocator):
        def free_owned(self, indices: torch.Tensor | int) -> None:
            super().free_owned(indices)

    assert TokenAllocator(4).owned_release() is not None
    assert Watching(4).owned_release() is None  # it must see every free
    a = TokenAllocator(4)
    monkeypatch.setattr(a, "free_owned", lambda indices: None)
    assert a.owned_release() is None


@needs_release_held_c
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_release_held_agrees_with_its_reference(ps: int, seed: int) -> None:
    # twin allocators and held marks take the same allocations (most marked held, some
    # left a caller's) and the same frees of nodes, some spoiled by a bad id (the padding
    # id, one past the pool, a freed id, an id twice, an id not held): the C pass and the
    # reference agree on every refusal, and the complete state (free order, mask, counters,
    # held marks) is equal after every step. The ring wraps.
    rng = random.Random(seed * 7 + ps)
    size = 40 * ps
    c, ref = _make(ps, size), _make(ps, size)
    nbytes = (size // ps + 8) // 8
    held_c, held_ref = np.zeros(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    rel = c.owned_release()
    assert rel is not None
    nodes: list[torch.Tensor] = []
    loose: list[int] = []  # first slots of pages handed out but not held
    freed: list[int] = []  # first slots of freed pages
    refused = 0
    for _ in range(300):
        if nodes and (rng.random() < 0.5 or c.available_size() < ps):
            i = rng.randrange(len(nodes))
            node = nodes[i].clone()
            kind = rng.randrange(7)
            p = rng.randrange(len(node) // ps) * ps  # the page spoiled
            if kind == 0:
                node[p] = 0
            elif kind == 1:
                node[p] = size + ps
            elif kind == 2 and freed:
                node[p] = rng.choice(freed)
            elif kind == 3 and len(node) > ps:
                node[p] = node[(p + ps) % len(node)]
            elif kind == 4 and loose:
                node[p] = rng.choice(loose)
            ok_c = rel(node.data_ptr(), len(node), ps, *_at(held_c))
            ok_ref = _ref_release_held(ref, held_ref, node)
            assert ok_c == ok_ref, (node.tolist(), ok_c, ok_ref)
            if ok_c:
                freed.extend(node[::ps].tolist())
                nodes.pop(i)
            else:
                refused += 1
        elif loose and c.available_size() < 2 * ps:  # a caller's pages back (public free)
            back = torch.tensor([s + j for s in loose for j in range(ps)], dtype=torch.int64)
            c.free(back)
            ref.free(back.clone())
            freed.extend(loose)
            loose = []
        else:
            k = rng.randint(1, max(1, c.available_size() // ps // 3)) * ps
            got_c, got_ref = c.alloc(k), ref.alloc(k)
            assert got_c is not None and got_ref is not None
            assert got_c.tolist() == got_ref.tolist()
            firsts = got_c[::ps].tolist()
            freed = [s for s in freed if s not in firsts]
            if rng.random() < 0.2:
                loose.extend(firsts)
            else:
                ids = (got_c[::ps] // ps).numpy()
                _mark(held_c, ids)
                _mark(held_ref, ids)
                nodes.append(got_c)
        assert c.snapshot() == ref.snapshot()
        assert held_c.tolist() == held_ref.tolist()
    assert refused > 10
    c.check()
