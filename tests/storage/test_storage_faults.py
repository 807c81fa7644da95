"""Faults never reach the engine: errors, timeouts, dead servers and corrupt pages in L3 are
counted misses; ``match_prefix`` and ``insert`` never raise and never attach wrong bytes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache import HiCacheConfig
from hicache.storage import RedisStore, page_key
from tests.helpers.mooncake_helpers import MOONCAKE_ENV, need_mooncake
from tests.storage.test_storage_common import (
    CLUSTER_ENV,
    L3,
    REDIS_ENV,
    WAIT_S,
    RedisServer,
    assert_same_kv,
    assert_same_state,
    drop_everything,
    fresh_model,
    make,
    make_pair,
    need_env,
    put_random,
    redis_server,  # noqa: F401 - fixture
    wrap_flaky,
)


def key_of(n: int, base: int = 1000) -> list[int]:
    return [base + 3 * i for i in range(n)]


def scripted_requests(b: L3, key: list[int], gen: torch.Generator) -> int:
    """What an engine does with a prompt that continues in L3; returns the tokens served from
    L3 to device. Raises only if the cache does."""
    c = b.cache
    m = c.match_prefix(key)
    served = 0
    if m.host_hit_length:
        served = c.load_back(m.last_host_node)
    m = c.match_prefix(key)
    c.sanity_check()
    put_random(b, key_of(8, base=90000 + int(torch.randint(0, 10**6, (1,), generator=gen))), gen)
    assert c.flush_storage(WAIT_S)
    c.match_prefix(key_of(12, base=7))
    c.sanity_check()
    return served if m.prefix_len else 0


@pytest.mark.parametrize("states", [0, 4], ids=["kv", "hybrid"])
@pytest.mark.parametrize("kind", ["error", "timeout"])
def test_a_fault_on_any_storage_call_is_a_counted_miss(tmp_path: Any, caches: list[L3], states: int,
                                                       kind: str) -> None:
    model = fresh_model()
    gen = torch.Generator().manual_seed(1)
    a = make("file", where=str(tmp_path), page_size=2, states=states, model=model)
    caches.append(a)
    key = key_of(12)
    w = put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    clean = make("file", where=str(tmp_path), page_size=2, states=states, model=model)
    caches.append(clean)
    wrap_flaky(clean)
    scripted_requests(clean, key, gen)
    n_calls = clean.cache.storage.backend.calls  # type: ignore[union-attr]
    assert n_calls >= 4
    faults_seen = 0
    for k in range(1, n_calls + 1):
        b = make("file", where=str(tmp_path), page_size=2, states=states, model=model)
        caches.append(b)
        flaky = wrap_flaky(b, **({"fail": [k]} if kind == "error" else {"timeout": [k]}))
        served = scripted_requests(b, key, gen)  # never raises
        st = b.cache.stats()
        counted = st["l3_backend_errors"] if kind == "error" else st["l3_backend_timeouts"]
        assert counted == (1 if flaky.calls >= k else 0)
        faults_seen += counted
        if served:  # whatever was served is exact
            m = b.cache.match_prefix(key)
            assert_same_kv(b, m.device_indices, w, m.prefix_len)
            if states:
                assert_same_state(b, m.state_slot, w)  # type: ignore[arg-type]
    assert faults_seen == n_calls


def test_a_dead_backend_leaves_a_working_cache(tmp_path: Any, caches: list[L3]) -> None:
    gen = torch.Generator().manual_seed(2)
    b = make("file", where=str(tmp_path), page_size=1, states=4)
    caches.append(b)
    wrap_flaky(b, fail_from=1)
    for i in range(5):
        w = put_random(b, key_of(6, base=100 * i), gen)
        assert b.cache.flush_storage(WAIT_S)
        m = b.cache.match_prefix(key_of(6, base=100 * i) + [1])
        assert m.prefix_len == 6 and torch.equal(m.device_indices, w.slots)
    st = b.cache.stats()
    assert st["l3_backend_errors"] >= 5 and st["l3_backup_written"] == 0
    b.cache.sanity_check()


def test_errors_outside_the_backend_are_contained(tmp_path: Any, caches: list[L3],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = make_pair(caches, "file", where=str(tmp_path), page_size=2)
    key = key_of(8)
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    st_b = b.cache.storage
    assert st_b is not None

    def boom(*args: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(b.cache.kv, "unpack_pages", boom)
    free_host = b.cache.hicache.host_kv.available_size()  # type: ignore[union-attr]
    m = b.cache.match_prefix(key)  # the attach fails half-way: contained
    assert m.host_hit_length == 0 and b.cache.stats()["l3_faults"] == 1
    b.cache.sanity_check()
    assert b.cache.hicache.host_kv.available_size() == free_host  # type: ignore[union-attr]
    monkeypatch.setattr(b.cache.kv, "pack_pages", boom)
    put_random(b, key_of(4, base=5), gen)  # the backup fails: insert still succeeds
    assert b.cache.stats()["l3_faults"] == 2
    b.cache.sanity_check()


def damage_second_page(h: L3, key: list[int]) -> str:
    """Flip one byte of the stored record of ``key``'s second page; return its key."""
    c = h.cache
    node = c.match_prefix(key).last_device_node
    hashes = c._storage._node_hashes(node)  # type: ignore[union-attr]
    assert hashes is not None
    k = page_key(hashes[1])
    store = c.storage.backend  # type: ignore[union-attr]
    if hasattr(store, "_path"):
        p = store._path(k)
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(bytes(raw))
    elif store.name == "mooncake":
        client = store._client()
        raw = bytearray(client.get(store.prefix + k))
        raw[-1] ^= 0xFF
        assert client.upsert(store.prefix + k, bytes(raw)) == 0  # a put would not replace it
    else:
        client = store._client()
        raw = bytearray(client.get(store.prefix + k))
        raw[-1] ^= 0xFF
        client.set(store.prefix + k, bytes(raw))
    return k


