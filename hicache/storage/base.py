"""The L3 storage interface: ``key -> verified page``, shared by every backend.

Contract (``host slots <-> storage pages``; keys from :mod:`hicache.storage.keys`):

* ``exists(key)`` / ``exists_mask(keys)`` / ``batch_exists(keys)``: presence; ``batch_exists``
  returns how many keys exist **consecutively from the start** (the usable prefix of a chain),
  so a gap hides every later page.
* ``set(key, a, b)`` / ``batch_set(items)``: write once (set-if-absent); a key already present
  is left as it is. Returns whether / how many records were written by this call.
* ``get(key)`` / ``batch_get(keys)``: the record's two sections (:class:`Page`) after
  :func:`hicache.storage.page.decode` checked its length, tag, key and checksum, else ``None``.
  A corrupt record is counted, logged, deleted (so it can be written again) and reported as a
  miss: never handed back.

Faults never escape: a backend error or timeout is logged (``logging``, logger
``hicache.storage``; messages pass through :meth:`StorageBackend.redact`), counted in
:attr:`StorageBackend.stats`, and answered as a miss (``False`` / ``0`` / ``None``). After a
fault the backend answers misses at once for ``cooldown_s`` seconds instead of paying a timeout
on every call, then tries again (the client reconnects).

Subclasses implement four raw calls on whole records (``_exists_raw``, ``_get_raw``,
``_set_nx_raw``, ``_delete_raw``); they may raise anything. A backend that can write records
in place (into memory it registered with its client) overrides ``_write_sections`` instead of
building them with :func:`~hicache.storage.page.encode`; one that reads into such memory uses
the record sizes of :meth:`StorageBackend.expect_sections`. Thread safety: every public
method may be called from several threads; subclasses lock what they share.
"""

from __future__ import annotations

import enum
import logging
import math
import queue
import re
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

from hicache.storage.keys import STATE_SUFFIX
from hicache.storage.page import (
    HEADER_SIZE,
    KIND_KV,
    KIND_STATE,
    CorruptPage,
    decode,
    encode,
    mac_state,
    tag_digest,
)

log = logging.getLogger("hicache.storage")

#: Counters every backend keeps (``stats``).
COUNTERS = (
    "get_calls",
    "get_hits",
    "get_misses",
    "corrupt",
    "unverified",
    "set_calls",
    "written",
    "already_present",
    "refused",
    "exists_calls",
    "errors",
    "timeouts",
    "skipped_in_cooldown",
    "bytes_read",
    "bytes_written",
    "close_errors",
    "touch_errors",
)


class Page(NamedTuple):
    """A verified record's sections: KV page ``(k, v)`` or state ``(conv, ssm)`` bytes."""

    a: memoryview
    b: memoryview


#: A raw record: whole bytes, or a view of memory the backend read it into.
Record = bytes | memoryview


class WriteFailed(enum.Enum):
    """A raw write's answer for a record that a fault kept out of the store (an error reply
    about its key, a failed put): neither written nor already present. The backend counts
    the fault itself (:meth:`StorageBackend._fault`); ``batch_set`` counts it nowhere else."""

    FAILED = "failed"


#: See :class:`WriteFailed`.
WRITE_FAILED = WriteFailed.FAILED
#: What a raw write answers for each record: written (``True``), already present
#: (``False``), refused for want of space (``None``) or kept out by a fault
#: (:data:`WRITE_FAILED`).
WriteResult = bool | None | WriteFailed


_KEY = re.compile(r"[0-9a-f]{64}(?:\.s)?")


def check_seconds(value: Any, name: str, zero_ok: bool = False) -> float:
    """``value`` as seconds: a finite number > 0 (>= 0 with ``zero_ok``), at most
    ``threading.TIMEOUT_MAX`` (the longest wait the platform takes); errors name ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or (
            value < 0 if zero_ok else value <= 0) or value > threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0 [s], "
                         f"at most {threading.TIMEOUT_MAX:.0f} (threading.TIMEOUT_MAX), "
                         f"got {value!r}")
    return float(value)


def check_wait(value: Any, name: str) -> float | None:
    """A bound on a wait [s]: ``None`` or a number >= 0; returned as ``None`` (no bound) when
    it is one no wait can take (``inf``, past ``threading.TIMEOUT_MAX``: until done).

    Raises:
        TypeError: not a number (a bool included), naming ``name``.
        ValueError: NaN or negative, naming ``name``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds >= 0 or None, got "
                        f"{type(value).__name__}")
    if value != value or value < 0:  # NaN, or negative
        raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
    return None if value > threading.TIMEOUT_MAX else float(value)


