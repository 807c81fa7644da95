"""The simulated device's primitives: tensors that report ``cuda:0``, streams, events, host
memory registration, and the tables that sort torch calls (see ``bench/dev/gpu/simcuda.py``, which
installs them and does the counting)."""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bench.dev.gpu.simcuda import SimCuda

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")
T = torch.Tensor

#: Calls whose result is a device value read on the host.
VALUE_READS = {
    T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.__complex__,
    T.__repr__, T.__format__, T.__contains__, torch.equal, T.equal, torch.allclose,
    T.allclose,
}
#: Calls whose output size depends on device data.
DATA_SIZED = {
    torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.unique, T.unique,
    torch.unique_consecutive, T.unique_consecutive, torch.masked_select, T.masked_select,
    torch.bincount, T.bincount,
}
INDEXING = {T.__getitem__, T.__setitem__}
INPLACE_EXTRA = {T.__setitem__, T.copy_, T.index_copy_, T.index_fill_, T.index_put_,
                 T.masked_fill_, T.scatter_, T.zero_, T.fill_}


def _fixed(value: object, what: str) -> Any:
    """A read-only property of every device tensor, ``value``; assigning it raises
    ``AttributeError`` naming ``what`` (as a real tensor's does)."""

    def get(_self: torch.Tensor) -> object:
        return value

    def refuse(_self: torch.Tensor, _value: object) -> None:
        raise AttributeError(f"{what} cannot be assigned")

    return property(get, refuse)


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0`` (see ``bench/dev/gpu/simcuda.py``).

    Results of torch calls on device tensors are device tensors; a view keeps its base (as on
    a real device: ``t[2:5]._base is t``), a new tensor has none.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **(kwargs or {}))
        return wrap_results(ret)

    device = _fixed(CUDA0, "a tensor's device")
    is_cpu = _fixed(False, "is_cpu")
    is_cuda = _fixed(True, "is_cuda")


def is_device(x: object) -> bool:
    return isinstance(x, DeviceTensor)


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, DeviceTensor) else t


def to_device(t: torch.Tensor) -> DeviceTensor:
    """``t`` (a CPU tensor) as a device tensor: a view stays a view of its base, anything else
    becomes a base of its own."""
    if isinstance(t, DeviceTensor):
        return t
    out = torch.Tensor._make_subclass(DeviceTensor, t) if t._base is None else t.as_subclass(DeviceTensor)
    assert isinstance(out, DeviceTensor)
    return out


def wrap_results(ret: Any) -> Any:
    if isinstance(ret, torch.Tensor):
        return to_device(ret)
    if isinstance(ret, (tuple, list)):
        return type(ret)(wrap_results(r) for r in ret)
    return ret


def tensors_of(args: Any, kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def is_cuda_device(d: Any) -> bool:
    if d is None:
        return False
    if isinstance(d, int):  # a bare index means a CUDA ordinal
        return True
    return torch.device(d).type == "cuda"


class SimStream:
    """A simulated CUDA stream: it remembers how far it has waited for every other stream."""

    def __init__(self, sim: SimCuda, device: Any = None, priority: int = 0) -> None:
        self.sim = sim
        self.device = CUDA0
        self.priority = priority
        #: other stream -> the last sequence number of that stream this one has waited for
        self.waited: dict[SimStream, int] = {}
        sim.streams.append(self)

    def wait_event(self, event: SimEvent) -> None:
        if event.stream is not None and event.stream is not self:
            self.waited[event.stream] = max(self.waited.get(event.stream, -1), event.seq)

    def wait_stream(self, stream: SimStream) -> None:
        if stream is not self:
            self.waited[stream] = max(self.waited.get(stream, -1), self.sim.seq)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent(self.sim)
        event.record(self)
        return event

    def query(self) -> bool:
        self.sim.land(self, self.sim.seq)
        return True

    def synchronize(self) -> None:
        self.sim.sync("Stream.synchronize")
        self.sim.land(self, self.sim.seq)

    def __repr__(self) -> str:
        return f"SimStream({'default' if self is self.sim.default_stream else id(self)})"


class SimEvent:
    """A simulated CUDA event (see the module docstring for when it completes)."""

    def __init__(self, sim: SimCuda, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.sim = sim
        self.stream: SimStream | None = None
        self.seq = -1

    def record(self, stream: SimStream | None = None) -> None:
        self.stream = stream if stream is not None else self.sim.current
        self.sim.seq += 1
        self.seq = self.sim.seq

    def query(self) -> bool:
        if self.stream is None:
            return True
        if not self.sim.events_complete and self.sim.synced.get(self.stream, -1) < self.seq:
            return False
        self.sim.land(self.stream, self.seq)
        return True

    def synchronize(self) -> None:
        self.sim.sync("Event.synchronize")
        if self.stream is not None:
            self.sim.land(self.stream, self.seq)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self.sim.current).wait_event(self)


class CudaRT:
    """``torch.cuda.cudart()``: host memory registration (page-locking in place)."""

    def __init__(self, sim: SimCuda) -> None:
        self.sim = sim

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.sim.pinned[ptr] = Registered()
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.sim.pinned.pop(ptr, None)
        return 0


class Registered:
    """A registration (``cudaHostRegister``) in the pinned table: alive until unregistered."""

    def __call__(self) -> bool:
        return True


class DeviceContext(contextlib.nullcontext[None]):
    """``torch.cuda.device(d)``: one simulated device, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        super().__init__()


def func_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


#: Calls that read or write no tensor data (metadata, views).
METADATA = {T.view, T.narrow, T.as_strided, T.reshape, T.unsqueeze, T.squeeze, T.t,
             T.transpose, T.permute, T.expand, T.__len__, T.dim, T.size, T.numel,
             T.element_size, T.storage_offset, T.stride, T.untyped_storage, T.is_pinned,
             T.is_contiguous, *(inspect.getattr_static(T, name).__get__
                                 for name in ("shape", "dtype", "_base", "_version"))}


def no_access(func: Any, args: Any) -> bool:
    """Whether a call touches no tensor data: metadata, or a basic-indexing view."""
    if func in METADATA:
        return True
    if func is T.__getitem__:
        idx = args[1]
        parts = idx if isinstance(idx, tuple) else (idx,)
        return not any(isinstance(p, (torch.Tensor, list)) for p in parts)
    return False


def writes_first_arg(func: Any) -> bool:
    if func in INPLACE_EXTRA:
        return True
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")
