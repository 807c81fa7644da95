"""AllocTxn / alloc_all: all or nothing over several allocators."""

from __future__ import annotations

import pytest
import torch

from allocators import AllocTxn, MambaStatePool, PagedAllocator, TokenAllocator, alloc_all


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def make() -> tuple[TokenAllocator, PagedAllocator, MambaStatePool]:
    kv = TokenAllocator(8)
    swa = PagedAllocator(8, page_size=2)
    st = MambaStatePool(2)
    # Give each a non-trivial free order so an inexact rollback would show.
    kv.alloc(3)
    kv.free(t(2))  # kv free: [4..8, 2]
    swa.alloc(4)
    swa.free(t(2, 3))  # swa free pages: [3, 4, 1]
    return kv, swa, st


def snaps(*allocs: object) -> list[object]:
    return [a.snapshot() for a in allocs]  # type: ignore[attr-defined]


def test_commit_keeps_everything_in_call_order() -> None:
    kv, swa, st = make()
    with AllocTxn() as txn:
        a = txn.alloc(kv, 6)
        b = txn.alloc(swa, 4)
        c = txn.alloc(st, 1)
        assert a is not None and b is not None and c is not None
        got = txn.commit()
    assert [x.tolist() for x in got] == [[4, 5, 6, 7, 8, 2], [6, 7, 8, 9], [1]]
    assert txn.state == "committed"
    assert kv.available_size() == 0 and swa.available_size() == 2 and st.available_size() == 1


def test_failed_alloc_then_leaving_the_block_restores_every_snapshot() -> None:
    kv, swa, st = make()
    before = snaps(kv, swa, st)
    with AllocTxn() as txn:
        assert txn.alloc(kv, 4) is not None
        assert txn.alloc(st, 1) is not None
        assert txn.alloc(swa, 8) is None  # only 6 free: the step fails
        assert txn.failed
        assert txn.alloc(kv, 1) is None  # failed txn: later allocs touch nothing
        with pytest.raises(RuntimeError, match="cannot commit"):
            txn.commit()
    assert txn.state == "rolled back"
    assert snaps(kv, swa, st) == before
    for a in (kv, swa, st):
        a.check()


def test_leaving_without_commit_rolls_back_even_if_all_succeeded() -> None:
    kv, swa, st = make()
    before = snaps(kv, swa, st)
    with AllocTxn() as txn:
        assert txn.alloc(kv, 2) is not None
        assert txn.alloc(kv, 3) is not None  # same allocator twice: undone newest first
        assert txn.alloc(swa, 2) is not None
    assert snaps(kv, swa, st) == before


def test_exception_inside_block_rolls_back_and_propagates() -> None:
    kv, swa, st = make()
    before = snaps(kv, swa, st)
    with pytest.raises(KeyError), AllocTxn() as txn:
        txn.alloc(kv, 2)
        txn.alloc(st, 2)
        raise KeyError("engine blew up")
    assert snaps(kv, swa, st) == before


def test_bad_argument_inside_block_rolls_back() -> None:
    kv, swa, st = make()
    before = snaps(kv, swa, st)
    with pytest.raises(ValueError, match="page_size"), AllocTxn() as txn:
        txn.alloc(kv, 2)
        txn.alloc(swa, 3)  # not whole pages
    assert snaps(kv, swa, st) == before


def test_explicit_rollback_and_closed_transaction() -> None:
    kv, swa, st = make()
    before = snaps(kv, swa, st)
    txn = AllocTxn()
    txn.alloc(kv, 5)
    txn.rollback()
    txn.rollback()  # idempotent
    assert snaps(kv, swa, st) == before
    with pytest.raises(RuntimeError, match="rolled back"):
        txn.alloc(kv, 1)
    with pytest.raises(RuntimeError, match="rolled back"):
        txn.commit()
    done = AllocTxn()
    done.commit()
    with pytest.raises(RuntimeError, match="committed"):
        done.rollback()
    with pytest.raises(TypeError, match="SlotAllocator"):
        AllocTxn().alloc(object(), 1)  # type: ignore[arg-type]


def test_rollback_reports_slots_freed_behind_its_back() -> None:
    kv = TokenAllocator(4)
    txn = AllocTxn()
    x = txn.alloc(kv, 2)
    assert x is not None
    kv.free(x)  # misuse: the txn still thinks it owns x
    with pytest.raises(RuntimeError, match="double free"):
        txn.rollback()
    kv.check()


def test_alloc_all() -> None:
    kv, swa, st = make()
    before = snaps(kv, swa, st)
    assert alloc_all([(kv, 6), (swa, 8), (st, 1)]) is None
    assert snaps(kv, swa, st) == before
    got = alloc_all([(kv, 6), (swa, 6), (st, 2)])
    assert got is not None
    assert [x.tolist() for x in got] == [[4, 5, 6, 7, 8, 2], [6, 7, 8, 9, 2, 3], [1, 2]]
    assert alloc_all([]) == []
