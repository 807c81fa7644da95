"""A CUDA device simulated on the CPU that counts every host synchronisation.

Code meant for a GPU must not stall the host on the engine's hot path, must order its
asynchronous copies by events, and must never mix host and device tensors. None of that can be
seen on a CPU-only machine by running the code as it is: this module makes it visible.
Inside ``with SimCuda() as sim:``

* ``torch.cuda.is_available()`` is true and ``torch.device("cuda")`` resolves to ``cuda:0``;
  tensors created on ``cuda`` are CPU tensors of the subclass :class:`DeviceTensor`, which
  report ``device == cuda:0``, ``is_cuda`` and not ``is_cpu``, so the code under test takes its
  CUDA paths while the data stays readable (round trips stay checkable bit for bit);
* ``torch.cuda.Stream`` / ``Event`` / ``stream()`` / ``synchronize()`` are simulated
  (:class:`SimStream`, :class:`SimEvent`): an event completes when it is queried or
  synchronised (the simulated device is infinitely fast), and everything an asynchronous copy
  issued before the event's ``record`` on the same stream lands then;
* a ``TorchFunctionMode`` sees every torch call and sorts it.

What counts as one host synchronisation (:attr:`SimCuda.syncs`, with its call site), as on a
real GPU (``torch.cuda.set_sync_debug_mode`` flags the same calls)::

    value to the host   .item() .tolist() bool() int() float() index() of a device tensor,
                        repr / format, torch.equal / allclose
    data-dependent size nonzero, argwhere, unique, unique_consecutive, masked_select,
                        one-argument where, bincount, repeat_interleave without output_size,
                        boolean-mask indexing (read or write) of a device tensor
    blocking copies     device -> host without non_blocking (.cpu(), .to("cpu"), copy_), and
                        non_blocking into pageable memory (the driver waits for the copy);
                        host -> device from pageable memory (.to("cuda"), copy_, torch.tensor(
                        ..., device="cuda"), a CPU index or a Python scalar written through
                        a tensor index into a device tensor: the value is copied to the device
                        first)
    explicit waits      Event.synchronize, Stream.synchronize, torch.cuda.synchronize

What is an error (:attr:`SimCuda.errors`; with ``strict=True`` it raises ``AssertionError`` at
the offending call): an operation mixing device tensors with CPU tensors of dimension > 0 (a
real GPU raises there), ``.numpy()`` / ``__array__`` / ``data_ptr()`` of a device tensor read
by host code, a host read or write of memory an asynchronous copy has not finished with (its
destination before the event that covers it, or its pinned source while the copy reads it), and
an operation on one stream touching device memory another stream wrote, without waiting for it.

:meth:`SimCuda.track` wraps methods of objects so that every sync is charged to the outermost
tracked call it happened in (the engine-facing operation), with call counts per operation:
what a per-operation budget asserts. Syncs outside any tracked call are charged to
``"(outside)"``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from allocators.staging import reset_uploads

__all__ = ["DeviceTensor", "SimCuda", "SimEvent", "SimStream"]

_CUDA0 = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_T = torch.Tensor
OUTSIDE = "(outside)"

#: Calls whose result is a device value read on the host.
_VALUE_READS = {
    _T.item, _T.tolist, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.__complex__,
    _T.__repr__, _T.__format__, _T.__contains__, torch.equal, _T.equal, torch.allclose,
    _T.allclose,
}
#: Calls whose output size depends on device data.
_DATA_SIZED = {
    torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.unique, _T.unique,
    torch.unique_consecutive, _T.unique_consecutive, torch.masked_select, _T.masked_select,
    torch.bincount, _T.bincount,
}
_INDEXING = {_T.__getitem__, _T.__setitem__}
_INPLACE_EXTRA = {_T.__setitem__, _T.copy_, _T.index_copy_, _T.index_fill_, _T.index_put_,
                  _T.masked_fill_, _T.scatter_, _T.zero_, _T.fill_}


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0`` (see the module docstring).

    Results of torch calls on device tensors are device tensors; a view keeps its base (as on
    a real device: ``t[2:5]._base is t``), a new tensor has none.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **(kwargs or {}))
        return _wrap(ret)

    @property
    def device(self) -> torch.device:
        return _CUDA0

    @device.setter
    def device(self, value: torch.device) -> None:
        raise AttributeError("a tensor's device cannot be assigned")

    @property
    def is_cpu(self) -> bool:
        return False

    @is_cpu.setter
    def is_cpu(self, value: bool) -> None:
        raise AttributeError("is_cpu cannot be assigned")

    @property
    def is_cuda(self) -> bool:
        return True

    @is_cuda.setter
    def is_cuda(self, value: bool) -> None:
        raise AttributeError("is_cuda cannot be assigned")


def _is_dev(x: object) -> bool:
    return isinstance(x, DeviceTensor)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, DeviceTensor) else t


def _to_dev(t: torch.Tensor) -> DeviceTensor:
    """``t`` (a CPU tensor) as a device tensor: a view stays a view of its base, anything else
    becomes a base of its own."""
    if isinstance(t, DeviceTensor):
        return t
    out = torch.Tensor._make_subclass(DeviceTensor, t) if t._base is None else t.as_subclass(DeviceTensor)
    assert isinstance(out, DeviceTensor)
    return out


def _wrap(ret: Any) -> Any:
    if isinstance(ret, torch.Tensor):
        return _to_dev(ret)
    if isinstance(ret, (tuple, list)):
        return type(ret)(_wrap(r) for r in ret)
    return ret


def _tensors(args: Any, kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _is_cuda_device(d: Any) -> bool:
    if d is None:
        return False
    if isinstance(d, int):  # a bare index means a CUDA ordinal
        return True
    return torch.device(d).type == "cuda"


class SimStream:
    """A simulated CUDA stream: it remembers how far it has waited for every other stream."""

    def __init__(self, sim: SimCuda, device: Any = None, priority: int = 0) -> None:
        self.sim = sim
        self.device = _CUDA0
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
        self.sim._land(self, self.sim.seq)
        return True

    def synchronize(self) -> None:
        self.sim._sync("Stream.synchronize")
        self.sim._land(self, self.sim.seq)

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
        if not self.sim.events_complete and self.sim._synced.get(self.stream, -1) < self.seq:
            return False
        self.sim._land(self.stream, self.seq)
        return True

    def synchronize(self) -> None:
        self.sim._sync("Event.synchronize")
        if self.stream is not None:
            self.sim._land(self.stream, self.seq)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self.sim.current).wait_event(self)


@dataclass
class _Region:
    """Host memory an asynchronous copy is writing (``dst``) or reading (``src``)."""

    ptr: int
    lo: int
    hi: int
    stream: SimStream
    seq: int
    kind: str
    ref: weakref.ref[torch.Tensor]


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, one past the last byte) a tensor may touch."""
    ptr = t.untyped_storage().data_ptr()
    es = t.element_size()
    if t.numel() == 0:
        return ptr, 0, 0
    lo = int(t.storage_offset())
    hi = lo + sum((int(s) - 1) * abs(int(st)) for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return ptr, lo * es, hi * es


@dataclass
class OpStats:
    """Calls and syncs charged to one tracked operation."""

    calls: int = 0
    syncs: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.syncs.values())


