"""L3 fields of HiCacheConfig: validated with errors that name the field; additive defaults."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import KVPool, TokenAllocator
from hicache import HiCacheConfig
from hicache.storage import FileStore, RedisStore, redact_url
from radix import CacheConfig, RadixCache


def test_defaults_leave_l3_off() -> None:
    cfg = HiCacheConfig()
    assert cfg.hicache_storage_backend is None and cfg.hicache_storage_prefetch_policy == "timeout"
    kv = TokenAllocator(8, pool=KVPool(8, 1, 1, 2, torch.float32))
    cache = RadixCache(CacheConfig(), kv_allocator=kv, hicache=cfg)
    assert cache.storage is None and "l3_faults" not in cache.stats()
    assert cache.poll_storage() == 0 and cache.flush_storage() is True


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"hicache_storage_backend": "s3"}, ValueError, "hicache_storage_backend"),
        ({"hicache_storage_backend": "file"}, ValueError, "hicache_storage_dir"),
        ({"hicache_storage_backend": "redis"}, ValueError, "hicache_storage_url"),
        ({"hicache_storage_dir": "/tmp/x"}, ValueError, "file backend"),
        ({"hicache_storage_backend": "redis", "hicache_storage_url": "redis://h:1",
          "hicache_storage_max_bytes": 10}, ValueError, "file backend"),
        ({"hicache_storage_url": "redis://h:1"}, ValueError, "redis backend"),
        ({"hicache_storage_backend": "redis", "hicache_storage_url": "http://h:1"}, ValueError,
         "redis://"),
        ({"hicache_storage_backend": "redis", "hicache_storage_url": " , "}, ValueError, "no Redis URL"),
        ({"hicache_storage_backend": "file", "hicache_storage_dir": "d",
          "hicache_storage_max_bytes": 0}, ValueError, "hicache_storage_max_bytes"),
        ({"hicache_storage_backend": "file", "hicache_storage_dir": 3}, TypeError, "hicache_storage_dir"),
        ({"hicache_storage_prefetch_policy": "eager"}, ValueError, "hicache_storage_prefetch_policy"),
        ({"hicache_prefetch_timeout_s": 0}, ValueError, "hicache_prefetch_timeout_s"),
        ({"hicache_storage_timeout_s": float("inf")}, ValueError, "hicache_storage_timeout_s"),
        ({"hicache_storage_model": 5}, TypeError, "hicache_storage_model"),
    ],
)
def test_bad_storage_fields_are_refused(kwargs: dict[str, Any], err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        HiCacheConfig(**kwargs)


def test_backend_is_built_from_the_config(tmp_path: Any) -> None:
    kv = TokenAllocator(8, pool=KVPool(8, 1, 1, 2, torch.float32))
    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"),
                        hicache_storage_max_bytes=1 << 20)
    cache = RadixCache(CacheConfig(), kv_allocator=kv, hicache=cfg)
    store = cache.storage.backend  # type: ignore[union-attr]
    assert isinstance(store, FileStore) and store.max_bytes == 1 << 20
    assert store.tag == "model=default;page=1;kv=1x1x2:torch.float32"
    cfg = HiCacheConfig(hicache_storage_backend="redis",
                        hicache_storage_url="rediss://u:pw@127.0.0.1:1,rediss://127.0.0.1:2",
                        hicache_storage_timeout_s=0.1)
    cache = RadixCache(CacheConfig(), kv_allocator=TokenAllocator(8), hicache=cfg)
    store = cache.storage.backend  # type: ignore[union-attr]
    assert isinstance(store, RedisStore) and store.timeout_s == 0.1
    assert store.tag.endswith("kv=none")  # an index-only cache stores empty pages
    assert repr(store) == ("RedisStore(urls='rediss://***:***@127.0.0.1:1,rediss://127.0.0.1:2', "
                           "cluster=None, prefix='hpc:')")  # nothing connected yet


def test_redact_url() -> None:
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("rediss://user:pw@h:1/0?x=1") == "rediss://***:***@h:1/0?x=1"
    assert redact_url("redis://:pw@h") == "redis://***:***@h"
