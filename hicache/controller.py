"""Device <-> host transfers with completion tracking: ``device slots <-> host slots``.

Writes (device -> host backups) return a :class:`Transfer`; the cache keeps the node locked
until the transfer is done and then runs its callback (``poll``). Loads (host -> device) return
one too. On the CPU every copy finishes inside the call. On a GPU nothing waits on the host:

    write  current stream: gather the device rows (KV of every layer, the state) into device
           temporaries, a snapshot ordered before any later reuse of those slots
           write stream (waits for the current one): each temporary -> a region of the pinned
           staging ring (``non_blocking``), then an event
           poll, once the event completed: the region -> the host pool rows (a host copy),
           region released, callback
    load   host: the host pool rows -> a pinned region (a host gather)
           load stream (waits for the current one): region -> device temporary ->
           the device rows, then an event; the current stream waits for that event (a wait
           on the GPU, not the host), so whatever the engine runs next sees the data;
           ``last_load`` is the transfer, for engines computing on other streams

The event of a write covers the whole path into the host pool: the host never reads a region
before its event, and the pool rows are written only then. The staging ring
(``allocators.staging.PinnedRing``) is allocated once and reused; copies larger than a quarter
of it go in chunks. The host waits only when the ring is too small for what is in flight (a
region to reuse whose write has not landed: its event is synchronised and the write finished
first) and when a load needs a host state whose write is still in flight. Streams are created
on the device of the pools.

``hold_completions`` (tests, simulations): completed transfers are reported only after
``release_held()``, which is how a test reproduces an in-flight backup on the CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch

from allocators import KVStorage, MambaStatePool, SlotAllocator, alloc_all, resolve_device
from allocators.staging import PinnedRing, Region, upload
from hicache.config import HiCacheConfig
from hicache.host_pools import PoolPair, copy_kv, copy_state, mirror_kv, mirror_state

#: Bytes of the pinned staging ring of a GPU controller (grown when one chunk needs more).
STAGING_BYTES = 64 << 20


class Transfer:
    """One copy between the device and the host; ``done()`` once it has finished (a write:
    its data is in the host pool; a load: on the device)."""

    __slots__ = ("event", "released", "chunks")

    def __init__(self, event: Any, chunks: int = 0) -> None:
        self.event = event
        self.released = True
        #: staged chunks not yet finished (a GPU write: copied into the host pool at ``poll``)
        self.chunks = chunks

    def done(self) -> bool:
        if not self.released or self.chunks:
            return False
        return self.event is None or bool(self.event.query())


class _Chunk:
    """One staged piece of a GPU write: done when ``event`` is, then ``finish`` copies the
    regions into the host pool and releases them."""

    __slots__ = ("event", "finish", "regions", "transfer")

    def __init__(self, event: Any, regions: list[Region], finish: Callable[[], None],
                 transfer: Transfer) -> None:
        self.event = event
        self.regions = regions
        self.finish = finish
        self.transfer = transfer


class HiCacheController:
    """Host pools mirroring the device pools, and the copies between them.

    Args:
        kv_device: the device KV allocator (its ``pool``, if any, holds the tensors: a
            ``KVPool`` or the engine's own ``KVBuffers``).
        state_device: the device state pool, or ``None`` (no recurrent layers).
        config: sizes and policies.
        staging_bytes: size of the pinned staging ring on a GPU [bytes].

    Raises:
        ValueError: a host pool not larger than its device pool, or a GPU KV allocator
            without a pool (``hicache.host_pools.mirror_kv``).

    Attributes:
        pools: ``{"kv": PoolPair, "state": PoolPair}`` (state only with recurrent layers).
        last_load: the last load's :class:`Transfer` (``None`` before the first).
    """

    def __init__(self, kv_device: SlotAllocator, state_device: MambaStatePool | None,
                 config: HiCacheConfig, *, staging_bytes: int = STAGING_BYTES) -> None:
        self.config = config
        self.pools: dict[str, PoolPair] = {"kv": PoolPair("kv", kv_device, mirror_kv(kv_device, config))}
        if state_device is not None:
            self.pools["state"] = PoolPair("state", state_device, mirror_state(state_device, config))
        dev_pool: KVStorage | None = getattr(kv_device, "pool", None)
        where = dev_pool.device if dev_pool is not None else (
            state_device.device if state_device is not None else kv_device.device)
        self.device = resolve_device(torch.device(where))
        self._cuda = self.device.type == "cuda"
        self._write_stream: Any = None
        self._load_stream: Any = None
        self._ring: PinnedRing | None = None
        if self._cuda:
            self._write_stream = torch.cuda.Stream(device=self.device)
            self._load_stream = torch.cuda.Stream(device=self.device)
            self._ring = PinnedRing(staging_bytes, on_full=self._finish_oldest_chunk)
        self._pending: deque[tuple[Transfer, Callable[[], None] | None]] = deque()
        self._chunks: deque[_Chunk] = deque()
        #: host state slot -> the write in flight that fills it (a load must wait for it)
        self._state_writes: dict[int, Transfer] = {}
        self.last_load: Transfer | None = None
        self._full_waits = 0
        #: times a load waited for the write of the host state it reads
        self.load_waits = 0
        self.hold_completions = False
        self.backup_tokens = 0
        self.load_tokens = 0

    def add_pool(self, name: str, device: SlotAllocator, host: SlotAllocator) -> PoolPair:
        """Register the pool pair ``name`` (a component's device pool and its host mirror),
        unless one of that name is registered already; returns the registered pair. A pair
        other than ``"kv"`` and ``"state"`` holds KV-layout pools (``KVStorage``: gather /
        scatter) or state pools (``MambaStatePool``), copied by :meth:`write_parts` /
        :meth:`load_parts`."""
        pair = self.pools.get(name)
        if pair is None:
            pair = self.pools[name] = PoolPair(name, device, host)
        return pair

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

    @property
    def staging_waits(self) -> int:
        """Times the host waited for the staging ring (it was smaller than the copies in
        flight); 0 on the CPU."""
        return self._ring.waits + self._full_waits if self._ring is not None else 0

    # ------------------------------------------------------------------ alloc
    def alloc_host(self, num_tokens: int, num_states: int) -> tuple[torch.Tensor, int | None] | None:
        """Host KV slots and (0 or 1) host state slot, all or nothing; ``None`` when short."""
        asks: list[tuple[SlotAllocator, int]] = [(self.host_kv, num_tokens)]
        if num_states:
            assert self.host_state is not None
            asks.append((self.host_state, num_states))
        got = alloc_all(asks)
        if got is None:
            return None
        return got[0], (int(got[1][0]) if num_states else None)

    def alloc_parts(self, asks: list[tuple[SlotAllocator, int]]) -> list[torch.Tensor] | None:
        """``alloc`` from several pools (``(allocator, n)``), all or nothing (``None``: every
        pool exactly as before)."""
        return alloc_all(asks)

    # ------------------------------------------------------------------ copies
    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor,
              device_state: int | None, host_state: int | None,
              on_done: Callable[[], None] | None) -> Transfer:
        """Copy device -> host (KV slots, and a state when both are given); ``on_done`` runs at
        ``poll`` once the data is in the host pool (see the module docstring)."""
        if self._cuda:
            t = self._write_gpu(device_slots, host_slots, device_state, host_state)
        else:
            kv = self.pools["kv"]
            copy_kv(kv.device, device_slots, kv.host, host_slots)
            if device_state is not None and host_state is not None:
                sd, sh = self._states()
                copy_state(sd, device_state, sh, host_state)
            t = Transfer(None)
        t.released = not self.hold_completions
        self._pending.append((t, on_done))
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
        t = self._write_gpu(None, None, device_state, host_state)
        self._pending.append((t, on_done))
        return t

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
             host_state: int | None, device_state: int | None) -> Transfer:
        """Copy host -> device (KV slots, and a state when both are given). On a GPU the copy
        is enqueued on the load stream and the current stream waits for it (no host wait;
        see the module docstring); the returned transfer is also ``last_load``."""
        if not self._cuda:
            kv = self.pools["kv"]
            copy_kv(kv.host, host_slots, kv.device, device_slots)
            if host_state is not None and device_state is not None:
                sd, sh = self._states()
                copy_state(sh, host_state, sd, device_state)
            t = Transfer(None)
        else:
            if host_state is not None:
                self._land_state(host_state)
            t = self._load_gpu(host_slots, device_slots, host_state, device_state)
        self.last_load = t
        self.load_tokens += len(host_slots)
        return t

    # ------------------------------------------------------- copies by pool name
    def write_parts(self, parts: list[tuple[str, torch.Tensor, torch.Tensor]],
                    on_done: Callable[[], None] | None) -> Transfer:
        """Copy device -> host, per registered pool pair: ``(name, device indices, host
        indices)``; ``on_done`` runs at ``poll`` once every part is in the host pools. The
        ``"kv"`` and ``"state"`` parts go through :meth:`write` (asynchronous on a GPU); the
        other pairs are copied in the call (their own pool's gather / scatter)."""
        kv_d = kv_h = _EMPTY
        st_d = st_h = None
        for name, dev, host in parts:
            if name == "kv":
                kv_d, kv_h = dev, host
            elif name == "state":
                st_d, st_h = int(dev[0]), int(host[0])
            else:
                pair = self.pools[name]
                _copy(pair.device, dev, pair.host, host)
        return self.write(kv_d, kv_h, st_d, st_h, on_done)

    def load_parts(self, parts: list[tuple[str, torch.Tensor, torch.Tensor]]) -> Transfer:
        """Copy host -> device, per registered pool pair: ``(name, host indices, device
        indices)`` (see :meth:`write_parts`, :meth:`load`)."""
        kv_h = kv_d = _EMPTY
        st_h = st_d = None
        for name, host, dev in parts:
            if name == "kv":
                kv_h, kv_d = host, dev
            elif name == "state":
                st_h, st_d = int(host[0]), int(dev[0])
            else:
                pair = self.pools[name]
                _copy(pair.host, host, pair.device, dev)
        return self.load(kv_h, kv_d, st_h, st_d)

    # ------------------------------------------------------------- GPU copies
    def _chunk_tokens(self) -> int:
        """Tokens per staged chunk: a quarter of the ring at most (at least one page)."""
        kv_pool: KVStorage | None = getattr(self.pools["kv"].device, "pool", None)
        assert self._ring is not None
        per = kv_pool.bytes_per_token if kv_pool is not None else 1
        ps = self.pools["kv"].device.page_size
        n = max(ps, self._ring.capacity // 4 // max(per, 1))
        return n - n % ps

    def _write_gpu(self, device_slots: torch.Tensor | None, host_slots: torch.Tensor | None,
                   device_state: int | None, host_state: int | None) -> Transfer:
        ring, side = self._ring, self._write_stream
        assert ring is not None
        cur = torch.cuda.current_stream(self.device)
        kv = self.pools["kv"]
        dev_pool: KVStorage | None = getattr(kv.device, "pool", None)
        host_pool: Any = getattr(kv.host, "pool", None)
        # each span is one chunk (its regions, one event): K and V of up to a quarter of the ring,
        # or one state tensor (never two regions that together could wrap onto each other)
        spans: list[list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]] = []
        if device_slots is not None and host_slots is not None and dev_pool is not None \
                and host_pool is not None and host_slots.numel():
            d = device_slots if device_slots.device == self.device else upload(
                device_slots.numpy(), self.device)
            step = self._chunk_tokens()
            for lo in range(0, host_slots.numel(), step):
                k, v = dev_pool.gather(d[lo:lo + step])  # current stream: the snapshot
                h = host_slots[lo:lo + step]
                spans.append([(k, partial(_put_rows, host_pool.k_all, h)),
                              (v, partial(_put_rows, host_pool.v_all, h))])
        if device_state is not None and host_state is not None:
            sd, sh = self._states()
            spans.append([(sd.conv[:, device_state].clone(), partial(_put_slot, sh.conv, host_state))])
            spans.append([(sd.ssm[:, device_state].clone(), partial(_put_slot, sh.ssm, host_state))])
        t = Transfer(None, chunks=len(spans))
        side.wait_stream(cur)
        for span in spans:
            regions: list[Region] = []
            targets: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
            for src, put in span:
                region = ring.take(src.numel() * src.element_size(), held=True)
                dst = region.view(src.dtype, tuple(src.shape))
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
                regions.append(region)
                targets.append((dst, put))
            ev = torch.cuda.Event()
            ev.record(side)
            for region in regions:
                region.event = ev

            # ``span`` keeps the device snapshots alive until the copies have landed (then the
            # caching allocator may hand their memory out again: no record_stream needed)
            def finish(targets: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = targets,
                       regions: list[Region] = regions, span: list[Any] = span) -> None:
                for dst, put in targets:
                    put(dst)
                for region in regions:
                    ring.release(region)
                span.clear()

            self._chunks.append(_Chunk(ev, regions, finish, t))
            t.event = ev
        if host_state is not None and device_state is not None:
            self._state_writes[host_state] = t
        return t

    def _load_gpu(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
                  host_state: int | None, device_state: int | None) -> Transfer:
        ring, side = self._ring, self._load_stream
        assert ring is not None
        cur = torch.cuda.current_stream(self.device)
        kv = self.pools["kv"]
        dev_pool: KVStorage | None = getattr(kv.device, "pool", None)
        host_pool: Any = getattr(kv.host, "pool", None)
        steps: list[Callable[[], list[Region]]] = []  # each stages its part, copies it on side
        if dev_pool is not None and host_pool is not None and host_slots.numel():
            d = device_slots if device_slots.device == self.device else upload(
                device_slots.numpy(), self.device)
            step = self._chunk_tokens()
            for lo in range(0, host_slots.numel(), step):
                steps.append(partial(self._load_kv_chunk, host_pool, dev_pool,
                                     host_slots[lo:lo + step], d[lo:lo + step]))
        if host_state is not None and device_state is not None:
            sd, sh = self._states()
            for rows, drows in ((sh.conv, sd.conv), (sh.ssm, sd.ssm)):
                steps.append(partial(self._load_state, rows, drows, host_state, device_state))
        side.wait_stream(cur)  # earlier work on the device rows is done before they change
        ev = None
        for stage in steps:
            regions = stage()
            ev = torch.cuda.Event()
            ev.record(side)
            for region in regions:
                region.event = ev
        if ev is not None:
            cur.wait_event(ev)  # what the engine enqueues next sees the loaded data
        return Transfer(ev)

    def _load_kv_chunk(self, host_pool: Any, dev_pool: KVStorage, h: torch.Tensor,
                       d: torch.Tensor) -> list[Region]:
        """Host rows ``h`` of every layer -> pinned regions (host gathers) -> the device rows
        ``d`` (on the load stream)."""
        assert self._ring is not None
        regions, staged = [], []
        for rows in (host_pool.k_all, host_pool.v_all):
            shape = (rows.shape[0], h.numel(), *rows.shape[2:])
            region = self._ring.take(rows[:, :1].numel() * h.numel() * rows.element_size())
            buf = region.view(rows.dtype, shape)
            torch.index_select(rows, 1, h, out=buf)
            regions.append(region)
            staged.append(buf)
        with torch.cuda.stream(self._load_stream):
            k, v = (b.to(self.device, non_blocking=True) for b in staged)
            dev_pool.scatter(d, k, v)
        return regions

    def _load_state(self, rows: torch.Tensor, drows: torch.Tensor, host_state: int,
                    device_state: int) -> list[Region]:
        """One state tensor (conv or SSM, every layer): host slot -> a pinned region -> the
        device slot (on the load stream)."""
        assert self._ring is not None
        src = rows[:, host_state]
        region = self._ring.take(src.numel() * src.element_size())
        buf = region.view(src.dtype, tuple(src.shape))
        buf.copy_(src)
        with torch.cuda.stream(self._load_stream):
            drows[:, device_state].copy_(buf, non_blocking=True)
        return [region]

    def _finish_oldest_chunk(self) -> bool:
        """The staging ring needs the oldest held region: wait for its write (a host
        synchronisation: the ring is too small for what is in flight) and finish it."""
        if not self._chunks:
            return False
        if self._finish_one():
            self._full_waits += 1
        return True

    def _finish_one(self) -> bool:
        """Finish the oldest staged chunk, waiting for its copy if it has not landed; returns
        whether the host waited."""
        chunk = self._chunks.popleft()
        waited = not chunk.event.query()
        if waited:
            chunk.event.synchronize()
        self._complete(chunk)
        return waited

    def _complete(self, chunk: _Chunk) -> None:
        chunk.finish()
        chunk.transfer.chunks -= 1

    def _land_state(self, host_state: int) -> None:
        """A load reads ``host_state``: finish the write that fills it first (waiting for it
        when its copy has not landed yet: the one host wait of a load)."""
        t = self._state_writes.get(host_state)
        while t is not None and t.chunks and self._chunks:
            if self._finish_one():
                self.load_waits += 1
        self._state_writes.pop(host_state, None)

    # -------------------------------------------------------------- completion
    def poll(self) -> int:
        """Finish the staged chunks whose copies have landed, then run the callbacks of
        finished writes, in issue order; return how many callbacks ran."""
        chunks = self._chunks
        while chunks and chunks[0].event.query():
            self._complete(chunks.popleft())
        n = 0
        pending = self._pending
        while pending and pending[0][0].done():
            t, cb = pending.popleft()
            if self._state_writes:
                for slot in [s for s, w in self._state_writes.items() if w is t]:
                    del self._state_writes[slot]
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


def _put_rows(rows: torch.Tensor, slots: torch.Tensor, data: torch.Tensor) -> None:
    """Host pool rows ``slots`` (of every layer, dim 1) <- ``data`` (a landed region)."""
    rows.index_copy_(1, slots, data)


def _put_slot(rows: torch.Tensor, slot: int, data: torch.Tensor) -> None:
    """Host state pool slot ``slot`` (of every layer) <- ``data`` (a landed region)."""
    rows[:, slot].copy_(data)


_EMPTY = torch.empty(0, dtype=torch.int64)


def _copy(src: Any, src_idx: torch.Tensor, dst: Any, dst_idx: torch.Tensor) -> None:
    """Copy slots ``src_idx -> dst_idx`` between the pools of two allocators of one pair,
    synchronously: state pools slot by slot, KV-layout pools (their ``pool``) at once."""
    if isinstance(src, MambaStatePool):
        for a, b in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
            copy_state(src, a, dst, b)
    else:
        copy_kv(src, src_idx, dst, dst_idx)
