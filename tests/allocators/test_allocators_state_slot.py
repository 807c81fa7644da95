"""MambaStatePool's one-slot path (``alloc_slot`` / ``free_slot`` / ``copy`` of two ints):
the same free-list order, zeroing, copies and errors as the tensor path, without tensors."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from allocators import MambaStatePool


def _pool(dtype: torch.dtype = torch.float32, size: int = 3) -> MambaStatePool:
    return MambaStatePool(size, num_layers=2, conv_state_shape=(2,), ssm_state_shape=(1, 2),
                          dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_slot_scenario(dtype: torch.dtype) -> None:
    # bfloat16 has no numpy dtype: its pool takes the torch views, the others numpy views.
    pool = _pool(dtype)
    assert [pool.alloc_slot(), pool.alloc_slot(), pool.alloc_slot()] == [1, 2, 3]
    assert pool.alloc_slot() is None and pool.available_size() == 0
    pool.conv[:, 2] = torch.tensor([[1.5, -2.0], [3.0, 4.0]], dtype=dtype)
    pool.ssm[:, 2] = 7.0
    pool.copy(2, 3)  # every layer of slot 2 into slot 3
    assert pool.conv[:, 3].tolist() == [[1.5, -2.0], [3.0, 4.0]]
    assert pool.ssm[:, 3].tolist() == [[[7.0, 7.0]], [[7.0, 7.0]]]
    assert pool.conv[:, 2].tolist() == [[1.5, -2.0], [3.0, 4.0]]  # the source is untouched
    pool.free_slot(3)
    pool.free_slot(1)
    assert pool.snapshot().free_ids() == [3, 1]  # appended in the order freed
    assert pool.alloc_slot() == 3  # the front, zeroed again in every layer
    assert torch.count_nonzero(pool.conv[:, 3]) == 0 and torch.count_nonzero(pool.ssm[:, 3]) == 0
    assert pool.available_size() == 1 and pool.used_size() == 2
    pool.check()


@pytest.mark.parametrize(
    ("slot", "exc", "msg"),
    [
        (0, ValueError, "foreign index: state slot 0 is not in 1..3"),
        (4, ValueError, "foreign index: state slot 4 is not in 1..3"),
        (-1, ValueError, "foreign index"),
        (2, ValueError, "double free: state slot 2 is already free"),
        (True, TypeError, "slot must be an int, got bool"),
        (1.0, TypeError, "slot must be an int, got float"),
    ],
)
def test_free_slot_refuses_and_changes_nothing(slot: Any, exc: type, msg: str) -> None:
    pool = _pool()
    assert pool.alloc_slot() == 1
    before = pool.snapshot()
    with pytest.raises(exc, match=msg):
        pool.free_slot(slot)
    assert pool.snapshot() == before


def test_free_slot_refuses_what_free_refuses() -> None:
    # the same errors as the tensor path, and a numpy integer is an int
    pool = _pool()
    pool.alloc(2)
    for bad in (0, 3, 4):
        with pytest.raises(ValueError) as scalar:
            pool.free_slot(bad)
        with pytest.raises(ValueError) as tensor:
            pool.free(torch.tensor([bad]))
        assert str(scalar.value) == str(tensor.value)
    numpy_int: Any = np.int64(2)
    pool.free_slot(numpy_int)
    assert pool.snapshot().free_ids() == [3, 2]


def test_one_slot_path_matches_the_tensor_path_seeded() -> None:
    """A seeded random run of alloc / free / copy on two pools: one through the int path, one
    through ``alloc(1)``, ``free(tensor)`` and ``copy(tensor, tensor)``; the free lists, the
    counters and every state value agree after every step."""
    rng = random.Random(23)
    fast, ref = _pool(size=8), _pool(size=8)
    held: list[int] = []
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            got = fast.alloc_slot()
            want = ref.alloc(1)
            assert (got is None) == (want is None), step
            if got is not None:
                assert want is not None and got == int(want[0])
                held.append(got)
                value = float(step)
                for p in (fast, ref):
                    p.conv[:, got] = value
                    p.ssm[:, got] = -value
        elif op < 0.7 and held:
            s = held.pop(rng.randrange(len(held)))
            fast.free_slot(s)
            ref.free(torch.tensor([s]))
        elif len(held) >= 2:
            a, b = rng.sample(held, 2)
            fast.copy(a, b)
            ref.copy(torch.tensor([a]), torch.tensor([b]))
        assert fast.snapshot().free_order == ref.snapshot().free_order, step
        assert torch.equal(fast.conv, ref.conv) and torch.equal(fast.ssm, ref.ssm), step
    fast.check()