@pytest.mark.parametrize("where", ["file", REDIS_ENV, CLUSTER_ENV, MOONCAKE_ENV, "mooncake-copying"],
                         ids=["file", "redis-single", "redis-cluster", "mooncake", "mooncake-copying"])
def test_a_corrupt_page_ends_the_prefetched_run(where: str, tmp_path: Any, caches: list[L3]) -> None:
    if where == "file":
        name, loc = "file", str(tmp_path)
    elif where in (MOONCAKE_ENV, "mooncake-copying"):
        name, loc = ("mooncake" if where == MOONCAKE_ENV else where), need_mooncake()[0]
    else:
        name, loc = "redis", need_env(where)
    gen = torch.Generator().manual_seed(4)
    a, b = make_pair(caches, name, where=loc, page_size=4)
    key = key_of(16)
    w = put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S)
    damage_second_page(a, key)
    m = b.cache.match_prefix(key)
    assert m.host_hit_length == 4  # the first page only: never the damaged one or past it
    st = b.cache.stats()
    assert st["l3_backend_corrupt"] == 1 and st["l3_prefetch_pages"] == 1
    assert b.cache.load_back(m.last_host_node) == 4
    m = b.cache.match_prefix(key)
    assert_same_kv(b, m.device_indices, w, 4)
    b.cache.sanity_check()


def test_redis_killed_mid_replay_and_restarted(redis_server: RedisServer,  # noqa: F811
                                               caches: list[L3]) -> None:
    gen = torch.Generator().manual_seed(5)
    model = fresh_model()
    a = make("redis", where=redis_server.url, page_size=2, model=model, size=64)
    caches.append(a)
    a.cache.storage.backend.cooldown_s = 0.05  # type: ignore[union-attr]
    keys = [key_of(8, base=1000 * i) for i in range(9)]
    for i, k in enumerate(keys):
        if i == 3:
            redis_server.kill()
        if i == 6:
            redis_server.start()  # empty again: persistence is off
            time.sleep(0.1)
        put_random(a, k, gen)  # never raises
        assert a.cache.flush_storage(WAIT_S)
        a.cache.evict(a.kv.size)
        a.cache.sanity_check()
    st = a.cache.stats()
    assert st["l3_backend_errors"] + st["l3_backend_timeouts"] >= 1  # then it rested
    missed = st["l3_backend_errors"] + st["l3_backend_timeouts"] + st["l3_backend_skipped_in_cooldown"]
    assert missed >= 3  # keys 3, 4, 5 could not be written
    b = make("redis", where=redis_server.url, page_size=2, model=model, size=64)
    caches.append(b)
    hits = [b.cache.match_prefix(k).host_hit_length for k in keys]
    assert hits == [0] * 6 + [8] * 3  # written after the restart: found again


@pytest.fixture
def secret_server(tmp_path: Any) -> Iterator[RedisServer]:
    server = RedisServer(str(tmp_path), "--requirepass", "hunter2-default-pw", "--user", "alice",
                         "on", ">alice-s3cret-pw", "~*", "&*", "+@all")
    yield server
    server.kill()


