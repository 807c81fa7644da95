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


@pytest.mark.parametrize("filename", ["<string>", "gen.py", "/gen.py", "a\\b\\gen.py"])
def test_a_sync_site_in_a_file_with_few_slashes_is_named(filename: str) -> None:
    """Code compiled under a name with fewer than two '/' (``exec`` strings, pytest-xdist's
    workers, a Windows path) is still a call site: it used to raise ``IndexError``."""
    code = compile("int(t[0])\nt.numpy()\n", filename, "exec")
    with SimCuda(strict=False) as sim:
        t = torch.arange(3, device="cuda")
        with pytest.raises(TypeError):
            exec(code, {"t": t})
    want = filename.replace("\\", "/").split("/")[-2:]
    assert [site for (_, _, site) in sim.sites] == [f"{'/'.join(want)}:1 <module>"]
    assert sim.errors == [f"numpy() of a device tensor (a real GPU raises: use cpu() first) at "
                          f"{'/'.join(want)}:2 <module>"]


def test_the_simulator_never_asks_the_real_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with a GPU the simulated device must behave as on one without: nothing it
    does may reach the real driver (here every entry to it raises)."""
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the real CUDA was asked")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "current_stream", refuse)
    with SimCuda() as sim:
        t = torch.arange(4, device="cuda")
        host = torch.empty(4, dtype=torch.int64, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        assert ev.query() and host.tolist() == [0, 1, 2, 3]
        assert int(t[1]) == 1 and sim.total_syncs == 1
    assert torch.cuda.current_stream is refuse  # restored to what it was before


def _api(fn: Callable[[torch.Tensor], object]) -> tuple[int, int]:
    """(kernel launches, memcpys) of ``fn(device tensor [3, 1, 4])`` in a fresh simulator."""
    with SimCuda(strict=False) as sim:
        t = torch.tensor([3, 1, 4], device="cuda")
        before = sim.api_of(OUTSIDE)
        n0, m0 = sum(before.launches.values()), sum(before.memcpys.values())
        fn(t)
        after = sim.api_of(OUTSIDE)
        return sum(after.launches.values()) - n0, sum(after.memcpys.values()) - m0


@pytest.mark.parametrize(
    "name, fn, want",
    [
        ("slice view", lambda t: t[1:], (0, 0)),
        ("reshape view", lambda t: t.view(3, 1), (0, 0)),
        ("split views", lambda t: t.split(2), (0, 0)),
        ("shape", lambda t: (len(t), t.shape, t.numel()), (0, 0)),
        ("empty", lambda t: torch.empty(5, device="cuda"), (0, 0)),
        ("contiguous of contiguous", lambda t: t.contiguous(), (0, 0)),
        ("zeros", lambda t: torch.zeros(5, device="cuda"), (1, 0)),
        ("cat", lambda t: torch.cat([t, t]), (1, 0)),
        ("clone", lambda t: t.clone(), (1, 0)),
        ("arithmetic", lambda t: t * 2, (1, 0)),
        ("in place", lambda t: t.add_(1), (1, 0)),
        ("fill a slice", lambda t: t[1:].fill_(0), (1, 0)),
        ("gather by a device index", lambda t: t[t[1:2]], (1, 0)),
        ("index_fill_", lambda t: torch.empty_like(t).index_fill_(0, t[1:2], 0), (1, 0)),
        ("dtype cast", lambda t: t.to(torch.int32), (1, 0)),
        ("device -> device copy_", lambda t: torch.empty_like(t).copy_(t), (1, 0)),
        ("upload", lambda t: torch.tensor([1, 2], device="cuda"), (0, 1)),
        ("pinned upload", lambda t: torch.zeros(3, dtype=torch.int64, pin_memory=True).to(
            "cuda", non_blocking=True), (0, 1)),
        ("download", lambda t: t.cpu(), (0, 1)),
        ("value read", lambda t: t.tolist(), (0, 1)),
        ("CPU index", lambda t: t[torch.tensor([0, 2])], (1, 1)),
        ("nonzero", lambda t: t.nonzero(), (1, 1)),
        ("zero elements", lambda t: (t[:0].clone(), torch.cat([t[:0], t[:0]]),
                                     torch.tensor([], dtype=torch.int64).to("cuda")), (0, 0)),
    ],
)
def test_each_call_counts_its_launches_and_memcpys(name: str, fn: Callable[[torch.Tensor], object],
                                                   want: tuple[int, int]) -> None:
    assert _api(fn) == want, name


def test_launches_and_memcpys_are_charged_to_the_outermost_call_and_excluded_apart() -> None:
    class Engine:
        def outer(self, t: torch.Tensor) -> torch.Tensor:
            return self.transfer(t) + 1  # one launch here, the transfer's apart

        def transfer(self, t: torch.Tensor) -> torch.Tensor:
            return self.step(t.cpu().to("cuda"))  # two memcpys, excluded

        def step(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2  # counted again, though inside the transfer

    with SimCuda(strict=False) as sim:
        e = Engine()
        sim.track(e, ["outer"], "e")
        sim.exclude(e, ["transfer"])
        sim.include(e, ["step"])
        e.outer(torch.arange(3, device="cuda"))
    c = sim.api_of("e.outer")
    assert (dict(c.launches), dict(c.memcpys), dict(c.excluded)) == (
        {"add": 1, "mul": 1}, {}, {"D2H copy": 1, "H2D copy": 1})
    assert c.total == 2 and sim.total_launches == 2 and sim.total_memcpys == 0
    assert "e.outer" in sim.api_report()
