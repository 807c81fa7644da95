"""Every L3 setting is checked when the config (or the backend) is built, with an error that
names the setting; misuse of a backend's public calls raises naming the argument; a fault that
concerns one key is a miss for that key only, never a rest period for the whole backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache import HiCacheConfig
from hicache.storage import FileStore, MooncakeOptions, RedisStore
from hicache.storage.page import HEADER_SIZE
from tests.storage.test_storage_common import Flaky, RedisServer, need_env

GOOD = "ab" * 32  # a page key: 64 hex digits


def redis_cfg(url: Any, **kw: Any) -> HiCacheConfig:
    return HiCacheConfig(hicache_storage_backend="redis", hicache_storage_url=url, **kw)


@pytest.mark.parametrize(
    "url,match",
    [
        ("redis://h:notaport", r"hicache_storage_url.*port"),
        ("redis://h:99999", r"hicache_storage_url.*port"),
        ("redis://h:0", r"hicache_storage_url.*port"),
        ("redis://h:1/abc", r"hicache_storage_url.*database"),
        ("redis://h:1/-1", r"hicache_storage_url.*database"),
        ("redis://h:1/0/1", r"hicache_storage_url.*database"),
        ("redis://h:1,,redis://g:2", r"hicache_storage_url.*empty"),
        ("redis://h:1/0,redis://g:2/3", r"hicache_storage_url.*database 0"),
        ("redis://h:1,rediss://g:2", r"hicache_storage_url.*scheme"),
        ("redis://h:1,redis://h:1", r"hicache_storage_url.*twice"),
        ("redis://:pw@h:notaport", r"hicache_storage_url.*port"),
    ],
)
def test_bad_redis_urls_are_refused_when_the_config_is_built(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        redis_cfg(url)
    assert "pw" not in str(info.value)


def test_good_redis_urls_are_accepted() -> None:
    for url in ("redis://h", "redis://h:6379", "redis://u:p@h:1/15", "rediss://h:1/0?ssl_cert_reqs=none",
                "redis://h:1,redis://g:2", "redis://[::1]:7000"):
        redis_cfg(url)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"hicache_storage_timeout_s": -1}, ValueError, "hicache_storage_timeout_s"),
        ({"hicache_storage_timeout_s": float("nan")}, ValueError, "hicache_storage_timeout_s"),
        ({"hicache_storage_timeout_s": "1"}, ValueError, "hicache_storage_timeout_s"),
        ({"hicache_prefetch_timeout_s": float("inf")}, ValueError, "hicache_prefetch_timeout_s"),
        ({"hicache_storage_url": ["redis://h:1"]}, TypeError, "hicache_storage_url"),
        ({"hicache_storage_model": None}, TypeError, "hicache_storage_model"),
    ],
)
def test_bad_numbers_and_types_are_refused(kwargs: dict[str, Any], err: type, match: str) -> None:
    kwargs.setdefault("hicache_storage_url", "redis://h:1")
    with pytest.raises(err, match=match):
        HiCacheConfig(hicache_storage_backend="redis", **kwargs)


# --------------------------------------------------------------------- backends
@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"urls": ["redis://h:1", 5]}, TypeError, r"urls\[1\]"),
        ({"urls": 5}, TypeError, "urls"),
        ({"urls": "redis://h:1", "timeout_s": -1}, ValueError, "timeout_s"),
        ({"urls": "redis://h:1", "timeout_s": float("nan")}, ValueError, "timeout_s"),
        ({"urls": "redis://h:1", "prefix": None}, TypeError, "prefix"),
        ({"urls": "redis://h:1", "prefix": ""}, ValueError, "prefix"),
        ({"urls": "redis://h:1", "cooldown_s": -1}, ValueError, "cooldown_s"),
        ({"urls": "redis://h:1", "tag": 3}, TypeError, "tag"),
        ({"urls": "redis://h:99999"}, ValueError, "port"),
    ],
)
def test_redis_store_arguments(kwargs: dict[str, Any], err: type, match: str) -> None:
    pytest.importorskip("redis", reason="redis-py is the storage extra")
    with pytest.raises(err, match=match):
        RedisStore(**kwargs)


def test_file_store_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="root"):
        FileStore(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cooldown_s"):
        FileStore(tmp_path, cooldown_s=float("inf"))


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"master_server_address": "h:0"}, "master_server_address"),
        ({"master_server_address": "h:65536"}, "master_server_address"),
        ({"master_server_address": "h:1", "metadata_server": "h:99999"}, "metadata_server"),
        ({"master_server_address": "h:1", "metadata_server": "http://h:notaport/metadata"},
         "metadata_server"),
        ({"master_server_address": "h:1", "key_prefix": ""}, "key_prefix"),
        ({"master_server_address": "h:1", "zero_copy_min_bytes": -1}, "zero_copy_min_bytes"),
    ],
)
def test_mooncake_options_are_checked(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MooncakeOptions.resolve(None, extra, environ={})
    with pytest.raises(ValueError, match=match):
        HiCacheConfig(hicache_storage_backend="mooncake",
                      hicache_storage_backend_extra_config=json.dumps(extra))


def test_mooncake_url_port_is_checked() -> None:
    with pytest.raises(ValueError, match="hicache_storage_url"):
        HiCacheConfig(hicache_storage_backend="mooncake", hicache_storage_url="mooncake://h:0")


MOONCAKE_EXTRA = json.dumps({"metadata_server": "P2PHANDSHAKE", "global_segment_size": 1 << 24,
                             "local_hostname": "127.0.0.1"})


@pytest.mark.parametrize("url", ["mooncake://[::1", "mooncake://[::1]:50051", "mooncake://u:pw@h:1",
                                 "mooncake://h:1?x=1", "mooncake://h:1#frag"])
def test_a_mooncake_url_that_is_not_host_port_is_refused_naming_the_setting(url: str) -> None:
    # actual: urllib's bare 'Invalid IPv6 URL'; an IPv6 master blamed on
    # master_server_address; credentials, a query or a fragment silently dropped
    with pytest.raises(ValueError, match="hicache_storage_url for mooncake") as info:
        HiCacheConfig(hicache_storage_backend="mooncake", hicache_storage_url=url,
                      hicache_storage_backend_extra_config=MOONCAKE_EXTRA)
    assert "pw" not in str(info.value)
    HiCacheConfig(hicache_storage_backend="mooncake", hicache_storage_url="mooncake://h:1",
                  hicache_storage_backend_extra_config=MOONCAKE_EXTRA)


# --------------------------------------------------------------- keys named
@pytest.mark.parametrize("bad,err", [("zz" * 32, ValueError), ("ab", ValueError),
                                     ("../" + GOOD, ValueError), (GOOD + ".x", ValueError),
                                     (GOOD.upper(), ValueError), (5, TypeError)])
def test_a_malformed_key_is_refused_naming_it(tmp_path: Path, bad: Any, err: type) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(err, match=r"\bkey\b"):
        store.get(bad)
    with pytest.raises(err, match=r"\bkey\b"):
        store.set(bad, b"a", b"b")
    with pytest.raises(err, match=r"\bkey\b"):
        store.exists(bad)
    with pytest.raises(err, match=r"keys\[1\]"):
        store.batch_get([GOOD, bad])
    with pytest.raises(err, match=r"items\[1\]"):
        store.batch_set([(GOOD, b"a", b"b"), (bad, b"a", b"b")])
    assert store.stats["get_calls"] == 0 and store.stats["set_calls"] == 0  # refused first
    assert not store.exists(GOOD)  # nothing was written by the refused batch
    assert store.exists(GOOD + ".s") is False  # a state key is a key


# ----------------------------------------------------- per-key faults, no poison
def test_one_unreadable_page_is_a_miss_for_that_key_only(tmp_path: Path) -> None:
    store = FileStore(tmp_path, cooldown_s=60.0)
    other = "cd" * 32
    assert store.set(other, b"a", b"b")
    bad = tmp_path / GOOD[:2] / GOOD
    bad.mkdir(parents=True)  # reading it fails (a directory) for this key only
    pages = store.batch_get([GOOD, other])
    assert pages[0] is None and pages[1] is not None
    assert bytes(pages[1].a) == b"a"
    st = store.stats
    assert st["errors"] == 1 and st["skipped_in_cooldown"] == 0
    assert store.get(other) is not None  # no rest period: the next call is served
    assert store.stats["skipped_in_cooldown"] == 0


def test_a_refused_record_whose_delete_fails_does_not_rest_the_backend(tmp_path: Path) -> None:
    inner = FileStore(tmp_path)
    other = "cd" * 32
    assert inner.set(GOOD, b"a", b"b") and inner.set(other, b"a", b"b")
    path = tmp_path / GOOD[:2] / GOOD
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE] ^= 1  # a flipped body bit: refused on read
    path.write_bytes(bytes(raw))
    store = Flaky(inner, fail=[2])  # raw call 1 reads, call 2 deletes the refused record: fails
    store.cooldown_s = 60.0
    assert store.get(GOOD) is None
    assert store.stats["corrupt"] == 1 and store.stats["errors"] == 1
    assert store.get(other) is not None and store.stats["skipped_in_cooldown"] == 0


def test_a_per_key_error_reply_from_redis_is_a_miss_for_that_key_only(tmp_path: Path) -> None:
    """An ACL user may touch only keys ``hpc:0*`` .. ``hpc:7*``: the server answers NOPERM for
    the others, key by key, while the connection is fine. Those keys are misses; the backend
    keeps serving the allowed ones at once (no rest period)."""
    pytest.importorskip("redis", reason="redis-py is the storage extra")
    need_env("HPC_REDIS_URL")  # the servers of .ci/redis-up are there (and redis-server)
    server = RedisServer(str(tmp_path))
    try:
        import redis

        admin = redis.Redis(port=server.port)
        admin.execute_command("ACL", "SETUSER", "eng", "on", ">engine-pw", "resetkeys",
                              "~hpc:[0-7]*", "+@all")
        store = RedisStore(f"redis://eng:engine-pw@127.0.0.1:{server.port}/0", cooldown_s=60.0)
        allowed, denied = "0a" * 32, "fa" * 32
        assert store.set(allowed, b"a", b"b")
        assert store.exists_mask([allowed, denied]) == [True, False]
        assert store.stats["errors"] >= 1 and store.stats["skipped_in_cooldown"] == 0
        assert store.get(allowed) is not None
        assert store.batch_set([(denied, b"a", b"b")]) == 0
        assert store.get(allowed) is not None and store.stats["skipped_in_cooldown"] == 0
        store.close()
    finally:
        server.kill()


# ------------------------------------------------------------ issue 36: settings that never work
@pytest.mark.parametrize(
    "url,match",
    [
        ("redis://h :1", r"hicache_storage_url: a Redis URL has no spaces or control characters"),
        ("redis://u:p w@h:1", r"no spaces .* got 'redis://\*\*\*:\*\*\*@h:1'"),
        ("redis://h:1/0\x00", r"no spaces or control characters"),
        ("redis://h:1/0?sockettimeout=1", r"unknown Redis URL query argument\(s\) \['sockettimeout'\]"),
        ("rediss://h:1/0?ssl_ca_cert=/x", r"unknown Redis URL query argument\(s\) \['ssl_ca_cert'\]"),
        ("redis://h:1/0?socket_timeout=soon", r"Invalid value for 'socket_timeout'"),
    ],
)
def test_redis_urls_that_could_never_connect_are_refused_when_the_config_is_built(
        url: str, match: str) -> None:
    """Before: accepted; the space failed at the first connect, an unknown query argument
    reached the connection class as a keyword (``TypeError`` in the writer thread)."""
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match=match) as info:
        redis_cfg(url)
    assert "p w" not in str(info.value)
    redis_cfg("rediss://h:1/0?ssl_ca_certs=/x&ssl_cert_reqs=required&socket_timeout=2")


def file_cfg(where: Any) -> HiCacheConfig:
    return HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=where)


def test_a_file_store_directory_that_could_never_work_is_refused_when_the_config_is_built(
        tmp_path: Path) -> None:
    """A file, a path under a file, a NUL, a name past the filesystem's limit. Before: accepted
    (the NUL and the file failed when the cache was built, the long name at the first write,
    counted as a fault)."""
    f = tmp_path / "f"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^hicache_storage_dir must be a directory, got .*f': "
                                         r"an existing file$"):
        file_cfg(str(f))
    with pytest.raises(ValueError, match=r"hicache_storage_dir must be a directory \(its parent "
                                         r".*f' is not one\)"):
        file_cfg(str(f / "sub"))
    with pytest.raises(ValueError, match=r"hicache_storage_dir must not contain a NUL"):
        file_cfg(str(tmp_path / "a\0b"))
    with pytest.raises(ValueError, match=r"hicache_storage_dir is too long for this filesystem "
                                         r"\(at most \d+ bytes, 255 per name\)"):
        file_cfg(str(tmp_path / ("x" * 256)))
    file_cfg(str(tmp_path / "new" / "dir"))  # made when the store is built


def test_an_unwritable_file_store_directory_is_refused(tmp_path: Path) -> None:
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this process may write anywhere (root): no unwritable directory here")
        with pytest.raises(ValueError, match=r"hicache_storage_dir=.*ro/x': its parent .*ro', "
                                             r"where it would be made, is not writable"):
            file_cfg(str(ro / "x"))
    finally:
        ro.chmod(0o700)


def test_rdma_without_a_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"protocol='rdma' needs device_name \(MOONCAKE_DEVICE"):
        MooncakeOptions.resolve(None, {"master_server_address": "h:1", "protocol": "rdma"},
                                environ={})
    o = MooncakeOptions.resolve(None, {"master_server_address": "h:1", "protocol": "rdma",
                                       "device_name": "mlx5_0"}, environ={})
    assert (o.protocol, o.device_name) == ("rdma", "mlx5_0")


def test_swallowed_errors_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page read whose recency touch fails is served and counted ``touch_errors``; a Redis
    client whose close fails is counted ``close_errors`` (both were logged or dropped only)."""
    import os

    s = FileStore(tmp_path, tag="t")
    assert s.set(GOOD, b"a", b"b")

    def no_utime(*_: Any, **__: Any) -> None:
        raise PermissionError("read-only mount")

    monkeypatch.setattr(os, "utime", no_utime)
    assert s.get(GOOD) is not None
    assert s.stats["touch_errors"] == 1
    pytest.importorskip("redis")
    r = RedisStore("redis://127.0.0.1:1", tag="t")

    class Broken:
        def close(self) -> None:
            raise ConnectionError("gone")

    r._client_obj = Broken()
    r.close()
    assert r.stats["close_errors"] == 1


