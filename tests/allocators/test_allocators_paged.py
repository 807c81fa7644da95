"""PagedAllocator: whole pages, page 0 padding, partial-page misuse."""

from __future__ import annotations

import pytest
import torch

from allocators import KVPool, PagedAllocator


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def page(k: int, p: int = 4) -> list[int]:
    return list(range(k * p, k * p + p))


def test_alloc_hands_out_whole_pages_starting_at_page_one() -> None:
    a = PagedAllocator(12, page_size=4)  # pages 1, 2, 3 = slots 4..7, 8..11, 12..15
    assert a.num_pages == 3 and a.size == 12 and a.page_size == 4
    x = a.alloc(8)
    assert x is not None and x.tolist() == page(1) + page(2)
    assert a.available_size() == 4 and a.used_size() == 8
    # Free page 1: free pages [3, 1] -> the next alloc(8) gets page 3 then page 1.
    a.free(t(*page(1)))
    y = a.alloc(8)
    assert y is not None and y.tolist() == page(3) + page(1)
    assert a.alloc(4) is None
    a.check()


def test_free_accepts_pages_in_any_order() -> None:
    a = PagedAllocator(12, page_size=4)
    a.alloc(12)
    a.free(t(*page(3), *page(1)))  # free pages [3, 1]
    assert a.snapshot().free_ids() == [3, 1]
    x = a.alloc(4)
    assert x is not None and x.tolist() == page(3)
    a.check()


def test_shortage_returns_none_and_takes_nothing() -> None:
    a = PagedAllocator(8, page_size=2)
    a.alloc(6)
    before = a.snapshot()
    assert not a.can_alloc(4)
    assert a.alloc(4) is None
    assert a.snapshot() == before


@pytest.mark.parametrize("n", [1, 3, 5, 6])
def test_alloc_of_partial_page_raises(n: int) -> None:
    a = PagedAllocator(16, page_size=4)
    before = a.snapshot()
    with pytest.raises(ValueError, match="not a multiple of page_size=4"):
        a.alloc(n)
    with pytest.raises(ValueError, match="not a multiple of page_size=4"):
        a.can_alloc(n)
    assert a.snapshot() == before


BAD_FREES = [
    (t(4, 5, 6), "partial page: 3 slots"),  # not a whole page
    (t(5, 6, 7, 8), "not page-aligned"),  # straddles pages 1 and 2
    (t(4, 5, 7, 6), "not the 4 contiguous slots"),  # page 1, scrambled
    (t(4, 4, 5, 6), "not the 4 contiguous slots"),  # duplicate inside a page
    (t(0, 1, 2, 3), "foreign index: slot 0"),  # padding page
    (t(20, 21, 22, 23), "foreign index: slot 20"),  # beyond page 4
    (t(-4, -3, -2, -1), "foreign index"),
    (t(12, 13, 14, 15), "double free: page 3 is already free"),  # never allocated
    (t(4, 5, 6, 7, 4, 5, 6, 7), "double free: page 1 appears more than once"),
]


@pytest.mark.parametrize(("indices", "msg"), BAD_FREES)
def test_bad_free_raises_and_changes_nothing(indices: torch.Tensor, msg: str) -> None:
    a = PagedAllocator(16, page_size=4)
    assert a.alloc(8) is not None  # pages 1 and 2 used, 3 and 4 free
    before = a.snapshot()
    with pytest.raises(ValueError, match=msg):
        a.free(indices)
    assert a.snapshot() == before
    a.check()


def test_dtype_and_shape_errors_match_token_allocator() -> None:
    a = PagedAllocator(8, page_size=4)
    a.alloc(8)
    with pytest.raises(TypeError, match="int64"):
        a.free(torch.arange(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        a.free(torch.arange(4, 8).view(1, 4))


def test_undo_alloc_restores_exact_state() -> None:
    a = PagedAllocator(16, page_size=4)
    a.alloc(8)
    a.free(t(*page(1)))
    before = a.snapshot()
    x, y = a.alloc(4), a.alloc(8)
    assert x is not None and y is not None
    a.undo_alloc(y)
    a.undo_alloc(x)
    assert a.snapshot() == before


def test_page_size_one_behaves_like_token_allocator() -> None:
    a = PagedAllocator(4, page_size=1)
    assert a.alloc(3) is not None
    a.free(t(2))
    x = a.alloc(2)
    assert x is not None and x.tolist() == [4, 2]


@pytest.mark.parametrize(
    ("args", "exc", "msg"),
    [
        ((10, 4), ValueError, "size=10 is not a multiple of page_size=4"),
        ((8, 0), ValueError, "page_size"),
        ((0, 4), ValueError, "size"),
        ((8, "4"), TypeError, "page_size"),
    ],
)
def test_bad_constructor_args(args: tuple[object, object], exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        PagedAllocator(*args)  # type: ignore[arg-type]


def test_pool_must_have_room_for_the_padding_page() -> None:
    assert PagedAllocator(16, 4, pool=KVPool(16, page_size=4)).pool is not None
    with pytest.raises(ValueError, match="page_size=page_size"):
        PagedAllocator(16, 4, pool=KVPool(16))
