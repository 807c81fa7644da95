"""The simulated CUDA device (bench/dev/gpu/simcuda.py) counts exactly the calls that synchronise the
host on a real GPU, flags what a real GPU would refuse or get wrong, and leaves the CPU alone
outside its ``with`` block. Every later GPU-path test relies on these properties."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench.dev.gpu.simcuda import OUTSIDE, DeviceTensor, SimCuda


def _syncs(fn: Callable[[torch.Tensor], object], **kw: bool) -> int:
    """Syncs of ``fn(device tensor [3, 1, 4])`` inside a fresh simulator."""
    with SimCuda(**kw) as sim:
        t = torch.tensor([3, 1, 4], device="cuda")
        before = sim.total_syncs  # torch.tensor(..., device=cuda) is one itself
        fn(t)
        return sim.total_syncs - before


@pytest.mark.parametrize(
    "name, fn",
    [
        ("item", lambda t: t[0].item()),
        ("tolist", lambda t: t.tolist()),
        ("bool", lambda t: bool(t[0])),
        ("int", lambda t: int(t[0])),
        ("float", lambda t: float(t[0])),
        ("index", lambda t: [0, 1, 2, 3, 4][t[1]]),
        ("cpu", lambda t: t.cpu()),
        ("to cpu", lambda t: t.to("cpu")),
        ("nonzero", lambda t: t.nonzero()),
        ("unique", lambda t: torch.unique(t)),
        ("mask read", lambda t: t[t > 1]),
        ("mask write of a tensor", lambda t: t.__setitem__(t > 1, t[0])),
        ("scalar through an index", lambda t: t.__setitem__(torch.arange(2, device="cuda"), 0)),
        ("cpu index", lambda t: t[torch.tensor([0, 2])]),
        ("pageable to device", lambda t: torch.tensor([1, 2]).to("cuda")),
        ("non_blocking into pageable", lambda t: torch.empty(3, dtype=torch.int64).copy_(t, non_blocking=True)),
        ("equal", lambda t: torch.equal(t, t)),
        ("synchronize", lambda t: torch.cuda.synchronize()),
    ],
)
def test_each_syncing_call_counts_once(name: str, fn: Callable[[torch.Tensor], object]) -> None:
    assert _syncs(fn) == 1, name


@pytest.mark.parametrize(
    "name, fn",
    [
        ("slice", lambda t: t[1:]),
        ("cat", lambda t: torch.cat([t, t])),
        ("device index", lambda t: t[torch.zeros(2, dtype=torch.int64, device="cuda")]),
        ("index_fill_", lambda t: t.index_fill_(0, t[:1] - 3, 0)),
        ("mask write of a scalar (masked_fill_)", lambda t: t.__setitem__(t > 1, 0)),
        ("arithmetic", lambda t: (t * 2 + 1) != 0),
        ("shape", lambda t: (len(t), t.shape[0], t.numel(), t.dtype, t.device)),
        ("device -> pinned", lambda t: torch.empty(3, dtype=torch.int64, pin_memory=True).copy_(
            t, non_blocking=True)),
        ("pinned -> device", lambda t: torch.zeros(3, dtype=torch.int64, pin_memory=True).to(
            "cuda", non_blocking=True)),
    ],
)
def test_asynchronous_calls_count_nothing(name: str, fn: Callable[[torch.Tensor], object]) -> None:
    assert _syncs(fn) == 0, name


def test_device_tensors_report_cuda_and_views_keep_their_base() -> None:
    with SimCuda():
        assert torch.cuda.is_available() and torch.device("cuda").index is None
        t = torch.arange(8, device="cuda")
        assert isinstance(t, DeviceTensor) and t.device == torch.device("cuda", 0)
        assert t.is_cuda and not t.is_cpu
        v = t[2:6]
        assert v._base is t and v[1:]._base is t and torch.cat([t, t])._base is None
        assert t.clone()._base is None
    assert not isinstance(torch.arange(3), DeviceTensor)


def test_mixed_devices_numpy_and_data_ptr_are_errors() -> None:
    with SimCuda() as sim, pytest.raises(AssertionError, match="mixed"):
        torch.arange(3, device="cuda") + torch.arange(3)
    assert len(sim.errors) == 1
    with SimCuda(strict=False) as sim:
        t = torch.arange(3, device="cuda")
        t * torch.tensor(2)  # a 0-d CPU tensor is a scalar: allowed, as on a GPU
        with pytest.raises(TypeError):
            t.numpy()
        t.data_ptr()
        torch.arange(3)[torch.tensor([0], device="cuda")]  # CPU data, device index
    assert [e.split(" at ")[0] for e in sim.errors] == [
        "numpy() of a device tensor (a real GPU raises: use cpu() first)",
        "data_ptr() of a device tensor taken by host code",
        "TensorBase.__getitem__: CPU tensor indexed with a device index"]


def test_a_non_blocking_destination_is_readable_only_after_its_event() -> None:
    with SimCuda() as sim:
        dev = torch.arange(4, device="cuda")
        host = torch.empty(4, dtype=torch.int64, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        with pytest.raises(AssertionError, match="before the event"):
            host + 1
        ev = torch.cuda.Event()
        ev.record()
        assert ev.query()
        assert (host + 1).tolist() == [1, 2, 3, 4]  # landed: readable, and no sync counted
        assert sim.total_syncs == 0
    with SimCuda(events_complete=False) as sim:
        dev = torch.arange(4, device="cuda")
        host = torch.empty(4, dtype=torch.int64, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        side = torch.cuda.Stream()
        ev = torch.cuda.Event()
        ev.record(side)  # an event on another stream covers nothing of the copy
        ev.synchronize()
        with pytest.raises(AssertionError, match="before the event"):
            host.sum()
        late = torch.cuda.Event()
        late.record()
        assert not late.query()
        late.synchronize()
        assert late.query() and host.sum() == 6 and sim.total_syncs == 2


def test_a_pinned_source_must_not_be_written_while_its_copy_reads_it() -> None:
    with SimCuda():
        src = torch.arange(4, dtype=torch.int64, pin_memory=True)
        dst = torch.empty(4, dtype=torch.int64, device="cuda")
        dst.copy_(src, non_blocking=True)
        src + 1  # reading it is harmless
        with pytest.raises(AssertionError, match="still reading"):
            src.add_(1)


def test_a_stream_must_wait_for_another_streams_writes() -> None:
    with SimCuda():
        side = torch.cuda.Stream()
        pool = torch.zeros(8, device="cuda")
        with torch.cuda.stream(side):
            pool.index_fill_(0, torch.arange(2, device="cuda"), 1.0)
        with pytest.raises(AssertionError, match="without waiting"):
            pool.sum()
    with SimCuda():
        side = torch.cuda.Stream()
        pool = torch.zeros(8, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pool.index_fill_(0, torch.arange(2, device="cuda"), 1.0)
            ev = torch.cuda.Event()
            ev.record(side)
        torch.cuda.current_stream().wait_event(ev)
        assert pool.sum().tolist() == 2.0


def test_syncs_are_charged_to_the_outermost_tracked_call() -> None:
    class Engine:
        def outer(self, t: torch.Tensor) -> int:
            return self.inner(t) + int(t[0])

        def inner(self, t: torch.Tensor) -> int:
            return int(t[1])

    with SimCuda() as sim:
        e = Engine()
        sim.track(e, ["outer", "inner"], "e")
        t = torch.arange(3, device="cuda")
        e.outer(t)
        e.inner(t)
        int(t[2])
    assert (sim.ops["e.outer"].calls, sim.syncs_of("e.outer")) == (1, 2)
    assert (sim.ops["e.inner"].calls, sim.syncs_of("e.inner")) == (1, 1)
    assert sim.syncs_of(OUTSIDE) == 1  # the last int(), outside every tracked call
    assert "e.outer" in sim.report()


def test_the_simulator_restores_torch_cuda() -> None:
    real = torch.cuda.is_available()
    with SimCuda():
        assert torch.cuda.is_available()
    assert torch.cuda.is_available() == real
    assert torch.cuda.Stream.__name__ == "Stream"