def test_a_size_cap_below_one_page_record_is_refused_when_the_cache_is_built(
        tmp_path: Path) -> None:
    """``hicache_storage_max_bytes`` below one KV page's record (only known once the pools
    are): the startup probe refuses it. Before: accepted, then every page refused at the write
    and counted ``already_present``."""
    from tests.storage.test_storage_common import make

    record = HEADER_SIZE + 2 * 2 * 1 * 1 * 2 * 4  # K and V: 2 layers x 1 token x 1 head x 2 dims, f32
    with pytest.raises(ValueError, match=rf"^hicache_storage_max_bytes={record - 1} is smaller "
                                         rf"than one KV page record \({record} bytes"):
        make("file", where=str(tmp_path / "a"), max_bytes=record - 1)
    ok = make("file", where=str(tmp_path / "b"), max_bytes=record)
    ok.close()


@pytest.mark.parametrize("url", ["redis://[::1", "redis://u:pw@[::1:7000", "redis://h:1,redis://[fe80::1"])
def test_a_malformed_host_is_refused_naming_the_setting_and_masking_the_password(url: str) -> None:
    with pytest.raises(ValueError, match="hicache_storage_url") as info:
        redis_cfg(url)
    assert "pw" not in str(info.value)


@pytest.mark.parametrize("query", ["socket_timeout=-1", "socket_timeout=nan", "socket_timeout=inf",
                                   "socket_connect_timeout=0", "timeout=-2",
                                   "socket_timeout=1e300"])
