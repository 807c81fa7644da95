"""The embedded L3 backend: one file per page in a local directory.

Layout: ``<root>/<key[:2]>/<key>`` (a state record's key ends in ``.s``). A write goes to a
temporary file ``<root>/<key[:2]>/.tmp.<pid>.<n>.<key>`` in the same directory and is then
hard-linked to its final name, which fails if the name exists (set-if-absent, atomic: a reader
sees the whole record or nothing), and the temporary name is removed. A writer that dies
between the two steps leaves only a temporary file: never a page (and a torn final file would
still fail its checksum). Temporary files of processes that are gone are removed on open.

Size cap (``max_bytes``): before a write, the least recently used pages (by this process's
reads and writes; on open, by modification time) are deleted until the new record fits. A
record larger than the cap is not stored. Several processes may share a directory; each
enforces the cap over the files it knows of.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from hicache.storage.base import StorageBackend
from hicache.storage.page import HEADER_SIZE, KIND_KV

TMP_PREFIX = ".tmp."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True


class FileStore(StorageBackend):
    """Pages as files under ``root`` (created if missing).

    Args:
        root: the directory.
        max_bytes: size cap over the records' bytes (``None``: no cap).
        tag / cooldown_s / secret: see :class:`StorageBackend`.

    Raises:
        ValueError: ``max_bytes`` not a positive int; ``OSError`` when ``root`` cannot be made.
    """

    name = "file"

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = None, tag: str = "",
                 cooldown_s: float = 1.0, secret: bytes | None = None) -> None:
        super().__init__(tag, cooldown_s, secret)
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a directory path (str or os.PathLike), got {type(root).__name__}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recent first
        self._total = 0
        self._io = threading.RLock()
        self._tmp_seq = itertools.count()
        self.evicted = 0
        self._scan()

    def expect_sections(self, kv: tuple[int, int], state: tuple[int, int]) -> None:
        """As :meth:`StorageBackend.expect_sections`; the startup probe of ``max_bytes``,
        which only now meets the record size.

        Raises:
            ValueError: ``max_bytes`` (``hicache_storage_max_bytes``) below one KV page's
                record: no page could ever be stored.
        """
        super().expect_sections(kv, state)
        need = self.record_bytes[KIND_KV]
        if self.max_bytes is not None and self.max_bytes < need:
            raise ValueError(
                f"hicache_storage_max_bytes={self.max_bytes} is smaller than one KV page record "
                f"({need} bytes: {HEADER_SIZE} of header and {sum(kv)} of K and V): no page "
                "could ever be stored")

    def __repr__(self) -> str:
        return (f"FileStore(root={str(self.root)!r}, max_bytes={self.max_bytes}, "
                f"pages={len(self._index)}, bytes={self._total})")

    # ----------------------------------------------------------------- index
    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad page key {key!r}")
        return self.root / key[:2] / key

    def _scan(self) -> None:
        """Index the pages on disk, oldest first; drop orphaned temporary files."""
        found = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                name = f.name
                if name.startswith(TMP_PREFIX):
                    parts = name.split(".")
                    pid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1
                    if pid != os.getpid() and not _pid_alive(pid):
                        f.unlink(missing_ok=True)
                    continue
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._total += size

    def _note(self, key: str, size: int) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._total -= old
        self._index[key] = size
        self._total += size

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._total -= size

    @property
    def total_bytes(self) -> int:
        """Bytes of the records this process knows of."""
        return self._total

    def keys_lru(self) -> list[str]:
        """Known keys, least recently used first (the eviction order)."""
        with self._io:
            return list(self._index)

    # ------------------------------------------------------------- raw calls
    def _exists_raw(self, keys: Sequence[str]) -> list[bool]:
        out = []
        with self._io:
            for key in keys:
                if key in self._index:
                    out.append(True)
                    continue
                try:
                    size = self._path(key).stat().st_size
                except FileNotFoundError:
                    out.append(False)
                    continue
                except OSError as exc:  # this key only (permissions, a bad entry)
                    self._fault("exists", exc, rest=False)
                    out.append(False)
                    continue
                self._note(key, size)
                out.append(True)
        return out

    def _get_raw(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._io:
            for key in keys:
                path = self._path(key)
                try:
                    data = path.read_bytes()
                except FileNotFoundError:
                    self._forget(key)
                    out.append(None)
                    continue
                except OSError as exc:  # this key only (permissions, a directory in its place)
                    self._fault("get", exc, rest=False)
                    out.append(None)
                    continue
                self._note(key, len(data))  # most recently used now
                try:
                    os.utime(path)
                except OSError:  # (recency only: the page is served; counted)
                    self._count("touch_errors")
                out.append(data)
        return out

    def _set_nx_raw(self, items: Sequence[tuple[str, bytes]]) -> list[bool | None]:
        out: list[bool | None] = []
        with self._io:
            for key, record in items:
                out.append(self._write_one(key, record))
        return out

    def _write_one(self, key: str, record: bytes) -> bool | None:
        """Written (``True``), present (``False``), or ``None``: larger than ``max_bytes``
        (refused: it could never be stored, counted ``refused``, not ``already_present``)."""
        path = self._path(key)
        if key in self._index:
            return False
        if path.exists():
            self._note(key, path.stat().st_size)
            return False
        size = len(record)
        if self.max_bytes is not None:
            if size > self.max_bytes:
                return None
            self._make_room(size)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}.{next(self._tmp_seq)}.{key}"
        try:
            with open(tmp, "xb") as f:
                f.write(record)
            try:
                os.link(tmp, path)  # fails if the page exists: written once
            except FileExistsError:
                self._note(key, path.stat().st_size)
                return False
            except OSError as exc:  # no hard links on this filesystem: rename (last wins)
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._note(key, size)
        return True

    def _make_room(self, size: int) -> None:
        assert self.max_bytes is not None
        while self._index and self._total + size > self.max_bytes:
            victim, vsize = self._index.popitem(last=False)
            self._total -= vsize
            self._path(victim).unlink(missing_ok=True)
            self.evicted += 1

    def _delete_raw(self, key: str, record: bytes) -> None:
        with self._io:
            self._forget(key)
            self._path(key).unlink(missing_ok=True)

    def _extra_stats(self) -> dict[str, int]:
        return {"evicted": self.evicted, "stored_bytes": self._total, "stored_pages": len(self._index)}
