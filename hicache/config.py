"""HiCache configuration (SGLang's server-argument names)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from hicache.storage.page import MIN_SECRET_BYTES

#: Write policies (SGLang ``--hicache-write-policy``).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

#: The environment variable a deployment secret for L3 pages may come from.
SECRET_ENV = "HICACHE_STORAGE_SECRET"

#: How rows move between the device and the pinned host pools (SGLang ``--hicache-io-backend``):
#: ``direct``: ``cudaMemcpyAsync`` (``copy_(non_blocking=True)``) between one contiguous run of
#: host slots and a device temporary the GPU gathers / scatters; ``kernel``: a GPU kernel
#: (torch's own index kernels) reads and writes the pinned host pool directly through its
#: mapped device address (needs CUDA).
IO_BACKENDS = ("direct", "kernel")

#: Host pool layouts (SGLang ``--hicache-mem-layout``): ``layer_first`` ``[layers, slots, ...]``
#: (a run of slots is one contiguous range per layer: load-back lands layer by layer);
#: ``page_first`` ``[slots, layers, ...]`` (a run of slots, every layer, is one contiguous
#: range: one copy per run and direction).
MEM_LAYOUTS = ("layer_first", "page_first")

#: L3 storage backends (``hicache_storage_backend``) and prefetch policies.
STORAGE_BACKENDS = (None, "file", "redis", "mooncake")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class HiCacheConfig:
    """Host (L2) tier of the prefix cache.

    Args:
        hicache_ratio: host pool size as a multiple of the device pool (default 2.0, SGLang's
            default); must be > 1 so the host can hold more than the device.
        hicache_size: host pool size in GB (10**9 bytes, as SGLang's ``--hicache-size``)
            instead of the ratio; 0 (default): use the ratio. Fractions are allowed (small
            pools). Must also exceed the device pool.
        hicache_write_policy: ``write_through`` (back up a node when it is inserted),
            ``write_through_selective`` (once its hit count reaches 2), ``write_back`` (only
            when it is evicted from device).
        load_back_threshold: host-only chains shorter than this are not loaded back [tokens]
            (SGLang's default 10: reloading a few tokens costs more than recomputing them).
        hicache_io_backend: how rows move between the device pools and the pinned host pools
            (:data:`IO_BACKENDS`): ``direct`` (default) or ``kernel``. Neither copies on the
            CPU. ``kernel`` needs CUDA.
        hicache_mem_layout: the host pools' layout (:data:`MEM_LAYOUTS`): ``page_first``
            (default: the fewest, largest copies) or ``layer_first`` (load-back lands layer by
            layer; see ``hicache.controller``).
        hicache_storage_backend: L3 below the host tier: ``None`` (off), ``"file"`` (pages as
            files in ``hicache_storage_dir``), ``"redis"`` (``hicache_storage_url``) or
            ``"mooncake"`` (Mooncake Store: ``hicache_storage_url="mooncake://host:port"`` of
            its master, or the extra config / ``MOONCAKE_*`` environment, as SGLang reads them:
            :mod:`hicache.storage.mooncake_options`).
        hicache_storage_dir: the file store's directory.
        hicache_storage_max_bytes: the file store's size cap [bytes] (``None``: no cap); the
            least recently used pages go first.
        hicache_storage_url: ``redis://[user:password@]host:port[/db]`` or ``rediss://``
            (TLS); comma-separated URLs are startup nodes of one cluster; ``mooncake://host:port``
            (the Mooncake master). Not in ``repr``.
        hicache_storage_backend_extra_config: the backend's options as SGLang takes them: a
            JSON object, or ``@path`` to a ``.json`` / ``.toml`` file. The mooncake backend
            reads SGLang's keys (``master_server_address``, ``metadata_server``,
            ``global_segment_size``, ``protocol``, ``device_name``, ``local_hostname``) and
            ``local_buffer_size``, ``zero_copy``, ``key_prefix``; the file and redis backends
            take none. Parsed and checked when the config is built.
        hicache_storage_timeout_s: connect / socket timeout of one storage call [s].
        hicache_storage_model: model name mixed into the page keys with the pool layout, so
            two models with the same layout never share pages.
        hicache_storage_prefetch_policy: on a miss whose key continues in L3: ``best_effort`` (fetch
            in the background; the pages join the tree at a later ``match_prefix`` /
            ``poll_storage``), ``wait_complete`` (fetch before ``match_prefix`` returns, but
            wait ``hicache_storage_timeout_s`` at most in all, retries included) or
            ``timeout`` (wait at most ``hicache_prefetch_timeout_s``); past the deadline, as
            best_effort. A re-match of the same key waits only for what is left of it.
        hicache_prefetch_timeout_s: the ``timeout`` policy's wait [s].
        hicache_storage_secret: a deployment secret (str, UTF-8, or bytes; at least 16 bytes)
            shared by the engines of one deployment: every L3 record then carries an
            HMAC-SHA256 under it and a record whose MAC does not check is a miss (see
            ``hicache/storage/README.md``, threat model). ``None`` (default): taken from the
            ``HICACHE_STORAGE_SECRET`` environment variable when that is set, else records are
            checksummed only. Never in ``repr``, logs or error messages.

    Raises:
        TypeError / ValueError: naming the argument.
    """

    hicache_ratio: float = 2.0
    hicache_size: float = 0
    hicache_write_policy: str = "write_through"
    load_back_threshold: int = 10
    hicache_io_backend: str = "direct"
    hicache_mem_layout: str = "page_first"
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_max_bytes: int | None = None
    hicache_storage_url: str | None = field(default=None, repr=False)
    hicache_storage_timeout_s: float = 1.0
    hicache_storage_model: str = "default"
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: str | None = None
    hicache_prefetch_timeout_s: float = 0.5
    hicache_storage_secret: str | bytes | None = field(default=None, repr=False)
    _secret: bytes | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        r = self.hicache_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"hicache_ratio must be a number > 1, got {type(r).__name__}")
        if not math.isfinite(r) or r <= 1.0:
            raise ValueError(f"hicache_ratio must be a finite number > 1 (host larger than device), got {r}")
        g = self.hicache_size
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(f"hicache_size must be a finite number >= 0 [GB; 0: use hicache_ratio], got {g!r}")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy={self.hicache_write_policy!r} is unknown; expected one of "
                f"{list(WRITE_POLICIES)}"
            )
        t = self.load_back_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"load_back_threshold must be an int >= 0 [tokens], got {t!r}")
        self._check_io()
        self._check_storage()

    def _check_io(self) -> None:
        """``hicache_io_backend`` / ``hicache_mem_layout``: known names; ``kernel`` only where
        CUDA is."""
        for name, choices in (("hicache_io_backend", IO_BACKENDS), ("hicache_mem_layout", MEM_LAYOUTS)):
            v = getattr(self, name)
            if not isinstance(v, str) or v not in choices:
                raise ValueError(f"{name}={v!r} is unknown; expected one of {list(choices)}")
        if self.hicache_io_backend == "kernel":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "hicache_io_backend='kernel' needs CUDA (a GPU kernel reading the pinned host "
                    f"pool) and this machine has none; expected one of {list(IO_BACKENDS)} "
                    "('direct' works everywhere)")

    def _check_storage(self) -> None:
        """L3 fields (``hicache_storage_*``, ``hicache_prefetch_*``); errors name the field and
        never echo a URL's credentials."""
        backend = self.hicache_storage_backend
        if backend not in STORAGE_BACKENDS:
            raise ValueError(
                f"hicache_storage_backend={backend!r} is unknown; expected one of {list(STORAGE_BACKENDS)}"
            )
        d, url, cap = self.hicache_storage_dir, self.hicache_storage_url, self.hicache_storage_max_bytes
        if d is not None and not isinstance(d, str):
            raise TypeError(f"hicache_storage_dir must be a str path or None, got {type(d).__name__}")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"hicache_storage_url must be a str or None, got {type(url).__name__}")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"hicache_storage_max_bytes must be a positive int or None, got {cap!r}")
        if backend == "file" and not d:
            raise ValueError('hicache_storage_backend="file" needs hicache_storage_dir (a directory)')
        if backend != "file" and (d is not None or cap is not None):
            raise ValueError(
                "hicache_storage_dir / hicache_storage_max_bytes are for the file backend; "
                f"hicache_storage_backend is {backend!r}"
            )
        if backend == "redis":
            if not url:
                raise ValueError('hicache_storage_backend="redis" needs hicache_storage_url (redis://host:port)')
            from hicache.storage.redis_store import split_urls

            split_urls(url, "hicache_storage_url")  # ValueError with credentials masked
        elif url is not None and backend != "mooncake":
            raise ValueError(f"hicache_storage_url is for the redis backend (redis://) or the mooncake "
                             f"backend (mooncake://); hicache_storage_backend is {backend!r}")
        for name in ("hicache_storage_timeout_s", "hicache_prefetch_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0 [s], got {v!r}")
        if not isinstance(self.hicache_storage_model, str):
            raise TypeError(f"hicache_storage_model must be a str, got {type(self.hicache_storage_model).__name__}")
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"hicache_storage_prefetch_policy={self.hicache_storage_prefetch_policy!r} is unknown; "
                f"expected one of {list(PREFETCH_POLICIES)}"
            )
        self._check_extra_config()
        object.__setattr__(self, "_secret", self._resolve_secret())

    def _resolve_secret(self) -> bytes | None:
        """The deployment secret as bytes (the setting, else the environment), checked; the
        errors never show it."""
        value: Any = self.hicache_storage_secret
        name = "hicache_storage_secret"
        if value is None:
            value = os.environ.get(SECRET_ENV) or None
            name = f"{SECRET_ENV} (environment)"
            if value is None:
                return None
        if isinstance(value, str):
            value = value.encode("utf-8")
        if not isinstance(value, bytes):
            raise TypeError(f"{name} must be a str or bytes, got {type(value).__name__}")
        if len(value) < MIN_SECRET_BYTES:
            raise ValueError(f"{name} must be at least {MIN_SECRET_BYTES} bytes (got {len(value)}); "
                             "use a random secret, e.g. 32 bytes from secrets.token_hex")
        return value

    @property
    def storage_secret(self) -> bytes | None:
        """The deployment secret L3 records are authenticated with, or ``None``."""
        return self._secret

    @property
    def host_size_bytes(self) -> int | None:
        """``hicache_size`` in bytes (``None``: size by the ratio)."""
        return round(self.hicache_size * 1e9) if self.hicache_size else None

    def extra_config(self) -> dict[str, Any]:
        """``hicache_storage_backend_extra_config`` parsed (a new dict each call)."""
        from hicache.storage.mooncake_options import load_extra_config

        return load_extra_config(self.hicache_storage_backend_extra_config)

    def _check_extra_config(self) -> None:
        x = self.hicache_storage_backend_extra_config
        if x is not None and not isinstance(x, str):
            raise TypeError("hicache_storage_backend_extra_config must be a JSON string or '@file', "
                            f"got {type(x).__name__}")
        extra = self.extra_config()
        if self.hicache_storage_backend == "mooncake":
            from hicache.storage.mooncake_options import MooncakeOptions

            MooncakeOptions.resolve(self.hicache_storage_url, extra)
        elif extra:
            raise ValueError(f"hicache_storage_backend_extra_config keys {sorted(extra)} are not "
                             f"accepted by hicache_storage_backend={self.hicache_storage_backend!r}")
