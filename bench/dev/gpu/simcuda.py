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
  issued before the event's ``record`` on the same stream lands then; a ``non_blocking`` copy
  from pinned host memory to the device reads its source when it lands (that event seen
  complete, a wait for its stream, or a device call on its destination), not when it is
  enqueued, so host bytes changed before then reach the device, as on a GPU;
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
an operation on one stream touching device memory another stream wrote, without waiting for it
(on the device, or on the host: an event of that stream seen complete covers its writes).

:meth:`SimCuda.track` wraps methods of objects so that every sync is charged to the outermost
tracked call it happened in (the engine-facing operation), with call counts per operation:
what a per-operation budget asserts. Syncs outside any tracked call are charged to
``"(outside)"``.

CUDA API calls (:attr:`SimCuda.api`, charged the same way, see :class:`ApiCalls`): a **kernel
launch** is a call on device tensors that writes device memory (an in-place call, or a result
with new storage: ``clone``, ``cat``, arithmetic, a gather through a tensor index, a fill of
a slice, a factory such as ``zeros`` / ``arange`` on ``cuda``); views, metadata and
``empty`` launch nothing. A **memcpy** is a copy between host and device (``to`` / ``copy_``
/ ``torch.tensor(..., device="cuda")``, a CPU or list index or a Python scalar sent along with
an indexing call, a value read on the host). Calls on zero elements launch and copy nothing
(as PyTorch skips them). Calls made inside :meth:`SimCuda.exclude`'d methods (the host tier's
data transfers) are counted apart, in ``ApiCalls.excluded``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from allocators.staging import reset_uploads
from bench.dev.gpu.device import (
    CPU,
    DATA_SIZED,
    INDEXING,
    METADATA,
    VALUE_READS,
    CudaRT,
    DeviceContext,
    DeviceTensor,
    SimEvent,
    SimStream,
    T,
    func_name,
    is_cuda_device,
    is_device,
    no_access,
    plain,
    tensors_of,
    to_device,
    writes_first_arg,
)

__all__ = ["OUTSIDE", "DeviceTensor", "SimCuda", "SimEvent", "SimStream"]

OUTSIDE = "(outside)"

