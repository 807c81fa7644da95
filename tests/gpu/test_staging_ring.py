"""The pinned staging ring (``allocators.staging.PinnedRing``) and :func:`upload`, its user, on
the simulated device: the ring grows rather than wait when the copies in flight outgrow it, up
to ``max_bytes``; only then does the host wait, for every in-flight region a take covers; a
held region goes back to its owner's ``on_full`` before it is reused, however long ago its copy
finished.

The simulated device reads a ``non_blocking`` copy's pinned source when the copy lands (its
event seen complete, a wait, a device call on its destination), not when it is enqueued: a ring
that hands out a region too early lets the next upload's ids reach the earlier upload's tensor,
and the tests compare every uploaded tensor with its ids. They run the simulator non-strict so
that such a race shows as wrong data (and as an entry in ``sim.errors``) rather than stopping at
the host write."""

from __future__ import annotations

import numpy as np
import torch

from allocators.staging import PinnedRing, upload, uploads
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


def test_the_simulated_device_reads_a_pinned_source_when_the_copy_lands() -> None:
    """The premise of the tests below: host bytes changed after a ``non_blocking`` copy was
    enqueued and before its event reach the device; changed after the event, they do not."""
    with SimCuda(strict=False) as sim:
        pinned = torch.full((4,), 1, dtype=torch.int64, pin_memory=True)
        late = torch.empty(4, dtype=torch.int64, device="cuda")
        late.copy_(pinned, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        pinned.fill_(2)  # too early: the copy has not read it yet
        assert len(sim.errors) == 1 and "still reading" in sim.errors[0]
        ev.synchronize()
        assert late.cpu().tolist() == [2, 2, 2, 2]

        on_time = torch.empty(4, dtype=torch.int64, device="cuda")
        on_time.copy_(pinned, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        assert ev.query()  # complete (events_complete): the copy has read the 2s
        pinned.fill_(3)
        assert on_time.cpu().tolist() == [2, 2, 2, 2] and len(sim.errors) == 1


def _device() -> torch.device:
    return torch.empty(0, device="cuda").device  # cuda:0, the key of the shared ring


def _ids(k: int, n: int) -> np.ndarray:
    """Upload ``k``'s ids: ``n`` values no other upload has."""
    return np.arange(k * n, (k + 1) * n, dtype=np.int64)


def test_a_take_over_several_in_flight_regions_waits_for_each() -> None:
    with SimCuda(strict=False, events_complete=False) as sim:
        dev = _device()
        ring = uploads(dev)
        ring.max_bytes = ring.capacity  # no growing: a full ring waits
        q = ring.capacity // 8 // 4  # ids in a quarter of the ring
        hosts = [_ids(k, q) for k in range(4)]
        outs = [upload(h, dev) for h in hosts]  # the ring full, all 4 copies in flight
        assert ring.waits == 0 and sim.total_syncs == 0
        hosts.append(_ids(4, 3 * q))  # from 0 again, over regions 0, 1 and 2
        outs.append(upload(hosts[-1], dev))
        waits, syncs = ring.waits, sim.total_syncs
        for k, (out, h) in enumerate(zip(outs, hosts, strict=True)):  # each read: one more sync
            assert np.array_equal(out.cpu().numpy(), h), f"upload {k} reached the device wrong"
        assert sim.errors == []
        assert waits == 3 and syncs == 3  # one wait per region it covers, none for region 3


def test_a_region_whose_copy_has_not_landed_is_never_reused() -> None:
    with SimCuda(strict=False, events_complete=False) as sim:
        dev = _device()
        ring = uploads(dev)
        ring.max_bytes = ring.capacity
        q = ring.capacity // 8 // 4
        hosts = [_ids(k, q) for k in range(6)]
        outs, waits = [], []
        for h in hosts:  # the 5th and 6th reuse the 1st's and 2nd's regions
            outs.append(upload(h, dev))
            waits.append(ring.waits)
        for k, (out, h) in enumerate(zip(outs, hosts, strict=True)):
            assert np.array_equal(out.cpu().numpy(), h), f"upload {k} reached the device wrong"
        assert sim.errors == []
        assert waits == [0, 0, 0, 0, 1, 2]


def test_a_held_region_is_not_reused_before_release_even_when_its_copy_finished() -> None:
    """A device -> host copy into a held region; its event completes; the ring comes round to
    it: the owner's ``on_full`` must run (read the bytes, release) before the region is
    handed out again."""
    with SimCuda(strict=False) as sim:
        read: list[list[int]] = []

        def on_full() -> bool:  # the owner: reads its bytes on the host, then lets go
            read.append(held.view(torch.int64, (32,)).tolist())
            ring.release(held)
            return True

        ring = PinnedRing(1024, max_bytes=1024, on_full=on_full)
        held = ring.take(256, held=True)
        src = torch.arange(100, 132, dtype=torch.int64, device="cuda")
        held.view(torch.int64, (32,)).copy_(src, non_blocking=True)
        held.event = torch.cuda.Event()
        held.event.record()
        assert held.event.query()  # the copy has finished; the owner has not read it yet
        for k in range(3):  # the rest of the ring: finished uploads
            r = ring.take(256)
            r.view(torch.int64, (32,)).fill_(k)
            r.event = torch.cuda.Event()
            r.event.record()
        again = ring.take(256)  # from 0 again: the held region is in the way
        again.view(torch.int64, (32,)).fill_(-1)
        assert read == [list(range(100, 132))]  # on_full ran once, before the overwrite
        assert again.start == 0 and not held.held and ring.waits == 0
        assert sim.errors == []