def _finite(x: int | float) -> bool:
    """Whether ``x`` is finite as a float (an int too large for one is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def check_key(key: Any, name: str = "key") -> str:
    """``key`` if it is a page key (64 lowercase hex digits, ``.s`` for a state record:
    :mod:`hicache.storage.keys`); ``TypeError`` / ``ValueError`` naming ``name`` otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str page key (64 hex digits), got {type(key).__name__}")
    if _KEY.fullmatch(key) is None:
        shown = key if len(key) <= 80 else key[:80] + "..."
        raise ValueError(f"{name} must be a page key: 64 lowercase hex digits, '.s' after them for "
                         f"a state record (hicache.storage.keys), got {shown!r}")
    return key


def _check_keys(keys: Sequence[str], name: str) -> list[str]:
    if isinstance(keys, str):
        raise TypeError(f"{name} must be a sequence of page keys, not one str")
    out = list(keys)
    for i, k in enumerate(out):
        check_key(k, f"{name}[{i}]")
    return out


def _split_key(key: str) -> tuple[int, bytes]:
    if key.endswith(STATE_SUFFIX):
        return KIND_STATE, bytes.fromhex(key[: -len(STATE_SUFFIX)])
    return KIND_KV, bytes.fromhex(key)


_CLOSE_QUEUE: queue.SimpleQueue[Any] = queue.SimpleQueue()
_closer_lock = threading.Lock()
_closer: threading.Thread | None = None


def _close_loop() -> None:
    while True:
        client = _CLOSE_QUEUE.get()
        try:
            client.close()
        except Exception as exc:  # its backend is gone: nothing left to count it in
            log.warning("L3: closing a dropped client failed (%s)", type(exc).__name__)
        del client


def _start_closer() -> None:
    global _closer
    with _closer_lock:
        if _closer is None:
            _closer = threading.Thread(target=_close_loop, name="hicache-l3-close", daemon=True)
            _closer.start()


def _close_held(held: list[Any]) -> None:
    """A backend was dropped unclosed (its finalizer, maybe in a GC pass on an engine thread):
    its clients go to the closer thread; nothing here waits."""
    while held:
        _CLOSE_QUEUE.put(held.pop())


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__


