"""Shared helpers of the L3 storage tests, and tests of the helpers themselves.

* Redis: ``HPC_REDIS_URL`` (one node) and ``HPC_REDIS_CLUSTER_URLS`` (3-node cluster) come from
  ``.ci/redis-up``; without them the Redis tests skip with the reason, except under CI
  (``CI`` set), where a missing server is a failure. :class:`RedisServer` starts a private
  ``redis-server`` for tests that kill it or need a password.
* Mooncake Store: ``tests/helpers/mooncake_helpers.py`` (``.ci/mooncake-up``'s master, private masters).
* :func:`make` builds a cache over real pools with a host tier and an L3 backend; every test
  gets its own ``hicache_storage_model`` (:func:`fresh_model`), so its pages never meet
  another test's in a shared server.
* :class:`Flaky` wraps a backend: chosen raw calls raise, time out or wait on a gate.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from allocators import KVPool, MambaStatePool, PagedAllocator, TokenAllocator
from hicache import HiCacheConfig
from hicache.storage import StorageBackend
from hicache.storage.base import WriteResult
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import bits, random_bits
from tests.helpers.mooncake_helpers import MOONCAKE_META_ENV, mooncake_extra
from tests.helpers.server_helpers import ChildProcess, free_ports, wait_port

REDIS_ENV = "HPC_REDIS_URL"
CLUSTER_ENV = "HPC_REDIS_CLUSTER_URLS"
#: An upper bound for what only has to finish (a flush, a prefetch a test waits for, a
#: thread) on a loaded 2-core machine [s]: generous, and free when things are fast. The
#: default ``hicache_storage_timeout_s`` of :func:`make`; tests of the deadlines themselves set
#: their own, short ones.
WAIT_S = 30.0


def need_env(name: str) -> str:
    value = os.environ.get(name)
    if value:
        return value
    msg = f'{name} is not set: start Redis first with eval "$(bash .ci/redis-up)"'
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide Redis: {msg}")
    pytest.skip(msg)


def fresh_model() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ======================================================================= caches
@dataclass
class L3:
    """One cache with its pools."""

    cache: RadixCache
    kv: TokenAllocator | PagedAllocator
    sp: MambaStatePool | None

    @property
    def pool(self) -> KVPool:
        return self.kv.pool  # type: ignore[return-value]

    def close(self) -> None:
        self.cache.close_storage()


def make(backend: str = "file", *, where: str, page_size: int = 1, size: int = 32,
         states: int = 0, model: str | None = None, prefetch: str = "wait_complete",
         policy: str = "write_through", dtype: torch.dtype = torch.float32,
         max_bytes: int | None = None, timeout_s: float = 0.2, layers: int = 2,
         extra: dict[str, Any] | None = None, head_dim: int = 2,
         secret: str | bytes | None = None, storage_timeout_s: float = WAIT_S) -> L3:
    """A cache whose L3 is ``backend`` at ``where`` (a directory, Redis URL(s) or a
    ``mooncake://`` master; ``"mooncake-copying"``: Mooncake without zero-copy transfers)."""
    pool = KVPool(size, layers, 1, head_dim, dtype, "cpu", page_size=page_size)
    kv = TokenAllocator(size, pool=pool) if page_size == 1 else PagedAllocator(size, page_size, pool=pool)
    sp = (MambaStatePool(states, num_layers=layers, conv_state_shape=(3,), ssm_state_shape=(2, 2))
          if states else None)
    l3: dict[str, Any] = {"hicache_storage_backend": backend}
    if backend == "file":
        l3.update(hicache_storage_dir=where, hicache_storage_max_bytes=max_bytes)
    elif backend.startswith("mooncake"):
        if extra is None:
            extra = mooncake_extra(os.environ[MOONCAKE_META_ENV], zero_copy=backend == "mooncake")
        l3.update(hicache_storage_backend="mooncake", hicache_storage_url=where,
                  hicache_storage_backend_extra_config=json.dumps(extra))
    else:
        l3.update(hicache_storage_url=where)
    if extra is not None and not backend.startswith("mooncake"):
        l3.update(hicache_storage_backend_extra_config=json.dumps(extra))
    cfg = HiCacheConfig(
        hicache_write_policy=policy, load_back_threshold=1, hicache_storage_prefetch_policy=prefetch,
        hicache_prefetch_timeout_s=timeout_s, hicache_storage_model=model or fresh_model(),
        hicache_storage_secret=secret, hicache_storage_timeout_s=storage_timeout_s, **l3,
    )
    cache = RadixCache(CacheConfig(page_size=page_size), kv_allocator=kv, state_allocator=sp,
                       hicache=cfg)
    return L3(cache, kv, sp)


@dataclass
class Written:
    """What :func:`put_random` wrote: the device slots and their bits."""

    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    state: int | None = None
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


def make_pair(caches: list[L3], backend: str = "file", *, where: str,
              reader: dict[str, Any] | None = None, **kw: Any) -> tuple[L3, L3]:
    """A writer ``a`` and a reader ``b`` sharing the L3 ``backend`` at ``where`` under a fresh
    model name: ``make(backend, where=where, **kw)`` each, ``reader`` on top of ``kw`` for
    ``b``; both appended to ``caches`` (closed at teardown)."""
    model = fresh_model()
    a = make(backend, where=where, model=model, **kw)
    b = make(backend, where=where, model=model, **{**kw, **(reader or {})})
    caches += [a, b]
    return a, b


def put_random(h: L3, key: list[int], gen: torch.Generator, extra_key: Any = None) -> Written:
    """Insert ``key`` (no prefix cached) with random KV bits (and a random state)."""
    c, pool = h.cache, h.pool
    slots = h.kv.alloc(len(key))
    if slots is None:
        c.evict(len(key))
        slots = h.kv.alloc(len(key))
    assert slots is not None
    shape = (pool.num_layers, len(key), pool.num_heads, pool.head_dim)
    k, v = random_bits(shape, pool.dtype, gen), random_bits(shape, pool.dtype, gen)
    pool.k_all[:, slots] = k
    pool.v_all[:, slots] = v
    w = Written(slots, k, v)
    if h.sp is not None:
        got = h.sp.alloc(1)
        if got is None:
            c.evict_states(1)
            got = h.sp.alloc(1)
        assert got is not None
        w.state = int(got[0])
        w.conv = random_bits(tuple(h.sp.conv[:, w.state].shape), h.sp.dtype, gen)
        w.ssm = random_bits(tuple(h.sp.ssm[:, w.state].shape), h.sp.dtype, gen)
        h.sp.conv[:, w.state] = w.conv
        h.sp.ssm[:, w.state] = w.ssm
    res = c.insert(key, slots, extra_key, state_slot=w.state)
    assert res.prefix_len == 0
    c.sanity_check()
    return w


def drop_everything(h: L3) -> None:
    """Evict device and host: the tree ends empty, only L3 keeps the pages."""
    c = h.cache
    c.poll_transfers()
    c.evict(h.kv.size)
    c.evict_host(c.hicache.host_kv.size)  # type: ignore[union-attr]
    c.sanity_check()
    assert c.tree.num_nodes == 0


def assert_same_kv(h: L3, slots: torch.Tensor, w: Written, upto: int) -> None:
    pool = h.pool
    assert torch.equal(bits(pool.k_all[:, slots]), bits(w.k[:, :upto]))
    assert torch.equal(bits(pool.v_all[:, slots]), bits(w.v[:, :upto]))


def assert_same_state(h: L3, slot: int, w: Written) -> None:
    assert h.sp is not None and w.conv is not None and w.ssm is not None
    assert torch.equal(bits(h.sp.conv[:, slot]), bits(w.conv))
    assert torch.equal(bits(h.sp.ssm[:, slot]), bits(w.ssm))


# ===================================================================== faults
class InjectedFault(RuntimeError):
    pass


class Flaky(StorageBackend):
    """``inner``'s raw calls, numbered from 1 across all four; ``fail`` numbers raise
    ``InjectedFault`` (``timeout`` numbers raise ``TimeoutError``); while ``gate`` is clear,
    reads (``_exists_raw`` / ``_get_raw``) wait on it (up to ``WAIT_S``)."""

    name = "flaky"

    def __init__(self, inner: StorageBackend, fail: Sequence[int] = (), timeout: Sequence[int] = (),
                 fail_from: int | None = None) -> None:
        super().__init__(inner.tag, cooldown_s=0.0)
        self.inner = inner
        self.fail = set(fail)
        self.timeout = set(timeout)
        self.fail_from = fail_from
        self.calls = 0
        self.gate = threading.Event()
        self.gate.set()
        self._n = threading.Lock()

    def _tick(self) -> None:
        with self._n:
            self.calls += 1
            n = self.calls
        if n in self.timeout:
            raise TimeoutError(f"injected timeout on call {n}")
        if n in self.fail or (self.fail_from is not None and n >= self.fail_from):
            raise InjectedFault(f"injected fault on call {n}")

    def _exists_raw(self, keys: Sequence[str]) -> list[bool]:
        self.gate.wait(WAIT_S)
        self._tick()
        return self.inner._exists_raw(keys)

    def _get_raw(self, keys: Sequence[str]) -> Sequence[bytes | memoryview | None]:
        self.gate.wait(WAIT_S)
        self._tick()
        return self.inner._get_raw(keys)

    def _set_nx_raw(self, items: Sequence[tuple[str, bytes]]) -> Sequence[WriteResult]:
        self._tick()
        return self.inner._set_nx_raw(items)

    def _delete_raw(self, key: str, record: bytes) -> None:
        self._tick()
        self.inner._delete_raw(key, record)


def wrap_flaky(h: L3, **kw: Any) -> Flaky:
    st = h.cache.storage
    assert st is not None
    flaky = Flaky(st.backend, **kw)
    st.backend = flaky
    return flaky


# =============================================================== redis servers
class RedisServer(ChildProcess):
    """A private ``redis-server`` on a free loopback port (its cluster bus port, +10000, free
    too in cluster mode), persistence off."""

    def __init__(self, tmp: str, *args: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            msg = "redis-server is not installed (.ci/redis-up installs it)"
            if os.environ.get("CI"):
                pytest.fail(msg)
            pytest.skip(msg)
        self.exe, self.args, self.tmp = exe, args, tmp
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.launch(self._pick_port, self.start)

    def _pick_port(self) -> None:
        (self.port,) = free_ports(1, bus_offset=10000 if "--cluster-enabled" in self.args else 0)

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if "--tls-cert-file" in self.args:  # TLS only: the plain port off
            ports = ["--port", "0", "--tls-port", str(self.port)]
        self.proc = subprocess.Popen(
            [self.exe, *ports, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.tmp, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, what="private redis-server did not start", proc=self.proc)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def redis_server(tmp_path: Any) -> Any:
    server = RedisServer(str(tmp_path))
    yield server
    server.kill()


# ============================================================ helper tests
def test_random_bits_cover_nan_payloads_and_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    x = random_bits((4096,), torch.float32, gen)
    assert bool(torch.isnan(x).any())  # about 0.4% of float32 bit patterns are NaNs...
    assert not torch.equal(x, x.clone()) and torch.equal(bits(x.clone()), bits(x))  # ...so compare bits


def test_flaky_numbers_calls_and_raises_on_the_chosen_ones(tmp_path: Any) -> None:
    from hicache.storage import FileStore

    f = Flaky(FileStore(tmp_path), fail=[2], timeout=[3])
    key = "ab" * 32
    assert f.set(key, b"x", b"y")  # call 1
    assert f.get(key) is None and f.stats["errors"] == 1  # call 2 fails
    assert not f.exists(key) and f.stats["timeouts"] == 1  # call 3 times out
    assert f.get(key) is not None and f.calls == 4


def test_a_redis_server_whose_port_is_taken_starts_again_on_a_fresh_one(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first port picked is taken by another listener before redis-server binds it: the
    server exits, and it is started again on the next port picked (not mistaken for the other
    listener, which answers on the first port)."""
    import tests.storage.test_storage_common as common

    need_env(REDIS_ENV)
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    taken = other.getsockname()[1]
    picks = [[taken]]
    real = common.free_ports

    def pick(n: int, bus_offset: int = 0) -> list[int]:
        return picks.pop() if picks else real(n, bus_offset)

    monkeypatch.setattr(common, "free_ports", pick)
    try:
        server = RedisServer(str(tmp_path))
        try:
            assert server.port != taken and server.proc is not None and not picks
            import redis

            assert redis.Redis.from_url(server.url).ping()
        finally:
            server.kill()
    finally:
        other.close()
