"""Device <-> host transfers with completion tracking: ``device slots <-> host slots``.

Writes (device -> host backups) return a :class:`Transfer`; the cache keeps the node locked
until the transfer is done and then runs its callback (``poll``). Loads (host -> device) return
one too. On the CPU every copy finishes inside the call. On a GPU every call enqueues its
copies and returns; the host never copies a byte of pool data and never waits:

    write  current stream: the GPU gathers each lane's device rows (K and V of every layer,
           conv and SSM state: :class:`hicache.host_pools.Lane`) into a device temporary in
           the host layout's order (the snapshot, ordered before any later reuse of the slots)
           write stream (waits for the current one): ``direct``: one ``cudaMemcpyAsync`` per run
           of consecutive host slots (per run and layer with ``layer_first``) from the
           temporary into the pinned host pool; ``kernel``: one GPU scatter into the host
           pool's mapped device address; then an event. ``poll`` runs the callback once the
           event completed (the data is in the host pool then).
    load   load stream (waits for the current one, and on the GPU for a write still filling a
           host state it reads): ``direct``: one copy per host run into a device temporary,
           then a GPU scatter into the device rows; ``kernel``: a GPU gather from the mapped
           host pool. ``layer_first``: layer by layer, an event after each layer
           (``Transfer.layer_events``); ``page_first``: every layer at once, one event. Then
           the current stream waits for the last event (on the GPU, not the host), so whatever
           the engine runs next sees the data; with ``layerwise = True`` it does not, and the
           engine waits for layer i alone (``last_load.wait_layer(i)``) before layer i's
           attention, while later layers are still in flight.

Every pool pair (``pools``: ``"kv"``, ``"state"``, and any other a component registers with
:meth:`HiCacheController.register_pair`) moves through the same two routines:
``write_rows([(pair, device rows, host rows), ...], on_done)`` and ``load_rows([...])`` (what
``write`` / ``load`` call for KV + state). Host pools are pinned once where they are allocated; nothing is
staged, and the engine thread's work per call grows with the number of host runs, never with
the bytes moved. Streams are created on the device of the pools.

``hold_completions`` (tests, simulations): completed transfers are reported only after
``release_held()``, which is how a test reproduces an in-flight backup on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from allocators import (
    KVStorage,
    MambaStatePool,
    SlotAllocator,
    alloc_all,
    host_ids,
    host_int,
    resolve_device,
)
from allocators.staging import mapped_on_device, upload
from hicache.config import HiCacheConfig
from hicache.host_pools import (
    Lane,
    PoolPair,
    copy_kv,
    copy_state,
    fit_host_ratio,
    kv_demand,
    kv_lanes,
    mirror_kv,
    mirror_state,
    state_lanes,
)

#: Device rows of one pair in a transfer: device slot ids (a tensor on the device) or one
#: contiguous range (a state slot).
Rows = torch.Tensor | slice

#: One pair's part of a transfer: ``(pair name, device rows, host rows)``, rows an index tensor
#: or one ``int`` slot.
Move = tuple[str, torch.Tensor | int, torch.Tensor | int]


class Transfer:
    """One copy between the device and the host; ``done()`` once it has finished (a write:
    its data is in the host pool; a load: on the device).

    ``layer_events`` (a GPU load): one event per KV layer, completed once that layer's rows
    (and every non-KV pair's) are on the device; ``wait_layer(i)`` makes a stream wait for it
    on the GPU (the host does not wait)."""

    __slots__ = ("event", "released", "layer_events", "keep")

    def __init__(self, event: Any, layer_events: tuple[Any, ...] = ()) -> None:
        self.event = event
        self.released = True
        self.layer_events = layer_events
        #: device temporaries the copies still read (dropped once done)
        self.keep: list[torch.Tensor] = []

    def done(self) -> bool:
        if not self.released:
            return False
        return self.event is None or bool(self.event.query())

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer``'s rows are on the device (a query: the host does not wait)."""
        ev = self._layer_event(layer)
        return ev is None or bool(ev.query())

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait on the GPU for layer ``layer``."""
        ev = self._layer_event(layer)
        if ev is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(ev)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait on the GPU for the whole transfer."""
        if self.event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the transfer has finished (only when the caller asks)."""
        if self.event is not None:
            self.event.synchronize()

    def _layer_event(self, layer: int) -> Any:
        if not self.layer_events:
            return self.event
        if not 0 <= layer < len(self.layer_events):
            raise ValueError(f"layer={layer} is out of range for {len(self.layer_events)} layers")
        return self.layer_events[layer]


class HiCacheController:
    """Host pools mirroring the device pools, and the copies between them.

    Args:
        kv_device: the device KV allocator (its ``pool``, if any, holds the tensors: a
            ``KVPool`` or the engine's own ``KVBuffers``).
        state_device: the device state pool, or ``None`` (no recurrent layers).
        config: sizes, policies, ``hicache_io_backend`` and ``hicache_mem_layout``.
        demands: every device pool the host tier will mirror by ``hicache_ratio``, as
            ``(device units, page size, bytes per unit)`` (``Component.host_demand``; default:
            the KV and state pools): with ``hicache_host_memory_fraction`` the ratio is
            reduced until their host pools fit together (``hicache.host_pools.fit_host_ratio``;
            ``config`` is then the reduced copy).

    Raises:
        TypeError: ``config`` not a ``HiCacheConfig``, ``kv_device`` not a slot allocator, a
            state allocator that is not a ``MambaStatePool``.
        ValueError: a host pool not larger than its device pool, a GPU KV allocator
            without a pool (``hicache.host_pools.mirror_kv``), or a state pool on another
            device than the KV pool.

    Attributes:
        pools: ``{"kv": PoolPair, "state": PoolPair}`` (state only with recurrent layers).
        last_load: the last load's :class:`Transfer` (``None`` before the first).
        layerwise: a GPU load leaves the current stream free: the engine waits per layer
            (``last_load.wait_layer(i)``). ``False`` (default): the current stream waits for
            the whole load.
    """

    def __init__(self, kv_device: SlotAllocator, state_device: MambaStatePool | None,
                 config: HiCacheConfig,
                 demands: Sequence[tuple[int, int, int]] | None = None) -> None:
        if not isinstance(config, HiCacheConfig):
            raise TypeError(f"config must be a HiCacheConfig, got {type(config).__name__}")
        if not isinstance(kv_device, SlotAllocator):
            raise TypeError("kv_device (a cache's kv_allocator) must be a KV slot allocator "
                            "(allocators.SlotAllocator) for a host tier to mirror, got "
                            f"{type(kv_device).__name__}")
        if state_device is not None and not isinstance(state_device, MambaStatePool):
            raise TypeError(
                "hicache with a state_allocator needs an allocators.MambaStatePool (its host "
                "mirror holds the conv and SSM state tensors the copies move), got "
                f"{type(state_device).__name__}")
        dev_pool: KVStorage | None = getattr(kv_device, "pool", None)
        if dev_pool is not None and state_device is not None and resolve_device(
                torch.device(dev_pool.device)) != resolve_device(torch.device(state_device.device)):
            raise ValueError(  # the copies of every pair run on one device's streams
                f"state_allocator is on {state_device.device}, the KV pool on {dev_pool.device}: "
                "a host tier moves both with one device's copies; put them on one device")
        if demands is None:
            demands = [kv_demand(kv_device)]
            if state_device is not None:
                demands.append((state_device.size, 1, state_device.bytes_per_slot))
        config = fit_host_ratio(config, demands)
        self.config = config
        kv_host = mirror_kv(kv_device, config)
        self.pools: dict[str, PoolPair] = {
            "kv": PoolPair("kv", kv_device, kv_host, kv_lanes(kv_device, kv_host))}
        if state_device is not None:
            state_host = mirror_state(state_device, config)
            self.pools["state"] = PoolPair("state", state_device, state_host,
                                           state_lanes(state_device, state_host))
        where = dev_pool.device if dev_pool is not None else (
            state_device.device if state_device is not None else kv_device.device)
        self.device = resolve_device(torch.device(where))
        self._cuda = self.device.type == "cuda"
        self._kernel = self._cuda and config.hicache_io_backend == "kernel"
        self._write_stream: Any = None
        self._load_stream: Any = None
        if self._cuda:
            self._write_stream = torch.cuda.Stream(device=self.device)
            self._load_stream = torch.cuda.Stream(device=self.device)
        if self._kernel:  # the GPU addresses the pinned host pools directly
            for name, pair in self.pools.items():
                lanes = tuple(dataclasses.replace(ln, mapped=mapped_on_device(ln.host_store, self.device))
                              for ln in pair.lanes)
                self.pools[name] = dataclasses.replace(pair, lanes=lanes)
        self._pending: deque[tuple[Transfer, Callable[[], None] | None]] = deque()
        self._loads: deque[Transfer] = deque()
        #: (pair, host slot) -> the write in flight that fills it (a load is ordered after
        #: it): one-slot moves (states); a KV node's rows stay locked on device meanwhile
        self._host_writes: dict[tuple[str, int], Transfer] = {}
        self.last_load: Transfer | None = None
        self.layerwise = False
        #: the newest layerwise load the current stream was made to wait for (``order_frees``)
        self._freed_after: Transfer | None = None
        #: loads ordered (on the GPU) after the write of a host state they read
        self.load_waits = 0
        self.hold_completions = False
        self.backup_tokens = 0
        self.load_tokens = 0
        #: bytes enqueued device -> host and host -> device [bytes]
        self.bytes_written = 0
        self.bytes_loaded = 0

    @property
    def host_kv(self) -> SlotAllocator:
        return self.pools["kv"].host

    @property
    def host_state(self) -> MambaStatePool | None:
        pair = self.pools.get("state")
        return cast("MambaStatePool", pair.host) if pair is not None else None

    def _states(self) -> tuple[MambaStatePool, MambaStatePool]:
        """The device and host state pools (only with recurrent layers)."""
        pair = self.pools["state"]
        return cast("MambaStatePool", pair.device), cast("MambaStatePool", pair.host)

    # ------------------------------------------------------------------ alloc
    def alloc_parts(self, asks: list[tuple[SlotAllocator, int]]) -> list[torch.Tensor] | None:
        """``alloc`` from several pools (``(allocator, n)``), all or nothing (``None``: every
        pool exactly as before)."""
        return alloc_all(asks)

    # ------------------------------------------------------------------ copies
    def register_pair(self, name: str, device: SlotAllocator, host: SlotAllocator,
                      lanes: tuple[Lane, ...]) -> PoolPair:
        """Add a pool pair (a component's own device pool and its host mirror) whose rows
        :meth:`write_rows` / :meth:`load_rows` move the way they move ``"kv"`` and
        ``"state"``. ``lanes`` name its tensors (``hicache.host_pools.Lane``; host stores
        pinned where they were allocated when the device is a GPU).

        Raises:
            ValueError: ``name`` is taken.
        """
        if name in self.pools:
            raise ValueError(f"pool pair {name!r} is registered already; have {sorted(self.pools)}")
        if self._kernel:
            lanes = tuple(dataclasses.replace(ln, mapped=mapped_on_device(ln.host_store, self.device))
                          for ln in lanes)
        pair = self.pools[name] = PoolPair(name, device, host, lanes)
        return pair

    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor,
              device_state: int | None, host_state: int | None,
              on_done: Callable[[], None] | None) -> Transfer:
        """Copy device -> host (KV slots, and a state when both are given); ``on_done`` runs at
        ``poll`` once the data is in the host pool (see the module docstring)."""
        moves: list[Move] = [("kv", device_slots, host_slots)]
        if device_state is not None and host_state is not None:
            moves.append(("state", device_state, host_state))
        t = self.write_rows(moves, on_done)
        self.backup_tokens += len(host_slots)
        return t

    def save_state(self, device_state: int, host_state: int,
                   on_done: Callable[[], None] | None = None) -> Transfer:
        """Copy one state device -> host (a state set after its KV's backup). On the CPU the
        copy and ``on_done`` run now; on a GPU as :meth:`write` (``on_done`` at ``poll``)."""
        if not self._cuda:
            sd, sh = self._states()
            copy_state(sd, device_state, sh, host_state)
            if on_done is not None:
                on_done()
            return Transfer(None)
        return self.write_rows([("state", device_state, host_state)], on_done)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
             host_state: int | None, device_state: int | None) -> Transfer:
        """Copy host -> device (KV slots, and a state when both are given). On a GPU the copies
        are enqueued on the load stream and the current stream waits for them on the GPU
        (unless ``layerwise``; see the module docstring); the returned transfer is also
        ``last_load``."""
        moves: list[Move] = []
        if host_state is not None and device_state is not None:
            moves.append(("state", device_state, host_state))
        moves.append(("kv", device_slots, host_slots))
        t = self.load_rows(moves)
        self.load_tokens += len(host_slots)
        return t

    def write_rows(self, moves: Sequence[Move], on_done: Callable[[], None] | None) -> Transfer:
        """Copy device -> host, for each ``(pair name, device rows, host rows)`` (rows: an index
        tensor, or one ``int`` slot), every pair the same way; ``on_done`` runs at ``poll`` once
        all of it is in the host pools. On the CPU the copies run now.

        Raises:
            KeyError: a pair that is not registered (nothing is enqueued).
        """
        self._settle(moves)
        if self._cuda:
            resolved = self._resolve(moves)
            t = self._write_gpu(resolved)
            for pair, _, hs in resolved:
                if pair.name != "kv" and len(hs) == 1:
                    self._host_writes[(pair.name, int(hs[0]))] = t
        else:
            for name, d, h in moves:
                self._copy_cpu(self.pools[name], d, h, to_host=True)
            t = Transfer(None)
        t.released = not self.hold_completions
        self._pending.append((t, on_done))
        return t

    def load_rows(self, moves: Sequence[Move]) -> Transfer:
        """Copy host -> device, for each ``(pair name, device rows, host rows)`` (as
        :meth:`write_rows`); non-KV pairs land first, then the KV pair layer by layer
        (``layer_first``). The transfer is also ``last_load``.

        Raises:
            KeyError: a pair that is not registered (nothing is enqueued).
        """
        self._settle(moves)
        if self._cuda:
            resolved = self._resolve(moves)
            after = [w for pair, _, hs in resolved
                     if len(hs) == 1 and (w := self._host_writes.get((pair.name, int(hs[0])))) is not None]
            t = self._load_gpu(resolved, after)
            self._loads.append(t)
        else:
            for name, d, h in moves:
                self._copy_cpu(self.pools[name], d, h, to_host=False)
            t = Transfer(None)
        self.last_load = t
        return t

    def _settle(self, moves: Sequence[Move]) -> None:
        """The device pools' pending work (``MambaStatePool.flush``: zeroing and copies kept on
        the host until the states are read) goes out before a transfer reads or writes their
        rows through its lanes."""
        for name, _, _ in moves:
            pair = self.pools.get(name)
            flush = getattr(pair.device, "flush", None) if pair is not None else None
            if flush is not None:
                flush()

    def _copy_cpu(self, pair: PoolPair, d: torch.Tensor | int, h: torch.Tensor | int,
                  to_host: bool) -> None:
        """The synchronous copies of a CPU controller (the KV and state pairs through their
        pools' own routines, any other pair lane by lane)."""
        if pair.name == "kv":
            assert isinstance(d, torch.Tensor) and isinstance(h, torch.Tensor)
            if to_host:
                copy_kv(pair.device, d, pair.host, h)
            else:
                copy_kv(pair.host, h, pair.device, d)
            return
        if pair.name == "state":
            sd, sh = self._states()
            ds, hs = host_int(d, "device state"), host_int(h, "host state")
            if to_host:
                copy_state(sd, ds, sh, hs)
            else:
                copy_state(sh, hs, sd, ds)
            return
        di = torch.tensor([d]) if isinstance(d, int) else d
        hi = torch.tensor([h]) if isinstance(h, int) else h
        for lane in pair.lanes:
            rows = lane.host_store.transpose(0, 1) if lane.slot_first else lane.host_store
            for i, dev in enumerate(lane.device):
                if to_host:
                    rows[i].index_copy_(0, hi, dev.index_select(0, di))
                else:
                    dev.index_copy_(0, di, rows[i].index_select(0, hi))

    def _resolve(self, moves: Sequence[Move]) -> list[tuple[PoolPair, Rows, np.ndarray]]:
        """Moves as (pair, device rows on the device, host slots); empty ones dropped."""
        out: list[tuple[PoolPair, Rows, np.ndarray]] = []
        for name, d, h in moves:
            pair = self.pools[name]
            if isinstance(h, int):
                hs = np.array([h], dtype=np.int64)
            else:
                hs = np.ascontiguousarray(host_ids(h, "host rows"), dtype=np.int64)
            if not len(hs):
                continue
            rows: Rows = slice(d, d + 1) if isinstance(d, int) else self._device_rows(d)
            out.append((pair, rows, hs))
        return out

    # ------------------------------------------------------------- GPU copies
    def _device_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Device slot ids on the device (a host tensor is uploaded: no host synchronisation)."""
        if slots.device == self.device:
            return slots
        return upload(np.ascontiguousarray(host_ids(slots, "device_slots"), dtype=np.int64), self.device)

    def _write_gpu(self, moves: list[tuple[PoolPair, Rows, np.ndarray]]) -> Transfer:
        side = self._write_stream
        cur = torch.cuda.current_stream(self.device)
        t = Transfer(None)
        staged = []
        for pair, rows, h in moves:  # the snapshot, on the current stream
            hdev = upload(h, self.device) if self._kernel else None
            # made on the current stream, read on the write stream: alive until the event
            t.keep.extend(x for x in (rows, hdev) if isinstance(x, torch.Tensor))
            for lane in pair.lanes:
                tmp = _gather(lane, rows)
                t.keep.append(tmp)
                staged.append((lane, tmp, h, hdev))
        side.wait_stream(cur)
        nbytes = 0
        with torch.cuda.stream(side):
            for lane, tmp, h, hdev in staged:
                nbytes += lane.row_bytes * len(h)
                if hdev is not None and lane.mapped is not None:
                    lane.mapped.index_copy_(0 if lane.slot_first else 1, hdev, tmp)
                    continue
                for h0, off, n in _runs(h):
                    if lane.slot_first:
                        lane.host_store[h0:h0 + n].copy_(tmp[off:off + n], non_blocking=True)
                    else:
                        for i in range(lane.num_layers):
                            lane.host_store[i, h0:h0 + n].copy_(tmp[i, off:off + n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
        t.event = ev
        self.bytes_written += nbytes
        return t

    def _load_gpu(self, moves: list[tuple[PoolPair, Rows, np.ndarray]],
                  after: list[Transfer]) -> Transfer:
        side = self._load_stream
        cur = torch.cuda.current_stream(self.device)
        hdevs = [upload(h, self.device) if self._kernel else None for _, _, h in moves]
        side.wait_stream(cur)  # earlier work on the device rows (and the ids) is done first
        for w in after:
            if w.event is not None and not w.done():
                side.wait_event(w.event)  # host rows still being written: a wait on the GPU
                self.load_waits += 1
        kv = self.pools["kv"]
        layers = kv.lanes[0].num_layers if kv.lanes else 0
        layer_events: list[Any] = []
        nbytes = 0
        with torch.cuda.stream(side):
            for (pair, rows, h), hdev in zip(moves, hdevs, strict=True):
                nbytes += sum(lane.row_bytes for lane in pair.lanes) * len(h)
                if pair is kv and kv.lanes and not kv.lanes[0].slot_first:
                    continue  # layer by layer below
                for lane in pair.lanes:
                    _scatter_all(lane, rows, _fetch_all(lane, h, hdev))
            for (pair, rows, h), hdev in zip(moves, hdevs, strict=True):
                if pair is not kv or not kv.lanes or kv.lanes[0].slot_first:
                    continue
                for i in range(layers):
                    for lane in pair.lanes:
                        _scatter_layer(lane, i, rows, _fetch_layer(lane, i, h, hdev))
                    ev = torch.cuda.Event()
                    ev.record(side)
                    layer_events.append(ev)
        last = torch.cuda.Event()
        last.record(side)
        if not layer_events:
            layer_events = [last] * layers
        t = Transfer(last, tuple(layer_events))
        # ids made on the current stream, read on the load stream: alive until the event
        t.keep.extend(x for x in (*hdevs, *(r for _, r, _ in moves)) if isinstance(x, torch.Tensor))
        if not self.layerwise:
            cur.wait_event(last)  # what the engine enqueues next sees the loaded data
        self.bytes_loaded += nbytes
        return t

    def order_frees(self) -> None:
        """Device rows about to be freed (an eviction) may be the destinations of a
        ``layerwise`` load still in flight that nobody waited for, and whoever gets them next
        writes them on the current stream: the current stream waits on the GPU for the newest
        load in flight (loads run in order on one stream: the earlier ones with it). No host
        synchronisation (an event query, a wait on the GPU); nothing when not ``layerwise``
        (the current stream waited for every load when it was enqueued)."""
        if not self.layerwise or not self._loads:
            return
        t = self._loads[-1]
        if t is self._freed_after or t.done():
            return
        torch.cuda.current_stream(self.device).wait_event(t.event)
        self._freed_after = t

    # -------------------------------------------------------------- completion
    def poll(self) -> int:
        """Run the callbacks of finished writes, in issue order; return how many ran. (Finished
        loads are forgotten.)"""
        loads = self._loads
        while loads and loads[0].done():
            loads.popleft().keep.clear()
        n = 0
        pending = self._pending
        while pending and pending[0][0].done():
            t, cb = pending.popleft()
            t.keep.clear()
            if self._host_writes:
                for key in [k for k, w in self._host_writes.items() if w is t]:
                    del self._host_writes[key]
            if cb is not None:
                cb()
                n += 1
        return n

    def release_held(self) -> None:
        """Let held transfers complete at the next ``poll`` (see ``hold_completions``)."""
        for t, _ in self._pending:
            t.released = True

    @property
    def num_inflight(self) -> int:
        return len(self._pending)

    def writes_landing(self) -> bool:
        """Whether a device -> host copy issued so far has not landed yet (its data is not
        in the host pools; its callback may have run already when it ends later ones)."""
        return any(not t.done() for t, _ in self._pending)


def _runs(h: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first host slot, offset in h, length)`` of each run of consecutive host slots."""
    if len(h) == 1:
        return [(int(h[0]), 0, 1)]
    cut = np.flatnonzero(np.diff(h) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(h)]))
    return [(int(h[a]), int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def _gather(lane: Lane, rows: Rows) -> torch.Tensor:
    """A new contiguous device tensor of ``lane``'s rows ``rows`` in the host store's order:
    ``[n, layers, *row]`` (slot-first) or ``[layers, n, *row]``. One or two GPU kernels."""
    sf = lane.slot_first
    if lane.device_all is not None:
        every = lane.device_all
        if isinstance(rows, slice):
            part = every[:, rows]
            return (part.transpose(0, 1) if sf else part).contiguous()
        return every.transpose(0, 1).index_select(0, rows) if sf else every.index_select(1, rows)
    parts = [t[rows] if isinstance(rows, slice) else t.index_select(0, rows) for t in lane.device]
    return torch.stack(parts, dim=1 if sf else 0)


def _fetch_all(lane: Lane, h: np.ndarray, hdev: torch.Tensor | None) -> torch.Tensor:
    """``lane``'s host rows ``h`` of every layer as a new device tensor in the store's order
    (on the current stream: the load stream)."""
    dim = 0 if lane.slot_first else 1
    if hdev is not None and lane.mapped is not None:
        return lane.mapped.index_select(dim, hdev)
    store = lane.host_store
    shape = list(store.shape)
    shape[dim] = len(h)
    tmp = torch.empty(shape, dtype=store.dtype, device=lane.device[0].device)
    for h0, off, n in _runs(h):
        if lane.slot_first:
            tmp[off:off + n].copy_(store[h0:h0 + n], non_blocking=True)
        else:
            for i in range(lane.num_layers):
                tmp[i, off:off + n].copy_(store[i, h0:h0 + n], non_blocking=True)
    return tmp


def _fetch_layer(lane: Lane, layer: int, h: np.ndarray, hdev: torch.Tensor | None) -> torch.Tensor:
    """Layer ``layer`` of ``lane``'s host rows ``h`` (a layer-first store) on the device."""
    store = lane.host_store[layer]
    if hdev is not None and lane.mapped is not None:
        return lane.mapped[layer].index_select(0, hdev)
    tmp = torch.empty((len(h), *store.shape[1:]), dtype=store.dtype, device=lane.device[0].device)
    for h0, off, n in _runs(h):
        tmp[off:off + n].copy_(store[h0:h0 + n], non_blocking=True)
    return tmp


def _scatter_all(lane: Lane, rows: Rows, tmp: torch.Tensor) -> None:
    """Write :func:`_fetch_all`'s ``tmp`` into ``lane``'s device rows ``rows``."""
    by_layer = tmp.transpose(0, 1) if lane.slot_first else tmp  # [layers, n, *row]
    if lane.device_all is not None:
        if isinstance(rows, slice):
            lane.device_all[:, rows].copy_(by_layer)
        else:
            lane.device_all.index_copy_(1, rows, by_layer)
        return
    for i in range(lane.num_layers):
        _scatter_layer(lane, i, rows, by_layer[i])


def _scatter_layer(lane: Lane, layer: int, rows: Rows, tmp: torch.Tensor) -> None:
    dst = lane.device[layer]
    if isinstance(rows, slice):
        dst[rows].copy_(tmp)
    else:
        dst.index_copy_(0, rows, tmp)
