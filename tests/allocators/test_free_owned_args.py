"""``free_owned`` (the cache's fast free of its own slots) skips the foreign / double-free
checks, not the argument's kind: a float, int32, 2-D or non-tensor argument raised numpy's
``IndexError`` / ``AttributeError`` or, for a paged allocator given a 2-D tensor, freed the
wrong pages and broke the free list. Now ``TypeError`` / ``ValueError`` naming ``indices``,
nothing changed, on the CPU and on the simulated device alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from allocators.base import SlotAllocator
from bench.dev.gpu.simcuda import SimCuda

MAKERS: dict[str, Callable[[str], SlotAllocator]] = {
    "token": lambda d: TokenAllocator(16, device=d),
    "paged": lambda d: PagedAllocator(16, 2, device=d),
    "state": lambda d: MambaStatePool(8, device=d),
}
BAD: dict[str, tuple[type[Exception], Callable[[torch.Tensor], object]]] = {
    "float": (TypeError, lambda s: s.float()),
    "int32": (TypeError, lambda s: s.to(torch.int32)),
    "2-D": (ValueError, lambda s: s.view(2, 2)),
    "list": (TypeError, lambda s: s.tolist()),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_free_owned_refuses_a_bad_argument_and_changes_nothing(device: str, kind: str,
                                                                bad: str) -> None:
    with SimCuda() as sim:
        a = MAKERS[kind](device)
        slots = a.alloc(4)
        assert slots is not None
        before = a.snapshot()
        err, make = BAD[bad]
        with pytest.raises(err, match="indices"):
            a.free_owned(make(slots))  # type: ignore[arg-type]
        assert a.snapshot() == before
        a.check()
        a.free_owned(slots)  # the good argument still frees
        assert a.available_size() == a.size
    assert sim.errors == []
