"""Mooncake Store as L3: options resolved as SGLang resolves them, and the store's own faults —
the master killed and restarted mid-replay, the process that owns the segment holding the pages
gone, a full segment. Never an exception into the engine, never a wrong page; every engine-facing
call returns within the storage timeout (the longest stall is measured and printed)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache import HiCacheConfig
from hicache.storage import MooncakeOptions
from hicache.storage.mooncake_options import load_extra_config, parse_size
from tests.helpers.mooncake_helpers import (
    MooncakeMaster,
    SegmentOwner,
    mooncake_extra,
    mooncake_package,
)
from tests.storage.test_storage_common import (
    L3,
    WAIT_S,
    assert_same_kv,
    fresh_model,
    make,
    put_random,
)

TIMEOUT_S = 1.5  # hicache_storage_timeout_s of the caches below, and timeout_s of the stores
#: Scheduling slack on a loaded 2-core machine [s]: below one timeout, so a second wait is
#: still caught; and what a call that must answer at once may take.
SLACK_S = 1.0
STALL_BOUND_S = TIMEOUT_S + SLACK_S  # one timed-out call, no more


# ====================================================================== options
def test_options_from_the_extra_config_take_sglangs_keys_and_defaults() -> None:
    o = MooncakeOptions.resolve(None, {"master_server_address": "10.0.0.1:50051",
                                       "global_segment_size": "2gb"}, environ={})
    assert (o.master_server_address, o.metadata_server, o.local_hostname, o.global_segment_size,
            o.local_buffer_size, o.protocol, o.device_name, o.zero_copy, o.source) == (
        "10.0.0.1:50051", "P2PHANDSHAKE", "localhost", 2 << 30, 16 << 20, "tcp", "", True,
        "extra_config")
    env = {"MOONCAKE_MASTER": "h:1", "MOONCAKE_PROTOCOL": "rdma"}
    o = MooncakeOptions.resolve(None, {"master_server_address": "h:2"}, environ=env)
    assert (o.master_server_address, o.protocol) == ("h:2", "tcp")  # env not mixed in, as SGLang


def test_options_from_the_environment_and_a_config_file(tmp_path: Any) -> None:
    env = {"MOONCAKE_MASTER": "127.0.0.1:7000", "MOONCAKE_TE_META_DATA_SERVER": "http://h:8/metadata",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "512mb", "MOONCAKE_PROTOCOL": "tcp",
           "MOONCAKE_DEVICE": "mlx5_0", "LOCAL_HOSTNAME": "node-a",
           "SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE": str(32 << 20)}
    o = MooncakeOptions.resolve(None, {}, environ=env)
    assert (o.master_server_address, o.metadata_server, o.global_segment_size, o.device_name,
            o.local_hostname, o.local_buffer_size, o.source) == (
        "127.0.0.1:7000", "http://h:8/metadata", 512 << 20, "mlx5_0", "node-a", 32 << 20, "env")
    o = MooncakeOptions.resolve("mooncake://127.0.0.1:9", {}, environ=env)
    assert (o.master_server_address, o.metadata_server, o.source) == ("127.0.0.1:9", "http://h:8/metadata", "url")
    f = tmp_path / "mc.json"
    f.write_text(json.dumps({"master_server_address": "f:1", "protocol": "tcp"}))
    o = MooncakeOptions.resolve(None, {}, environ={**env, "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(f)})
    assert (o.master_server_address, o.source) == ("f:1", "file")


def test_extra_config_is_json_or_a_file(tmp_path: Any) -> None:
    assert load_extra_config(None) == {} and load_extra_config('{"a": 1}') == {"a": 1}
    (tmp_path / "x.toml").write_text('master_server_address = "t:1"\nzero_copy = false\n')
    assert load_extra_config(f"@{tmp_path / 'x.toml'}") == {"master_server_address": "t:1", "zero_copy": False}
    cfg = HiCacheConfig(hicache_storage_backend="mooncake",
                        hicache_storage_backend_extra_config=f"@{tmp_path / 'x.toml'}")
    assert cfg.extra_config()["master_server_address"] == "t:1"
    assert parse_size("4gb", "s") == 4 << 30 and parse_size(" 16 MB ", "s") == 16 << 20
    assert parse_size(123, "s") == 123


@pytest.mark.parametrize("kwargs,match", [
    ({"hicache_storage_backend": "mooncake"}, "needs a master"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "redis://h:1"}, "mooncake://host:port"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "mooncake://h:1",
      "hicache_storage_backend_extra_config": '{"master_server_address": "h:2"}'}, "not both"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": "[1]"}, "JSON object"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": "{"}, "not valid JSON"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": "@/nope.json"}, "cannot read"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": "@x.ini"}, ".json, .yaml / .yml or .toml"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "mooncake://h:1",
      "hicache_storage_backend_extra_config": '{"master_metrics_port": 9003}'}, "unknown key"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "mooncake://h:1",
      "hicache_storage_backend_extra_config": '{"global_segment_size": "1mb"}'}, "16 MiB"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "mooncake://h:1",
      "hicache_storage_backend_extra_config": '{"global_segment_size": "lots"}'}, "global_segment_size"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "mooncake://h:1",
      "hicache_storage_backend_extra_config": '{"protocol": "udp"}'}, "protocol"),
    ({"hicache_storage_backend": "mooncake", "hicache_storage_url": "mooncake://h:1",
      "hicache_storage_backend_extra_config": '{"zero_copy": "yes"}'}, "zero_copy"),
    ({"hicache_storage_backend": "file", "hicache_storage_dir": "d",
      "hicache_storage_backend_extra_config": '{"zero_copy": true}'}, "not accepted"),
    ({"hicache_storage_backend_extra_config": 5}, "JSON string"),
])
def test_bad_mooncake_settings_fail_when_the_config_is_built(kwargs: dict[str, Any], match: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MOONCAKE_MASTER", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises((ValueError, TypeError), match=match):
        HiCacheConfig(**kwargs)


# ======================================================================= faults
@pytest.fixture
def master(tmp_path: Any) -> Iterator[MooncakeMaster]:
    mooncake_package()
    m = MooncakeMaster(str(tmp_path))
    yield m
    m.kill()


def key_of(n: int, base: int = 1000) -> list[int]:
    return [base + 5 * i for i in range(n)]


def on(master: MooncakeMaster, caches: list[L3], segment: int = 0, **kw: Any) -> L3:
    kw.setdefault("storage_timeout_s", TIMEOUT_S)
    h = make("mooncake", where=master.url, extra=mooncake_extra(master.metadata, segment), **kw)
    caches.append(h)
    return h


def backend_of(h: L3) -> Any:
    st = h.cache.storage
    assert st is not None
    return st.backend


def host_size(h: L3) -> int:
    hc = h.cache.hicache
    assert hc is not None
    return int(hc.host_kv.size)


def load(h: L3, m: Any) -> int:
    """``load_back`` of a match's host part; the tokens brought to device."""
    assert m.last_host_node is not None
    return int(h.cache.load_back(m.last_host_node))


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def test_master_killed_mid_replay_and_restarted(master: MooncakeMaster, caches: list[L3]) -> None:
    owner = SegmentOwner(master, 64 << 20)
    try:
        gen = torch.Generator().manual_seed(21)
        model = fresh_model()
        a = on(master, caches, page_size=2, model=model, size=64)
        backend_of(a).cooldown_s = 0.05
        keys = [key_of(8, base=1000 * i) for i in range(9)]
        stall = 0.0
        written = []
        for i, k in enumerate(keys):
            if i == 3:
                master.kill()
            if i == 6:
                master.start()  # empty again; the owner's client mounts its segment again
                wait_writable(a)
            written.append(put_random(a, k, gen))  # never raises
            _, dt = timed(a.cache.match_prefix, key_of(6, base=77 + 1000 * i))  # an inline lookup
            stall = max(stall, dt)
            assert a.cache.flush_storage(WAIT_S)
            a.cache.evict(a.kv.size)
            a.cache.sanity_check()
        st = a.cache.stats()
        assert st["l3_backend_errors"] + st["l3_backend_timeouts"] >= 1
        print(f"\nmaster killed: longest match_prefix {stall:.3f} s; errors {st['l3_backend_errors']}, "
              f"timeouts {st['l3_backend_timeouts']}, skipped {st['l3_backend_skipped_in_cooldown']}")
        assert stall < STALL_BOUND_S
        b = on(master, caches, page_size=2, model=model, size=64)
        hits = [b.cache.match_prefix(k).host_hit_length for k in keys]
        assert hits == [0] * 6 + [8] * 3  # only what was written after the restart
        for k, w in zip(keys[6:], written[6:], strict=True):  # found again, bit-exact
            assert load(b, b.cache.match_prefix(k)) == 8
            assert_same_kv(b, b.cache.match_prefix(k).device_indices, w, 8)
        b.cache.sanity_check()
    finally:
        owner.kill()


