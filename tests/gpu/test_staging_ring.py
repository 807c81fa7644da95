"""The pinned staging ring (``allocators.staging.PinnedRing``) grows rather than wait when the
copies in flight outgrow it, up to ``max_bytes``; only then does the host wait for one (on the
simulated device, with events that never complete on their own)."""

from __future__ import annotations

import torch

from allocators.staging import PinnedRing
from bench.dev.gpu.simcuda import SimCuda


def test_the_ring_grows_while_everything_is_in_flight_then_waits() -> None:
    with SimCuda(events_complete=False) as sim:
        ring = PinnedRing(1024, max_bytes=2048)
        taken = []
        for _ in range(4):  # 4 x 256 bytes: the first buffer, full
            r = ring.take(256)
            r.event = torch.cuda.Event()
            r.event.record()
            taken.append(r)
        assert ring.capacity == 1024 and ring.waits == 0
        r = ring.take(256)  # the next one would reuse a copy in flight: grow, no wait
        assert ring.capacity == 2048 and ring.waits == 0 and sim.total_syncs == 0
        assert r.buffer is not taken[0].buffer and r.start == 0
        r.event = torch.cuda.Event()
        r.event.record()
        for _ in range(7):  # the rest of the 2048-byte buffer
            x = ring.take(256)
            x.event = torch.cuda.Event()
            x.event.record()
        assert ring.capacity == 2048 and ring.waits == 0
        ring.take(256)  # at max_bytes, all in flight: the host waits for the oldest
        assert ring.capacity == 2048 and ring.waits == 1 and sim.total_syncs == 1
