"""HiCache L3: pages keyed by a hash chain, in a local file store, Redis / Valkey or Mooncake Store.

Contract: ``host slots <-> storage pages``.

* :mod:`~hicache.storage.keys` — page keys: SHA-256 chain seeded by layout tag and namespace.
* :mod:`~hicache.storage.page` — one record: header (version, tag, key, lengths), checksum.
* :mod:`~hicache.storage.base` — :class:`StorageBackend`: ``exists / get / set``, batch forms,
  ``batch_exists`` = leading run; verification on read; faults are counted misses.
* :mod:`~hicache.storage.file_store` / :mod:`~hicache.storage.redis_store` /
  :mod:`~hicache.storage.mooncake_store` — the backends (Mooncake's options:
  :mod:`~hicache.storage.mooncake_options`, resolved as SGLang resolves them).
* :mod:`~hicache.storage.registry` — backends by name: :func:`register_backend` for an
  engine's own; an instance may be given to ``hicache_storage_backend`` directly.
* :mod:`~hicache.storage.sglang_adapter` — SGLang's ``HiCacheStorage`` interface over a backend
  (SGLang's ``dynamic`` backend can load it).
* :mod:`~hicache.storage.controller` — packing host bytes, background writes, prefetch jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.storage.base import COUNTERS, Page, StorageBackend
from hicache.storage.controller import PrefetchJob, StorageController
from hicache.storage.file_store import FileStore
from hicache.storage.keys import (
    chain_seed,
    encode_namespace,
    end_key,
    kv_layout,
    layout_tag,
    layout_tag_of,
    page_hashes,
    page_key,
    state_key,
    state_layout,
)
from hicache.storage.mooncake_options import MooncakeOptions
from hicache.storage.page import CorruptPage
from hicache.storage.redis_store import RedisStore, redact_url
from hicache.storage.registry import (
    BUILTIN_BACKENDS,
    backend_names,
    build_dynamic,
    build_registered,
    check_tag,
    register_backend,
    unregister_backend,
)

if TYPE_CHECKING:
    from hicache.config import HiCacheConfig

__all__ = [
    "COUNTERS",
    "CorruptPage",
    "FileStore",
    "MooncakeOptions",
    "Page",
    "PrefetchJob",
    "RedisStore",
    "StorageBackend",
    "StorageController",
    "backend_names",
    "chain_seed",
    "encode_namespace",
    "end_key",
    "kv_layout",
    "layout_tag",
    "layout_tag_of",
    "make_backend",
    "page_hashes",
    "page_key",
    "redact_url",
    "register_backend",
    "state_key",
    "state_layout",
    "unregister_backend",
]


def make_backend(config: HiCacheConfig, tag: str) -> StorageBackend | None:
    """The backend ``config.hicache_storage_backend`` names or is (``None`` when off); with
    the extra config's ``check_server``, after it answered one lookup.

    Raises:
        ConnectionError: ``check_server`` and the backend did not answer.
        TypeError / ValueError: a registered factory's bad result, a backend instance or
            factory backend built with another layout tag (:mod:`hicache.storage.registry`).
        ImportError: ``redis`` without redis-py (``pip install .[redis]``), ``mooncake``
            without the Mooncake client (``.[mooncake]``, or ``.[mooncake-cuda]`` beside a GPU
            engine).
        ValueError: ``mooncake`` options that do not resolve (see ``MooncakeOptions.resolve``).
        OSError: the file store's directory cannot be created.
    """
    backend = _build(config, tag)
    if backend is not None and config.generic_extra()["check_server"]:
        try:
            backend.check_server()
        except ConnectionError:
            if backend is not config.hicache_storage_backend:  # ours to close, not the caller's
                backend.close()
            raise
    return backend


def _build(config: HiCacheConfig, tag: str) -> StorageBackend | None:
    name: str | StorageBackend | None = config.hicache_storage_backend
    if name is None:
        return None
    if isinstance(name, StorageBackend):
        check_tag(name, tag, "the hicache_storage_backend instance")
        return name
    secret = config.storage_secret
    if name == "dynamic":
        return build_dynamic(config, tag)
    if name not in BUILTIN_BACKENDS:
        return build_registered(name, config, tag)
    if name == "file":
        assert config.hicache_storage_dir is not None
        return FileStore(config.hicache_storage_dir, config.hicache_storage_max_bytes, tag=tag,
                         secret=secret)
    if name == "mooncake":
        from hicache.storage.mooncake_store import MooncakeStore

        options = MooncakeOptions.resolve(config.hicache_storage_url, config.extra_config())
        return MooncakeStore(options, tag=tag, timeout_s=config.hicache_storage_timeout_s,
                             secret=secret)
    assert name == "redis" and config.hicache_storage_url is not None
    return RedisStore(config.hicache_storage_url, tag=tag,
                      timeout_s=config.hicache_storage_timeout_s, secret=secret)
