"""A blocking prefetch stalls ``match_prefix`` for one deadline at most, retries included.

A frozen store (a private ``redis-server`` stopped with SIGSTOP: connections stay open, no
reply ever comes) is the worst case: every call waits its whole socket timeout once (the
client retries a lost connection, never a timeout). Under ``wait_complete`` the engine's stall is bounded by
``hicache_storage_timeout_s`` in all; under ``timeout`` by ``hicache_prefetch_timeout_s``, and a
re-match of the same key while that prefetch is still running does not wait again. Past the
deadline the prefetch goes on in the background and its pages join at a later match, as under
``best_effort``, once the store answers again.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from tests.storage.test_storage_common import (
    L3,
    REDIS_ENV,
    RedisServer,
    fresh_model,
    make,
    need_env,
    put_random,
)

KEY = [7000 + 3 * i for i in range(16)]
#: Scheduling slack on a loaded 2-core machine [s].
SLACK = 0.25


@pytest.fixture
def server(tmp_path: Any) -> Iterator[RedisServer]:
    need_env(REDIS_ENV)
    s = RedisServer(str(tmp_path))
    yield s
    if s.proc is not None:
        s.proc.send_signal(signal.SIGCONT)
    s.kill()


def engine(url: str, model: str, policy: str, storage_timeout: float,
           prefetch_timeout: float) -> L3:
    from allocators import KVPool, TokenAllocator

    pool = KVPool(64, 2, 1, 2, torch.float32, "cpu")
    kv = TokenAllocator(64, pool=pool)
    cfg = HiCacheConfig(load_back_threshold=1, hicache_storage_backend="redis",
                        hicache_storage_url=url, hicache_storage_model=model,
                        hicache_storage_prefetch_policy=policy,
                        hicache_storage_timeout_s=storage_timeout,
                        hicache_prefetch_timeout_s=prefetch_timeout)
    return L3(RadixCache(CacheConfig(), kv_allocator=kv, hicache=cfg), kv, None)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("policy,bound_attr", [("wait_complete", "storage"),
                                               ("timeout", "prefetch")])
def test_a_frozen_store_stalls_a_match_for_one_deadline(server: RedisServer, policy: str,
                                                        bound_attr: str) -> None:
    model = fresh_model()
    writer = make("redis", where=server.url, model=model)
    put_random(writer, KEY, torch.Generator().manual_seed(1))
    assert writer.cache.flush_storage(10)
    writer.close()
    storage_timeout, prefetch_timeout = 0.6, 0.4
    deadline = storage_timeout if bound_attr == "storage" else prefetch_timeout
    b = engine(server.url, model, policy, storage_timeout, prefetch_timeout)
    try:
        m = b.cache.match_prefix([1, 2, 3, 4, 5])  # connects: a miss
        assert m.host_hit_length == 0
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        m, dt = timed(b.cache.match_prefix, KEY + [1])
        assert m.host_hit_length == 0  # nothing came in time: a miss
        assert dt < deadline + SLACK, f"{policy}: stalled {dt:.2f} s, deadline {deadline} s"
        m, dt2 = timed(b.cache.match_prefix, KEY + [1])  # the same prefetch is still running
        assert dt2 < SLACK, f"{policy}: a re-match waited again ({dt2:.2f} s)"
        st = b.cache.stats()
        # Under ``wait_complete`` the engine's deadline and the store's socket timeout are the
        # same 0.6 s, so either may fire first: the engine stops waiting (a prefetch timeout,
        # counted once) or the store's call times out first and the prefetch ends as a miss.
        # Under ``timeout`` the engine's 0.4 s deadline always comes first.
        assert st["l3_prefetch_timeouts"] <= 1
        assert st["l3_prefetch_timeouts"] + st["l3_backend_timeouts"] >= 1
        if policy == "timeout":
            assert st["l3_prefetch_timeouts"] == 1
        server.proc.send_signal(signal.SIGCONT)
        b.cache.flush_storage(10)  # the prefetch ends in the background
        b.cache.sanity_check()
        b.cache.storage.backend._down_until = 0.0  # type: ignore[union-attr]
        m = b.cache.match_prefix(KEY + [1])
        b.cache.sanity_check()
        assert m.host_hit_length in (0, 16)  # what the late answer brought, whole or nothing
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        b.close()


def test_a_slow_but_answering_store_still_completes_under_wait_complete(
        server: RedisServer) -> None:
    """The deadline bounds a store that does not answer; one that answers within it is waited
    for, and ``wait_complete`` returns the pages in the same match."""
    model = fresh_model()
    writer = make("redis", where=server.url, model=model)
    put_random(writer, KEY, torch.Generator().manual_seed(2))
    assert writer.cache.flush_storage(10)
    writer.close()
    b = engine(server.url, model, "wait_complete", 2.0, 0.05)
    try:
        m = b.cache.match_prefix(KEY + [1])
        assert m.host_hit_length == 16
        assert b.cache.stats()["l3_prefetch_timeouts"] == 0
    finally:
        b.close()


def test_a_frozen_store_costs_one_timeout_per_call_and_then_rests(server: RedisServer) -> None:
    """A frozen Redis: the first call waits one ``timeout_s`` (before: two, the client
    retried the timed-out read once), the next calls during the rest period answer at once."""
    from hicache.storage import RedisStore

    s = RedisStore(server.url, tag="t", timeout_s=0.6, cooldown_s=5.0)
    key = "ab" * 32
    try:
        assert s.set(key, b"a", b"b")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        got, dt = timed(s.exists_mask, [key])
        assert got == [False] and dt < 0.6 + SLACK, f"stalled {dt:.2f} s for a 0.6 s timeout"
        got, dt2 = timed(s.get, key)
        assert got is None and dt2 < SLACK
        st = s.stats
        assert (st["timeouts"], st["errors"], st["skipped_in_cooldown"]) == (1, 0, 1)
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        s.close()


class _BlockingClient:
    """A client whose ``close`` waits on ``release`` (up to 5 s), as a Redis Cluster client's
    close waits on a lock its running I/O holds; in a reference cycle with a ``__del__`` that
    closes it, as redis-py's clients are, so only a GC pass frees it."""

    def __init__(self, release: threading.Event, closed_by: list[str]) -> None:
        self.release = release
        self.closed_by = closed_by
        self.me = self

    def close(self) -> None:
        if not self.closed_by:
            self.closed_by.append(threading.current_thread().name)
            self.release.wait(5.0)

    def __del__(self) -> None:
        self.close()


