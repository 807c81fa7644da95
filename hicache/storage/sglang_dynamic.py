"""The class SGLang's ``dynamic`` storage backend loads (needs SGLang installed).

SGLang's loader accepts only subclasses of its own ``HiCacheStorage``; this module makes
:class:`~hicache.storage.sglang_adapter.SGLangStorageAdapter` one. Extra config::

    {"backend_name": "hpc", "module_path": "hicache.storage.sglang_dynamic",
     "class_name": "HiCacheStorageAdapter", "hpc_backend": "file",
     "hicache_storage_dir": "/var/cache/l3"}

Raises:
    ImportError: on import, where SGLang is not installed.
"""

from __future__ import annotations

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from hicache.storage.sglang_adapter import SGLangStorageAdapter

__all__ = ["HiCacheStorageAdapter"]


class HiCacheStorageAdapter(SGLangStorageAdapter, HiCacheStorage):
    """:class:`~hicache.storage.sglang_adapter.SGLangStorageAdapter` as an SGLang
    ``HiCacheStorage`` (the adapter's methods come first)."""
