"""Host slots <-> storage pages: record sections, background writes, prefetch jobs.

A cache stores two kinds of record (:mod:`hicache.storage.page`): one per page, the primary
component's (KV: sections ``(K, V)``, keyed :func:`~hicache.storage.keys.page_key`), and one at
a page's end (:func:`~hicache.storage.keys.end_key`) holding the *end sections* of every other
component that declares some (the recurrent state valid there: ``(conv, ssm)``; the SWA KV
of the sliding window before it: ``(K, V)``; a plug-in's per-node value). The components pack and unpack their own bytes (``components.base``: the L3
hooks); this controller knows only section sizes. An end record's two sections are the first
end section and the rest concatenated, in component order, so a KV + state record is
``(conv, ssm)`` as it always was.

The engine thread packs host bytes and hands them to one writer thread, which asks the backend
which records are missing and writes only those (set-if-absent). Prefetch jobs run on one
reader thread (the engine waits for them, up to a deadline, under ``wait_complete`` /
``timeout``): leading pages present in L3, their verified bytes, and with end sections the end
record at the deepest page that has one. The tree is never touched off the engine thread: jobs
only collect bytes; :class:`radix.tiers.storage.StorageTier` attaches them (the components
unpack into fresh host slots) on the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hicache.storage.base import Page, StorageBackend, check_wait
from hicache.storage.keys import chain_seed, encode_namespace, end_key, page_key

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

    ``hashes``: the page hashes from ``start`` on. ``want_end``: the cache stores end sections,
    and a match can end only where they are (a hybrid model's state): the job reads the pages
    up to the deepest one with an end record, and that record. Filled by the fetch: ``pages``
    (the leading verified pages, in order; with ``want_end`` only once complete) and ``end``
    (the end record at the last page's end, ``want_end`` only), published together as one
    immutable ``result`` tuple; ``done`` is set at the end.
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
    want_end: bool
    result: tuple[tuple[Page, ...], Page | None] = ((), None)
    done: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    timed_out: bool = False

    @property
    def pages(self) -> list[Page]:
        return list(self.result[0])

    @property
    def end(self) -> Page | None:
        return self.result[1]

    def snapshot(self) -> tuple[list[Page], Page | None, bool]:
        """(pages so far, end record, finished) read consistently and without waiting:
        ``done`` is read first, so a finished job's result is its final one."""
        finished = self.done.is_set()
        pages, end = self.result
        return list(pages), end, finished


