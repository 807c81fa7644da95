"""The embedded file store: atomic write-once files, least-recently-used size cap."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from hicache.storage import FileStore
from hicache.storage.page import HEADER_SIZE, KIND_KV, encode, tag_digest


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def rec_size(body: int) -> int:
    return HEADER_SIZE + body


def files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_pages_are_files_named_by_key(tmp_path: Path) -> None:
    s = FileStore(tmp_path, tag="t")
    k = key("a")
    assert s.set(k, b"K", b"V")
    assert (tmp_path / k[:2] / k).is_file() and files(tmp_path) == [k]
    assert (tmp_path / k[:2] / k).stat().st_size == rec_size(2) == s.total_bytes


def test_a_crash_between_temp_write_and_link_leaves_no_page(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    s = FileStore(tmp_path, tag="t")
    k = key("crash")

    def crash(src: str, dst: str) -> None:
        assert Path(src).read_bytes()  # the whole record was in the temp file
        raise OSError(errno.EIO, "simulated crash before the link")

    monkeypatch.setattr(os, "link", crash)
    assert s.set(k, b"K" * 10, b"V") is False
    assert s.stats["errors"] == 1
    monkeypatch.undo()
    s.cooldown_s = 0
    s._down_until = 0.0
    assert not s.exists(k) and s.get(k) is None and files(tmp_path) == []
    # A writer killed after its temp write leaves only a temp file: never a page, and the
    # next store to open the directory removes it (its pid is gone).
    sub = tmp_path / k[:2]
    sub.mkdir(exist_ok=True)
    orphan = sub / f".tmp.999999999.0.{k}"
    orphan.write_bytes(encode(KIND_KV, tag_digest("t"), bytes.fromhex(k), b"K", b"V"))
    assert not s.exists(k) and s.get(k) is None
    s2 = FileStore(tmp_path, tag="t")
    assert not orphan.exists() and s2.batch_exists([k]) == 0
    # A torn final file (a crash of a filesystem without atomic rename) fails its checks.
    full = encode(KIND_KV, tag_digest("t"), bytes.fromhex(k), b"K" * 100, b"V")
    (sub / k).write_bytes(full[:-30])
    assert s2.get(k) is None and s2.stats["corrupt"] == 1 and not (sub / k).exists()
    assert s2.set(k, b"K" * 100, b"V") and bytes(s2.get(k).a) == b"K" * 100  # type: ignore[union-attr]


def test_a_concurrent_writer_of_the_same_key_wins_once(tmp_path: Path) -> None:
    a, b = FileStore(tmp_path, tag="t"), FileStore(tmp_path, tag="t")
    k = key("race")
    assert a.set(k, b"from a", b"")
    assert b.set(k, b"from b", b"") is False  # the final name exists: the link fails
    assert bytes(b.get(k).a) == b"from a"  # type: ignore[union-attr]
    assert [p.name for p in (tmp_path / k[:2]).iterdir()] == [k]  # no temp left behind


def test_size_cap_evicts_least_recently_used_pages_exactly(tmp_path: Path) -> None:
    body = 100
    cap = 3 * rec_size(body)
    s = FileStore(tmp_path, max_bytes=cap, tag="t")
    a, b, c, d, e = (key(x) for x in "abcde")
    for k in (a, b, c):
        assert s.set(k, b"x" * body, b"")
    assert s.keys_lru() == [a, b, c] and s.total_bytes == cap
    assert s.get(a) is not None  # a is the most recently used now
    assert s.keys_lru() == [b, c, a]
    assert s.set(d, b"x" * body, b"")  # evicts b, the least recently used
    assert s.keys_lru() == [c, a, d] and not s.exists(b) and s.evicted == 1
    assert s.exists(c)  # exists does not count as a use
    assert s.set(e, b"x" * (body - 40), b"")  # smaller: one victim (c) is enough
    assert s.keys_lru() == [a, d, e] and s.evicted == 2
    assert sorted(files(tmp_path)) == sorted([a, d, e])
    assert s.total_bytes == sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= cap
    assert s.set(key("huge"), b"x" * cap, b"") is False  # larger than the cap: not stored
    # (counted refused: before, as already_present, a page that could never be stored)
    assert s.keys_lru() == [a, d, e]
    assert (s.stats["refused"], s.stats["already_present"]) == (1, 0)
    st = s.stats
    assert (st["evicted"], st["stored_pages"], st["stored_bytes"]) == (2, 3, s.total_bytes)


def test_reopening_orders_pages_by_modification_time(tmp_path: Path) -> None:
    s = FileStore(tmp_path, tag="t")
    ks = [key(str(i)) for i in range(3)]
    for i, k in enumerate(ks):
        s.set(k, b"x", b"")
        os.utime(s._path(k), ns=(10**18 + i, 10**18 + (2 - i)))  # mtime: newest first
    s2 = FileStore(tmp_path, max_bytes=3 * rec_size(1), tag="t")
    assert s2.keys_lru() == ks[::-1]
    s2.set(key("new"), b"x", b"")
    assert not s2.exists(ks[2]) and s2.exists(ks[0])


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        FileStore(tmp_path, max_bytes=0)
    s = FileStore(tmp_path)
    with pytest.raises(ValueError, match="key"):  # misuse, refused before any file is touched
        s.get("../etc")
    assert s.stats["errors"] == 0 and s.stats["get_calls"] == 0
