"""Host slots <-> storage pages: packing, background writes, prefetch jobs.

The engine thread packs host bytes into page sections (:meth:`StorageController.pack_kv`, a
gather and a copy) and hands them to one writer thread, which asks the backend which pages are
missing and writes only those (set-if-absent). Prefetch jobs run on one reader thread (the
engine waits for them, up to a deadline, under ``wait_complete`` / ``timeout``): leading pages
present in L3, their verified bytes, and for a hybrid model the state record at the deepest
page that has one. The tree is never touched off the engine thread: jobs only collect bytes;
:class:`radix.tiers.storage.StorageTier` attaches them (``unpack_kv`` into fresh host slots) on
the engine thread.

Section byte layouts are those of :mod:`hicache.storage.page`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.storage.base import Page, StorageBackend
from hicache.storage.keys import chain_seed, encode_namespace, page_key, state_key

log = logging.getLogger("hicache.storage")

#: Pages per read batch of a prefetch job (a ``timeout`` wait can use the leading batches).
FETCH_CHUNK = 64
#: Keys remembered as present in L3 (not packed or asked about again).
KNOWN_MAX = 1 << 17
#: Bytes queued for the writer before new backups are dropped (counted).
MAX_PENDING_BYTES = 256 << 20

CONTROLLER_COUNTERS = (
    "backup_written",
    "backup_already_present",
    "backup_known_skipped",
    "backup_dropped",
    "backup_unverified",
    "prefetch_started",
    "prefetch_pages",
    "prefetch_tokens",
    "prefetch_states",
    "prefetch_dropped",
    "prefetch_timeouts",
    "prefetch_in_flight_skipped",
    "bad_sections",
    "faults",
    "unkeyable",
)


@dataclass(eq=False)
class PrefetchJob:
    """One lookup of consecutive pages after position ``start`` of ``tokens``.

    ``hashes``: the page hashes from ``start`` on. Filled by the fetch: ``pages`` (the leading
    verified pages, in order; for a hybrid model only once complete) and ``state`` (the state
    record at the end of the last page, hybrid only), published together as one immutable
    ``result`` tuple; ``done`` is set at the end.
    ``deadline`` (``time.monotonic``, engine thread only): until when matches wait for it;
    ``timed_out``: a wait reached the deadline.

    The engine reads a job without a lock (:meth:`snapshot`): the reader thread replaces
    ``result`` by one assignment, so no engine call ever waits on the reader thread, which may
    be stalled in network I/O (or in a finalizer that a GC pass runs on it).
    """

    tokens: Any
    extra_key: Any
    start: int
    hashes: list[bytes]
    want_state: bool
    result: tuple[tuple[Page, ...], Page | None] = ((), None)
    done: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    timed_out: bool = False

    @property
    def pages(self) -> list[Page]:
        return list(self.result[0])

    @property
    def state(self) -> Page | None:
        return self.result[1]

    def snapshot(self) -> tuple[list[Page], Page | None, bool]:
        """(pages so far, state, finished) read consistently and without waiting: ``done``
        is read first, so a finished job's result is its final one."""
        finished = self.done.is_set()
        pages, state = self.result
        return list(pages), state, finished