def test_a_dropped_backend_is_closed_off_the_thread_that_collects_it() -> None:
    """An engine dropped without ``close()``: a GC pass on the next engine's thread (inside a
    best-effort call such as a prefetch snapshot) used to run the old client's close there and
    wait 0.9 s on it. Now the client is handed to the closer thread: the collecting thread
    returns at once while the close is blocked for 5 s, and the close still happens."""
    pytest.importorskip("redis")
    from hicache.storage import RedisStore

    release, closed_by = threading.Event(), list[str]()

    class Dropped(RedisStore):
        def __init__(self, made: list[_BlockingClient]) -> None:
            super().__init__("redis://127.0.0.1:1", tag="t")
            self.made = made
            self.me = self  # a cycle: freed by a GC pass, not by refcount

        def _connect(self) -> _BlockingClient:
            return self.made.pop()

    s = Dropped([_BlockingClient(release, closed_by)])
    assert isinstance(s._client(), _BlockingClient)
    del s
    try:
        t0 = time.monotonic()
        gc.collect()
        dt = time.monotonic() - t0
        assert dt < 0.5, f"the collecting thread waited {dt:.2f} s on a dropped client's close"
        for _ in range(500):
            if closed_by:
                break
            time.sleep(0.01)
        assert closed_by == ["hicache-l3-close"]
    finally:
        release.set()
