"""The storage interface on every backend: the file store, one Redis node, a Redis Cluster,
Mooncake Store (zero-copy and copying transfers).

Leading-run ``batch_exists``, write-once ``set``, verified reads: a corrupt, truncated,
misfiled or foreign-layout record is a miss (counted, deleted), never data.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache.storage import FileStore, MooncakeOptions, RedisStore, StorageBackend
from tests.helpers.mooncake_helpers import MOONCAKE_ENV, mooncake_extra, need_mooncake
from tests.storage.test_storage_common import CLUSTER_ENV, REDIS_ENV, fresh_model, need_env

Mutate = Callable[[bytes], bytes]


class Handle:
    """A backend plus raw access to what it stored (to damage it)."""

    def __init__(self, store: StorageBackend, raw_get: Callable[[str], bytes | None],
                 raw_put: Callable[[str, bytes], None]) -> None:
        self.store, self.raw_get, self.raw_put = store, raw_get, raw_put

    def damage(self, key: str, mutate: Mutate) -> None:
        rec = self.raw_get(key)
        assert rec is not None
        self.raw_put(key, mutate(rec))


def file_handle(tmp: Any, tag: str) -> Handle:
    store = FileStore(tmp, tag=tag)

    def put(key: str, rec: bytes) -> None:
        store._path(key).write_bytes(rec)

    def get(key: str) -> bytes | None:
        p = store._path(key)
        return p.read_bytes() if p.exists() else None

    return Handle(store, get, put)


def redis_handle(env: str, tag: str) -> Handle:
    import redis
    from redis.cluster import RedisCluster

    urls = need_env(env)
    store = RedisStore(urls, tag=tag, prefix=f"t-{tag}:")
    first = urls.split(",")[0]
    raw: Any = RedisCluster.from_url(first) if env == CLUSTER_ENV else redis.Redis.from_url(first)

    def put(key: str, rec: bytes) -> None:
        raw.set(store.prefix + key, rec)

    def get(key: str) -> bytes | None:
        return raw.get(store.prefix + key)

    return Handle(store, get, put)


def mooncake_handle(tag: str, zero_copy: bool) -> Handle:
    from hicache.storage.mooncake_store import MooncakeStore

    url, meta = need_mooncake()
    extra = mooncake_extra(meta, zero_copy=zero_copy, key_prefix=f"t-{tag}:")
    store = MooncakeStore(MooncakeOptions.resolve(url, extra), tag=tag)

    def put(key: str, rec: bytes) -> None:  # upsert: a Mooncake put never replaces a record
        assert store._client().upsert(store.prefix + key, rec) == 0

    def get(key: str) -> bytes | None:
        return store._client().get(store.prefix + key) or None

    return Handle(store, get, put)


BACKENDS = ["file", REDIS_ENV, CLUSTER_ENV, MOONCAKE_ENV, "mooncake-copying"]
IDS = ["file", "redis-single", "redis-cluster", "mooncake", "mooncake-copying"]


@pytest.fixture(params=BACKENDS, ids=IDS)
def h(request: Any, tmp_path: Any) -> Iterator[Handle]:
    tag = fresh_model()
    if request.param == "file":
        handle = file_handle(tmp_path, tag)
    elif request.param in (MOONCAKE_ENV, "mooncake-copying"):
        handle = mooncake_handle(tag, zero_copy=request.param == MOONCAKE_ENV)
        # What a controller tells it: the sizes of the records it reads (8 + 8 bytes here).
        handle.store.expect_sections((8, 8), (4, 4))
    else:
        handle = redis_handle(request.param, tag)
    yield handle
    handle.store.close()


def keys(n: int, salt: str = "") -> list[str]:
    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def test_batch_exists_counts_only_the_leading_run(h: Handle) -> None:
    s = h.store
    k = keys(6)
    assert s.batch_exists([]) == 0 and s.batch_exists(k) == 0
    assert s.batch_set([(k[i], b"a%d" % i, b"b") for i in (0, 1, 3, 4, 5)]) == 5
    assert s.batch_exists(k) == 2  # k[2] is missing: k[3:] do not count
    assert s.exists_mask(k) == [True, True, False, True, True, True]
    assert s.batch_exists(k[1:2] + k[3:]) == 4 and s.batch_exists(k[2:]) == 0
    assert s.set(k[2], b"a2", b"b")
    assert s.batch_exists(k) == 6
    assert [bytes(p.a) for p in s.batch_get(k)] == [b"a%d" % i for i in range(6)]  # type: ignore[union-attr]


def test_set_is_write_once(h: Handle) -> None:
    s = h.store
    (k,) = keys(1, "nx")
    assert s.set(k, b"first", b"1") is True
    assert s.set(k, b"second", b"2") is False
    assert s.batch_set([(k, b"third", b"3")]) == 0
    p = s.get(k)
    assert p is not None and (bytes(p.a), bytes(p.b)) == (b"first", b"1")
    st = s.stats
    assert (st["written"], st["already_present"]) == (1, 2)


def test_many_keys_across_hash_slots_round_trip(h: Handle) -> None:
    s = h.store
    k = keys(700, "many")  # more than one MGET chunk, every slot group of a cluster
    payload = {key: (os.urandom(33), os.urandom(7)) for key in k}
    assert s.batch_set([(key, a, b) for key, (a, b) in payload.items()]) == 700
    got = s.batch_get(k)
    assert all(p is not None and (bytes(p.a), bytes(p.b)) == payload[key]
               for key, p in zip(k, got, strict=True))
    assert s.batch_exists(k) == 700


@pytest.mark.parametrize("how", ["flip a body byte", "flip a header byte", "truncate", "header only",
                                 "append", "empty"])
def test_a_damaged_record_is_a_miss_and_is_removed(h: Handle, how: str) -> None:
    s = h.store
    if how == "empty" and s.name == "mooncake":
        pytest.skip("Mooncake Store refuses to store an empty object (put returns -600)")
    k = keys(3, "dmg" + how)
    assert s.batch_set([(key, b"K" * 64, b"V" * 64) for key in k]) == 3
    mutate: dict[str, Mutate] = {
        "flip a body byte": lambda r: r[:-5] + bytes([r[-5] ^ 1]) + r[-4:],
        "flip a header byte": lambda r: r[:60] + bytes([r[60] ^ 0x80]) + r[61:],
        "truncate": lambda r: r[: len(r) // 2],
        "header only": lambda r: r[:88],
        "append": lambda r: r + b"x",
        "empty": lambda r: b"",
    }
    h.damage(k[1], mutate[how])
    got = s.batch_get(k)
    assert got[0] is not None and got[2] is not None
    assert got[1] is None  # never the damaged bytes
    assert s.stats["corrupt"] == 1
    assert h.raw_get(k[1]) is None and s.batch_exists(k) == 1  # deleted: it can be written again
    assert s.set(k[1], b"K" * 64, b"V" * 64)
    p = s.get(k[1])
    assert p is not None and bytes(p.a) == b"K" * 64


def test_a_record_filed_under_another_key_or_layout_is_refused(h: Handle) -> None:
    s = h.store
    k = keys(2, "swap")
    s.batch_set([(k[0], b"zero", b""), (k[1], b"one", b"")])
    h.raw_put(k[1], h.raw_get(k[0]))  # type: ignore[arg-type]  # a valid record, wrong key
    assert s.get(k[1]) is None and s.get(k[0]) is not None
    assert s.stats["corrupt"] == 1
    (k2,) = keys(1, "state")
    s.set(k2 + ".s", b"conv", b"ssm")
    h.raw_put(k2, h.raw_get(k2 + ".s"))  # type: ignore[arg-type]  # a state record as a KV page
    assert s.get(k2) is None and s.get(k2 + ".s") is not None


def test_clients_of_another_layout_see_a_miss(h: Handle, tmp_path: Any) -> None:
    s = h.store
    (k,) = keys(1, "layout")
    s.set(k, b"K", b"V")
    other: StorageBackend
    if isinstance(s, FileStore):
        other = FileStore(s.root, tag="other")
    elif isinstance(s, RedisStore):
        other = RedisStore(s._urls, tag="other", prefix=s.prefix)
    else:
        from hicache.storage.mooncake_store import MooncakeStore

        assert isinstance(s, MooncakeStore)
        other = MooncakeStore(s.options, tag="other")
    assert other.get(k) is None and other.stats["corrupt"] == 1


@pytest.mark.parametrize("env", [REDIS_ENV, CLUSTER_ENV], ids=["redis-single", "redis-cluster"])
def test_a_redis_url_timeout_wins_over_timeout_s(env: str) -> None:
    """``?socket_timeout=7&socket_connect_timeout=3`` in the URL: the client's connections
    use 7 s / 3 s, not ``timeout_s``. Before: the URL's option and ``timeout_s`` went to
    redis-py as the same keyword twice (``TypeError`` on connect), so every call failed."""
    import redis

    urls = need_env(env).split(",")
    urls[0] += "?socket_timeout=7&socket_connect_timeout=3"
    s = RedisStore(",".join(urls), tag="t", timeout_s=0.5, prefix=f"t-{fresh_model()}:")
    try:
        (k,) = keys(1, "url-timeout")
        assert s.set(k, b"K", b"V")
        page = s.get(k)
        assert page is not None and (bytes(page.a), bytes(page.b)) == (b"K", b"V")
        assert s.stats["errors"] == 0
        client = s._client()
        if env == CLUSTER_ENV:
            pools = [n.redis_connection.connection_pool for n in client.get_nodes()]
            assert len(pools) == 3
        else:
            assert isinstance(client, redis.Redis)
            pools = [client.connection_pool]
        for pool in pools:
            kw = pool.connection_kwargs
            assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (7.0, 3.0)
    finally:
        s.close()