@dataclass
class _Copy:
    """A ``non_blocking`` host -> device copy from pinned memory that has not run yet."""

    stream: SimStream
    seq: int
    dst: torch.Tensor  # a plain alias of the destination's memory
    src: torch.Tensor


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
class ApiCalls:
    """Kernel launches and memcpys charged to one tracked operation, by kind (see the module
    docstring); ``excluded``: those made inside excluded calls (not in the totals)."""

    launches: Counter[str] = field(default_factory=Counter)
    memcpys: Counter[str] = field(default_factory=Counter)
    excluded: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Launches plus memcpys (the excluded ones not counted)."""
        return sum(self.launches.values()) + sum(self.memcpys.values())


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
        #: host storage pointer -> the pinned tensor (weak): what ``is_pinned`` answers from
        self.pinned: dict[int, Callable[[], object]] = {}
        self._regions: list[_Region] = []
        #: asynchronous host -> device copies not yet run (each reads its source when it lands)
        self._pending: list[_Copy] = []
        #: stream -> the last sequence number known complete (synchronised)
        self.synced: dict[SimStream, int] = {}
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
        self._init_api()
        self._init_transfer_counters()

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
            "device": DeviceContext,
            "cudart": lambda: CudaRT(sim),
        }
        for name, value in patches.items():
            self._saved[name] = getattr(cuda, name)
            setattr(cuda, name, value)
        reset_uploads()  # the library's shared upload rings are pinned again, here
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(None, None, None)
        self._run_copies(lambda c: True)
        for name, value in self._saved.items():
            setattr(torch.cuda, name, value)
        self._saved.clear()
        reset_uploads()

    # ------------------------------------------------------------------ counters
    def track(self, obj: Any, names: tuple[str, ...] | list[str], label: str | None = None) -> None:
        """Charge syncs, kernel launches and memcpys to ``obj``'s methods ``names`` (as
        ``"label.name"``, ``label`` defaulting to the class name) whenever such a call is the
        outermost tracked one."""
        prefix = label if label is not None else type(obj).__name__
        for name in names:
            fn = getattr(obj, name)
            op = f"{prefix}.{name}"
            setattr(obj, name, self._tracked(fn, op))

    def _tracked(self, fn: Callable[..., Any], op: str) -> Callable[..., Any]:
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
        """``dir/file.py:line function`` of the innermost frame outside torch and this module
        (a frame of generated code, e.g. ``<string>``, is named as it is)."""
        f: Any = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            parts = fn.replace("\\", "/").split("/")
            if "torch" not in parts[:-1] and parts[-1] != "simcuda.py":
                return f"{'/'.join(parts[-2:])}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        return "?"

    def sync(self, kind: str) -> None:
        """Count one host synchronisation of ``kind`` against the current operation and site."""
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
        self.sync("torch.cuda.synchronize")
        for s in self.streams:
            self.synced[s] = self.seq
        self._regions.clear()
        self._run_copies(lambda c: True)

    def land(self, stream: SimStream, seq: int) -> None:
        """Work on ``stream`` up to sequence number ``seq`` is complete (synchronised): its
        regions in flight are released."""
        if self.synced.get(stream, -1) < seq:
            self.synced[stream] = seq
        if self._regions:
            self._regions = [r for r in self._regions
                             if not (r.stream is stream and r.seq <= seq) and r.ref() is not None]
        if self._pending:  # its copies and those of the streams it waited for
            self._run_copies(lambda c: c.seq <= (seq if c.stream is stream
                                                 else stream.waited.get(c.stream, -1)))

    def _run_copies(self, due: Callable[[_Copy], bool]) -> None:
        """Run the pending host -> device copies ``due`` says have landed, in enqueue order:
        each reads its pinned source now."""
        now = [c for c in self._pending if due(c)]
        if not now:
            return
        self._pending = [c for c in self._pending if not due(c)]
        with torch._C.DisableTorchFunction():
            for c in now:
                c.dst.copy_(c.src)

    def _land_touched(self, ts: list[torch.Tensor]) -> None:
        """A device call on the destination of a pending copy runs after it (the copy lands
        first, with everything its stream enqueued before it)."""
        ptrs = {t.untyped_storage().data_ptr() for t in ts if is_device(t)}
        hit = [c for c in self._pending if c.dst.untyped_storage().data_ptr() in ptrs]
        if hit:
            last = {c.stream: c.seq for c in hit}
            self._run_copies(lambda c: c.seq <= last.get(c.stream, -1))

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        self.pinned[t.untyped_storage().data_ptr()] = weakref.ref(t)
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        if is_device(t):
            return False
        ptr = t.untyped_storage().data_ptr()
        ref = self.pinned.get(ptr)
        return ref is not None and ref() is not None

    def _in_flight(self, t: torch.Tensor, kind: str, stream: SimStream) -> None:
        ptr, lo, hi = _extent(t)
        self.seq += 1
        self._regions.append(_Region(ptr, lo, hi, stream, self.seq, kind, weakref.ref(t)))

    def _check_host(self, ts: list[torch.Tensor], func: Any, target: Any,
                    dma: SimStream | None = None) -> None:
        """Flag host access to memory under an asynchronous copy: any access to a copy's
        destination, a write (``target``: the written tensor, or ``True`` for any) to its
        source. ``dma``: the access is itself an asynchronous copy enqueued on that stream,
        ordered after the copies of its own stream and of those it waited for."""
        for t in ts:
            if is_device(t) or t.numel() == 0:
                continue
            ptr, lo, hi = _extent(t)
            for r in self._regions:
                if r.kind == "src" and target is not True and t is not target:
                    continue
                if dma is not None and (r.stream is dma or dma.waited.get(r.stream, -1) >= r.seq):
                    continue
                if r.ptr == ptr and r.lo < hi and lo < r.hi and r.ref() is not None:
                    what = ("read or write of a non_blocking copy's destination before the event "
                            "that covers it" if r.kind == "dst" else
                            "host access to a pinned buffer a non_blocking copy is still reading")
                    self._error(f"{func_name(func)}: {what}")
                    return

    def _check_streams(self, ts: list[torch.Tensor], written: list[torch.Tensor], func: Any) -> None:
        cur = self.current
        for t in ts:
            if not is_device(t):
                continue
            w = self._writers.get(t.untyped_storage().data_ptr())
            if w is None or w[0] is cur or w[2]() is None:
                continue
            if cur.waited.get(w[0], -1) < w[1] and self.synced.get(w[0], -1) < w[1]:
                self._error(f"{func_name(func)}: {cur} touches device memory {w[0]} wrote without "
                            "waiting for it")
                return
        for t in written:
            if is_device(t):
                self.seq += 1
                self._writers[t.untyped_storage().data_ptr()] = (cur, self.seq, weakref.ref(t))

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        ts = tensors_of(args, kwargs)
        if self._pending and not no_access(func, args):
            self._land_touched(ts)
        if self._regions and not no_access(func, args):
            target = (True if func in (T.numpy, T.__array__, T.data_ptr) else
                      args[0] if args and writes_first_arg(func) else None)
            self._check_host(ts, func, target, self._dma_stream(func, args, kwargs))
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, args, kwargs)
        dev = [t for t in ts if is_device(t)]
        if not dev:
            return self._host_call(func, args, kwargs)
        if func in VALUE_READS:
            self.sync(f"{func_name(func)}")
        elif func in DATA_SIZED or (func is torch.where and len(args) + len(kwargs) == 1) or (
            func in (torch.repeat_interleave, T.repeat_interleave)
            and kwargs.get("output_size") is None
        ):
            self.sync(f"{func_name(func)}")
        if func in INDEXING:
            self._check_index(func, args)
        else:
            mixed = [t for t in ts if not is_device(t) and t.dim() > 0]
            if mixed:
                self._error(f"{func_name(func)}: device and CPU tensors mixed "
                            f"(CPU shapes {[tuple(t.shape) for t in mixed]})")
        out = func(*args, **kwargs)
        written = [args[0]] if args and isinstance(args[0], torch.Tensor) and writes_first_arg(func) else []
        self._count_call(func, args, dev, written, out)
        if isinstance(out, DeviceTensor) and not written and out._base is None:
            written = [out]  # new data (a view writes nothing)
        self._check_streams(dev, written, func)
        self._mapped_writes(written)
        return out

    def _host_call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A call without device tensor operands: a factory on ``cuda`` becomes a device
        tensor; ``pin_memory=True`` allocates pinned memory."""
        device = kwargs.get("device")
        pin = bool(kwargs.get("pin_memory", False))
        if func is torch.as_tensor and args and hasattr(args[0], "__cuda_array_interface__"):
            return self._mapped(args[0])
        if not is_cuda_device(device) and not pin:
            out = func(*args, **kwargs)
            self._charge_cpu_copy(func, args, kwargs, out)
            return out
        kw = dict(kwargs)
        if is_cuda_device(device):
            kw["device"] = CPU
            if pin:
                raise RuntimeError("pin_memory=True is for CPU tensors only")
            if func in (torch.tensor, torch.as_tensor, T.new_tensor):
                self.sync("torch.tensor(device=cuda) from pageable memory")
            out = func(*args, **kw)
            if isinstance(out, torch.Tensor):
                self._count_factory(func, out)
            return to_device(out) if isinstance(out, torch.Tensor) else out
        kw["pin_memory"] = False
        out = func(*args, **kw)
        self.pinned_allocs.append(out.numel() * out.element_size())
        return self._pin(out)

    def _check_index(self, func: Any, args: Any) -> None:
        self_t, idx = args[0], args[1]
        parts = idx if isinstance(idx, tuple) else (idx,)
        value = args[2] if func is T.__setitem__ else None
        # x[mask] = scalar is masked_fill_: the mask stays on the device, no sync
        masked_fill = (func is T.__setitem__ and not isinstance(value, torch.Tensor)
                       and len(parts) == 1 and isinstance(parts[0], torch.Tensor)
                       and parts[0].dtype == torch.bool)
        tensor_idx = False
        for p in parts:
            if isinstance(p, list):
                p = torch.as_tensor(p)
                if is_device(self_t):
                    self.sync("list index into a device tensor (host->device copy)")
                    self._memcpy("H2D list index", p)
            if not isinstance(p, torch.Tensor):
                continue
            tensor_idx = True
            if p.dtype == torch.bool and p.dim() > 0:
                if (is_device(self_t) or is_device(p)) and not masked_fill:
                    self.sync("boolean-mask indexing")
            elif is_device(self_t) and not is_device(p) and p.dim() > 0:
                self.sync("CPU index into a device tensor (host->device copy)")
                self._memcpy("H2D CPU index", p)
            elif not is_device(self_t) and is_device(p):
                self._error(f"{func_name(func)}: CPU tensor indexed with a device index")
        if func is not T.__setitem__ or masked_fill:
            return
        if isinstance(value, torch.Tensor):
            if is_device(value) != is_device(self_t) and value.dim() > 0:
                self._error(f"{func_name(func)}: device and CPU tensors mixed in an assignment")
            elif is_device(self_t) and not is_device(value) and tensor_idx:
                self.sync("CPU scalar tensor written through an index (host->device copy)")
                self._memcpy("H2D scalar value", value)
        elif is_device(self_t) and tensor_idx:
            self.sync("Python scalar written through a tensor index (host->device copy)")
            self._memcpy("H2D scalar value", None)

    # ------------------------------------------------------------------ copies
    def _copy_kind(self, src: torch.Tensor, to_dev: bool, non_blocking: bool,
                   dst: torch.Tensor | None) -> bool:
        """Count or track one copy between host and device; True: an asynchronous host ->
        device copy from pinned memory (the caller defers it, :meth:`_defer`)."""
        self._memcpy("D2H copy" if is_device(src) else "H2D copy", src)
        self._charge_link(src)
        if is_device(src) and not to_dev:  # device -> host
            if non_blocking and dst is not None and self.is_pinned(dst):
                self._in_flight(dst, "dst", self.current)
            else:
                self.sync("device->host copy" + (" into pageable memory" if non_blocking else ""))
        elif not is_device(src) and to_dev:  # host -> device
            if non_blocking and self.is_pinned(src):
                self._in_flight(src, "src", self.current)
                return True
            self.sync("host->device copy" + ("" if non_blocking else " (blocking)")
                      + ("" if self.is_pinned(src) else " from pageable memory"))
        return False

    def _defer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue the copy just tracked (:meth:`_in_flight`) to run when it lands. It writes
        ``dst``'s memory through an alias with a version counter of its own: the enqueueing
        call already counted the write (as ``copy_`` does on a GPU), landing adds none."""
        with torch._C.DisableTorchFunction():
            alias = torch.empty(0, dtype=dst.dtype).set_(
                dst.untyped_storage(), dst.storage_offset(), dst.shape, dst.stride())
        self._pending.append(_Copy(self.current, self.seq, alias, src))

    def _to(self, args: Any, kwargs: dict[str, Any]) -> Any:
        src = args[0]
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        copy = bool(kwargs.get("copy", False))
        to_dev = is_device(src) if device is None else device.type == "cuda"
        data = plain(src)
        if to_dev == is_device(src):  # same side: dtype / copy only
            out = data.to(dtype=dtype if dtype is not None else data.dtype, copy=copy)
            out_t = to_device(out) if to_dev else out
            if is_device(src):
                if out is not data:
                    self._launch("Tensor.to", out)
                self._check_streams([src], [] if out is data else [out_t], T.to)
            return src if out is data else out_t
        out = data.to(dtype=dtype if dtype is not None else data.dtype, copy=True)
        if not to_dev:
            if non_blocking:  # PyTorch gives a non_blocking device->host copy a pinned result
                self._pin(out)
            self._check_streams([src], [], T.to)
            self._copy_kind(src, False, non_blocking, out)
            return out
        if self._copy_kind(src, True, non_blocking, None):
            self._defer(out, data)  # runs again when it lands: the source as it is then
        out_d = to_device(out)
        self._check_streams([], [out_d], T.to)
        return out_d

    def _cuda(self, args: Any, kwargs: dict[str, Any]) -> Any:
        return self._to((args[0], "cuda"), {"non_blocking": kwargs.get("non_blocking", False)})

    def _cpu(self, args: Any, kwargs: dict[str, Any]) -> Any:
        return self._to((args[0], "cpu"), {})

    def _copy_(self, args: Any, kwargs: dict[str, Any]) -> Any:
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        deferred = False
        if is_device(dst) != is_device(src):
            deferred = self._copy_kind(src, is_device(dst), non_blocking, dst)
            if deferred:
                self._defer(dst, plain(src))
        elif is_device(dst):
            self._launch("Tensor.copy_", dst)
        else:
            self._charge_cpu_copy(T.copy_, args, kwargs, dst)
        self._check_streams([t for t in (dst, src) if is_device(t)], [dst], T.copy_)
        if not deferred:
            plain(dst).copy_(plain(src))
        return dst

    def _pin_memory(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if is_device(t):
            raise RuntimeError("cannot pin a device tensor")
        self.pinned_copies.append((t.numel() * t.element_size(), self._site()))
        return self._pin(t.clone())

    def _is_pinned(self, args: Any, kwargs: dict[str, Any]) -> Any:
        return self.is_pinned(args[0])

    def _numpy(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if is_device(t):
            self._error("numpy() of a device tensor (a real GPU raises: use cpu() first)")
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        return T.numpy(t, **kwargs)

    def _array(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if is_device(t):
            self._error("__array__ of a device tensor (a real GPU raises: use cpu() first)")
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        return T.__array__(t, *args[1:], **kwargs)

    def _data_ptr(self, args: Any, kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if is_device(t):
            self._error("data_ptr() of a device tensor taken by host code")
        return T.data_ptr(plain(t))

    # ------------------------------------------------------------------ CUDA API calls
    def _init_api(self) -> None:
        #: tracked operation -> its kernel launches and memcpys (see :class:`ApiCalls`)
        self.api: dict[str, ApiCalls] = {}
        #: (operation, "launch" / "memcpy" / "excluded", kind, call site) -> count
        self.api_sites: Counter[tuple[str, str, str, str]] = Counter()
        self._excluding = 0

    def exclude(self, obj: Any, names: tuple[str, ...] | list[str]) -> None:
        """Count the launches and memcpys made inside ``obj``'s methods ``names`` apart
        (``ApiCalls.excluded`` of the operation they run in), e.g. the host tier's data
        transfers. Syncs inside them are counted as everywhere."""
        for name in names:
            fn = getattr(obj, name)
            setattr(obj, name, self._excluded(fn))

    def include(self, obj: Any, names: tuple[str, ...] | list[str]) -> None:
        """Count the launches and memcpys made inside ``obj``'s methods ``names`` as usual,
        also when they run inside an excluded call (work of the engine's that a transfer
        happens to issue, e.g. a pool's pending writes flushed by the transfer's read)."""
        for name in names:
            fn = getattr(obj, name)
            setattr(obj, name, self._included(fn))

    def _included(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def included(*args: Any, **kwargs: Any) -> Any:
            saved, self._excluding = self._excluding, 0
            try:
                return fn(*args, **kwargs)
            finally:
                self._excluding = saved

        return included

    def _excluded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def excluded(*args: Any, **kwargs: Any) -> Any:
            self._excluding += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._excluding -= 1

        return excluded

    def api_of(self, op: str) -> ApiCalls:
        """The launches and memcpys charged to ``op`` (empty when none)."""
        return self.api.get(op) or ApiCalls()

    def _api_call(self, what: str, kind: str) -> None:
        op = self._stack[0] if self._stack else OUTSIDE
        calls = self.api.get(op)
        if calls is None:
            calls = self.api[op] = ApiCalls()
        if self._excluding:
            calls.excluded[kind] += 1
            what = "excluded"
        elif what == "launch":
            calls.launches[kind] += 1
        else:
            calls.memcpys[kind] += 1
        self.api_sites[(op, what, kind, self._site())] += 1

    def _launch(self, kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.numel() > 0:
            self._api_call("launch", kind)

    def _memcpy(self, kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.numel() > 0:
            self._api_call("memcpy", kind)

    def _count_factory(self, func: Any, out: torch.Tensor) -> None:
        """A factory on ``cuda``: an upload of its data, a fill kernel, or nothing (``empty``)."""
        if func in (torch.tensor, torch.as_tensor, T.new_tensor):
            self._memcpy("H2D torch.tensor", out)
        elif func not in _NO_KERNEL_FACTORIES:
            self._launch(getattr(func, "__name__", None) or func_name(func), out)

    def _count_call(self, func: Any, args: Any, dev: list[torch.Tensor],
                    written: list[torch.Tensor], out: Any) -> None:
        """One call with device operands: a memcpy for a value read on the host, one kernel
        for any device memory written (in place, or new storage in the result)."""
        name = getattr(func, "__name__", None) or func_name(func)
        if func in VALUE_READS or func in DATA_SIZED:
            self._memcpy(f"D2H {name}", None)
            if func in VALUE_READS:
                return
        if written:
            if is_device(written[0]):
                self._launch(name, written[0])
            return
        if func in _NO_KERNEL_FACTORIES:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        ptrs = {t.untyped_storage().data_ptr() for t in dev}
        for o in outs:
            if (isinstance(o, DeviceTensor) and o._base is None
                    and o.untyped_storage().data_ptr() not in ptrs):
                self._launch(name, o)
                return

    @property
    def total_launches(self) -> int:
        """Kernel launches charged to tracked operations (not ``(outside)``, not excluded)."""
        return sum(sum(c.launches.values()) for op, c in self.api.items() if op != OUTSIDE)

    @property
    def total_memcpys(self) -> int:
        """Memcpys charged to tracked operations (not ``(outside)``, not excluded)."""
        return sum(sum(c.memcpys.values()) for op, c in self.api.items() if op != OUTSIDE)

    def api_report(self) -> str:
        """One line per operation: calls, launches, memcpys (by kind), excluded."""
        lines = []
        for op, c in sorted(self.api.items()):
            calls = self.ops[op].calls if op in self.ops else 0
            kinds = ", ".join(f"{k} {v}" for k, v in (c.launches + c.memcpys).most_common())
            lines.append(f"{op:40s} calls {calls:6d} launches {sum(c.launches.values()):6d} "
                         f"memcpys {sum(c.memcpys.values()):6d} excluded "
                         f"{sum(c.excluded.values()):5d} {kinds}")
        return "\n".join(lines)


    # ------------------------------------------------------------------ transfer counters
    # Per tracked operation: bytes of floating-point data the CPU itself copied (host-side
    # torch calls: a gather, scatter or staging copy of pool data), bytes the device's copy
    # engines moved between host and device (``link_bytes``), and the blocking waits (every
    # host synchronisation, :attr:`ops`). What a transfer budget asserts:
    # ``cpu_copied_bytes == 0`` per byte moved, and no blocking wait.
    def _init_transfer_counters(self) -> None:
        #: op -> bytes of floating-point data written by host-side torch calls
        self.cpu_copied: Counter[str] = Counter()
        #: op -> bytes of floating-point data copied between host and device (either way)
        self.link_bytes: Counter[str] = Counter()

    def _op(self) -> str:
        return self._stack[0] if self._stack else OUTSIDE

    def _charge_cpu_copy(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        n = host_copy_bytes(func, args, kwargs, out)
        if n:
            self.cpu_copied[self._op()] += n

    def _charge_link(self, src: torch.Tensor) -> None:
        if src.is_floating_point():  # data, not index uploads
            self.link_bytes[self._op()] += src.numel() * src.element_size()

    def _dma_stream(self, func: Any, args: Any, kwargs: dict[str, Any]) -> SimStream | None:
        """The stream of an asynchronous copy between host and device (``copy_``), else None."""
        if func is not T.copy_ or len(args) < 2:
            return None
        nb = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return self.current if nb and is_device(args[0]) != is_device(args[1]) else None

    def _mapped(self, obj: Any) -> torch.Tensor:
        """``torch.as_tensor`` of a ``__cuda_array_interface__`` over pinned host memory (a
        mapped host buffer): a device tensor over the same bytes."""
        iface = obj.__cuda_array_interface__
        ptr, nbytes = int(iface["data"][0]), int(iface["shape"][0])
        if ptr not in self.pinned:
            self._error("a device view of host memory that is not page-locked")
        raw = np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)), dtype=np.uint8)
        return to_device(torch.from_numpy(raw))

    def _mapped_writes(self, written: list[torch.Tensor]) -> None:
        """A kernel writing mapped host memory (:meth:`_mapped`) is an asynchronous write of
        that host memory: the host must not touch it before the event that covers it."""
        for t in written:
            if is_device(t) and t.untyped_storage().data_ptr() in self.pinned:
                self._in_flight(t, "dst", self.current)

    def transfer_report(self) -> dict[str, dict[str, int]]:
        """Per tracked operation: ``cpu_copied_bytes``, ``link_bytes``, ``blocking_waits``."""
        ops = set(self.cpu_copied) | set(self.link_bytes) | set(self.ops)
        return {op: {"cpu_copied_bytes": self.cpu_copied[op], "link_bytes": self.link_bytes[op],
                     "blocking_waits": self.syncs_of(op)} for op in sorted(ops)}


def host_copy_bytes(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> int:
    """Bytes of floating-point data a host-side torch call (no device operand) copied from
    other floating-point data: an in-place call's largest float source, else its result (a
    new tensor or ``out=``); 0 for metadata, views, factories and index arithmetic."""
    if func in METADATA or no_access(func, args):
        return 0
    ins = [t for t in tensors_of(args, kwargs) if t.is_floating_point()]
    if not ins or any(t.is_cuda for t in ins):
        return 0
    if args and isinstance(args[0], torch.Tensor) and writes_first_arg(func):
        return max((t.numel() * t.element_size() for t in ins if t is not args[0]), default=0)
    o = kwargs.get("out", out)
    if not isinstance(o, torch.Tensor) or not o.is_floating_point() or (
            o._base is not None and "out" not in kwargs):
        return 0
    return o.numel() * o.element_size()


#: Factories on ``cuda`` that allocate without writing (no kernel).
_NO_KERNEL_FACTORIES = {torch.empty, torch.empty_like, torch.empty_strided, T.new_empty,
                        T.new_empty_strided}


_SPECIAL: dict[Any, Callable[[SimCuda, Any, dict[str, Any]], Any]] = {
    T.to: SimCuda._to,
    T.cuda: SimCuda._cuda,
    T.cpu: SimCuda._cpu,
    T.copy_: SimCuda._copy_,
    T.pin_memory: SimCuda._pin_memory,
    T.is_pinned: SimCuda._is_pinned,
    T.numpy: SimCuda._numpy,
    T.__array__: SimCuda._array,
    T.data_ptr: SimCuda._data_ptr,
    T.record_stream: lambda sim, args, kwargs: None,
}