class _Mode(TorchFunctionMode):
    def __init__(self, sim: SimCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.sim._dispatch(func, args, kwargs or {})


class SimCuda:
    """The simulated device and its counters (see the module docstring).

    Args:
        strict: raise ``AssertionError`` at the first error instead of collecting it.
        events_complete: ``Event.query()`` returns True (False: events never complete unless
            synchronised: every later wait for them is a counted sync).
    """

    def __init__(self, strict: bool = True, events_complete: bool = True) -> None:
        self.strict = strict
        self.events_complete = events_complete
        self.seq = 0
        self.errors: list[str] = []
        self.ops: dict[str, OpStats] = {}
        self.sites: Counter[tuple[str, str, str]] = Counter()
        self._stack: list[str] = []
        self._pinned: dict[int, Callable[[], object]] = {}
        self._regions: list[_Region] = []
        #: stream -> the last sequence number known complete (synchronised)
        self._synced: dict[SimStream, int] = {}
        #: pinned host allocations (``pin_memory=True``) made, with their sizes [bytes]
        self.pinned_allocs: list[int] = []
        self._writers: dict[int, tuple[SimStream, int, weakref.ref[torch.Tensor]]] = {}
        #: (bytes, call site) of every ``Tensor.pin_memory()`` call (a pageable copy pinned
        #: after the fact: twice the memory while both exist)
        self.pinned_copies: list[tuple[int, str]] = []
        self.streams: list[SimStream] = []
        self.default_stream = SimStream(self)
        self.current = self.default_stream
        self._mode = _Mode(self)
        self._saved: dict[str, Any] = {}

    # ------------------------------------------------------------------ install
    def __enter__(self) -> SimCuda:
        cuda = torch.cuda
        sim = self

        @contextlib.contextmanager
        def stream_ctx(s: SimStream | None) -> Iterator[None]:
            prev = sim.current
            if s is not None:
                sim.current = s
            try:
                yield
            finally:
                sim.current = prev

        patches: dict[str, Any] = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda d: None,
            "is_initialized": lambda: True,
            "Stream": functools.partial(SimStream, self),
            "Event": functools.partial(SimEvent, self),
            "current_stream": lambda device=None: sim.current,
            "default_stream": lambda device=None: sim.default_stream,
            "stream": stream_ctx,
            "synchronize": self._synchronize_all,
            "device": _DeviceContext,
            "cudart": lambda: _CudaRT(sim),
        }
        for name, value in patches.items():
            self._saved[name] = getattr(cuda, name)
            setattr(cuda, name, value)
        reset_uploads()  # the library's shared upload rings are pinned again, here
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(None, None, None)
        for name, value in self._saved.items():
            setattr(torch.cuda, name, value)
        self._saved.clear()
        reset_uploads()

    # ------------------------------------------------------------------ counters
    def track(self, obj: Any, names: tuple[str, ...] | list[str], label: str | None = None) -> None:
        """Charge syncs to ``obj``'s methods ``names`` (as ``"label.name"``, ``label`` defaulting
        to the class name) whenever such a call is the outermost tracked one."""
        prefix = label if label is not None else type(obj).__name__
        for name in names:
            fn = getattr(obj, name)
            op = f"{prefix}.{name}"
            setattr(obj, name, self._wrap(fn, op))

    def _wrap(self, fn: Callable[..., Any], op: str) -> Callable[..., Any]:
        stack = self._stack

        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            if stack:
                return fn(*args, **kwargs)
            stack.append(op)
            self.ops.setdefault(op, OpStats()).calls += 1
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()

        return tracked

    @property
    def total_syncs(self) -> int:
        return sum(s.total for s in self.ops.values())

    def syncs_of(self, op: str) -> int:
        s = self.ops.get(op)
        return s.total if s is not None else 0

    def _site(self) -> str:
        f: Any = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if "/torch/" not in fn and not fn.endswith("simcuda.py"):
                return f"{fn.rsplit('/', 2)[-2]}/{fn.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        return "?"

    def _sync(self, kind: str) -> None:
        op = self._stack[0] if self._stack else OUTSIDE
        self.ops.setdefault(op, OpStats()).syncs[kind] += 1
        self.sites[(op, kind, self._site())] += 1

    def _error(self, msg: str) -> None:
        full = f"{msg} at {self._site()}"
        self.errors.append(full)
        if self.strict:
            raise AssertionError(full)

    def report(self) -> str:
        """One line per tracked operation: calls, syncs, syncs per call, by kind."""
        lines = []
        for op, s in sorted(self.ops.items()):
            kinds = ", ".join(f"{k} {v}" for k, v in s.syncs.most_common())
            per = s.total / s.calls if s.calls else float(s.total)
            lines.append(f"{op:40s} calls {s.calls:6d} syncs {s.total:6d} ({per:.2f}/call) {kinds}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ memory tracking
    def _synchronize_all(self, device: Any = None) -> None:
        self._sync("torch.cuda.synchronize")
        for s in self.streams:
            self._synced[s] = self.seq
        self._regions.clear()

    def _land(self, stream: SimStream, seq: int) -> None:
        if self._synced.get(stream, -1) < seq:
            self._synced[stream] = seq
        if self._regions:
            self._regions = [r for r in self._regions
                             if not (r.stream is stream and r.seq <= seq) and r.ref() is not None]

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        self._pinned[t.untyped_storage().data_ptr()] = weakref.ref(t)
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        if _is_dev(t):
            return False
        ptr = t.untyped_storage().data_ptr()
        ref = self._pinned.get(ptr)
        return ref is not None and ref() is not None

    def _in_flight(self, t: torch.Tensor, kind: str, stream: SimStream) -> None:
        ptr, lo, hi = _extent(t)
        self.seq += 1
        self._regions.append(_Region(ptr, lo, hi, stream, self.seq, kind, weakref.ref(t)))

    def _check_host(self, ts: list[torch.Tensor], func: Any, target: Any) -> None:
        """Flag host access to memory under an asynchronous copy: any access to a copy's
        destination, a write (``target``: the written tensor, or ``True`` for any) to its
        source."""
        for t in ts:
            if _is_dev(t) or t.numel() == 0:
                continue
            ptr, lo, hi = _extent(t)
            for r in self._regions:
                if r.kind == "src" and target is not True and t is not target:
                    continue
                if r.ptr == ptr and r.lo < hi and lo < r.hi and r.ref() is not None:
                    what = ("read or write of a non_blocking copy's destination before the event "
                            "that covers it" if r.kind == "dst" else
                            "host access to a pinned buffer a non_blocking copy is still reading")
                    self._error(f"{_name(func)}: {what}")
                    return

    def _check_streams(self, ts: list[torch.Tensor], written: list[torch.Tensor], func: Any) -> None:
        cur = self.current
        for t in ts:
            if not _is_dev(t):
                continue
            w = self._writers.get(t.untyped_storage().data_ptr())
            if w is None or w[0] is cur or w[2]() is None:
                continue
            if cur.waited.get(w[0], -1) < w[1]:
                self._error(f"{_name(func)}: {cur} touches device memory {w[0]} wrote without "
                            "waiting for it")
                return
        for t in written:
            if _is_dev(t):
                self.seq += 1
                self._writers[t.untyped_storage().data_ptr()] = (cur, self.seq, weakref.ref(t))

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        ts = _tensors(args, kwargs)
        if self._regions and not _no_access(func, args):
            target = (True if func in (_T.numpy, _T.__array__, _T.data_ptr) else
                      args[0] if args and _inplace(func) else None)
            self._check_host(ts, func, target)
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, args, kwargs)
        dev = [t for t in ts if _is_dev(t)]
        if not dev:
            return self._host_call(func, args, kwargs)
        if func in _VALUE_READS:
            self._sync(f"{_name(func)}")
        elif func in _DATA_SIZED or (func is torch.where and len(args) + len(kwargs) == 1) or (
            func in (torch.repeat_interleave, _T.repeat_interleave)
            and kwargs.get("output_size") is None
        ):
            self._sync(f"{_name(func)}")
        if func in _INDEXING:
            self._check_index(func, args)
        else:
            mixed = [t for t in ts if not _is_dev(t) and t.dim() > 0]
            if mixed:
                self._error(f"{_name(func)}: device and CPU tensors mixed "
                            f"(CPU shapes {[tuple(t.shape) for t in mixed]})")
        out = func(*args, **kwargs)
        written = [args[0]] if args and isinstance(args[0], torch.Tensor) and _inplace(func) else []
        if isinstance(out, DeviceTensor) and not written and out._base is None:
            written = [out]  # new data (a view writes nothing)
        self._check_streams(dev, written, func)
        return out

    def _host_call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A call without device tensor operands: a factory on ``cuda`` becomes a device
        tensor; ``pin_memory=True`` allocates pinned memory."""
        device = kwargs.get("device")
        pin = bool(kwargs.get("pin_memory", False))
        if not _is_cuda_device(device) and not pin:
            return func(*args, **kwargs)
        kw = dict(kwargs)
        if _is_cuda_device(device):
            kw["device"] = _CPU
            if pin:
                raise RuntimeError("pin_memory=True is for CPU tensors only")
            if func in (torch.tensor, torch.as_tensor, _T.new_tensor):
                self._sync("torch.tensor(device=cuda) from pageable memory")
            out = func(*args, **kw)
            return _to_dev(out) if isinstance(out, torch.Tensor) else out
        kw["pin_memory"] = False
        out = func(*args, **kw)
        self.pinned_allocs.append(out.numel() * out.element_size())
        return self._pin(out)

    def _check_index(self, func: Any, args: Any) -> None:
        self_t, idx = args[0], args[1]
        parts = idx if isinstance(idx, tuple) else (idx,)
        value = args[2] if func is _T.__setitem__ else None
        # x[mask] = scalar is masked_fill_: the mask stays on the device, no sync
        masked_fill = (func is _T.__setitem__ and not isinstance(value, torch.Tensor)
                       and len(parts) == 1 and isinstance(parts[0], torch.Tensor)
                       and parts[0].dtype == torch.bool)
        tensor_idx = False
        for p in parts:
            if isinstance(p, list):
                p = torch.as_tensor(p)
                if _is_dev(self_t):
                    self._sync("list index into a device tensor (host->device copy)")
            if not isinstance(p, torch.Tensor):
                continue
            tensor_idx = True
            if p.dtype == torch.bool and p.dim() > 0:
                if (_is_dev(self_t) or _is_dev(p)) and not masked_fill:
                    self._sync("boolean-mask indexing")
            elif _is_dev(self_t) and not _is_dev(p) and p.dim() > 0:
                self._sync("CPU index into a device tensor (host->device copy)")
            elif not _is_dev(self_t) and _is_dev(p):
                self._error(f"{_name(func)}: CPU tensor indexed with a device index")
        if func is not _T.__setitem__ or masked_fill:
            return
        if isinstance(value, torch.Tensor):
            if _is_dev(value) != _is_dev(self_t) and value.dim() > 0:
                self._error(f"{_name(func)}: device and CPU tensors mixed in an assignment")
            elif _is_dev(self_t) and not _is_dev(value) and tensor_idx:
                self._sync("CPU scalar tensor written through an index (host->device copy)")
        elif _is_dev(self_t) and tensor_idx:
            self._sync("Python scalar written through a tensor index (host->device copy)")

    # ------------------------------------------------------------------ copies
    def _copy_kind(self, src: torch.Tensor, to_dev: bool, non_blocking: bool,
                   dst: torch.Tensor | None) -> None:
        """Count or track one copy between host and device."""
        if _is_dev(src) and not to_dev:  # device -> host
            if non_blocking and dst is not None and self.is_pinned(dst):
                self._in_flight(dst, "dst", self.current)
            else:
                self._sync("device->host copy" + (" into pageable memory" if non_blocking else ""))
        elif not _is_dev(src) and to_dev:  # host -> device
            if non_blocking and self.is_pinned(src):
                self._in_flight(src, "src", self.current)
            else:
                self._sync("host->device copy" + ("" if non_blocking else " (blocking)")
                           + ("" if self.is_pinned(src) else " from pageable memory"))

    def _to(self, args: Any, kwargs: dict[str, Any]) -> Any:
        src = args[0]
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        copy = bool(kwargs.get("copy", False))
        to_dev = _is_dev(src) if device is None else device.type == "cuda"
        plain = _plain(src)
        if to_dev == _is_dev(src):  # same side: dtype / copy only
            out = plain.to(dtype=dtype if dtype is not None else plain.dtype, copy=copy)
            out_t = _to_dev(out) if to_dev else out
            if _is_dev(src):
                self._check_streams([src], [] if out is plain else [out_t], _T.to)
            return src if out is plain else out_t
        out = plain.to(dtype=dtype if dtype is not None else plain.dtype, copy=True)
        if not to_dev:
            if non_blocking:  # PyTorch gives a non_blocking device->host copy a pinned result
                self._pin(out)
            self._check_streams([src], [], _T.to)
            self._copy_kind(src, False, non_blocking, out)
            return out
        self._copy_kind(src, True, non_blocking, None)
        out_d = _to_dev(out)
        self._check_streams([], [out_d], _T.to)
        return out_d

    def _cuda(self, args: Any, kwargs: dict[str, Any]) -> Any:
        return self._to((args[0], "cuda"), {"non_blocking": kwargs.get("non_blocking", False)})

    def _cpu(self, args: Any, kwargs: dict[str, Any]) -> Any:
        return self._to((args[0], "cpu"), {})

    def _copy_(self, args: Any, kwargs: dict[str, Any]) -> Any:
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if _is_dev(dst) != _is_dev(src):
            self._copy_kind(src, _is_dev(dst), non_blocking, dst)
        self._check_streams([t for t in (dst, src) if _is_dev(t)], [dst], _T.copy_)
        _plain(dst).copy_(_plain(src))
        return dst

    def _pin_memory(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if _is_dev(t):
            raise RuntimeError("cannot pin a device tensor")
        self.pinned_copies.append((t.numel() * t.element_size(), self._site()))
        return self._pin(t.clone())

    def _is_pinned(self, args: Any, kwargs: dict[str, Any]) -> Any:
        return self.is_pinned(args[0])

    def _numpy(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if _is_dev(t):
            self._error("numpy() of a device tensor (a real GPU raises: use cpu() first)")
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        return _T.numpy(t, **kwargs)

    def _array(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if _is_dev(t):
            self._error("__array__ of a device tensor (a real GPU raises: use cpu() first)")
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        return _T.__array__(t, *args[1:], **kwargs)

    def _data_ptr(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if _is_dev(t):
            self._error("data_ptr() of a device tensor taken by host code")
        return _T.data_ptr(_plain(t))


class _CudaRT:
    """``torch.cuda.cudart()``: host memory registration (page-locking in place)."""

    def __init__(self, sim: SimCuda) -> None:
        self.sim = sim

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.sim._pinned[ptr] = _Registered()
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.sim._pinned.pop(ptr, None)
        return 0


class _Registered:
    """A registration (``cudaHostRegister``) in the pinned table: alive until unregistered."""

    def __call__(self) -> bool:
        return True


class _DeviceContext(contextlib.nullcontext[None]):
    """``torch.cuda.device(d)``: one simulated device, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        super().__init__()


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


