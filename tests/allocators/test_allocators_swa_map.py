"""SWAAllocator.map_swa: the load-back path's mapping of fresh SWA slots to SWA-less full slots.

Slot ids by hand from the FIFO free lists (initially ascending; alloc from the front;
free / free_swa append to the back in the order given).
"""

from __future__ import annotations

import pytest
import torch

from allocators import SWAAllocator


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def one_page_rig() -> tuple[SWAAllocator, int]:
    """SWAAllocator(8, 4): full 1, 2, 3 -> SWA 1, 2, 3; full 1, 2 tombstoned (SWA free list
    [4, 1, 2]); full 4 taken by the full side alone (SWA-less, what a load-back gets); SWA 4
    taken by the SWA side alone (free, held by no full slot). Returns it and that SWA slot."""
    a = SWAAllocator(8, 4)
    assert a.alloc(3).tolist() == [1, 2, 3]
    a.free_swa(t(1, 2))
    assert a.full_side.alloc(1).tolist() == [4]
    assert a.swa_side.alloc(1).tolist() == [4]
    return a, 4  # (check() would flag SWA 4, taken but not mapped yet: map it, then check)


def test_map_swa_gives_swa_less_full_slots_the_fresh_swa_slots() -> None:
    a, s = one_page_rig()
    a.map_swa(t(4), t(s))
    a.check()
    assert a.translate(t(1, 2, 3, 4)).tolist() == [0, 0, 3, 4]
    assert (a.swa_used_size(), a.swa_available_size()) == (2, 2)
    a.free(t(4, 3))  # both SWA sides go back with their full slots, in that order
    assert a.snapshot().swa.free_ids() == [1, 2, 4, 3]
    a.check()


BAD_MAPS = [
    # (full, swa, message): each would break the mapping if accepted
    ((2,), (1,), "SWA slot 1 is free"),  # SWA 1 was released by free_swa: on the free list
    ((4,), (3,), "SWA slot 3 is already held by full slot 3"),  # two owners for SWA 3
    ((4,), (0,), r"swa: index 0 is outside \[1, 5\)"),  # 0 means "no SWA slot"
    ((4,), (99,), r"swa: index 99 is outside \[1, 5\)"),
    ((4, 4), (4, 4), "full slot 4 appears more than once"),
    ((1, 2), (4, 4), "SWA slot 4 appears more than once"),
    ((4,), (4, 4), "1 full slots for 2 SWA slots"),
    ((0,), (4,), r"full: index 0 is outside \[1, 9\)"),
    ((5,), (4,), "a full slot is free or already holds an SWA slot"),
    ((3,), (4,), "a full slot is free or already holds an SWA slot"),
]


@pytest.mark.parametrize(("full", "swa", "msg"), BAD_MAPS)
def test_map_swa_refuses_a_bad_mapping_and_changes_nothing(full: tuple, swa: tuple,
                                                           msg: str) -> None:
    a, _ = one_page_rig()
    before = a.snapshot()
    with pytest.raises(ValueError, match=msg):
        a.map_swa(t(*full), t(*swa))
    assert a.snapshot() == before
    a.map_swa(t(4), t(4))  # the valid mapping still goes through
    a.check()


def test_map_swa_of_a_duplicated_full_slot_would_leak_an_swa_slot() -> None:
    # Before: map_swa(full=[1, 1], swa=[s1, s2]) kept only s2; s1 stayed taken, held by no
    # full slot, and no free() could ever give it back.
    a = SWAAllocator(8, 4)
    assert a.alloc(2).tolist() == [1, 2]
    a.free_swa(t(1, 2))
    fresh = a.swa_side.alloc(2)
    assert fresh.tolist() == [3, 4]
    with pytest.raises(ValueError, match="full slot 1 appears more than once"):
        a.map_swa(t(1, 1), fresh)
    a.map_swa(t(1, 2), fresh)
    a.free(t(1, 2))
    assert (a.full_available_size(), a.swa_available_size()) == (8, 4)
    a.check()


def test_paged_map_swa_maps_whole_pages_slot_by_slot() -> None:
    # SWAAllocator(8, 4, page_size=2): pages 1..4 full, 1..2 SWA (page 0 is padding).
    a = SWAAllocator(8, 4, 2)
    assert a.alloc(2).tolist() == [2, 3]  # full page 1 -> SWA page 1
    a.free_swa(t(2, 3))
    assert a.swa_side.alloc(4).tolist() == [4, 5, 2, 3]  # SWA pages 2, 1
    before = a.snapshot()
    for full, swa, msg in [
        ((2,), (4,), "partial page: 1 slots"),
        ((2, 3), (5, 4), "partial page: run starting at slot 5 is not page-aligned"),
        ((3, 2), (4, 5), "partial page: run starting at slot 3 is not page-aligned"),
        ((2, 3), (1, 2), r"swa: index 1 is outside \[2, 6\)"),  # slot 1: the padding page
    ]:
        with pytest.raises(ValueError, match=msg):
            a.map_swa(t(*full), t(*swa))
        assert a.snapshot() == before
    a.map_swa(t(2, 3), t(4, 5))
    assert a.translate(t(2, 3)).tolist() == [4, 5]
    a.free(t(2, 3))
    a.swa_side.free(t(2, 3))  # the SWA page taken and never mapped
    assert (a.full_available_size(), a.swa_available_size()) == (8, 4)
    a.check()
