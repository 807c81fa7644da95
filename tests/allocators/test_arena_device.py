"""A MemoryArena on a device (``bench.dev.gpu.simcuda.SimCuda``: a CUDA device simulated on
the CPU, the data readable): the state view's zeroing and copies are pending work, issued when
the states are next read (``allocators.state_pool``). A chunk that leaves the states must not
receive them after it became KV's.

Shapes as tests/allocators/test_arena.py: 64 B per KV token, page_size 2, 3 pages per chunk;
chunks 0..9, ``state_slots=3``: chunks 7, 8, 9 states (chunk 7: KV slots 42..47).
"""

from __future__ import annotations

import numpy as np
import torch

from allocators.arena import KVShape, MemoryArena, StateShape
from bench.dev.gpu.simcuda import SimCuda

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))


def test_pending_state_work_lands_before_its_chunk_becomes_kv() -> None:
    with SimCuda():
        a = MemoryArena(3616, KV, ST, state_slots=3, device="cuda")
        kv, st = a.kv_allocator, a.state_pool
        s7, s8 = st.alloc_slot(), st.alloc_slot()  # zeroing pending
        assert (s7, s8) == (7, 8)
        conv, ssm = torch.full((4, 3), 5.0), torch.full((2, 4, 4), -5.0)
        for layer in range(2):
            st.set_state(7, layer, conv, ssm)
        st.copy(7, 8)  # pending: 8 takes 7's state at the next read
        st.free_slot(7)  # the request let go of its source: legal, the copy stands
        assert a.state_to_kv(1) and a.owner[7] == 1  # chunk 7 (lowest free) is KV now
        got = kv.alloc(kv.available_size())
        assert got is not None and 42 in got.tolist()
        ones = torch.ones((), dtype=torch.float16, device="cuda")
        for layer in range(2):
            kv.pool.k_buffer(layer)[got] = ones
            kv.pool.v_buffer(layer)[got] = -ones
        c, m = st.get_state(8, 1)  # reads the states: the pending work goes out now
        assert torch.equal(c.cpu(), conv) and torch.equal(m.cpu(), ssm)  # 7's state
        for layer in range(2):  # and no KV byte was overwritten by it
            assert bool((kv.pool.k_buffer(layer)[got] == 1).all())
            assert bool((kv.pool.v_buffer(layer)[got] == -1).all())
        a.check()


def test_relocating_kv_pages_moves_their_bytes_without_a_host_sync() -> None:
    """``relocate_kv_pages`` (what a compaction runs) on a device: the page ids go up as one
    upload through pinned staging, not as pageable copies the host waits for (before: two
    "host->device copy from pageable memory" syncs per call)."""
    with SimCuda() as sim:
        a = MemoryArena(3616, KV, ST, state_slots=3, device="cuda")
        kv = a.kv_allocator
        got = kv.alloc(8)  # pages 3..6 (slots 6..13: chunk 0's pages are padding)
        assert got is not None and got.cpu().tolist() == list(range(6, 14))
        rows = a.buffer.view(-1, KV.page_bytes)
        data = torch.arange(4 * KV.page_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        rows[3:7] = data.view(4, KV.page_bytes).to("cuda")
        kv.free(got[:4])  # pages 3, 4 free
        sim.track(a, ["relocate_kv_pages"], "arena")
        a.relocate_kv_pages(np.array([5, 6], dtype=np.int64), np.array([3, 4], dtype=np.int64))
        assert sim.syncs_of("arena.relocate_kv_pages") == 0, sim.report()
        moved = rows[3:5].cpu()
        assert torch.equal(moved, data.view(4, KV.page_bytes)[2:4])
        assert kv.lowest.free_mask()[3:7].tolist() == [False, False, True, True]
        a.check()
    assert sim.errors == []
