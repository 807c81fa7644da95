"""SGLang's ``HiCacheStorage`` interface over this library's L3 backends.

:class:`SGLangStorageAdapter` answers the calls SGLang 0.5.23's HiCache makes on a storage
backend (its ``hicache_storage.HiCacheStorage`` base class): ``register_mem_pool_host``,
``batch_exists(keys)`` (the leading run found), ``batch_get_v1(keys, host_indices)`` /
``batch_set_v1(keys, host_indices)`` (pages moved between the registered host pool and the
store), and the older ``get`` / ``set`` / ``batch_get`` / ``batch_set`` / ``exists`` on flat
page tensors, plus ``clear`` / ``get_stats`` / ``close``. The multi-pool ``*_v2`` calls (hybrid
models) are not answered (``NotImplementedError``, as SGLang's base class).

SGLang loads it with its ``dynamic`` backend through :mod:`hicache.storage.sglang_dynamic`
(which makes it a subclass of SGLang's own base class)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hpc", "module_path": "hicache.storage.sglang_dynamic",
        "class_name": "HiCacheStorageAdapter",
        "hpc_backend": "file", "hicache_storage_dir": "/var/cache/l3"}'

Extra-config keys read here (:data:`ADAPTER_KEYS`): ``hpc_backend`` (a name of
:mod:`hicache.storage.registry`, default ``"file"``), ``hicache_storage_dir`` (SGLang's
``file_storage_path`` is taken for it too), ``hicache_storage_url``,
``hicache_storage_max_bytes``, ``hicache_storage_timeout_s``, ``hicache_storage_secret``,
``backend_extra_config`` (a mapping: the backend's own options). The keys SGLang reads for
itself (:data:`SGLANG_KEYS`) are left to it; any other key is refused by name.

Data: SGLang's host pool gives one flat tensor per page (``get_data_page(index, flat=True)``,
``set_from_flat_data_page(index, tensor)``, ``get_dummy_flat_data_page()`` for the dtype and
shape); its bytes are section ``a`` of one of this library's records (``b`` empty), so they are
checksummed (or MAC'd under ``hicache_storage_secret``) and verified on read. SGLang's keys
(any str) map to the library's page keys as ``sha256(key)``. Records carry the layout tag
``sglang:<model>:<shard>`` (:func:`sglang_tag`), so a page of another model or TP shard is a
miss.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hicache.storage.base import StorageBackend

#: Extra-config keys this adapter reads.
ADAPTER_KEYS = ("hpc_backend", "hicache_storage_dir", "file_storage_path", "hicache_storage_url",
                "hicache_storage_max_bytes", "hicache_storage_timeout_s",
                "hicache_storage_secret", "backend_extra_config")
#: Extra-config keys SGLang itself reads (its ``dynamic`` loader, its HiCache controller).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")


def page_key_of(key: str) -> str:
    """The library's page key (64 hex digits) of one SGLang key (any str).

    Raises:
        TypeError: ``key`` not a str.
    """
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def sglang_tag(storage_config: Any) -> str:
    """The layout tag of an SGLang ``HiCacheStorageConfig``: model, and the shard whose
    pages this rank holds (MLA pages are shared by the TP ranks, as SGLang's file backend
    keys them)."""
    model = (getattr(storage_config, "model_name", None) or "").replace("/", "-")
    parts = [f"sglang:{model}"]
    if not getattr(storage_config, "is_mla_model", False):
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    if getattr(storage_config, "pp_size", 1) > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    if getattr(storage_config, "attn_cp_size", 1) > 1:
        parts.append(f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
    return ":".join(parts)


def backend_from_extra(extra: Mapping[str, Any], tag: str) -> StorageBackend:
    """The library backend an SGLang extra config names (see the module docstring).

    Raises:
        ValueError: an unknown key (naming it), an unknown ``hpc_backend``, the backend's
            own settings refused by ``HiCacheConfig`` (naming them).
    """
    from hicache.config import HiCacheConfig
    from hicache.storage import make_backend

    unknown = sorted(set(extra) - set(ADAPTER_KEYS) - set(SGLANG_KEYS))
    if unknown:
        raise ValueError(f"hicache_storage_backend_extra_config: unknown key(s) {unknown} for "
                         f"the hpc adapter; accepted: {list(ADAPTER_KEYS)} (and SGLang's own "
                         f"{list(SGLANG_KEYS)})")
    fields: dict[str, Any] = {k: extra[k] for k in ADAPTER_KEYS
                              if k in extra and k.startswith("hicache_storage_")}
    if "file_storage_path" in extra and "hicache_storage_dir" not in fields:
        fields["hicache_storage_dir"] = extra["file_storage_path"]
    inner = extra.get("backend_extra_config")
    if inner is not None:
        if not isinstance(inner, Mapping):
            raise ValueError("hicache_storage_backend_extra_config backend_extra_config must be a "
                             f"mapping, got {type(inner).__name__}")
        fields["hicache_storage_backend_extra_config"] = json.dumps(dict(inner))
    cfg = HiCacheConfig(hicache_storage_backend=extra.get("hpc_backend", "file"), **fields)
    backend = make_backend(cfg, tag)
    assert backend is not None
    return backend


class SGLangStorageAdapter:
    """One of this library's backends behind SGLang's ``HiCacheStorage`` calls.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (as its ``dynamic`` loader passes
            it): its ``extra_config`` names the backend (module docstring) and its model /
            ranks give the layout tag. ``None`` with ``backend``.
        kwargs: what SGLang's loader passes second (unused).
        backend: a backend to wrap instead (built with any tag).

    Raises:
        TypeError: neither ``storage_config`` nor ``backend``, or a ``backend`` that is not a
            ``hicache.storage.StorageBackend``.
        ValueError: see :func:`backend_from_extra`.
    """

    def __init__(self, storage_config: Any = None, kwargs: Mapping[str, Any] | None = None, *,
                 backend: StorageBackend | None = None) -> None:
        if backend is not None:
            if not isinstance(backend, StorageBackend):
                raise TypeError("backend must be a hicache.storage.StorageBackend, got "
                                f"{type(backend).__name__}")
            self.backend = backend
        elif storage_config is None:
            raise TypeError("SGLangStorageAdapter needs storage_config (SGLang's "
                            "HiCacheStorageConfig) or backend=")
        else:
            extra = getattr(storage_config, "extra_config", None) or {}
            self.backend = backend_from_extra(extra, sglang_tag(storage_config))
        self.mem_pool_host: Any = None

    # ------------------------------------------------------------ host pool
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool ``batch_get_v1`` / ``batch_set_v1`` move pages in and out of (it
        gives ``page_size``, ``get_data_page``, ``set_from_flat_data_page``,
        ``get_dummy_flat_data_page``)."""
        self.mem_pool_host = mem_pool_host

    def _pool(self) -> Any:
        if self.mem_pool_host is None:
            raise RuntimeError("register_mem_pool_host was not called: batch_get_v1 / "
                               "batch_set_v1 need SGLang's host pool")
        return self.mem_pool_host

    @staticmethod
    def _page_index(host_indices: torch.Tensor, i: int, page_size: int) -> int:
        return int(host_indices[i * page_size])

    @staticmethod
    def _check_run(keys: Sequence[str], host_indices: torch.Tensor, page_size: int) -> None:
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(f"host_indices must hold len(keys) x page_size = "
                             f"{len(keys) * page_size} slots, got {len(host_indices)}")

    # --------------------------------------------------------------- v1 calls
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store page ``i`` of the host pool (slots ``host_indices[i*page_size:...]``) under
        ``keys[i]``; for each key, whether the store holds it afterwards."""
        pool = self._pool()
        self._check_run(keys, host_indices, pool.page_size)
        values = [pool.get_data_page(self._page_index(host_indices, i, pool.page_size), flat=True)
                  for i in range(len(keys))]
        return self._set_many(keys, values)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load ``keys[i]`` into page ``i`` of the host pool, up to the first key missing (or
        failing verification); for each key, whether it was loaded."""
        pool = self._pool()
        self._check_run(keys, host_indices, pool.page_size)
        like = pool.get_dummy_flat_data_page()
        out = [False] * len(keys)
        for i, page in enumerate(self.backend.batch_get([page_key_of(k) for k in keys])):
            value = None if page is None else self._tensor(page.a, like)
            if value is None:
                break
            pool.set_from_flat_data_page(self._page_index(host_indices, i, pool.page_size), value)
            out[i] = True
        return out

    # ------------------------------------------------------ flat-tensor calls
    @staticmethod
    def _bytes(value: torch.Tensor) -> bytes:
        return bytes(value.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())

    @staticmethod
    def _tensor(data: memoryview, like: torch.Tensor | None) -> torch.Tensor | None:
        """``data`` as a tensor shaped as ``like`` (uint8 without it); ``None`` when the size
        differs."""
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(
            0, dtype=torch.uint8)
        if like is None:
            return raw
        if raw.numel() != like.numel() * like.element_size():
            return None
        return raw.view(like.dtype).reshape(like.shape)

    def _set_many(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        pks = [page_key_of(k) for k in keys]
        self.backend.batch_set([(pk, self._bytes(v), b"") for pk, v in zip(pks, values, strict=True)])
        return self.backend.exists_mask(pks)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """The page under ``key``, copied into ``target_location`` when given (its dtype and
        shape; a stored page of another size is a miss), else a flat uint8 tensor."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[torch.Tensor | None]:
        """:meth:`get` of each key."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for page, target in zip(self.backend.batch_get([page_key_of(k) for k in keys]), targets,
                                strict=True):
            value = None if page is None else self._tensor(page.a, target)
            if value is not None and target is not None:
                target.copy_(value)
                value = target
            out.append(value)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store the tensor ``value`` (or ``target_location``) under ``key``; whether the store
        holds it afterwards."""
        return self._set_many([key], [value if value is not None else target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """:meth:`set` of each key; whether every one is held."""
        vals = list(values if values is not None else target_locations)
        return all(self._set_many(keys, vals))

    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a record (unverified: a get still checks it)."""
        return self.backend.exists_mask([page_key_of(key)])[0]

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys`` exist consecutively from the start."""
        return self.backend.batch_exists([page_key_of(k) for k in keys])

    # ------------------------------------------------------------------ rest
    def clear(self) -> None:
        """Kept as SGLang's base class's: the library's stores are shared by engines and are
        not wiped by one of them."""

    def get_stats(self) -> dict[str, int]:
        """The backend's counters (``hicache.storage.COUNTERS`` and its own)."""
        return self.backend.stats

    def close(self) -> None:
        """Release the backend's connections."""
        self.backend.close()