class StorageBackend(ABC):
    """Base of every L3 backend (see the module docstring for the contract).

    Args:
        tag: the layout tag of the pages this client reads and writes (a record carrying
            another tag is refused as corrupt).
        cooldown_s: seconds to answer misses without calling the backend after a fault.
        secret: the deployment secret (bytes, at least 16): every record written carries an
            HMAC-SHA256 under it, and only records whose MAC checks are served
            (:mod:`hicache.storage.page`). ``None``: checksummed records. Kept only inside the
            MAC state, never in ``repr``, logs or stats.
    """

    name = "abstract"

    def __init__(self, tag: str = "", cooldown_s: float = 1.0, secret: bytes | None = None) -> None:
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a str (hicache.storage.keys.layout_tag), got {type(tag).__name__}")
        self.tag = tag
        self._tag_digest = tag_digest(tag)
        self.cooldown_s = check_seconds(cooldown_s, "cooldown_s", zero_ok=True)
        self._mac: Any = None if secret is None else mac_state(secret)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(COUNTERS, 0)
        self._logged = 0
        #: Record size [bytes] of each kind this client reads, when known (``expect_sections``).
        self.record_bytes: dict[int, int] = {}
        self._held: list[Any] = []
        weakref.finalize(self, _close_held, self._held).atexit = False

    def _hold(self, client: Any) -> Any:
        """Register ``client`` (an open network client, with ``close()``) and return it: if
        this backend is dropped without :meth:`close`, the client is closed on a closer thread,
        never by a finalizer on whichever thread a GC pass runs on (an engine thread inside a
        best-effort call: a client's close can wait on locks its I/O holds). The client stays
        referenced until then, so its own ``__del__`` cannot run first."""
        _start_closer()
        self._held.append(client)
        return client

    def _unhold(self, client: Any) -> None:
        """``client`` is being closed by its backend (:meth:`close`): no longer held."""
        for i, c in enumerate(self._held):
            if c is client:
                del self._held[i]
                return

    @property
    def authenticated(self) -> bool:
        """Whether records carry and must carry a MAC under a deployment secret."""
        return self._mac is not None

    # ------------------------------------------------------------ raw calls
    @abstractmethod
    def _exists_raw(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key (may stop early after the first absent one: the rest False)."""

    @abstractmethod
    def _get_raw(self, keys: Sequence[str]) -> Sequence[Record | None]:
        """The stored record of each key, or ``None``."""

    @abstractmethod
    def _set_nx_raw(self, items: Sequence[tuple[str, bytes]]) -> Sequence[WriteResult]:
        """Store each record unless its key exists; for each: written (``True``), already
        present (``False``), refused for want of space (``None``) or not stored because of a
        fault about that record, counted by the backend (:data:`WRITE_FAILED`)."""

    @abstractmethod
    def _delete_raw(self, key: str, record: bytes) -> None:
        """Remove ``key`` if it still holds ``record`` (a corrupt record seen by ``get``)."""

    def check_server(self) -> None:
        """Ask the store one presence question directly (no fault handling, no cooldown):
        SGLang's ``check_server`` extra-config key, at build time.

        Raises:
            ConnectionError: the store did not answer (the cause chained).
        """
        try:
            self._exists_raw(["0" * 64])
        except Exception as exc:
            raise ConnectionError(f"check_server: the {self.name} storage backend did not answer "
                                  f"({type(exc).__name__}: {self.redact(str(exc))})") from exc

    def close(self) -> None:
        """Release connections / handles (the backend may be used again: it reopens). The
        default holds none."""
        return None

    def expect_sections(self, kv: tuple[int, int], state: tuple[int, int]) -> None:
        """Tell the backend the section sizes [bytes] of this client's KV pages and state
        records, so it can read a record into memory of the right size (a record of another
        size is refused as corrupt anyway)."""
        self.record_bytes = {KIND_KV: HEADER_SIZE + sum(kv), KIND_STATE: HEADER_SIZE + sum(state)}

    def _write_sections(self, items: Sequence[tuple[str, int, bytes, bytes, bytes]]
                        ) -> Sequence[WriteResult]:
        """Store ``(key, kind, page hash, a, b)`` records unless present (set-if-absent); for
        each: written (``True``), already present (``False``), refused for want of space
        (``None``, counted ``refused``) or kept out by a fault (:data:`WRITE_FAILED`, counted
        by the backend as an error or timeout). Default: :func:`encode` each, then ``_set_nx_raw``."""
        records = [(key, encode(kind, self._tag_digest, h, a, b, self._mac))
                   for key, kind, h, a, b in items]
        return self._set_nx_raw(records)

    # -------------------------------------------------------------- helpers
    def redact(self, text: str) -> str:
        """``text`` with any credential of this backend replaced (override with secrets)."""
        return text

    @property
    def stats(self) -> dict[str, int]:
        """A copy of the counters (:data:`COUNTERS`) and the backend's own figures."""
        with self._lock:
            out = dict(self._stats)
        out.update(self._extra_stats())
        return out

    def _extra_stats(self) -> dict[str, int]:
        return {}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _available(self) -> bool:
        if self._down_until and time.monotonic() < self._down_until:
            self._count("skipped_in_cooldown")
            return False
        return True

    def _fault(self, op: str, exc: BaseException, rest: bool = True) -> None:
        """Count and log a fault; ``rest``: the backend itself failed (a connection, a
        timeout), so it answers misses for ``cooldown_s``. A fault of one key (an error reply
        about it, one unreadable record) passes ``rest=False``: a miss for that key only."""
        kind = "timeouts" if _is_timeout(exc) else "errors"
        self._count(kind)
        if rest:
            self._down_until = time.monotonic() + self.cooldown_s if self.cooldown_s > 0 else 0.0
        self._logged += 1
        if self._logged <= 10 or self._logged % 1000 == 0:
            log.warning("L3 %s %s failed (%s: %s); treated as a miss",
                        self.name, op, type(exc).__name__, self.redact(str(exc)))

    # ------------------------------------------------------------- presence
    def exists_mask(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a record (unverified: ``get`` still checks it).

        Raises ``TypeError`` / ``ValueError`` naming ``keys[i]`` for a malformed key, before
        any call (:func:`check_key`)."""
        keys = _check_keys(keys, "keys")
        if not keys:
            return []
        self._count("exists_calls")
        if not self._available():
            return [False] * len(keys)
        try:
            return [bool(x) for x in self._exists_raw(keys)]
        except Exception as exc:
            self._fault("exists", exc)
            return [False] * len(keys)

    def exists(self, key: str) -> bool:
        return self.exists_mask([check_key(key)])[0]

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` exist consecutively from the start (0 on a fault)."""
        n = 0
        for present in self.exists_mask(keys):
            if not present:
                break
            n += 1
        return n

    # ---------------------------------------------------------------- reads
    def batch_get(self, keys: Sequence[str]) -> list[Page | None]:
        """Verified sections of each key's record; ``None`` for a miss, a corrupt record or a
        fault. Raises ``TypeError`` / ``ValueError`` naming ``keys[i]`` for a malformed key,
        before any call."""
        keys = _check_keys(keys, "keys")
        if not keys:
            return []
        self._count("get_calls")
        if not self._available():
            return [None] * len(keys)
        try:
            records = self._get_raw(keys)
        except Exception as exc:
            self._fault("get", exc)
            return [None] * len(keys)
        out: list[Page | None] = []
        for key, rec in zip(keys, records, strict=True):
            out.append(None if rec is None else self._verify(key, rec))
        hits = sum(p is not None for p in out)
        self._count("get_hits", hits)
        self._count("get_misses", len(out) - hits)
        return out

    def get(self, key: str) -> Page | None:
        return self.batch_get([check_key(key)])[0]

    def _verify(self, key: str, record: Record) -> Page | None:
        """The record's sections, or ``None``: a damaged record is counted ``corrupt`` and
        deleted (so it can be written again); a foreign one (``CorruptPage.foreign``: another
        deployment's secret, or a forgery) is counted ``unverified`` and left in place (a
        writer holding a valid record replaces it: :meth:`keep_verified`)."""
        try:
            kind, page_hash = _split_key(key)
            a, b = decode(record, kind, self._tag_digest, page_hash, self._mac)
        except (CorruptPage, ValueError) as exc:
            foreign = isinstance(exc, CorruptPage) and exc.foreign
            self._count("unverified" if foreign else "corrupt")
            log.warning("L3 %s: page %s… refused (%s); treated as a miss", self.name, key[:12],
                        exc)
            if not foreign:
                self._delete(key, record)
            return None
        self._count("bytes_read", len(record))
        return Page(a, b)

    def _delete(self, key: str, record: Record) -> None:
        try:
            self._delete_raw(key, bytes(record))
        except Exception as exc:  # the miss stands; the next writer may fail NX
            self._fault("delete", exc, rest=False)  # one record: no rest period

    def keep_verified(self, keys: Sequence[str]) -> list[bool]:
        """For a writer about to store its own records under ``keys``: whether each key holds
        a record this client accepts (keep it). A record it refuses (damaged, foreign,
        forged) is deleted, if it is still the same record, so the writer's record takes its
        place: a record nobody can check never blocks a valid one. ``False`` for absent keys
        and on a fault (then the writer's set-if-absent decides).

        Raises ``TypeError`` / ``ValueError`` naming ``keys[i]`` for a malformed key."""
        keys = _check_keys(keys, "keys")
        if not keys:
            return []
        self._count("get_calls")
        if not self._available():
            return [False] * len(keys)
        try:
            records = self._get_raw(keys)
        except Exception as exc:
            self._fault("get", exc)
            return [False] * len(keys)
        out = []
        for key, rec in zip(keys, records, strict=True):
            if rec is None:
                out.append(False)
                continue
            try:
                kind, page_hash = _split_key(key)
                decode(rec, kind, self._tag_digest, page_hash, self._mac)
                out.append(True)
            except CorruptPage as exc:
                self._count("unverified" if exc.foreign else "corrupt")
                self._delete(key, rec)
                out.append(False)
        return out

    # --------------------------------------------------------------- writes
    def batch_set(self, items: Sequence[tuple[str, bytes, bytes]]) -> int:
        """Write each ``(key, a, b)`` unless present; return how many this call wrote (a page
        the backend has no room for is counted ``refused``)."""
        items = _check_items(items)
        if not items:
            return 0
        self._count("set_calls")
        if not self._available():
            return 0
        prepared = [(key, *_split_key(key), a, b) for key, a, b in items]
        try:
            done = self._write_sections(prepared)
        except Exception as exc:
            self._fault("set", exc)
            return 0
        written = sum(d is True for d in done)
        self._count("written", written)
        self._count("already_present", sum(d is False for d in done))
        self._count("refused", sum(d is None for d in done))
        self._count("bytes_written", sum(HEADER_SIZE + len(a) + len(b)
                                         for (_, a, b), d in zip(items, done, strict=True)
                                         if d is True))
        return written

    def set(self, key: str, a: bytes, b: bytes) -> bool:
        return self.batch_set([(check_key(key), a, b)]) == 1


def _check_items(items: Sequence[tuple[str, bytes, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """``items`` as a list of ``(key, a, b)``: a page key and two bytes-like sections."""
    out = list(items)
    for i, it in enumerate(out):
        if not isinstance(it, tuple) or len(it) != 3:
            raise TypeError(f"items[{i}] must be a (key, a, b) tuple, got {type(it).__name__}")
        check_key(it[0], f"items[{i}] key")
        for part in it[1:]:
            if not isinstance(part, (bytes, bytearray, memoryview)):
                raise TypeError(f"items[{i}]: sections must be bytes, got {type(part).__name__}")
    return out