def test_a_url_timeout_no_socket_takes_is_refused_naming_the_setting(query: str) -> None:
    # redis-py parses these as floats and only the first connect fails (every call a fault)
    with pytest.raises(ValueError, match=r"hicache_storage_url.*timeout"):
        redis_cfg(f"redis://h:1/0?{query}")
    redis_cfg("redis://h:1/0?socket_timeout=2.5&socket_connect_timeout=1")  # still fine


@pytest.mark.parametrize("kwargs,name", [
    ({"hicache_storage_timeout_s": 1e300}, "hicache_storage_timeout_s"),
    ({"hicache_prefetch_timeout_s": 1e10}, "hicache_prefetch_timeout_s"),
    ({"hicache_storage_backend": "file", "hicache_storage_dir": "/tmp",
      "hicache_storage_backend_extra_config": json.dumps({"prefetch_timeout_base": 1e300})},
     "prefetch_timeout_base"),
])
def test_a_timeout_longer_than_a_wait_can_take_is_refused(kwargs: dict[str, Any], name: str) -> None:
    # threading waits refuse anything past threading.TIMEOUT_MAX (~292 years): accepted,
    # every prefetch wait would raise and be counted as an L3 fault
    with pytest.raises(ValueError, match=name):
        HiCacheConfig(**kwargs)