def wait_writable(h: L3, timeout_s: float = 30.0, in_a_row: int = 8) -> None:
    """Until the store takes ``in_a_row`` probe pages in a row (the master places each in a
    random segment: a dead one still listed would refuse some of them)."""
    store = backend_of(h)
    deadline = time.monotonic() + timeout_s
    ok = 0
    while time.monotonic() < deadline:
        store._down_until = 0.0
        ok = ok + 1 if store.set(f"{time.monotonic_ns():064x}", b"probe", b"") else 0
        if ok >= in_a_row:
            return
        time.sleep(0.05 if ok else 0.2)
    raise AssertionError("the store did not take writes again")


def test_the_process_owning_the_segment_gone(tmp_path: Any, caches: list[L3]) -> None:
    mooncake_package()
    master = MooncakeMaster(str(tmp_path), "--client_ttl=2")  # a silent client is dropped after 2 s
    try:
        segment_owner_gone(master, caches)
    finally:
        master.kill()


def segment_owner_gone(master: MooncakeMaster, caches: list[L3]) -> None:
    owner = SegmentOwner(master, 64 << 20)
    gen = torch.Generator().manual_seed(22)
    model = fresh_model()
    a = on(master, caches, page_size=4, model=model)  # lends nothing: every page is the owner's
    key = key_of(16)
    put_random(a, key, gen)
    assert a.cache.flush_storage(WAIT_S) and a.cache.stats()["l3_backup_written"] == 4
    owner.kill()
    b = on(master, caches, page_size=4, model=model)
    m, stall = timed(b.cache.match_prefix, key)  # present in the master, unreadable
    st = b.cache.stats()
    print(f"\nsegment owner gone: match_prefix {stall:.3f} s; errors {st['l3_backend_errors']}, "
          f"timeouts {st['l3_backend_timeouts']}")
    assert m.host_hit_length == 0 and m.prefix_len == 0  # a miss, no wrong bytes
    assert st["l3_backend_errors"] + st["l3_backend_timeouts"] >= 1 and st["l3_prefetch_pages"] == 0
    assert stall < STALL_BOUND_S
    b.cache.sanity_check()
    # An engine that lends its own segment works on the same master once the master has dropped
    # the dead client (until then it still places pages in the dead segment: refused writes).
    c = on(master, caches, segment=32 << 20, page_size=4, model=model + "-c")
    d = on(master, caches, page_size=4, model=model + "-c")
    time.sleep(4)  # twice the master's client_ttl: the dead client is dropped
    wait_writable(c)
    w = put_random(c, key_of(8, base=9), gen)
    assert c.cache.flush_storage(WAIT_S)
    m = d.cache.match_prefix(key_of(8, base=9))
    assert m.host_hit_length == 8 and load(d, m) == 8
    m = d.cache.match_prefix(key_of(8, base=9))
    assert_same_kv(d, m.device_indices, w, 8)


