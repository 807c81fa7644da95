"""SWAAllocator: full + SWA pools behind one alloc, the full-to-SWA mapping, tombstones.

Slot ids are worked out by hand from the FIFO free-list order of each side (initially
ascending; alloc from the front; free / free_swa append to the back in the order given).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from allocators import (
    AllocatorSnapshot,
    KVPool,
    SlotAllocator,
    SWAAllocator,
    SWAAllocatorSnapshot,
    TokenAllocator,
    alloc_all,
)

NEVER = "SWA indices never allocated or already freed"


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def ids(x: torch.Tensor | None) -> list[int] | None:
    return None if x is None else x.tolist()


def page(k: int, p: int = 4) -> list[int]:
    return list(range(k * p, k * p + p))


def sides(a: SWAAllocator) -> tuple[list[int], list[int]]:
    """(full free list, SWA free list), front first."""
    snap = a.snapshot()
    return snap.free_ids(), snap.swa.free_ids()


# ---------------------------------------------------------------------- scenarios
def test_alloc_takes_the_same_count_from_both_pools_and_maps_them() -> None:
    a = SWAAllocator(6, 4)
    assert (a.size, a.swa_size, a.page_size) == (6, 4, 1)
    assert a.full_to_swa.dtype == torch.int64 and a.full_to_swa.shape == (7,)
    x = a.alloc(3)
    assert x is not None and x.dtype == torch.int64 and ids(x) == [1, 2, 3]
    assert ids(a.translate(x)) == [1, 2, 3]
    assert a.has_swa(t(0, 1, 3, 4)).tolist() == [False, True, True, False]
    assert a.full_available_size() == 3 and a.swa_available_size() == 1
    assert a.available_size() == 1  # min(full, SWA)
    assert a.used_size() == 3 and a.swa_used_size() == 3
    assert sides(a) == ([4, 5, 6], [4])
    assert ids(a.alloc(0)) == []
    a.check()


def test_none_when_the_swa_side_is_short_and_nothing_is_taken() -> None:
    a = SWAAllocator(6, 4)
    assert ids(a.alloc(3)) == [1, 2, 3]  # full free [4, 5, 6], SWA free [4]
    before = a.snapshot()
    assert not a.can_alloc(2)
    assert a.alloc(2) is None  # the full side has 3 free, the SWA side only 1
    assert a.snapshot() == before
    x = a.alloc(1)
    assert ids(x) == [4] and ids(a.translate(t(4))) == [4]
    assert a.alloc(1) is None  # SWA empty, full still has [5, 6]
    assert a.full_available_size() == 2 and a.available_size() == 0
    a.check()


def test_none_when_the_full_side_is_short() -> None:
    a = SWAAllocator(4, 4)
    assert ids(a.alloc(3)) == [1, 2, 3]
    a.free_swa(t(1, 2, 3))  # SWA has 4 free, full only 1
    before = a.snapshot()
    assert a.available_size() == 1 and a.alloc(2) is None
    assert a.snapshot() == before


def test_free_gives_back_both_sides_in_the_order_given() -> None:
    a = SWAAllocator(6, 4)
    assert ids(a.alloc(4)) == [1, 2, 3, 4]  # full free [5, 6], SWA free []
    a.free(t(3, 1))
    assert sides(a) == ([5, 6, 3, 1], [3, 1])
    assert a.translate(t(1, 2, 3, 4)).tolist() == [0, 2, 0, 4]
    x = a.alloc(2)
    assert ids(x) == [5, 6] and ids(a.translate(t(5, 6))) == [3, 1]
    assert sides(a) == ([3, 1], [])
    a.check()


def test_free_swa_then_reuse_then_free_leaves_the_reused_swa_slot_alone() -> None:
    """The stale-mapping case: a tombstoned full slot must not free its old SWA slot."""
    a = SWAAllocator(6, 4)
    assert ids(a.alloc(3)) == [1, 2, 3]  # SWA [1, 2, 3]; SWA free [4]
    a.free_swa(t(1, 2))  # tombstone full 1, 2: SWA free [4, 1, 2]
    assert sides(a) == ([4, 5, 6], [4, 1, 2])
    assert a.translate(t(1, 2, 3)).tolist() == [0, 0, 3]
    assert a.has_swa(t(1, 2, 3)).tolist() == [False, False, True]
    assert a.is_free(t(1, 2, 4)).tolist() == [False, False, True]  # tombstones stay allocated
    assert a.swa_used_size() == 1 and a.used_size() == 3
    a.check()
    # Another request gets SWA slot 1 (freed by the tombstone of full slot 1).
    x = a.alloc(2)
    assert ids(x) == [4, 5] and ids(a.translate(t(4, 5))) == [4, 1]
    assert sides(a) == ([6], [2])
    # Freeing full slot 1 must not touch SWA slot 1, now owned by full slot 5.
    a.free(t(1))
    assert sides(a) == ([6, 1], [2])
    assert ids(a.translate(t(5))) == [1] and a.swa_used_size() == 3
    a.check()
    # Full slot 5 still frees it; tombstoned full slot 2 frees only its full side.
    a.free(t(5, 2))
    assert sides(a) == ([6, 1, 5, 2], [2, 1])
    assert a.swa_used_size() == 2 and a.used_size() == 2  # full 3 -> SWA 3, full 4 -> SWA 4
    a.check()


def test_undo_alloc_restores_both_sides_exactly() -> None:
    a = SWAAllocator(8, 6)
    a.alloc(2)
    a.free_swa(t(1))
    a.free(t(2))  # full free [3..8, 2], SWA free [3..6, 1, 2]
    before = a.snapshot()
    x, y = a.alloc(3), a.alloc(3)
    assert ids(x) == [3, 4, 5] and ids(y) == [6, 7, 8]
    assert ids(a.translate(t(3, 4, 5, 6, 7, 8))) == [3, 4, 5, 6, 1, 2]
    assert x is not None and y is not None
    a.undo_alloc(y)
    a.undo_alloc(x)
    assert a.snapshot() == before
    a.check()


def test_alloc_txn_rolls_back_the_swa_allocator() -> None:
    a, other = SWAAllocator(8, 4), TokenAllocator(4)
    a.alloc(2)
    before = (a.snapshot(), other.snapshot())
    assert alloc_all([(a, 2), (other, 5)]) is None  # other is short: a is given back
    assert (a.snapshot(), other.snapshot()) == before
    got = alloc_all([(a, 2), (other, 4)])
    assert got is not None and ids(got[0]) == [3, 4]
    a.check()


def test_clear_restores_initial_state() -> None:
    a = SWAAllocator(6, 4, page_size=2)
    fresh = a.snapshot()
    a.alloc(4)
    a.free_swa(t(2, 3))
    a.clear()
    assert a.snapshot() == fresh
    assert not a.full_to_swa.any()
    a.check()


def test_snapshot_is_hashable_and_includes_the_swa_side_and_the_mapping() -> None:
    a, b = SWAAllocator(4, 4), SWAAllocator(4, 4)
    assert a.snapshot() == b.snapshot() and hash(a.snapshot()) == hash(b.snapshot())
    snap = a.snapshot()
    assert isinstance(snap, SWAAllocatorSnapshot) and isinstance(snap, AllocatorSnapshot)
    a.alloc(2)
    full_only = a.snapshot()
    a.free_swa(t(1))  # full side unchanged; SWA side and mapping change
    assert a.snapshot().free_ids() == full_only.free_ids()
    assert a.snapshot() != full_only
    assert a.snapshot().mapping() == [0, 0, 2, 0, 0]
    assert a.snapshot().swa.free_ids() == [3, 4, 1]


def test_is_a_slot_allocator_and_holds_its_pools() -> None:
    full, swa = KVPool(8), KVPool(4)
    a = SWAAllocator(8, 4, full_pool=full, swa_pool=swa)
    assert isinstance(a, SlotAllocator)
    assert a.full_pool is full and a.pool is full and a.swa_pool is swa
    assert a.device == torch.device("cpu")
    assert "SWAAllocator(full_size=8, swa_size=4" in repr(a)


# ---------------------------------------------------------------------- paged
def test_paged_variant_maps_pages_to_pages() -> None:
    a = SWAAllocator(16, 8, page_size=4)  # full pages 1..4 = slots 4..19; SWA pages 1, 2
    assert a.full_to_swa.shape == (20,)
    x = a.alloc(4)
    assert ids(x) == page(1) and ids(a.translate(t(*page(1)))) == page(1)
    y = a.alloc(4)
    assert ids(y) == page(2) and ids(a.translate(t(*page(2)))) == page(2)
    assert a.available_size() == 0 and a.full_available_size() == 8
    before = a.snapshot()
    assert a.alloc(4) is None
    assert a.snapshot() == before
    a.free_swa(t(*page(1)))  # SWA free pages [1]
    assert sides(a) == ([3, 4], [1])
    z = a.alloc(4)  # full page 3 gets SWA page 1
    assert ids(z) == page(3) and ids(a.translate(t(*page(3)))) == page(1)
    assert a.translate(t(*page(1))).tolist() == [0, 0, 0, 0]
    a.free(t(*page(1)))  # tombstoned: full side only
    assert sides(a) == ([4, 1], [])
    assert ids(a.translate(t(*page(3)))) == page(1)
    a.free(t(*page(3), *page(2)))
    assert sides(a) == ([4, 1, 3, 2], [1, 2])
    a.check()


PAGED_BAD = [
    ("free_swa", t(4, 5, 6), ValueError, "partial page: 3 slots"),
    ("free_swa", t(5, 6, 7, 8), ValueError, "not page-aligned"),
    ("free_swa", t(4, 5, 7, 6), ValueError, "not the 4 contiguous slots"),
    ("free_swa", t(0, 1, 2, 3), ValueError, "foreign index: slot 0"),
    ("free_swa", t(*page(4)), ValueError, f"{NEVER}: slot 16 is not allocated"),
    ("free_swa", t(*page(1)), ValueError, f"{NEVER}: slot 4 has no live SWA slot"),
    ("free_swa", t(*page(2), *page(2)), ValueError, "slot 8 appears more than once"),
    ("free", t(4, 5, 6), ValueError, "partial page"),
    ("free", t(*page(4)), ValueError, "double free: page 4 is already free"),
    ("free", t(*page(2), *page(4)), ValueError, "double free: page 4"),
    ("free", t(20, 21, 22, 23), ValueError, "foreign index: slot 20"),
    ("undo_alloc", t(*page(1)), ValueError, "undo_alloc: slot 4 has no SWA slot"),
]


@pytest.mark.parametrize(("method", "indices", "exc", "msg"), PAGED_BAD)
def test_paged_bad_input_raises_and_changes_nothing(
    method: str, indices: torch.Tensor, exc: type, msg: str
) -> None:
    a = SWAAllocator(16, 8, page_size=4)
    assert a.alloc(12) is None  # only 2 SWA pages
    assert a.alloc(8) is not None  # full pages 1, 2 -> SWA pages 1, 2
    a.free_swa(t(*page(1)))  # full page 1 tombstoned
    before = a.snapshot()
    with pytest.raises(exc, match=msg):
        getattr(a, method)(indices)
    assert a.snapshot() == before
    a.check()


def test_paged_alloc_of_partial_page_raises() -> None:
    a = SWAAllocator(16, 8, page_size=4)
    before = a.snapshot()
    for n in (1, 3, 6):
        with pytest.raises(ValueError, match="not a multiple of page_size=4"):
            a.alloc(n)
        with pytest.raises(ValueError, match="not a multiple of page_size=4"):
            a.can_alloc(n)
    assert a.snapshot() == before


# ---------------------------------------------------------------------- misuse
@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "msg"),
    [
        ((4, 8), {}, ValueError, "swa_size=8 must be <= full_size=4"),
        ((10, 8, 4), {}, ValueError, "full_size=10 is not a multiple of page_size=4"),
        ((16, 6, 4), {}, ValueError, "swa_size=6 is not a multiple of page_size=4"),
        ((0, 4), {}, ValueError, "full_size"),
        ((8, 0), {}, ValueError, "swa_size"),
        ((8, 4, 0), {}, ValueError, "page_size"),
        (("8", 4), {}, TypeError, "full_size"),
        ((8, 4.0), {}, TypeError, "swa_size"),
        ((8, 4), {"device": 3}, TypeError, "device"),
        ((8, 4), {"device": "nonsense"}, ValueError, "device"),
        ((8, 4), {"full_pool": KVPool(7)}, ValueError, "full_pool: pool has 8 slot rows"),
        ((16, 8, 4), {"swa_pool": KVPool(8)}, ValueError, "swa_pool: pool has 9 slot rows"),
        ((8, 4), {"swa_pool": "pool"}, TypeError, "swa_pool: pool must be a KVPool"),
    ],
)
def test_bad_constructor_args(
    args: tuple[object, ...], kwargs: dict[str, object], exc: type, msg: str
) -> None:
    with pytest.raises(exc, match=msg):
        SWAAllocator(*args, **kwargs)  # type: ignore[arg-type]


BAD = [
    # free: validated like TokenAllocator.free, all-or-nothing
    ("free", t(1, 2).to(torch.int32), TypeError, "int64"),
    ("free", [1, 2], TypeError, "torch.Tensor"),
    ("free", torch.tensor([[2, 3]]), ValueError, "1-D"),
    ("free", t(0), ValueError, "foreign index: slot 0"),
    ("free", t(2, 9), ValueError, "foreign index: slot 9"),
    ("free", t(2, 5), ValueError, "double free: slot 5 is already free"),
    ("free", t(2, 3, 2), ValueError, "double free: slot 2 appears more than once"),
    # free_swa: only allocated full slots that still have a live SWA slot
    ("free_swa", t(1), ValueError, f"{NEVER}: slot 1 has no live SWA slot"),
    ("free_swa", t(2, 1), ValueError, f"{NEVER}: slot 1 has no live SWA slot"),
    ("free_swa", t(5), ValueError, f"{NEVER}: slot 5 is not allocated"),
    ("free_swa", t(2, 2), ValueError, "double free: slot 2 appears more than once"),
    ("free_swa", t(0), ValueError, "foreign index: slot 0"),
    ("free_swa", t(9), ValueError, "foreign index: slot 9"),
    ("free_swa", t(2).to(torch.int32), TypeError, "int64"),
    ("free_swa", torch.tensor([[2]]), ValueError, "1-D"),
    # undo_alloc: like free, and only intact alloc results
    ("undo_alloc", t(1), ValueError, "undo_alloc: slot 1 has no SWA slot"),
    ("undo_alloc", t(5), ValueError, "double free: slot 5 is already free"),
    ("undo_alloc", t(3).to(torch.int32), TypeError, "int64"),
    # queries
    ("translate", t(9), ValueError, "index 9 is outside"),
    ("translate", t(1).to(torch.int32), TypeError, "int64"),
    ("has_swa", t(-1), ValueError, "outside"),
    ("is_free", t(1).to(torch.int32), TypeError, "int64"),
    ("alloc", -1, ValueError, "n must be >= 0"),
    ("alloc", 1.0, TypeError, "n must be an int"),
    ("can_alloc", True, TypeError, "n must be an int"),
]


@pytest.mark.parametrize(("method", "arg", "exc", "msg"), BAD)
def test_bad_input_raises_and_changes_nothing(
    method: str, arg: object, exc: type, msg: str
) -> None:
    a = SWAAllocator(8, 4)
    assert ids(a.alloc(3)) == [1, 2, 3]
    a.free_swa(t(1))  # full 1 tombstoned; full 2, 3 -> SWA 2, 3
    before = a.snapshot()
    with pytest.raises(exc, match=msg):
        getattr(a, method)(arg)
    assert a.snapshot() == before
    a.check()


def test_free_swa_twice_names_the_slot() -> None:
    a = SWAAllocator(4, 2)
    x = a.alloc(2)
    assert x is not None
    a.free_swa(x)
    before = a.snapshot()
    with pytest.raises(ValueError, match=f"{NEVER}: slot 1 has no live SWA slot"):
        a.free_swa(x)
    assert a.snapshot() == before
    a.free(x)
    with pytest.raises(ValueError, match=f"{NEVER}: slot 1 is not allocated"):
        a.free_swa(x)


def test_empty_tensors_are_no_ops_and_arguments_are_copied() -> None:
    a = SWAAllocator(4, 4)
    x = a.alloc(2)
    assert x is not None
    before = a.snapshot()
    for method in (a.free, a.free_swa, a.undo_alloc):
        method(torch.empty(0, dtype=torch.int64))
    assert a.snapshot() == before
    a.free(x)
    x.fill_(3)  # the caller reusing its tensor must not corrupt anything
    assert sides(a) == ([3, 4, 1, 2], [3, 4, 1, 2])
    a.check()


def test_check_detects_a_broken_mapping_and_dumps_state() -> None:
    a = SWAAllocator(6, 4)
    a.alloc(3)
    a.full_to_swa[2] = 0  # SWA slot 2 used but no full slot maps to it
    with pytest.raises(AssertionError, match="2 non-zero mappings but 3 SWA slots used") as info:
        a.check()
    assert "full_to_swa (first 32 non-zero" in str(info.value)
    b = SWAAllocator(6, 4)
    b.alloc(3)
    b.full_to_swa[3] = 1  # two full slots share SWA slot 1
    with pytest.raises(AssertionError, match="used by several full slots"):
        b.check()
    c = SWAAllocator(6, 4)
    c.alloc(1)
    c.full_to_swa[5] = 4  # a free full slot maps, to a free SWA slot
    with pytest.raises(AssertionError, match="free full slot 5 still maps"):
        c.check()
    d = SWAAllocator(8, 8, page_size=2)
    d.alloc(4)
    d.full_to_swa[3] = 5  # page 1 no longer maps slot by slot onto one SWA page
    with pytest.raises(AssertionError, match="full page 1 maps to \\[2, 5\\]"):
        d.check()


# ---------------------------------------------------------------------- random model
class Reference:
    """Page-level model: FIFO free lists for both sides, a dict full page -> SWA page."""

    def __init__(self, full_pages: int, swa_pages: int, page_size: int) -> None:
        self.p = page_size
        self.full_free = list(range(1, full_pages + 1))
        self.swa_free = list(range(1, swa_pages + 1))
        self.used: set[int] = set()
        self.map: dict[int, int] = {}

    def slots(self, pages: list[int]) -> list[int]:
        return [pg * self.p + i for pg in pages for i in range(self.p)]

    def alloc(self, k: int) -> list[int] | None:
        if k > len(self.full_free) or k > len(self.swa_free):
            return None
        full, self.full_free = self.full_free[:k], self.full_free[k:]
        swa, self.swa_free = self.swa_free[:k], self.swa_free[k:]
        self.used.update(full)
        self.map.update(zip(full, swa, strict=True))
        return full

    def free(self, pages: list[int]) -> None:
        for pg in pages:
            self.used.remove(pg)
            self.full_free.append(pg)
            if pg in self.map:
                self.swa_free.append(self.map.pop(pg))

    def free_swa(self, pages: list[int]) -> None:
        for pg in pages:
            self.swa_free.append(self.map.pop(pg))

    def undo(self, pages: list[int]) -> None:
        self.used.difference_update(pages)
        self.full_free[:0] = pages
        self.swa_free[:0] = [self.map.pop(pg) for pg in pages]

    def mapping(self, full_size: int) -> list[int]:
        m = [0] * (full_size + self.p)
        for f, s in self.map.items():
            for i in range(self.p):
                m[f * self.p + i] = s * self.p + i
        return m


def _agree(a: SWAAllocator, ref: Reference) -> None:
    a.check()
    snap = a.snapshot()
    assert snap.free_ids() == ref.full_free
    assert snap.swa.free_ids() == ref.swa_free
    assert snap.mapping() == ref.mapping(a.size)
    p = ref.p
    assert a.full_available_size() == len(ref.full_free) * p
    assert a.swa_available_size() == len(ref.swa_free) * p
    assert a.available_size() == min(len(ref.full_free), len(ref.swa_free)) * p
    assert a.used_size() == len(ref.used) * p and a.swa_used_size() == len(ref.map) * p


def _expect_error(a: SWAAllocator, method: str, slots: list[int], exc: type, msg: str) -> None:
    before = a.snapshot()
    with pytest.raises(exc, match=msg):
        getattr(a, method)(t(*slots))
    assert a.snapshot() == before


@pytest.mark.parametrize(("full_pages", "swa_pages", "page_size"), [(24, 10, 1), (12, 5, 4)])
def test_seeded_random_operations_match_the_reference(
    full_pages: int, swa_pages: int, page_size: int
) -> None:
    for seed in range(4):
        rng = random.Random(seed)
        a = SWAAllocator(full_pages * page_size, swa_pages * page_size, page_size=page_size)
        ref = Reference(full_pages, swa_pages, page_size)
        undoable: list[int] | None = None  # the last alloc, while nothing else happened
        for _ in range(250):
            op = rng.random()
            last, undoable = undoable, None
            if op < 0.35 or not ref.used:
                k = rng.randint(0, 4)
                got, want = a.alloc(k * page_size), ref.alloc(k)
                assert ids(got) == (None if want is None else ref.slots(want))
                undoable = want or None
            elif op < 0.55:
                pages = rng.sample(sorted(ref.used), rng.randint(1, len(ref.used)))
                a.free(t(*ref.slots(pages)))
                ref.free(pages)
            elif op < 0.75 and ref.map:
                pages = rng.sample(sorted(ref.map), rng.randint(1, len(ref.map)))
                a.free_swa(t(*ref.slots(pages)))
                ref.free_swa(pages)
            elif op < 0.85 and last is not None:
                a.undo_alloc(t(*ref.slots(last)))
                ref.undo(last)
            else:  # misuse: each raises and changes nothing
                undoable = last
                tomb = sorted(ref.used - set(ref.map))
                if tomb:
                    pg = rng.choice(tomb)
                    slots = ref.slots([pg])
                    _expect_error(a, "free_swa", slots, ValueError, f"{NEVER}: slot {slots[0]}")
                if ref.full_free:
                    slots = ref.slots([rng.choice(ref.full_free)])
                    _expect_error(a, "free_swa", slots, ValueError, f"{NEVER}: slot {slots[0]}")
                    _expect_error(a, "free", slots, ValueError, "double free")
                live = ref.slots([rng.choice(sorted(ref.used))])
                _expect_error(a, "free", live + live, ValueError, "double free")
                before = a.snapshot()
                with pytest.raises(TypeError, match="int64"):
                    a.free(t(*live).to(torch.int32))
                assert a.snapshot() == before
            _agree(a, ref)


def test_large_pool_batch_ops_stay_vectorised() -> None:
    a = SWAAllocator(1 << 18, 1 << 16)
    x = a.alloc(60_000)
    assert x is not None
    a.free_swa(x[:50_000])
    y = a.alloc(50_000)
    assert y is not None
    assert torch.equal(a.translate(y[:5_536]), torch.arange(60_001, (1 << 16) + 1))
    assert torch.equal(a.translate(y[5_536:]), x[: 50_000 - 5_536])
    a.free(x)
    assert a.swa_used_size() == 50_000 and a.used_size() == 50_000
    assert np.array_equal(a.has_swa(x).numpy(), np.zeros(60_000, dtype=bool))
    a.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_results_live_on_the_device() -> None:
    a = SWAAllocator(8, 4, device="cuda")
    x = a.alloc(3)
    assert x is not None and x.device.type == "cuda"
    assert a.translate(x).device.type == "cuda" and a.translate(x).tolist() == [1, 2, 3]
    a.free_swa(x[:1])
    a.free(x)
    assert sides(a) == ([4, 5, 6, 7, 8, 1, 2, 3], [4, 1, 2, 3])
    a.check()
