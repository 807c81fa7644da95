"""The arena KV free list's C paths (``_LowestFirst.release_owned_at`` / ``release_held_at``
and ``lowest_free``, ``allocators/_release.c``) against its numpy paths (``release_owned``,
``lowest_free_numpy``), and ``take`` against the lowest free ids read off the mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allocators import arena, free_list
from allocators.arena import _LowestFirst

GROUP = 4
CAP = 6 * GROUP - 1  # ids 1..23, groups 0..5 (group 0 holds the padding id 0)

needs_c = pytest.mark.skipif(free_list._release_held_c is None or arena._lowest_free_c is None,
                             reason="C loops not built")


def state(f: _LowestFirst) -> tuple[list[int], list[int], int, int]:
    return (f.free_order().tolist(), f.group_free.tolist(), f.num_free, f.num_used)


def recount(f: _LowestFirst) -> list[int]:
    """Free ids per group, counted from the mask."""
    per = [0] * (CAP // GROUP + 1)
    for i in f.free_order().tolist():
        per[i // GROUP] += 1
    return per


def marks_of(ids: list[int]) -> np.ndarray:
    held = np.zeros((CAP + 8) // 8, dtype=np.uint8)
    for i in ids:
        held[i >> 3] |= 1 << (i & 7)
    return held


@needs_c
@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10 ** 6)), min_size=1, max_size=30))
def test_c_release_matches_numpy(ops: list[tuple[bool, int]]) -> None:
    c, ref = _LowestFirst(CAP, "page", GROUP), _LowestFirst(CAP, "page", GROUP)
    held: list[list[int]] = []  # runs taken and not yet released
    for take, x in ops:
        rng = np.random.default_rng(x)
        if take or not held:
            k = int(rng.integers(0, 6))
            got, want = c.take(k), ref.take(k)
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert got.tolist() == want.tolist()
                # the k lowest free ids, read off the mask before the take
                if got.numel():
                    held.append(got.tolist())
        else:
            ids = held.pop(x % len(held))
            arr = torch.tensor(ids, dtype=torch.int64)
            if x % 2:
                assert c.release_owned_at(arr.data_ptr(), arr.numel(), 1)
            else:
                marks = marks_of(ids)
                assert c.release_held_at(arr.data_ptr(), arr.numel(), 1, marks.ctypes.data,
                                         marks.size)
                assert not marks.any()  # the held bits cleared
            ref.release_owned(arr.numpy())
        assert state(c) == state(ref)
        assert c.group_free.tolist() == recount(c)


def test_take_is_the_lowest_free_ids_and_counts_follow() -> None:
    f = _LowestFirst(CAP, "page", GROUP)
    first = f.take(10)
    assert first is not None and first.tolist() == list(range(1, 11))
    f.release_owned(np.array([2, 3, 9], dtype=np.int64))
    assert f.group_free.tolist() == [2, 0, 2, 4, 4, 4] == recount(f)  # 2, 3 | - | 9, 11 | ..
    got = f.take(5)  # 2, 3 (group 0), 9, 11 (group 2), then 12
    assert got is not None and got.tolist() == [2, 3, 9, 11, 12]
    assert f.group_free.tolist() == [0, 0, 0, 3, 4, 4] == recount(f)
    assert f.take(12) is None  # 11 free
    with pytest.raises(ValueError, match="whole number"):
        _LowestFirst(10, "page", GROUP)


def test_whole_groups_move_by_rows() -> None:
    f = _LowestFirst(CAP, "page", GROUP)
    got = f.take(5)  # 1, 2, 3 (group 0), 4, 5 (group 1)
    assert got is not None
    f.withdraw_groups(np.array([5, 3], dtype=np.int64))
    assert f.group_free.tolist() == [0, 2, 4, 0, 4, 0] == recount(f)
    assert (f.num_free, f.num_used) == (10, 13)
    s0 = state(f)
    for bad in ([1], [0], [3], [4, 4]):  # 1 partly used, 0 the padding's, 3 withdrawn, repeat
        with pytest.raises(ValueError, match="withdraw_groups"):
            f.withdraw_groups(np.array(bad, dtype=np.int64))
        assert state(f) == s0
    for bad in ([1], [2], [0], [3, 3]):  # free ids in groups 1, 2; group 0; a repeat
        with pytest.raises(ValueError, match="release_groups"):
            f.release_groups(np.array(bad, dtype=np.int64))
        assert state(f) == s0
    f.release_groups(np.array([3], dtype=np.int64))
    assert f.group_free.tolist() == [0, 2, 4, 4, 4, 0] == recount(f)
    assert (f.num_free, f.num_used) == (14, 9)
    got = f.take(7)  # the lowest: 6, 7 (group 1), 8..11 (group 2), 12 (group 3)
    assert got is not None and got.tolist() == [6, 7, 8, 9, 10, 11, 12]


@needs_c
@settings(max_examples=120, deadline=None)
@given(st.lists(st.booleans(), min_size=CAP, max_size=CAP), st.integers(0, CAP + 2),
       st.lists(st.booleans(), min_size=CAP // GROUP + 1, max_size=CAP // GROUP + 1),
       st.booleans())
def test_c_lowest_free_matches_numpy_and_the_mask(free: list[bool], k: int, skip: list[bool],
                                                  use_skip: bool) -> None:
    f = _LowestFirst(CAP, "page", GROUP)
    f.take(CAP)
    ids = np.array([i + 1 for i, x in enumerate(free) if x], dtype=np.int64)
    f.release_owned(ids)  # every id free or not as drawn (whole groups included)
    mask = np.array(skip, dtype=np.bool_) if use_skip else None
    # by hand: the free ids from the lowest on, outside the skipped groups, the first k
    want = [int(i) for i in ids if mask is None or not mask[i // GROUP]][:k]
    assert f.lowest_free(k, mask).tolist() == want
    assert f.lowest_free_numpy(k, mask).tolist() == want
    assert state(f)[1] == recount(f)  # reads only