def test_a_full_segment_refuses_pages_and_serves_only_verified_ones(master: MooncakeMaster,
                                                                   caches: list[L3]) -> None:
    owner = SegmentOwner(master, 16 << 20)  # the only segment: 16 MiB, the client's minimum
    try:
        gen = torch.Generator().manual_seed(23)
        model = fresh_model()
        kw: dict[str, Any] = {"page_size": 4, "model": model, "head_dim": 4096, "size": 16}
        a = on(master, caches, **kw)  # a record: 88 B + 2 x 128 KiB
        keys = [key_of(8, base=100 * i) for i in range(40)]  # 80 records, 20 MiB > the segment
        written = []
        stall = 0.0
        for k in keys:
            w, dt = timed(put_random, a, k, gen)
            stall = max(stall, dt)
            written.append(w)
            assert a.cache.flush_storage(WAIT_S)
            a.cache.evict(a.kv.size)
            a.cache.evict_host(host_size(a))
        st = a.cache.stats()
        kept = 0
        b = on(master, caches, **kw)
        for k, w in zip(keys, written, strict=True):
            m, dt = timed(b.cache.match_prefix, k)
            stall = max(stall, dt)
            assert m.host_hit_length % 4 == 0
            if m.host_hit_length:
                kept += m.host_hit_length // 4
                n = load(b, m)
                m = b.cache.match_prefix(k)
                assert_same_kv(b, m.device_indices, w, n)  # every page served is the one written
            b.cache.evict(b.kv.size)
            b.cache.evict_host(host_size(b))
            b.cache.sanity_check()
        refused = st["l3_backend_refused"]
        print(f"\nfull segment: refused {refused} of 80 pages, {kept} pages served back, longest "
              f"engine call {stall:.3f} s")
        assert refused + (80 - st["l3_backup_written"]) > 0 or kept < 80  # it did not all fit
        assert 0 < kept < 80
        assert st["l3_backend_errors"] == 0  # a full store is not a fault
        assert stall < STALL_BOUND_S
    finally:
        owner.kill()


