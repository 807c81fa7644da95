"""A blocking prefetch stalls ``match_prefix`` for one deadline at most, retries included.

A frozen store (a private ``redis-server`` stopped with SIGSTOP: connections stay open, no
reply ever comes) is the worst case: every call waits its whole socket timeout once (the
client retries a lost connection, never a timeout). Under ``wait_complete`` the engine's stall is bounded by
``hicache_storage_timeout_s`` in all; under ``timeout`` by ``hicache_prefetch_timeout_s``, and a
re-match of the same key while that prefetch is still running does not wait again. Past the
deadline the prefetch goes on in the background and its pages join at a later match, as under
``best_effort``, once the store answers again. The engine's tests give the store a socket
timeout (the URL's ``?socket_timeout=``) far above the engine's deadline, so the deadline
fires first every time and is counted exactly once.
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
from tests.helpers.server_helpers import freeze
from tests.storage.test_storage_common import (
    L3,
    REDIS_ENV,
    WAIT_S,
    RedisServer,
    fresh_model,
    make,
    need_env,
    put_random,
)

KEY = [7000 + 3 * i for i in range(16)]
#: The engine's deadlines [s] (``hicache_storage_timeout_s`` under ``wait_complete``,
#: ``hicache_prefetch_timeout_s`` under ``timeout``), and the frozen store's own socket timeout
#: (the URL's ``?socket_timeout=``), far above them: the engine's deadline always fires first.
DEADLINE_S = 1.5
STORE_TIMEOUT_S = 10
#: Scheduling slack on a loaded 2-core machine [s]: below one deadline, so a second wait (or
#: a wait per retry) is still caught.
SLACK = 1.0


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


def faults(h: L3, since: tuple[int, int, int] = (0, 0, 0)) -> tuple[int, int, int]:
    """(prefetch timeouts, backend timeouts, backend errors) of ``h`` counted after ``since``."""
    st = h.cache.stats()
    now = (st["l3_prefetch_timeouts"], st["l3_backend_timeouts"], st["l3_backend_errors"])
    return (now[0] - since[0], now[1] - since[1], now[2] - since[2])


def write_key(server: RedisServer, model: str, seed: int) -> None:
    writer = make("redis", where=server.url, model=model)
    try:
        put_random(writer, KEY, torch.Generator().manual_seed(seed))
        assert writer.cache.flush_storage(WAIT_S)
    finally:
        writer.close()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_a_frozen_store_stalls_a_match_for_one_deadline(server: RedisServer, policy: str) -> None:
    model = fresh_model()
    write_key(server, model, 1)
    # the store's socket timeout far above the engine's deadline: the engine stops waiting
    # first, every time (with both equal, either could fire first)
    url = f"{server.url}?socket_timeout={STORE_TIMEOUT_S}&socket_connect_timeout={STORE_TIMEOUT_S}"
    b = engine(url, model, policy, DEADLINE_S, DEADLINE_S)
    try:
        m = b.cache.match_prefix([1, 2, 3, 4, 5])  # connects: a miss
        assert m.host_hit_length == 0
        assert b.cache.flush_storage(WAIT_S)  # (on a loaded machine this one may time out too)
        before = faults(b)
        assert server.proc is not None
        freeze(server.proc)
        m, dt = timed(b.cache.match_prefix, KEY + [1])
        assert m.host_hit_length == 0  # nothing came in time: a miss
        assert dt < DEADLINE_S + SLACK, f"{policy}: stalled {dt:.2f} s, deadline {DEADLINE_S} s"
        m, dt2 = timed(b.cache.match_prefix, KEY + [1])  # the same prefetch is still running
        assert m.host_hit_length == 0
        assert dt2 < SLACK, f"{policy}: a re-match waited again ({dt2:.2f} s)"
        # the engine's deadline fired once; the store's call is still waiting, not failed
        assert faults(b, before) == (1, 0, 0)
        server.proc.send_signal(signal.SIGCONT)
        # the store answers the waiting call: the prefetch ends in the background, and the
        # flush attaches its pages
        assert b.cache.flush_storage(WAIT_S)
        b.cache.sanity_check()
        m = b.cache.match_prefix(KEY + [1])
        b.cache.sanity_check()
        assert m.host_hit_length == 16  # the late answer brought the whole key
        assert faults(b, before) == (1, 0, 0)
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        b.close()


def test_a_slow_but_answering_store_still_completes_under_wait_complete(
        server: RedisServer) -> None:
    """The deadline bounds a store that does not answer; one that answers within it is waited
    for, and ``wait_complete`` returns the pages in the same match (the ``timeout`` policy's
    0.05 s does not apply to it)."""
    model = fresh_model()
    write_key(server, model, 2)
    b = engine(server.url, model, "wait_complete", WAIT_S, 0.05)
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

    s = RedisStore(server.url, tag="t", timeout_s=DEADLINE_S, cooldown_s=WAIT_S)
    key = "ab" * 32
    try:
        assert s.set(key, b"a", b"b")
        assert server.proc is not None
        freeze(server.proc)
        got, dt = timed(s.exists_mask, [key])
        assert got == [False] and dt < DEADLINE_S + SLACK, \
            f"stalled {dt:.2f} s for a {DEADLINE_S} s timeout"
        got, dt2 = timed(s.get, key)
        assert got is None and dt2 < SLACK
        st = s.stats
        assert (st["timeouts"], st["errors"], st["skipped_in_cooldown"]) == (1, 0, 1)
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        s.close()


class _BlockingClient:
    """A client whose ``close`` waits on ``release`` (up to ``WAIT_S``), as a Redis Cluster client's
    close waits on a lock its running I/O holds; in a reference cycle with a ``__del__`` that
    closes it, as redis-py's clients are, so only a GC pass frees it."""

    def __init__(self, release: threading.Event, closed_by: list[str]) -> None:
        self.release = release
        self.closed_by = closed_by
        self.me = self

    def close(self) -> None:
        if not self.closed_by:
            self.closed_by.append(threading.current_thread().name)
            self.release.wait(WAIT_S)

    def __del__(self) -> None:
        self.close()


def test_a_dropped_backend_is_closed_off_the_thread_that_collects_it() -> None:
    """An engine dropped without ``close()``: a GC pass on the next engine's thread (inside a
    best-effort call such as a prefetch snapshot) used to run the old client's close there and
    wait 0.9 s on it. Now the client is handed to the closer thread: the collecting thread
    returns at once (well within the close's ``WAIT_S`` block), and the close still happens."""
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
        assert dt < WAIT_S / 6, f"the collecting thread waited {dt:.2f} s on a dropped client's close"
        deadline = time.monotonic() + WAIT_S
        while not closed_by and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed_by == ["hicache-l3-close"]
    finally:
        release.set()
