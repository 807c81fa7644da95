"""Device <-> host transfers with completion tracking: ``device slots <-> host slots``.

Writes (device -> host backups) return a :class:`Transfer`; the cache keeps the node locked
until the transfer is done and then runs its callback (``poll``). On the CPU a copy finishes
inside the call; on CUDA the copy is issued on a side stream and an event marks completion,
so backups overlap compute. Loads (host -> device) are synchronous: the engine needs the data
before the forward pass.

``hold_completions`` (tests, simulations): completed transfers are reported only after
``release_held()``, which is how a test reproduces an in-flight backup on the CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from allocators import MambaStatePool, SlotAllocator, alloc_all
from hicache.config import HiCacheConfig
from hicache.host_pools import PoolPair, copy_kv, copy_state, mirror_kv, mirror_state


class Transfer:
    """One device -> host copy; ``done()`` once its data has landed on the host."""

    __slots__ = ("event", "released")

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event
        self.released = True

    def done(self) -> bool:
        if not self.released:
            return False
        return self.event is None or bool(self.event.query())


class HiCacheController:
    """Host pools mirroring the device pools, and the copies between them.

    Args:
        kv_device: the device KV allocator (its ``pool``, if any, holds the tensors).
        state_device: the device state pool, or ``None`` (no recurrent layers).
        config: sizes and policies.

    Attributes:
        pools: ``{"kv": PoolPair, "state": PoolPair}`` (state only with recurrent layers).
    """

    def __init__(self, kv_device: SlotAllocator, state_device: MambaStatePool | None,
                 config: HiCacheConfig) -> None:
        self.config = config
        self.pools: dict[str, PoolPair] = {"kv": PoolPair("kv", kv_device, mirror_kv(kv_device, config))}
        if state_device is not None:
            self.pools["state"] = PoolPair("state", state_device, mirror_state(state_device, config))
        dev_pool = getattr(kv_device, "pool", None)
        self._cuda = dev_pool is not None and dev_pool.device.type == "cuda"
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._pending: deque[tuple[Transfer, Callable[[], None]]] = deque()
        self.hold_completions = False
        self.backup_tokens = 0
        self.load_tokens = 0

    @property
    def host_kv(self) -> SlotAllocator:
        return self.pools["kv"].host

    @property
    def host_state(self) -> MambaStatePool | None:
        pair = self.pools.get("state")
        return pair.host if pair is not None else None  # type: ignore[return-value]

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

    # ------------------------------------------------------------------ copies
    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor,
              device_state: int | None, host_state: int | None,
              on_done: Callable[[], None]) -> Transfer:
        """Copy device -> host (KV slots, and a state when given); ``on_done`` runs at ``poll``
        once the copy has landed."""
        kv = self.pools["kv"]
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._write(kv, device_slots, host_slots, device_state, host_state, True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            self._write(kv, device_slots, host_slots, device_state, host_state, False)
            event = None
        t = Transfer(event)
        t.released = not self.hold_completions
        self._pending.append((t, on_done))
        self.backup_tokens += len(host_slots)
        return t

    def _write(self, kv: PoolPair, d: torch.Tensor, h: torch.Tensor, ds: int | None,
               hs: int | None, non_blocking: bool) -> None:
        copy_kv(kv.device, d, kv.host, h, non_blocking)
        if ds is not None and hs is not None:
            pair = self.pools["state"]
            copy_state(pair.device, ds, pair.host, hs, non_blocking)  # type: ignore[arg-type]

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
             host_state: int | None, device_state: int | None) -> None:
        """Copy host -> device, synchronously (the data is needed before compute)."""
        kv = self.pools["kv"]
        copy_kv(kv.host, host_slots, kv.device, device_slots)
        if host_state is not None and device_state is not None:
            pair = self.pools["state"]
            copy_state(pair.host, host_state, pair.device, device_state)  # type: ignore[arg-type]
        if self._cuda:
            torch.cuda.current_stream().synchronize()
        self.load_tokens += len(host_slots)

    def save_state(self, device_state: int, host_state: int) -> None:
        """Copy one state device -> host synchronously (a state set after its KV's backup)."""
        pair = self.pools["state"]
        copy_state(pair.device, device_state, pair.host, host_state)  # type: ignore[arg-type]

    # -------------------------------------------------------------- completion
    def poll(self) -> int:
        """Run the callbacks of finished writes, in issue order; return how many ran."""
        n = 0
        pending = self._pending
        while pending and pending[0][0].done():
            _, cb = pending.popleft()
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
