"""One-slot arguments given as device tensors (``alloc(...)[i]``: a 0-d view of an id tensor
the pool made, with a host mirror) on the simulated device (``SimCuda``).

``MambaStatePool``'s docstring: on a device, slot arguments are read as ints or through their
host mirrors. ``copy`` did so; ``free_slot``, ``get_state`` and ``set_state`` read such a slot
with ``__index__``, a device -> host copy the host waits for (one sync per call).
"""

from __future__ import annotations

import pytest
import torch

from allocators import MambaStatePool
from allocators.arena import KVShape, MemoryArena, StateShape
from allocators.host_mirror import host_ids
from bench.dev.gpu.simcuda import SimCuda


def test_one_slot_device_tensors_are_read_through_their_mirrors() -> None:
    with SimCuda() as sim:
        pool = MambaStatePool(8, 2, (3, 2), (2, 2, 2), device="cuda")
        got = pool.alloc(3)
        assert got is not None
        a, b, c = (int(x) for x in host_ids(got))
        assert (a, b, c) == (1, 2, 3)
        sim.track(pool, ["free_slot", "get_state", "set_state"], "pool")
        conv = torch.full((3, 2), 4.0, device="cuda")
        ssm = torch.full((2, 2, 2), -4.0, device="cuda")
        pool.set_state(got[1], 1, conv, ssm)
        k, s = pool.get_state(got[1], 1)
        pool.free_slot(got[0])
        pool.free_slot(got[2].reshape(1))
        assert [sim.syncs_of(f"pool.{op}") for op in ("set_state", "get_state", "free_slot")] \
            == [0, 0, 0], sim.report()
        assert torch.equal(k.cpu(), torch.full((3, 2), 4.0))
        assert torch.equal(s.cpu(), torch.full((2, 2, 2), -4.0))
        assert pool.available_size() == 7 and pool.snapshot().free_ids()[-2:] == [a, c]
    assert sim.errors == []


def test_a_bad_one_slot_argument_is_refused_naming_it() -> None:
    with SimCuda():
        pool = MambaStatePool(4, 2, (3, 2), (2, 2, 2), device="cuda")
        got = pool.alloc(2)
        assert got is not None
        with pytest.raises(TypeError, match="slot"):
            pool.free_slot(got.float()[0])
        with pytest.raises(ValueError, match="slot"):
            pool.free_slot(got)  # two slots
        with pytest.raises(ValueError, match="not allocated"):
            pool.get_state(torch.tensor(3, device="cuda"), 0)
        assert pool.available_size() == 2


def test_the_arena_state_view_frees_a_device_slot_through_its_mirror() -> None:
    with SimCuda() as sim:
        a = MemoryArena(3616, KVShape(2, 2, 4, torch.float16, 2),
                        StateShape(2, (4, 3), (2, 4, 4)), state_slots=3, device="cuda")
        sp = a.state_pool
        got = sp.alloc(2)
        assert got is not None and host_ids(got).tolist() == [7, 8]
        sim.track(sp, ["free_slot"], "arena_states")
        sp.free_slot(got[1])
        assert sim.syncs_of("arena_states.free_slot") == 0, sim.report()
        assert sp.available_size() == 2 and sp.snapshot().free_ids()[-1] == 8
        a.check()
    assert sim.errors == []