def test_credentials_never_in_repr_logs_or_stats(secret_server: RedisServer, caches: list[L3],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    secrets = ("alice-s3cret-pw", "hunter2-default-pw", "alice")
    port = secret_server.port
    good = f"redis://alice:alice-s3cret-pw@127.0.0.1:{port}/0"
    gen = torch.Generator().manual_seed(6)
    caplog.set_level(logging.DEBUG)
    a = make("redis", where=good, page_size=2)
    caches.append(a)
    put_random(a, key_of(4), gen)
    assert a.cache.flush_storage(WAIT_S)
    assert a.cache.stats()["l3_backup_written"] == 2  # authenticated as alice
    wrong = make("redis", where=f"redis://alice:hunter2-default-pw@127.0.0.1:{port}/0", page_size=2)
    caches.append(wrong)
    put_random(wrong, key_of(4), gen)
    assert wrong.cache.flush_storage(WAIT_S)
    assert wrong.cache.stats()["l3_backend_errors"] >= 1  # bad password: a counted miss
    secret_server.kill()
    a.cache.storage.backend._down_until = 0.0  # type: ignore[union-attr]
    a.cache.match_prefix(key_of(8, base=5))  # server gone: logged
    cfg = a.cache.hicache.config  # type: ignore[union-attr]
    texts = [repr(cfg), str(cfg), repr(a.cache.storage), repr(a.cache.storage.backend),
             str(a.cache.stats()), str(wrong.cache.stats()), caplog.text,
             repr(RedisStore(good)), repr(HiCacheConfig(hicache_storage_backend="redis",
                                                         hicache_storage_url=good))]
    assert "L3 redis" in caplog.text  # the faults were logged...
    for text in texts:
        for s in secrets:
            assert s not in text, (s, text[:300])  # ...without credentials
    with pytest.raises(ValueError) as exc:
        HiCacheConfig(hicache_storage_backend="redis", hicache_storage_url="http://alice:alice-s3cret-pw@h:1")
    assert "alice-s3cret-pw" not in str(exc.value)


@pytest.fixture
def tls_server(tmp_path: Any) -> Iterator[tuple[RedisServer, str]]:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = RedisServer(str(tmp_path), "--tls-cert-file", cert, "--tls-key-file", key,
                         "--tls-ca-cert-file", cert, "--tls-auth-clients", "no")
    yield server, cert
    server.kill()


def test_tls_round_trip_and_an_unverified_server_is_a_miss(tls_server: tuple[RedisServer, str]) -> None:
    server, cert = tls_server
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    store = RedisStore(url, tag="t")
    key = "cd" * 32
    assert store.set(key, b"over", b"tls")
    page = store.get(key)
    assert page is not None and bytes(page.a) + bytes(page.b) == b"overtls"
    no_ca = RedisStore(f"rediss://127.0.0.1:{server.port}/0", tag="t", timeout_s=1.0)
    assert no_ca.get(key) is None and no_ca.stats["errors"] == 1  # self-signed: refused
    plain = RedisStore(f"redis://127.0.0.1:{server.port}/0", tag="t", timeout_s=0.5)
    assert plain.get(key) is None and plain.stats["errors"] + plain.stats["timeouts"] == 1
    for s in (store, no_ca, plain):
        s.close()


@pytest.fixture
def private_cluster(tmp_path: Any) -> Iterator[list[RedisServer]]:
    import shutil
    import subprocess

    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (.ci/redis-up installs it)")
    nodes = []
    for i in range(3):
        d = tmp_path / f"n{i}"
        d.mkdir()
        nodes.append(RedisServer(str(d), "--cluster-enabled", "yes", "--cluster-config-file",
                                 "nodes.conf", "--cluster-node-timeout", "1000"))
    try:
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True,
                       timeout=WAIT_S)
        wait_cluster_ok(nodes)
        yield nodes
    finally:
        for n in nodes:
            n.kill()


def wait_cluster_ok(nodes: list[RedisServer], timeout_s: float = WAIT_S) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(redis.Redis(port=n.port).cluster("info").get("cluster_state") == "ok"
                   for n in nodes):
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError("private cluster did not reach cluster_state:ok")


