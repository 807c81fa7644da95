"""The L3 backend on Mooncake Store (the distributed KV-cache store of SGLang HiCache deployments).

Client: ``mooncake.store.MooncakeDistributedStore`` (PyPI ``mooncake-transfer-engine-non-cuda``,
the ``storage`` extra). Each engine process holds one client; the client lends the store
``global_segment_size`` bytes of its memory (0: none, as when a standalone ``mooncake_client``
lends it) and talks to a ``mooncake_master`` (object placement, leases, eviction) over RPC.
Options: :mod:`hicache.storage.mooncake_options`.

* Keys: ``<key_prefix><page key>``; values: whole records (header + checksum, as every backend).
* Presence: ``batch_is_exist`` (one RPC for a batch).
* Writes, set-if-absent: the missing keys are found with ``batch_is_exist`` and only those are
  put (a Mooncake ``put`` of an existing key leaves it as it is, so two writers racing keep the
  first record). Copying path: ``put_batch`` in chunks that fit the client's local transfer
  buffer (``local_buffer_size``), which the client copies the records through. Zero-copy path
  (``zero_copy``, default, for batches of ``zero_copy_min_bytes`` or more): the records are
  encoded in place into a send buffer registered with the client once (``register_buffer``)
  and sent from there (``batch_put_from``): no copy into the transfer buffer, no limit from its
  size. Smaller batches take the copying path (a registration costs more than their copy). A page the store has no room for (code -200,
  segments full while its eviction catches up) is not written and counted ``refused``.
* Reads: copying path ``get_batch`` (chunks limited by the transfer buffer are retried; a key
  present but unreadable is a fault). Zero-copy path, once the record sizes are known
  (:meth:`~hicache.storage.base.StorageBackend.expect_sections`): ``batch_get_into`` one
  registered buffer, verified in place; the pages are views of it (no ``bytes`` per page). A
  record larger than the layout's (code -600) is read again on the copying path (and then
  refused by its checksum or by the controller's size check).
* Corrupt records are removed with ``remove(key, force=True)`` (a read holds a lease on the
  object for the master's ``default_kv_lease_ttl``; the record is refused either way).
* Bounded waits: every client call runs on a small worker pool and is waited for at most
  ``timeout_s`` (a killed master makes each call return -900 only after about 4 s). A call past
  its time is counted as a timeout and abandoned (it finishes in the background, its buffers
  kept alive until then); the backend then rests for ``cooldown_s``. The client is set up on
  first use (``setup_timeout_s``), so an engine starts while its store is down; after a master
  restart the client re-mounts its segment by itself (the store's pages are gone).
* Error codes (the client returns them instead of raising): -704 object not found is a miss,
  -200 no space is ``refused``, -600 buffer too small is a record larger than expected; every
  other negative code is a fault (:class:`MooncakeError`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from hicache.storage.base import (
    WRITE_FAILED,
    Record,
    StorageBackend,
    WriteResult,
    _split_key,
    check_seconds,
)
from hicache.storage.mooncake_options import MooncakeOptions
from hicache.storage.page import HEADER_SIZE, encode, encode_into

log = logging.getLogger("hicache.storage")

OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
#: Names of the client's codes seen in faults (``mooncake-store/include/types.h``).
ERROR_NAMES = {-1: "INTERNAL_ERROR", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS",
               -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE", -800: "TRANSFER_FAIL",
               -900: "RPC_FAIL"}
#: Client calls running at once (abandoned ones included) before new calls answer a miss.
WORKERS = 4
#: Largest registered send buffer kept for reuse [bytes]; larger batches register their own.
SEND_BUFFER_MAX = 256 << 20


class MooncakeError(RuntimeError):
    """A client call returned error code ``code``."""

    def __init__(self, op: str, code: int) -> None:
        super().__init__(f"{op} returned {code} ({ERROR_NAMES.get(code, 'error')})")
        self.code = code


def _ptr(buf: bytes) -> int:
    address = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value
    assert address is not None
    return address


class MooncakeStore(StorageBackend):
    """Pages in Mooncake Store (see the module docstring).

    Args:
        options: the resolved client options.
        tag / cooldown_s / secret: see :class:`StorageBackend`.
        timeout_s: the longest wait for one client call [s].
        setup_timeout_s: the longest wait for the client's setup (connect, mount) [s].

    Raises:
        ImportError: the Mooncake client is not installed (``pip install .[mooncake]``, or
            ``.[mooncake-cuda]`` beside a GPU engine).
    """

    name = "mooncake"

    def __init__(self, options: MooncakeOptions, tag: str = "", timeout_s: float = 1.0,
                 cooldown_s: float = 1.0, setup_timeout_s: float = 10.0,
                 secret: bytes | None = None) -> None:
        if not isinstance(options, MooncakeOptions):
            raise TypeError("options must be MooncakeOptions (MooncakeOptions.resolve), got "
                            f"{type(options).__name__}")
        timeout_s = check_seconds(timeout_s, "timeout_s")  # before anything connects
        setup_timeout_s = check_seconds(setup_timeout_s, "setup_timeout_s")
        super().__init__(tag, cooldown_s, secret)
        from mooncake.store import MooncakeDistributedStore  # ImportError here when absent

        self._client_class = MooncakeDistributedStore
        self.options = options
        self.prefix = options.key_prefix
        self.timeout_s = timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.zero_copy = options.zero_copy
        self._store: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._busy = 0
        self._first_wait = True
        self._setup: Future[Any] | None = None
        self._send_buf: torch.Tensor | None = None
        self._send_lock = threading.Lock()
        self._busy_lock = threading.Lock()
        self._extra = {"refused_pages": 0, "abandoned_calls": 0, "registered_bytes": 0}
        self._setup = self._start_setup()  # connects in the background from now on

    def __repr__(self) -> str:
        o = self.options
        return (f"MooncakeStore(master={o.master_server_address!r}, metadata={o.metadata_server!r}, "
                f"protocol={o.protocol!r}, zero_copy={self.zero_copy}, prefix={self.prefix!r})")

    def _extra_stats(self) -> dict[str, int]:
        with self._busy_lock:
            return dict(self._extra)

    # ------------------------------------------------------------ the client
    def _run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
             keep: Any = None, never_ran: Callable[[], None] | None = None) -> Any:
        """``fn(*args)`` on the worker pool, waited for at most ``timeout_s``.

        ``keep``: buffers the call reads or writes, referenced until it really ends.
        ``never_ran``: called when ``fn`` is known never to run (refused or cancelled).
        Raises ``TimeoutError`` (the call is abandoned) or what ``fn`` raised."""
        with self._busy_lock:
            if self._busy >= WORKERS:
                if never_ran is not None:
                    never_ran()
                raise TimeoutError(f"{WORKERS} earlier Mooncake calls are still running")
            self._busy += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="hicache-mooncake")
            pool = self._pool

        def call() -> Any:
            try:
                return fn(*args)
            finally:
                with self._busy_lock:
                    self._busy -= 1
                del keep_alive[:]

        keep_alive = [keep]
        try:
            fut = pool.submit(call)
        except RuntimeError:  # closed meanwhile
            with self._busy_lock:
                self._busy -= 1
            if never_ran is not None:
                never_ran()
            raise
        try:
            return fut.result(self.timeout_s if timeout_s is None else timeout_s)
        except FutureTimeout:
            with self._busy_lock:
                cancelled = fut.cancel()  # still queued: it will never run
                if cancelled:
                    self._busy -= 1
            if cancelled and never_ran is not None:
                never_ran()
            with self._busy_lock:
                self._extra["abandoned_calls"] += 1
            raise TimeoutError(f"Mooncake call {getattr(fn, '__name__', fn)} took longer than "
                               f"{self.timeout_s if timeout_s is None else timeout_s} s") from None

    def _client(self) -> Any:
        if self._store is not None:
            return self._store
        if self._setup is None or (self._setup.done() and self._setup.exception() is not None):
            self._setup = self._start_setup()
        wait = self.setup_timeout_s if self._first_wait else self.timeout_s
        self._first_wait = False
        try:
            self._store = self._hold(self._setup.result(wait))
        except FutureTimeout:
            raise TimeoutError(f"Mooncake setup took longer than {wait} s") from None
        return self._store

    def _start_setup(self) -> Future[Any]:
        o = self.options
        if "MC_TCP_BIND_ADDRESS" not in os.environ and o.local_hostname in ("localhost", "127.0.0.1"):
            # Otherwise the transfer engine advertises a non-loopback address it may not serve.
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

        def setup() -> Any:
            store = self._client_class()
            rc = store.setup(o.local_hostname, o.metadata_server, o.global_segment_size,
                             o.local_buffer_size, o.protocol, o.device_name, o.master_server_address)
            if rc != 0:
                raise MooncakeError("setup", rc)
            return store

        pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-mooncake-setup")
        fut = pool.submit(setup)
        pool.shutdown(wait=False)
        return fut

    def close(self, wait_s: float = 10.0) -> None:
        """Close the client once no call of it runs (abandoned calls get ``wait_s`` to end;
        a client still busy then is left open rather than closed under a running call)."""
        store, self._store, self._setup = self._store, None, None
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        deadline = time.monotonic() + wait_s
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.01)
        if store is None:
            return
        self._unhold(store)
        if not self._busy and self._send_buf is not None:
            store.unregister_buffer(self._send_buf.data_ptr())
        self._send_buf = None
        if self._busy:
            self._count("close_errors")
            log.warning("L3 mooncake: %d calls still running; client left open", self._busy)
            return
        try:
            store.close()
        except Exception as exc:
            self._count("close_errors")
            log.warning("L3 mooncake: close failed (%s)", exc)

    def _full(self, keys: Sequence[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    # -------------------------------------------------------------- presence
    def _exists_raw(self, keys: Sequence[str]) -> list[bool]:
        store = self._client()
        codes = self._run(store.batch_is_exist, self._full(keys))
        bad = [c for c in codes if c < 0]
        if bad:
            raise MooncakeError("batch_is_exist", bad[0])
        return [c == 1 for c in codes]

    # ----------------------------------------------------------------- reads
    def _get_raw(self, keys: Sequence[str]) -> list[Record | None]:
        store = self._client()
        sizes = [self.record_bytes.get(_split_key(k)[0]) for k in keys]
        if self.zero_copy and all(sizes) and sum(s or 0 for s in sizes) >= self.options.zero_copy_min_bytes:
            return self._get_into(store, keys, [s for s in sizes if s])
        return self._get_copying(store, keys)

    def _get_copying(self, store: Any, keys: Sequence[str]) -> list[Record | None]:
        full = self._full(keys)
        out: list[Record | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        while todo:
            values = self._run(store.get_batch, [full[i] for i in todo])
            empty = [i for i, v in zip(todo, values, strict=True) if not v]
            for i, v in zip(todo, values, strict=True):
                if v:
                    out[i] = v
            if not empty:
                break
            codes = self._run(store.batch_is_exist, [full[i] for i in empty])
            present = [i for i, c in zip(empty, codes, strict=True) if c != 0]
            if not present:
                break  # plain misses
            if len(empty) == len(todo):  # nothing came through: not the transfer buffer's size
                self._fault("get", MooncakeError("get_batch", min(min(codes), -1)))
                break
            todo = present  # the transfer buffer filled up: the rest in another round
        return out

    def _get_into(self, store: Any, keys: Sequence[str], sizes: list[int]) -> list[Record | None]:
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        arena = torch.empty(offsets[-1], dtype=torch.uint8)
        base = arena.data_ptr()
        codes = self._registered(store, base, offsets[-1], arena, store.batch_get_into,
                                 self._full(keys), [base + o for o in offsets[:-1]], sizes)
        view = arena.numpy().data
        out: list[Record | None] = []
        larger: list[int] = []
        fault = 0
        for i, (code, off) in enumerate(zip(codes, offsets, strict=False)):
            out.append(view[off : off + code] if code > 0 else None)
            if code == INVALID_PARAMS:
                larger.append(i)  # larger than this layout's record: read it whole
            elif code < 0 and code != OBJECT_NOT_FOUND:
                fault = fault or code
        if fault:
            self._fault("get", MooncakeError("batch_get_into", fault))
        if larger:
            for i, rec in zip(larger, self._get_copying(store, [keys[i] for i in larger]), strict=True):
                out[i] = rec
        return out

    # ---------------------------------------------------------------- writes
    def _set_nx_raw(self, items: Sequence[tuple[str, bytes]]) -> list[WriteResult]:
        return self._put_records(items)

    def _write_sections(self, items: Sequence[tuple[str, int, bytes, bytes, bytes]]
                        ) -> Sequence[WriteResult]:
        total = sum(HEADER_SIZE + len(a) + len(b) for *_, a, b in items)
        if not self.zero_copy or total < self.options.zero_copy_min_bytes:
            return self._put_records([(k, encode(kind, self._tag_digest, h, a, b, self._mac))
                                      for k, kind, h, a, b in items])
        store = self._client()
        done: list[WriteResult] = [False] * len(items)
        todo = self._absent(store, [k for k, *_ in items])
        if not todo:
            return done
        sizes = [HEADER_SIZE + len(items[i][3]) + len(items[i][4]) for i in todo]
        arena, registered = self._take_send_buffer(store, sum(sizes))
        view = arena.numpy().data
        offsets, off = [], 0
        try:
            for i, n in zip(todo, sizes, strict=True):
                _, kind, h, a, b = items[i]
                encode_into(view[off : off + n], kind, self._tag_digest, h, a, b, self._mac)
                offsets.append(off)
                off += n
        except BaseException:
            if registered:
                self._send_lock.release()
            raise
        base = arena.data_ptr()
        args = (self._full([items[i][0] for i in todo]), [base + o for o in offsets], sizes)
        if registered:
            codes = self._run(self._release_after(store.batch_put_from), *args, keep=arena,
                              never_ran=self._send_lock.release)
        else:
            codes = self._registered(store, base, off, arena, store.batch_put_from, *args)
        self._settle(todo, codes, done, "batch_put_from")
        return done

    def _take_send_buffer(self, store: Any, size: int) -> tuple[torch.Tensor, bool]:
        """A buffer of ``size`` bytes to encode records into, and whether it is the backend's
        send buffer, registered once and reused (grown up to ``SEND_BUFFER_MAX``) while no call
        uses it; else a fresh one to register for the call only."""
        if size > SEND_BUFFER_MAX or not self._send_lock.acquire(blocking=False):
            return torch.empty(size, dtype=torch.uint8), False
        try:
            buf = self._send_buf
            if buf is None or buf.numel() < size:
                if buf is not None:
                    store.unregister_buffer(buf.data_ptr())
                    self._send_buf = None
                new = torch.zeros(max(size, self.options.local_buffer_size), dtype=torch.uint8)
                rc = store.register_buffer(new.data_ptr(), new.numel())
                if rc != 0:
                    raise MooncakeError("register_buffer", rc)
                with self._busy_lock:
                    self._extra["registered_bytes"] += new.numel()
                self._send_buf = buf = new
            return buf, True
        except BaseException:
            self._send_lock.release()
            raise

    def _release_after(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that hands the send buffer back when it ends (on the worker, so an abandoned
        call keeps it until then)."""
        def call(*args: Any) -> Any:
            try:
                return fn(*args)
            finally:
                self._send_lock.release()

        return call

    def _put_records(self, records: Sequence[tuple[str, bytes]]) -> list[WriteResult]:
        """The copying path: ``put_batch`` in chunks that fit the transfer buffer."""
        store = self._client()
        done: list[WriteResult] = [False] * len(records)
        todo = self._absent(store, [k for k, _ in records])
        limit = self.options.local_buffer_size
        chunk: list[int] = []
        size = 0
        for i in [*todo, -1]:
            n = len(records[i][1]) if i >= 0 else 0
            if chunk and (i < 0 or size + n > limit):
                keys = self._full([records[j][0] for j in chunk])
                rc = self._run(store.put_batch, keys, [records[j][1] for j in chunk])
                codes = [0] * len(chunk)
                if rc != 0:  # which ones landed
                    got = self._run(store.batch_is_exist, keys)
                    codes = [0 if g == 1 else rc for g in got]
                self._settle(chunk, codes, done, "put_batch")
                chunk, size = [], 0
            if i < 0:
                break
            if n > limit:  # never fits the transfer buffer: one zero-copy put
                rec = records[i][1]
                rc = self._registered(store, _ptr(rec), n, rec, store.put_from,
                                      self.prefix + records[i][0], _ptr(rec), n)
                self._settle([i], [rc], done, "put_from")
                continue
            chunk.append(i)
            size += n
        return done

    def _absent(self, store: Any, keys: Sequence[str]) -> list[int]:
        codes = self._run(store.batch_is_exist, self._full(keys))
        bad = [c for c in codes if c < 0]
        if bad:
            raise MooncakeError("batch_is_exist", bad[0])
        return [i for i, c in enumerate(codes) if c == 0]

    def _settle(self, idx: Sequence[int], codes: Sequence[int], done: list[WriteResult],
                op: str) -> None:
        fault = 0
        for i, code in zip(idx, codes, strict=True):
            if code == 0:
                done[i] = True
            elif code == NO_AVAILABLE_HANDLE:
                done[i] = None
                with self._busy_lock:
                    self._extra["refused_pages"] += 1
            else:
                done[i] = WRITE_FAILED
                fault = fault or code
        if fault:
            self._fault("set", MooncakeError(op, fault))

    def _registered(self, store: Any, ptr: int, size: int, keep: Any,
                    fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with ``[ptr, ptr + size)`` (memory of ``keep``) registered with the
        client for the call: register, call and unregister run together on one worker, so an
        abandoned call keeps its buffer registered and alive until it really ends."""
        def call() -> Any:
            rc = store.register_buffer(ptr, size)
            if rc != 0:
                raise MooncakeError("register_buffer", rc)
            try:
                return fn(*args)
            finally:
                store.unregister_buffer(ptr)

        with self._busy_lock:
            self._extra["registered_bytes"] += size
        return self._run(call, keep=keep)

    def _delete_raw(self, key: str, record: bytes) -> None:
        store = self._client()
        rc = self._run(store.remove, self.prefix + key, True)
        if rc not in (0, OBJECT_NOT_FOUND):
            raise MooncakeError("remove", rc)