def test_the_timeout_wait_of_a_long_prompt_is_at_most_the_longest_wait() -> None:
    import threading

    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir="/tmp",
                        hicache_storage_backend_extra_config=json.dumps(
                            {"prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token": 1e6}))
    assert cfg.prefetch_wait_s(1024) == 1 + 1e6
    # 2**40 tokens x 1e6 s per 1024: past TIMEOUT_MAX, which an Event.wait would refuse
    assert cfg.prefetch_wait_s(2**40) == threading.TIMEOUT_MAX


@pytest.mark.parametrize("bad,err", [(True, TypeError), ("1", TypeError), ([1], TypeError),
                                     (-1, ValueError), (float("nan"), ValueError)])
def test_flush_storage_refuses_a_timeout_that_is_not_seconds(tmp_path: Path, bad: Any,
                                                             err: type) -> None:
    from tests.storage.test_storage_common import make

    h = make("file", where=str(tmp_path))
    try:
        with pytest.raises(err, match="timeout_s"):
            h.cache.flush_storage(bad)
    finally:
        h.close()


def test_flush_storage_without_a_bound_waits_for_what_is_in_flight(tmp_path: Path) -> None:
    # inf (and a bound past what a wait can take) means "until done", as None does; before,
    # such a flush with a prefetch still running raised OverflowError from the wait
    import threading

    from tests.storage.test_storage_common import make, wrap_flaky

    h = make("file", where=str(tmp_path), prefetch="best_effort")
    try:
        flaky = wrap_flaky(h)
        for i, timeout in enumerate((float("inf"), 1e300)):
            flaky.gate.clear()  # the prefetch's lookup waits on the gate
            h.cache.match_prefix([100 * (i + 1) + t for t in range(4)])
            threading.Timer(0.2, flaky.gate.set).start()
            assert h.cache.flush_storage(timeout) is True
        assert h.cache.stats()["l3_prefetch_started"] == 2
    finally:
        h.close()