def test_a_cluster_node_killed_mid_replay_and_restarted(private_cluster: list[RedisServer],
                                                        caches: list[L3]) -> None:
    nodes = private_cluster
    urls = ",".join(n.url for n in nodes)
    gen = torch.Generator().manual_seed(12)
    model = fresh_model()
    a = make("redis", where=urls, page_size=2, model=model, size=64)
    caches.append(a)
    a.cache.storage.backend.cooldown_s = 0.05  # type: ignore[union-attr]
    keys = [key_of(8, base=1000 * i) for i in range(9)]
    written = []
    for i, k in enumerate(keys):
        if i == 3:
            nodes[1].kill()  # a third of the hash slots gone
        if i == 6:
            nodes[1].start()  # rejoins with its slots (nodes.conf), without its data
            wait_cluster_ok(nodes)
            time.sleep(0.1)
        written.append(put_random(a, k, gen))  # never raises
        assert a.cache.flush_storage(WAIT_S)
        a.cache.evict(a.kv.size)
        a.cache.sanity_check()
    st = a.cache.stats()
    assert st["l3_backend_errors"] + st["l3_backend_timeouts"] >= 1
    b = make("redis", where=urls, page_size=2, model=model, size=64)
    caches.append(b)
    hits = []
    for k, w in zip(keys, written, strict=True):
        m = b.cache.match_prefix(k)
        hits.append(m.host_hit_length)
        if m.host_hit_length:
            assert b.cache.load_back(m.last_host_node) == m.host_hit_length
            m = b.cache.match_prefix(k)
            assert_same_kv(b, m.device_indices, w, m.prefix_len)  # what survived is exact
        b.cache.sanity_check()
    assert hits[6:] == [8, 8, 8]  # written after the restart: found through the whole cluster
    # Before it: the leading run of pages that survived (the restarted node lost its own).
    assert all(h % 2 == 0 and h <= 8 for h in hits[:6])


@pytest.fixture
def acl_server(tmp_path: Any) -> Iterator[RedisServer]:
    """A server whose user ``half`` may touch only the keys ``hpc:0*`` .. ``hpc:7*``."""
    server = RedisServer(str(tmp_path), "--user", "half", "on", ">half-pw-half-pw", "~hpc:[0-7]*",
                         "&*", "+@all")
    yield server
    server.kill()


def test_a_write_refused_by_the_server_is_an_error_not_already_present(
        acl_server: RedisServer) -> None:
    """One record of a batch refused with an error reply (``NOPERM``: outside the user's key
    pattern) is a counted error, never ``already_present`` (nothing was there), and the other
    record of the batch is still written."""
    store = RedisStore(f"redis://half:half-pw-half-pw@127.0.0.1:{acl_server.port}/0", tag="acl")
    allowed, refused = "0" * 64, "f" * 64
    try:
        assert store.batch_set([(allowed, b"K" * 8, b"V" * 8), (refused, b"K" * 8, b"V" * 8)]) == 1
        st = store.stats
        assert (st["written"], st["already_present"], st["refused"], st["errors"]) == (1, 0, 0, 1)
        assert store.exists(allowed)
        assert store.batch_set([(allowed, b"K" * 8, b"V" * 8)]) == 0  # now it is there
        assert store.stats["already_present"] == 1
    finally:
        store.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_the_server_dropped_are_written_again(redis_server: RedisServer,  # noqa: F811
                                                    caches: list[L3], page_size: int) -> None:
    """The server drops every page after the backup (``FLUSHALL``; a ``maxmemory`` eviction
    is the same to the client). The writer's next match finds them absent; when it computes
    the prompt again, its backup stores them again (it does not go on taking them for stored),
    and a second engine is served the same bits."""
    import redis

    key = key_of(16)
    a, b = make_pair(caches, "redis", where=redis_server.url, page_size=page_size, states=4)
    w = put_random(a, key, torch.Generator().manual_seed(5))
    assert a.cache.flush_storage(WAIT_S)
    records = 16 // page_size + 1  # the pages and the state record at the end
    assert a.cache.stats()["l3_backup_written"] == records
    redis.Redis(port=redis_server.port).flushall()
    drop_everything(a)
    m = a.cache.match_prefix(key)  # nothing left anywhere: a miss
    assert (m.prefix_len, m.host_hit_length) == (0, 0)
    a.cache.sanity_check()
    w = put_random(a, key, torch.Generator().manual_seed(5))  # computed again: same bits
    assert a.cache.flush_storage(WAIT_S)
    assert a.cache.stats()["l3_backup_written"] == 2 * records
    m = b.cache.match_prefix(key)
    assert m.host_hit_length == 16
    assert b.cache.load_back(m.last_host_node) == 16
    m = b.cache.match_prefix(key)
    assert_same_kv(b, m.device_indices, w, 16)
    assert m.state_slot is not None
    assert_same_state(b, m.state_slot, w)
    b.cache.sanity_check()