#: Calls that read or write no tensor data (metadata, views).
_METADATA = {_T.view, _T.narrow, _T.as_strided, _T.reshape, _T.unsqueeze, _T.squeeze, _T.t,
             _T.transpose, _T.permute, _T.expand, _T.__len__, _T.dim, _T.size, _T.numel,
             _T.element_size, _T.storage_offset, _T.stride, _T.untyped_storage, _T.is_pinned,
             _T.is_contiguous, *(inspect.getattr_static(_T, name).__get__
                                 for name in ("shape", "dtype", "_base", "_version"))}


def _no_access(func: Any, args: Any) -> bool:
    """Whether a call touches no tensor data: metadata, or a basic-indexing view."""
    if func in _METADATA:
        return True
    if func is _T.__getitem__:
        idx = args[1]
        parts = idx if isinstance(idx, tuple) else (idx,)
        return not any(isinstance(p, (torch.Tensor, list)) for p in parts)
    return False


def _inplace(func: Any) -> bool:
    if func in _INPLACE_EXTRA:
        return True
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


_SPECIAL: dict[Any, Callable[[SimCuda, Any, dict[str, Any]], Any]] = {
    _T.to: SimCuda._to,
    _T.cuda: SimCuda._cuda,
    _T.cpu: SimCuda._cpu,
    _T.copy_: SimCuda._copy_,
    _T.pin_memory: SimCuda._pin_memory,
    _T.is_pinned: SimCuda._is_pinned,
    _T.numpy: SimCuda._numpy,
    _T.__array__: SimCuda._array,
    _T.data_ptr: SimCuda._data_ptr,
    _T.record_stream: lambda sim, args, kwargs: None,
}