class StorageController:
    """Moves records between a cache's L3 tier and an L3 backend.

    Args:
        backend: the storage (its faults are already misses).
        page_size: tokens per page.
        tag: layout tag (:func:`hicache.storage.keys.layout_tag_of`).
        page_sections: byte sizes ``(a, b)`` of a page record's sections (KV: ``(K, V)``).
        end_sections: byte sizes of the end sections, every end component's in order (``()``:
            no end record).
        prefetch_policy / prefetch_timeout_s: as ``HiCacheConfig``'s.

    Attributes:
        end_record_bytes: byte sizes ``(a, b)`` of an end record's two sections, or ``None``.
    """

    def __init__(self, backend: StorageBackend, page_size: int, tag: str,
                 page_sections: tuple[int, int], end_sections: tuple[int, ...] = (),
                 prefetch_policy: str = "best_effort", prefetch_timeout_s: float = 0.5) -> None:
        self.backend = backend
        self.page_size = page_size
        self.tag = tag
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout_s = prefetch_timeout_s
        self.page_sections = page_sections
        self.end_sections = end_sections
        self.end_record_bytes: tuple[int, int] | None = (
            (end_sections[0], sum(end_sections[1:])) if end_sections else None)
        backend.expect_sections(page_sections, self.end_record_bytes or (0, 0))
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

    def count_prefetched(self, pages: int, tokens: int, end: bool) -> None:
        """A prefetch attached ``pages`` pages (``tokens`` tokens), and an end record when
        ``end`` (counted as ``prefetch_states``: the state was the first end section)."""
        with self._lock:
            c = self.counters
            c["prefetch_pages"] += pages
            c["prefetch_tokens"] += tokens
            c["prefetch_states"] += int(end)

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

    def forget(self, keys: Sequence[str]) -> None:
        """The store answered that ``keys`` hold no record (it dropped them: ``maxmemory``,
        a flush, a restart): no longer taken for stored, so the next backup writes them."""
        with self._lock:
            known = self._known
            for k in keys:
                known.pop(k, None)

    def mark_known(self, keys: Sequence[str]) -> None:
        with self._lock:
            known = self._known
            for k in keys:
                known[k] = None
                known.move_to_end(k)
            while len(known) > KNOWN_MAX:
                known.popitem(last=False)

    # ---------------------------------------------------------------- bytes
    def end_record(self, sections: Sequence[bytes]) -> tuple[bytes, bytes]:
        """The two sections of an end record holding ``sections`` (every end section, in
        order, of the sizes ``end_sections``): the first, and the rest concatenated.

        Raises:
            ValueError: the sections' sizes are not ``end_sections`` (a component packed
                other sizes than its ``l3_sections``; the record is not written).
        """
        sizes = tuple(len(x) for x in sections)
        if sizes != self.end_sections:
            raise ValueError(f"end sections of {sizes} bytes, expected {self.end_sections} "
                             "(the end components' l3_sections)")
        return sections[0], b"".join(sections[1:])

    def end_parts(self, page: Page) -> list[memoryview]:
        """The end sections of a verified end record (:meth:`end_ok`), in order."""
        out = [memoryview(page.a)]
        rest, o = memoryview(page.b), 0
        for n in self.end_sections[1:]:
            out.append(rest[o:o + n])
            o += n
        return out

    def page_ok(self, page: Page) -> bool:
        """Whether a page record has the page sections' sizes."""
        return (len(page.a), len(page.b)) == self.page_sections

    def end_ok(self, page: Page) -> bool:
        """Whether an end record has the end sections' sizes."""
        return (len(page.a), len(page.b)) == self.end_record_bytes

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
        """Wait for queued writes and running prefetches (``timeout_s``: see
        ``hicache.storage.base.check_wait``); whether all finished in time."""
        timeout_s = check_wait(timeout_s, "timeout_s")
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
        mask = be.exists_mask(keys)
        # an absent page's end record is unusable anyway: re-checked at the next backup too
        self.forget([k for i, present in enumerate(mask) if not present
                     for k in (keys[i], end_key(job.hashes[i]))])
        n = mask.index(False) if False in mask else len(mask)
        end = None
        if job.want_end:
            ends = [end_key(h) for h in job.hashes[:n]]
            mask = be.exists_mask(ends)
            self.forget([k for k, present in zip(ends, mask, strict=True) if not present])
            n = max((i + 1 for i, present in enumerate(mask) if present), default=0)
            if n == 0:
                return
            end = be.get(ends[n - 1])
            if end is None or not self.end_ok(end):
                if end is None:
                    self.forget([ends[n - 1]])
                else:
                    self.count("bad_sections")
                return
        got: list[Page] = []
        for lo in range(0, n, FETCH_CHUNK):
            chunk = be.batch_get(keys[lo : min(n, lo + FETCH_CHUNK)])
            lead = []
            for i, p in enumerate(chunk):
                if p is None:  # gone since the presence check, or corrupt (then deleted)
                    self.forget([keys[lo + i]])
                    break
                if not self.page_ok(p):
                    self.count("bad_sections")
                    break
                lead.append(p)
            got.extend(lead)
            if not job.want_end:
                job.result = (job.result[0] + tuple(lead), None)
            if len(lead) < len(chunk):
                break
        if job.want_end and len(got) == n:
            job.result = (tuple(got), end)

    def close(self) -> None:
        """Finish queued work, stop the threads, close the backend."""
        for ex in (self._writer, self._reader):
            if ex is not None:
                ex.shutdown(wait=True)
        self._writer = self._reader = None
        self.backend.close()
