"""TokenAllocator: narrated scenarios with exact slot ids, and every misuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from allocators import AllocatorSnapshot, KVPool, SlotAllocator, TokenAllocator


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def ids(x: torch.Tensor | None) -> list[int] | None:
    return None if x is None else x.tolist()


# ---------------------------------------------------------------------- scenarios
def test_alloc_takes_ascending_ids_from_one_and_free_appends_to_back() -> None:
    a = TokenAllocator(4)
    assert a.page_size == 1 and a.size == 4 and a.available_size() == 4
    # Fresh free list is [1, 2, 3, 4]; alloc takes from the front.
    first = a.alloc(3)
    assert first is not None and first.dtype == torch.int64 and first.dim() == 1
    assert ids(first) == [1, 2, 3]
    assert a.available_size() == 1 and a.used_size() == 3
    # Free list [4] -> free([2]) appends: [4, 2] -> alloc(2) returns them in that order.
    a.free(t(2))
    assert a.snapshot().free_ids() == [4, 2]
    assert ids(a.alloc(2)) == [4, 2]
    assert a.available_size() == 0
    a.check()


def test_free_keeps_the_order_given_and_reuses_after_older_free_slots() -> None:
    a = TokenAllocator(6)
    assert ids(a.alloc(4)) == [1, 2, 3, 4]  # free: [5, 6]
    a.free(t(3, 1))  # free: [5, 6, 3, 1]
    a.free(t(4))  # free: [5, 6, 3, 1, 4]
    assert ids(a.alloc(3)) == [5, 6, 3]  # free: [1, 4]
    assert ids(a.alloc(2)) == [1, 4]
    assert ids(a.alloc(0)) == []
    a.check()


def test_shortage_returns_none_and_takes_nothing() -> None:
    a = TokenAllocator(5)
    assert ids(a.alloc(3)) == [1, 2, 3]
    before = a.snapshot()
    assert not a.can_alloc(3)
    assert a.alloc(3) is None
    assert a.snapshot() == before
    assert a.can_alloc(2)
    assert ids(a.alloc(2)) == [4, 5]
    assert a.alloc(1) is None
    assert ids(a.alloc(0)) == []
    a.check()


def test_undo_alloc_restores_exact_state() -> None:
    a = TokenAllocator(8)
    a.alloc(2)
    a.free(t(1))  # free: [3..8, 1]
    before = a.snapshot()
    x = a.alloc(3)
    y = a.alloc(4)
    assert ids(x) == [3, 4, 5] and ids(y) == [6, 7, 8, 1]
    assert x is not None and y is not None
    assert a.alloc(1) is None
    a.undo_alloc(y)
    a.undo_alloc(x)
    assert a.snapshot() == before
    a.check()


def test_free_of_empty_tensor_is_a_no_op() -> None:
    a = TokenAllocator(3)
    a.alloc(2)
    before = a.snapshot()
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.snapshot() == before


def test_free_copies_its_argument() -> None:
    a = TokenAllocator(4)
    x = a.alloc(2)
    assert x is not None
    a.free(x)
    x.fill_(3)  # the caller reusing its tensor must not corrupt the free list
    assert a.snapshot().free_ids() == [3, 4, 1, 2]
    a.check()


def test_clear_restores_initial_state() -> None:
    a = TokenAllocator(5)
    fresh = a.snapshot()
    a.alloc(4)
    a.free(t(2))
    a.clear()
    assert a.snapshot() == fresh


def test_snapshot_is_hashable_and_distinguishes_order() -> None:
    a, b = TokenAllocator(3), TokenAllocator(3)
    assert a.snapshot() == b.snapshot() and hash(a.snapshot()) == hash(b.snapshot())
    a.alloc(3)
    b.alloc(3)
    a.free(t(1, 2))
    b.free(t(2, 1))  # same set of free slots, different reuse order
    assert a.snapshot() != b.snapshot()
    assert isinstance(a.snapshot(), AllocatorSnapshot)


def test_is_a_slot_allocator_and_holds_its_pool() -> None:
    pool = KVPool(8)
    a = TokenAllocator(8, pool=pool)
    assert isinstance(a, SlotAllocator) and a.pool is pool
    with pytest.raises(ValueError, match="pool has 9 slot rows"):
        TokenAllocator(9, pool=pool)
    with pytest.raises(TypeError, match="pool"):
        TokenAllocator(4, pool="pool")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- misuse
BAD_FREES = [
    (t(1, 2).to(torch.int32), TypeError, "int64"),
    ([1, 2], TypeError, "torch.Tensor"),
    (np.array([1, 2]), TypeError, "torch.Tensor"),
    (torch.tensor([[1, 2]], dtype=torch.int64), ValueError, "1-D"),
    (torch.tensor(1, dtype=torch.int64), ValueError, "1-D"),
    (t(0), ValueError, "foreign index"),
    (t(9), ValueError, "foreign index"),
    (t(1, -1), ValueError, "foreign index"),
    (t(5), ValueError, "double free"),  # never allocated: still free
    (t(1, 2, 1), ValueError, "double free"),  # repeated within one call
]


@pytest.mark.parametrize(("indices", "exc", "msg"), BAD_FREES)
def test_bad_free_raises_and_changes_nothing(indices: object, exc: type, msg: str) -> None:
    a = TokenAllocator(8)
    a.alloc(4)  # slots 1..4 used, 5..8 free
    before = a.snapshot()
    with pytest.raises(exc, match=msg):
        a.free(indices)  # type: ignore[arg-type]
    assert a.snapshot() == before
    with pytest.raises(exc, match=msg):
        a.undo_alloc(indices)  # type: ignore[arg-type]
    assert a.snapshot() == before
    a.check()


def test_double_free_after_a_valid_free() -> None:
    a = TokenAllocator(4)
    x = a.alloc(2)
    assert x is not None
    a.free(x)
    before = a.snapshot()
    with pytest.raises(ValueError, match="double free: slot 1 is already free"):
        a.free(x)
    assert a.snapshot() == before


def test_messages_name_the_slot() -> None:
    a = TokenAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError, match="slot 3 appears more than once"):
        a.free(t(1, 3, 2, 3))
    with pytest.raises(ValueError, match="slot 0 is not in 1..4"):
        a.free(t(1, 0))


@pytest.mark.parametrize(
    ("n", "exc"), [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("2", TypeError)]
)
def test_bad_alloc_count_raises(n: object, exc: type) -> None:
    a = TokenAllocator(4)
    before = a.snapshot()
    with pytest.raises(exc, match="n"):
        a.alloc(n)  # type: ignore[arg-type]
    with pytest.raises(exc, match="n"):
        a.can_alloc(n)  # type: ignore[arg-type]
    assert a.snapshot() == before


def test_numpy_integer_count_is_accepted() -> None:
    assert ids(TokenAllocator(4).alloc(np.int64(2))) == [1, 2]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"size": 0}, ValueError, "size"),
        ({"size": -3}, ValueError, "size"),
        ({"size": 2.5}, TypeError, "size"),
        ({"size": 4, "device": 3}, TypeError, "device"),
        ({"size": 4, "device": "nonsense"}, ValueError, "device"),
    ],
)
def test_bad_constructor_args(kwargs: dict[str, object], exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        TokenAllocator(**kwargs)  # type: ignore[arg-type]


def test_check_detects_corruption_and_dumps_state() -> None:
    a = TokenAllocator(4)
    a.alloc(2)
    a._pages._is_free[1] = True  # simulate a bug: slot 1 both used and marked free
    with pytest.raises(AssertionError, match="TokenAllocator invariant broken") as info:
        a.check()
    assert "free order" in str(info.value)
    b = TokenAllocator(4)
    b._pages._num_used += 1  # counters no longer add up
    with pytest.raises(AssertionError, match="num_free \\+ num_used != capacity"):
        b.check()


def test_large_pool_batch_ops() -> None:
    """A big pool with large batches stays exact (vectorised paths, wrap-around)."""
    a = TokenAllocator(1 << 20)
    x = a.alloc(700_000)
    y = a.alloc(300_000)
    assert x is not None and y is not None
    a.free(x)
    z = a.alloc(500_000)  # wraps around the ring: 48_576 tail slots then 451_424 of x
    assert z is not None
    assert torch.equal(z[:48_576], torch.arange(1_000_001, (1 << 20) + 1))
    assert torch.equal(z[48_576:], x[:451_424])
    a.check()