class StorageController:
    """Moves pages between the host pools and an L3 backend.

    Args:
        backend: the storage (its faults are already misses).
        host_kv: the host KV allocator (its ``pool`` holds the tensors, or ``None``).
        host_state: the host state pool, or ``None``.
        page_size: tokens per page.
        tag: layout tag (:func:`hicache.storage.keys.layout_tag`).
    """

    def __init__(self, backend: StorageBackend, host_kv: Any, host_state: Any, page_size: int,
                 tag: str, prefetch_policy: str = "best_effort",
                 prefetch_timeout_s: float = 0.5) -> None:
        self.backend = backend
        self.host_kv = host_kv
        self.host_state = host_state
        self.page_size = page_size
        self.tag = tag
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout_s = prefetch_timeout_s
        pool = getattr(host_kv, "pool", None)
        self._kv_pool = pool
        if pool is not None:
            elem = torch.empty((), dtype=pool.dtype).element_size()
            self.kv_section_bytes = pool.num_layers * page_size * pool.num_heads * pool.head_dim * elem
        else:
            self.kv_section_bytes = 0
        if host_state is not None:
            elem = torch.empty((), dtype=host_state.dtype).element_size()
            n = host_state.num_layers
            self.state_section_bytes = (n * math.prod(host_state.conv_state_shape) * elem,
                                        n * math.prod(host_state.ssm_state_shape) * elem)
        else:
            self.state_section_bytes = (0, 0)
        backend.expect_sections((self.kv_section_bytes, self.kv_section_bytes),
                                self.state_section_bytes)
        self._seeds: dict[bytes, bytes | None] = {}
        self._known: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(CONTROLLER_COUNTERS, 0)
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._pending_bytes = 0

    def __repr__(self) -> str:
        return f"StorageController(backend={self.backend!r}, tag={self.tag!r})"

    def counters_now(self) -> dict[str, int]:
        """A consistent copy of the counters (taken under the writer's lock)."""
        with self._lock:
            return dict(self.counters)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # ------------------------------------------------------------------ keys
    def seed(self, extra_key: Any) -> bytes | None:
        """The chain seed of a namespace (``None``: not storable; counted once per call)."""
        # Cached by the typed encoding, not by the value: 1, True and 1.0 are equal as dict
        # keys but three namespaces.
        ns = encode_namespace(extra_key)
        if ns is None:
            self.count("unkeyable")
            return None
        try:
            return self._seeds[ns]
        except KeyError:
            s = self._seeds[ns] = chain_seed(self.tag, extra_key)
            return s

    def is_known(self, key: str) -> bool:
        with self._lock:
            return key in self._known

    def mark_known(self, keys: Sequence[str]) -> None:
        with self._lock:
            known = self._known
            for k in keys:
                known[k] = None
                known.move_to_end(k)
            while len(known) > KNOWN_MAX:
                known.popitem(last=False)

    # ---------------------------------------------------------------- bytes
    def pack_kv(self, host_slots: torch.Tensor) -> list[tuple[bytes, bytes]]:
        """Sections ``(K, V)`` of each whole page of ``host_slots`` (page order)."""
        npages = len(host_slots) // self.page_size
        pool = self._kv_pool
        if pool is None:
            return [(b"", b"")] * npages
        idx = host_slots.to(pool.device)
        out_k = self._pages_bytes(pool.k_all[:, idx], npages)
        out_v = self._pages_bytes(pool.v_all[:, idx], npages)
        return list(zip(out_k, out_v, strict=True))

    @staticmethod
    def _pages_bytes(x: torch.Tensor, npages: int) -> list[bytes]:
        layers = x.shape[0]
        per_page = x.reshape(layers, npages, -1).transpose(0, 1).contiguous()
        raw = per_page.view(torch.uint8).reshape(npages, -1).cpu().numpy()
        return [raw[i].tobytes() for i in range(npages)]

    def unpack_kv(self, host_slots: torch.Tensor, pages: Sequence[Page]) -> None:
        """Write the pages' K and V into ``host_slots`` (``len(pages)`` whole pages)."""
        pool = self._kv_pool
        if pool is None or not pages:
            return
        npages, layers = len(pages), pool.num_layers
        shape = (npages, layers, self.page_size, pool.num_heads, pool.head_dim)
        idx = host_slots.to(pool.device)
        for target, sections in ((pool.k_all, [p.a for p in pages]), (pool.v_all, [p.b for p in pages])):
            buf = bytearray(b"".join(sections))
            t = torch.frombuffer(buf, dtype=torch.uint8).view(pool.dtype).reshape(shape)
            target[:, idx] = t.transpose(0, 1).reshape(layers, npages * self.page_size,
                                                       pool.num_heads, pool.head_dim)

    def pack_state(self, slot: int) -> tuple[bytes, bytes]:
        hs = self.host_state
        assert hs is not None
        return (hs.conv[:, slot].contiguous().view(torch.uint8).cpu().numpy().tobytes(),
                hs.ssm[:, slot].contiguous().view(torch.uint8).cpu().numpy().tobytes())

    def unpack_state(self, slot: int, page: Page) -> None:
        hs = self.host_state
        assert hs is not None
        for target, section in ((hs.conv, page.a), (hs.ssm, page.b)):
            shape = target[:, slot].shape
            t = torch.frombuffer(bytearray(section), dtype=torch.uint8).view(hs.dtype).reshape(shape)
            target[:, slot] = t

    def kv_page_ok(self, page: Page) -> bool:
        return len(page.a) == self.kv_section_bytes and len(page.b) == self.kv_section_bytes

    def state_ok(self, page: Page) -> bool:
        return (len(page.a), len(page.b)) == self.state_section_bytes

    # --------------------------------------------------------------- writes
    def submit_writes(self, items: list[tuple[str, bytes, bytes]]) -> None:
        """Queue ``(key, a, b)`` records for the writer thread (dropped, and counted, when
        more than ``MAX_PENDING_BYTES`` are queued)."""
        if not items:
            return
        size = sum(len(a) + len(b) for _, a, b in items)
        with self._lock:
            if self._pending_bytes + size > MAX_PENDING_BYTES:
                self.counters["backup_dropped"] += len(items)
                return
            self._pending_bytes += size
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-write")
        fut = self._writer.submit(self._write, items, size)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _write(self, items: list[tuple[str, bytes, bytes]], size: int) -> None:
        try:
            keys = [k for k, _, _ in items]
            present = self._present(keys)
            todo = [it for it, p in zip(items, present, strict=True) if not p]
            written = self.backend.batch_set(todo)
            if written == len(todo):  # on a fault nothing is remembered: it is tried again
                self.mark_known(keys)
            self.count("backup_written", written)
            self.count("backup_already_present", len(items) - len(todo))
        except Exception as exc:  # a bug or an unexpected backend error: never past here
            self.count("faults")
            log.warning("L3 backup failed (%s); pages not stored", type(exc).__name__)
        finally:
            with self._lock:
                self._pending_bytes -= size

    def _present(self, keys: list[str]) -> list[bool]:
        """Which keys already hold a record we may keep. Authenticated (a deployment secret):
        only records whose MAC checks count; one that does not check is deleted and our own
        record is written in its place (``StorageBackend.keep_verified``): a forged record
        never stops our backup."""
        be = self.backend
        present = be.exists_mask(keys)
        if be.authenticated and any(present):
            idx = [i for i, p in enumerate(present) if p]
            for i, ok in zip(idx, be.keep_verified([keys[i] for i in idx]), strict=True):
                if not ok:
                    present[i] = False
                    self.count("backup_unverified")
        return present

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued writes and running prefetches; whether all finished in time."""
        with self._lock:
            futs = list(self._pending)
        from concurrent.futures import wait

        _, not_done = wait(futs, timeout=timeout_s)
        return not not_done

    # -------------------------------------------------------------- prefetch
    def start(self, job: PrefetchJob) -> None:
        """Run ``job`` on the reader thread (``job.done`` is set when it ends)."""
        self.count("prefetch_started")
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-prefetch")
        fut = self._reader.submit(self._fetch, job)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._write_done)

    def _fetch(self, job: PrefetchJob) -> None:
        try:
            self._fetch_pages(job)
        except Exception as exc:
            self.count("faults")
            log.warning("L3 prefetch failed (%s); treated as a miss", type(exc).__name__)
            job.result = ((), None)
        finally:
            job.done.set()

    def _fetch_pages(self, job: PrefetchJob) -> None:
        be = self.backend
        keys = [page_key(h) for h in job.hashes]
        n = be.batch_exists(keys)
        state = None
        if job.want_state:
            mask = be.exists_mask([state_key(h) for h in job.hashes[:n]])
            n = max((i + 1 for i, present in enumerate(mask) if present), default=0)
            if n == 0:
                return
            state = be.get(state_key(job.hashes[n - 1]))
            if state is None or not self.state_ok(state):
                if state is not None:
                    self.count("bad_sections")
                return
        got: list[Page] = []
        for lo in range(0, n, FETCH_CHUNK):
            chunk = be.batch_get(keys[lo : min(n, lo + FETCH_CHUNK)])
            lead = []
            for p in chunk:
                if p is None:
                    break
                if not self.kv_page_ok(p):
                    self.count("bad_sections")
                    break
                lead.append(p)
            got.extend(lead)
            if not job.want_state:
                job.result = (job.result[0] + tuple(lead), None)
            if len(lead) < len(chunk):
                break
        if job.want_state and len(got) == n:
            job.result = (tuple(got), state)

    def close(self) -> None:
        """Finish queued work, stop the threads, close the backend."""
        for ex in (self._writer, self._reader):
            if ex is not None:
                ex.shutdown(wait=True)
        self._writer = self._reader = None
        self.backend.close()
