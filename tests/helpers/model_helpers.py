"""Shared helpers of the model tests (``tests/model/test_model_*.py``); no tests here.

Skipped without the optional extra (``pip install -e .[model]``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from bench.dev.model import MIN_TRANSFORMERS

pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS,
                    reason="model tests need the optional extra: pip install -e .[model]")

from bench.dev.model.adapter import ARCHITECTURES  # noqa: E402
from bench.dev.model.driver import DriverConfig, ModelDriver  # noqa: E402

ARCHS = sorted(ARCHITECTURES)
HYBRID = ["bamba", "falcon_h1", "qwen3_next"]
NUM_PROMPTS = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread than on a contended pool (tens of times on a
    2-core runner); restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def driver(arch: str, page_size: int, **kw) -> ModelDriver:
    """Small pools: 512 KV tokens (256 SWA), 10 state slots; 2 requests in flight (1 for the
    SWA model: 2 hit a library bug, see test_model_driver)."""
    kw.setdefault("concurrency", 1 if arch == "qwen2_swa" else 2)
    kw.setdefault("swa_tokens", 256 if arch == "qwen2_swa" else None)
    return ModelDriver(DriverConfig(arch, page_size=page_size, **kw))


def assert_idle_and_leak_free(d: ModelDriver) -> None:
    """Every request finished: no lock left, every slot (device and host) either free or held
    by the tree."""
    cache, alloc = d.cache, d.pools.kv_allocator
    cache.sanity_check()
    assert cache.protected_size() == 0 and cache.state_protected_size() == 0
    if cache.swa is not None:
        assert alloc.full_available_size() + cache.total_size() == alloc.size
        live_swa = cache.swa_evictable_size() + cache.swa_protected_size()
        assert alloc.swa_available_size() + live_swa == alloc.swa_size
    else:
        assert alloc.available_size() + cache.total_size() == alloc.size
    pool = d.pools.state_pool
    if pool is not None:
        assert pool.available_size() + cache.state_evictable_size() == pool.size
    hc = cache.hicache
    if hc is not None:
        assert hc.num_inflight == 0
        assert hc.host_kv.available_size() + cache.host_size() == hc.host_kv.size


class KnownLibraryBug(Exception):
    """A failure pinned as a known library bug: tests raising it are strict xfails, so a fix
    shows up as XPASS (then drop the mark)."""


@contextmanager
def known_bug(exc_type: type[BaseException], pattern: str) -> Iterator[None]:
    """Turn ``exc_type`` whose message matches ``pattern`` into :class:`KnownLibraryBug`; any
    other failure propagates unchanged (so a strict xfail cannot hide it)."""
    try:
        yield
    except exc_type as exc:
        if re.search(pattern, str(exc)):
            raise KnownLibraryBug(str(exc).splitlines()[0]) from exc
        raise