# ============================================================ the client's calls
class Slow:
    """The real client, with ``batch_is_exist`` blocked until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        import threading

        self.inner, self.release, self.calls = inner, threading.Event(), 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        self.release.wait(WAIT_S)
        return self.inner.batch_is_exist(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def direct_store(zero_copy: bool = True, timeout_s: float = TIMEOUT_S) -> Any:
    from hicache.storage.mooncake_store import MooncakeStore
    from tests.helpers.mooncake_helpers import need_mooncake

    url, meta = need_mooncake()
    opts = MooncakeOptions.resolve(url, mooncake_extra(meta, zero_copy=zero_copy,
                                                       key_prefix=f"{fresh_model()}:"))
    return MooncakeStore(opts, tag="t", timeout_s=timeout_s, cooldown_s=0.0)


def test_a_hung_call_is_abandoned_after_the_timeout_and_never_piles_up() -> None:
    from hicache.storage.mooncake_store import WORKERS

    store = direct_store()
    try:
        key = "ef" * 32
        assert store.set(key, b"a", b"b")
        slow = Slow(store._client())
        store._store = slow
        stalls = []
        for _ in range(WORKERS + 2):
            _, dt = timed(store.exists, key)
            stalls.append(dt)
        st = store.stats
        # WORKERS calls wait their timeout and are abandoned; the next ones are refused at once.
        assert st["timeouts"] == WORKERS + 2 and st["abandoned_calls"] == WORKERS
        assert max(stalls) < STALL_BOUND_S and max(stalls[WORKERS:]) < SLACK_S, stalls
        deadline = time.monotonic() + WAIT_S  # a worker may not have started its call yet
        while slow.calls < WORKERS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.calls == WORKERS
        slow.release.set()
        deadline = time.monotonic() + WAIT_S
        while store._busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._busy == 0 and store.exists(key)  # the abandoned calls ended; working again
    finally:
        store._store = getattr(store._store, "inner", store._store)
        store.close()


def test_zero_copy_writes_reuse_one_registered_send_buffer() -> None:
    store = direct_store(timeout_s=WAIT_S)
    try:
        import hashlib

        keys = [hashlib.sha256(b"zc%d" % i).hexdigest() for i in range(30)]
        for lo in range(0, 30, 10):
            assert store.batch_set([(k, b"K" * 1000, b"V" * 1000) for k in keys[lo:lo + 10]]) == 10
        assert store.stats["registered_bytes"] == 16 << 20  # the transfer-buffer size, once
        store.expect_sections((1000, 1000), (0, 0))
        pages = store.batch_get(keys)
        assert all(p is not None and bytes(p.a) == b"K" * 1000 and bytes(p.b) == b"V" * 1000
                   for p in pages)
        assert store.stats["registered_bytes"] == (16 << 20) + 30 * 2088  # plus one read buffer
    finally:
        store.close()


@pytest.mark.parametrize("frozen", ["master", "segment_owner"])
def test_a_frozen_store_costs_one_timeout_and_then_rests(master: MooncakeMaster, frozen: str) -> None:
    """As Redis (tests/storage/test_storage_deadline.py): with the master, or the client that
    holds the pages, stopped (SIGSTOP: connections open, no reply), one call waits one
    ``timeout_s`` and every later call during ``cooldown_s`` answers a miss at once, without
    calling the client (the rest period of ``StorageBackend``, shared by every backend)."""
    import signal

    from hicache.storage.mooncake_store import MooncakeStore
    from tests.helpers.server_helpers import freeze

    owner = SegmentOwner(master, 64 << 20)
    opts = MooncakeOptions.resolve(master.url, mooncake_extra(master.metadata,
                                                              key_prefix=f"{fresh_model()}:"))
    store = MooncakeStore(opts, tag="t", timeout_s=TIMEOUT_S, cooldown_s=10 * WAIT_S)
    proc = master.proc if frozen == "master" else owner.proc
    assert proc is not None
    key = "cd" * 32
    try:
        assert store.set(key, b"a" * 100, b"b" * 100) and store.exists(key)
        freeze(proc)
        # Calls until one times out: the first that needs the stopped process (a presence call
        # needs only the master, a read the segment owner too; the client may also answer one
        # from what it holds). Then the rest period: every call a miss at once.
        calls = (store.exists_mask, store.batch_get) * 5
        stalls = []
        for call in calls:
            _, dt = timed(call, [key])
            stalls.append(dt)
            if store.stats["timeouts"]:
                break
        answered = len(stalls) - 1
        for call in calls[:4]:
            got, dt = timed(call, [key])
            assert got in ([False], [None]), got
            stalls.append(dt)
        st = store.stats
        print(f"\nfrozen {frozen}: {answered} call(s) answered before the timeout; stalls "
              f"{[round(x, 3) for x in stalls]}")
        assert (st["timeouts"], st["errors"], st["skipped_in_cooldown"]) == (1, 0, 4), st
        assert max(stalls) < STALL_BOUND_S, stalls
        assert max(stalls[answered + 1:]) < SLACK_S, f"a call during the rest period waited: {stalls}"
    finally:
        proc.send_signal(signal.SIGCONT)
        store.close(wait_s=3.0)
        owner.kill()


class FailingPuts:
    """The real client, with every put answering ``code`` for each key (nothing stored)."""

    def __init__(self, inner: Any, code: int) -> None:
        self.inner, self.code = inner, code

    def put_batch(self, keys: list[str], values: list[bytes]) -> int:
        return self.code

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return [self.code] * len(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copying"])
def test_a_failed_put_is_an_error_not_already_present(zero_copy: bool) -> None:
    """A put the store answers with an error code (not ``NO_AVAILABLE_HANDLE``: no room) wrote
    nothing and found nothing: counted as an error, not as ``already_present``."""
    import hashlib

    from hicache.storage.mooncake_store import INVALID_PARAMS

    store = direct_store(zero_copy=zero_copy, timeout_s=WAIT_S)
    try:
        keys = [hashlib.sha256(b"fp%d%d" % (i, zero_copy)).hexdigest() for i in range(3)]
        store._store = FailingPuts(store._client(), INVALID_PARAMS)
        # 3 records of 400 KiB: past zero_copy_min_bytes (1 MiB) on the zero-copy path
        half = 200 << 10
        assert store.batch_set([(k, b"K" * half, b"V" * half) for k in keys]) == 0
        st = store.stats
        assert (st["written"], st["already_present"], st["refused"]) == (0, 0, 0)
        assert st["errors"] == 1
        assert store.exists_mask(keys) == [False] * 3
    finally:
        store._store = getattr(store._store, "inner", store._store)
        store.close()


@pytest.mark.parametrize("arg", ["timeout_s", "setup_timeout_s"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "1", True, None])
def test_a_bad_timeout_is_refused_by_name_before_connecting(arg: str, value: Any) -> None:
    """As RedisStore's: a wait must be a finite number of seconds > 0 (0 or less would time
    every call out at once); refused before the client starts connecting."""
    from hicache.storage.mooncake_store import MooncakeStore

    mooncake_package()
    opts = MooncakeOptions.resolve("mooncake://127.0.0.1:1", mooncake_extra("http://127.0.0.1:1/m"))
    with pytest.raises(ValueError, match=arg):
        MooncakeStore(opts, tag="t", **{arg: value})


def test_options_that_are_not_resolved_options_are_refused_by_name() -> None:
    from hicache.storage.mooncake_store import MooncakeStore

    mooncake_package()
    with pytest.raises(TypeError, match="options"):
        MooncakeStore({"master_server_address": "127.0.0.1:1"}, tag="t")  # type: ignore[arg-type]
