"""HiCache configuration (SGLang's server-argument names)."""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.storage.page import MIN_SECRET_BYTES

if TYPE_CHECKING:
    from hicache.storage.base import StorageBackend

#: Write policies (SGLang ``--hicache-write-policy``).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

#: The longest wait a timeout may ask for [s]: ``threading.TIMEOUT_MAX``, past which the
#: platform's waits (``Event.wait``, socket timeouts) raise ``OverflowError``.
MAX_WAIT_S = threading.TIMEOUT_MAX

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

#: The built-in L3 storage backends (``hicache_storage_backend``; more by
#: ``hicache.storage.register_backend``) and the prefetch policies.
STORAGE_BACKENDS = (None, "file", "redis", "mooncake", "dynamic")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")

#: Host memory modes (SGLang ``--hicache-host-memory-mode``): ``cache`` (the host pools are a
#: tier that keeps its copies). SGLang's ``buffer_only`` (host memory only a staging buffer
#: between the device and L3) is refused by name: the host tier here always keeps its copies.
HOST_MEMORY_MODES = ("cache",)

#: Keys of ``hicache_storage_backend_extra_config`` SGLang's HiCache reads for itself, whatever
#: the backend, with SGLang's defaults: the ``timeout`` prefetch policy's wait is
#: ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024`` [s] (tokens: the
#: whole pages the prefetch looks up); ``check_server``: the backend must answer one lookup when
#: the cache is built, else the build fails (``ConnectionError``).
GENERIC_EXTRA_KEYS: dict[str, float | bool] = {
    "prefetch_timeout_base": 1.0,
    "prefetch_timeout_per_ki_token": 0.25,
    "check_server": False,
}


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
        hicache_storage_backend: L3 below the host tier: a name of
            :mod:`hicache.storage.registry` (an engine's own via
            ``hicache.storage.register_backend``, built with ``factory(config, tag)``), a
            ``hicache.storage.StorageBackend`` instance (built with the cache's layout tag), or
            ``"dynamic"`` (as SGLang's: the extra config's ``module_path`` and ``class_name``
            name a factory ``(config, tag) -> StorageBackend``, e.g. a backend class taking
            them; ``backend_name`` names it in messages), ``None`` (off), ``"file"`` (pages as
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
            JSON object, or ``@path`` to a ``.json``, ``.yaml`` / ``.yml`` (needs PyYAML) or
            ``.toml`` file. Every backend takes SGLang's generic keys
            (:data:`GENERIC_EXTRA_KEYS`: ``prefetch_timeout_base`` [s],
            ``prefetch_timeout_per_ki_token`` [s per 1024 tokens], ``check_server`` [bool]).
            The mooncake backend also reads SGLang's keys (``master_server_address``,
            ``metadata_server``, ``global_segment_size``, ``protocol``, ``device_name``,
            ``local_hostname``) and ``local_buffer_size``, ``zero_copy``, ``key_prefix``; the
            file and redis backends take no others. Parsed and checked when the config is
            built.
        hicache_storage_timeout_s: connect / socket timeout of one storage call [s].
        hicache_storage_model: model name mixed into the page keys with the pool layout, so
            two models with the same layout never share pages.
        hicache_storage_prefetch_policy: on a miss whose key continues in L3: ``best_effort`` (fetch
            in the background; the pages join the tree at a later ``match_prefix`` /
            ``poll_storage``), ``wait_complete`` (fetch before ``match_prefix`` returns, but
            wait ``hicache_storage_timeout_s`` at most in all, retries included) or
            ``timeout`` (default, as SGLang's: wait at most :meth:`prefetch_wait_s`); past the
            deadline, as best_effort. A re-match of the same key waits only for what is left
            of it.
        hicache_prefetch_timeout_s: the ``timeout`` policy's wait [s] when the extra config
            sets neither ``prefetch_timeout_base`` nor ``prefetch_timeout_per_ki_token``.
        hicache_storage_secret: a deployment secret (str, UTF-8, or bytes; at least 16 bytes)
            shared by the engines of one deployment: every L3 record then carries an
            HMAC-SHA256 under it and a record whose MAC does not check is a miss (see
            ``hicache/storage/README.md``, threat model). ``None`` (default): taken from the
            ``HICACHE_STORAGE_SECRET`` environment variable when that is set, else records are
            checksummed only. Never in ``repr``, logs or error messages.
        hicache_host_memory_mode: SGLang's ``--hicache-host-memory-mode``: ``cache`` (the only
            mode, SGLang's default: the host pools keep their copies); ``buffer_only`` is
            refused (:data:`HOST_MEMORY_MODES`).
        hicache_host_memory_fraction: SGLang's ``--hicache-host-memory-fraction`` (default
            0.8): when the host pools are sized by ``hicache_ratio`` (``hicache_size`` 0), the
            share of the host memory available when they are built (``MemAvailable``, bounded
            by the cgroup's ``memory.max``; see ``hicache.host_pools.host_memory_budget``) they
            may take together (KV, state and SWA host pools); one ratio, reduced until they
            all fit (``hicache.host_pools.fit_host_ratio``), and the build fails (ValueError)
            when a pool larger than the device pool does not fit. ``None``: no cap. In (0, 1].
            Unlike SGLang, no 10 GiB reserve is kept back and an explicit ratio is capped too
            (a dataclass cannot tell a given 2.0 from the default).

    Raises:
        TypeError / ValueError: naming the argument.
    """

    hicache_ratio: float = 2.0
    hicache_size: float = 0
    hicache_write_policy: str = "write_through"
    load_back_threshold: int = 10
    hicache_io_backend: str = "direct"
    hicache_mem_layout: str = "page_first"
    hicache_storage_backend: str | StorageBackend | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_max_bytes: int | None = None
    hicache_storage_url: str | None = field(default=None, repr=False)
    hicache_storage_timeout_s: float = 1.0
    hicache_storage_model: str = "default"
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend_extra_config: str | None = None
    hicache_prefetch_timeout_s: float = 0.5
    hicache_storage_secret: str | bytes | None = field(default=None, repr=False)
    hicache_host_memory_mode: str = "cache"
    hicache_host_memory_fraction: float | None = 0.8
    _secret: bytes | None = field(init=False, repr=False, compare=False, default=None)
    #: ``(prefetch_timeout_base, prefetch_timeout_per_ki_token)`` when the extra config sets
    #: either, else ``None`` (parsed once, when the config is built).
    _timeouts: tuple[float, float] | None = field(init=False, repr=False, compare=False,
                                                  default=None)

    def __post_init__(self) -> None:
        r = self.hicache_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"hicache_ratio must be a number > 1, got {type(r).__name__}")
        if not _finite(r) or r <= 1.0:
            raise ValueError(f"hicache_ratio must be a finite number > 1 (host larger than device), got {r}")
        g = self.hicache_size
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not _finite(g) or g < 0 \
                or not math.isfinite(float(g) * 1e9):  # the byte count (host_size_bytes) too
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
        self._check_host_memory()
        self._check_storage()

    def _check_host_memory(self) -> None:
        """``hicache_host_memory_mode`` / ``hicache_host_memory_fraction`` (SGLang's names)."""
        mode = self.hicache_host_memory_mode
        if mode == "buffer_only":
            raise ValueError(
                "hicache_host_memory_mode='buffer_only' (host memory only a staging buffer "
                "between the device and L3) is not supported: the host tier keeps its copies; "
                f"expected one of {list(HOST_MEMORY_MODES)}")
        if not isinstance(mode, str) or mode not in HOST_MEMORY_MODES:
            raise ValueError(f"hicache_host_memory_mode={mode!r} is unknown; expected one of "
                             f"{list(HOST_MEMORY_MODES)}")
        f = self.hicache_host_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not _finite(f) or not 0 < f <= 1):
            raise ValueError(f"hicache_host_memory_fraction must be a number in (0, 1] or None, "
                             f"got {f!r}")

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
        if not self._known_backend(backend):
            from hicache.storage.registry import backend_names

            raise ValueError(f"hicache_storage_backend={backend!r} is unknown; expected None, one "
                             f"of {backend_names()} (hicache.storage.register_backend) or a "
                             "hicache.storage.StorageBackend instance")
        d, url, cap = self.hicache_storage_dir, self.hicache_storage_url, self.hicache_storage_max_bytes
        if d is not None and not isinstance(d, str):
            raise TypeError(f"hicache_storage_dir must be a str path or None, got {type(d).__name__}")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"hicache_storage_url must be a str or None, got {type(url).__name__}")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"hicache_storage_max_bytes must be a positive int or None, got {cap!r}")
        if backend == "file" and not d:
            raise ValueError('hicache_storage_backend="file" needs hicache_storage_dir (a directory)')
        if backend == "file" and d:
            check_storage_dir(d, "hicache_storage_dir")
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
        elif url is not None and (not isinstance(backend, str) or backend == "file"):
            raise ValueError(f"hicache_storage_url is for the redis backend (redis://), the mooncake "
                             f"backend (mooncake://) or a registered / dynamic backend; "
                             f"hicache_storage_backend is {backend!r}")
        for name in ("hicache_storage_timeout_s", "hicache_prefetch_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0 [s], got {v!r}")
            if v > MAX_WAIT_S:
                raise ValueError(f"{name} must be at most {MAX_WAIT_S:.0f} s (threading.TIMEOUT_MAX, "
                                 f"the longest wait the platform takes), got {v!r}")
        if not isinstance(self.hicache_storage_model, str):
            raise TypeError(f"hicache_storage_model must be a str, got {type(self.hicache_storage_model).__name__}")
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"hicache_storage_prefetch_policy={self.hicache_storage_prefetch_policy!r} is unknown; "
                f"expected one of {list(PREFETCH_POLICIES)}"
            )
        self._check_extra_config()
        object.__setattr__(self, "_secret", self._resolve_secret())

    @staticmethod
    def _known_backend(backend: Any) -> bool:
        """``None``, a built-in or registered name, or a ``StorageBackend`` instance."""
        from hicache.storage.base import StorageBackend
        from hicache.storage.registry import is_known

        if backend is None or isinstance(backend, StorageBackend):
            return True
        return isinstance(backend, str) and is_known(backend)

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
        """``hicache_storage_backend_extra_config`` parsed, less SGLang's generic keys
        (:meth:`generic_extra`): the backend's own options (a new dict each call)."""
        from hicache.storage.mooncake_options import load_extra_config

        extra = load_extra_config(self.hicache_storage_backend_extra_config)
        return {k: v for k, v in extra.items() if k not in GENERIC_EXTRA_KEYS}

    def generic_extra(self) -> dict[str, Any]:
        """SGLang's generic extra-config keys (:data:`GENERIC_EXTRA_KEYS`), each the extra
        config's value or SGLang's default, checked.

        Raises:
            ValueError: a timeout that is not a finite number >= 0 [s], a ``check_server``
                that is not a bool (naming the key).
        """
        from hicache.storage.mooncake_options import load_extra_config

        extra = load_extra_config(self.hicache_storage_backend_extra_config)
        out = {k: extra.get(k, d) for k, d in GENERIC_EXTRA_KEYS.items()}
        for k in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
            v = out[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v < 0 \
                    or v > MAX_WAIT_S:
                raise ValueError(f"hicache_storage_backend_extra_config {k} must be a finite "
                                 f"number >= 0 [s], at most {MAX_WAIT_S:.0f} "
                                 f"(threading.TIMEOUT_MAX), got {v!r}")
            out[k] = float(v)
        if not isinstance(out["check_server"], bool):
            raise ValueError("hicache_storage_backend_extra_config check_server must be true or "
                             f"false, got {out['check_server']!r}")
        return out

    def prefetch_wait_s(self, tokens: int) -> float | None:
        """How long a match waits in all for the prefetch of ``tokens`` tokens [s]:
        ``wait_complete``: ``hicache_storage_timeout_s``; ``timeout``:
        ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024`` (at most
        :data:`MAX_WAIT_S`) when the extra config sets either key (the other at SGLang's
        default), else ``hicache_prefetch_timeout_s``; ``best_effort``: ``None`` (no wait)."""
        policy = self.hicache_storage_prefetch_policy
        if policy == "wait_complete":
            return self.hicache_storage_timeout_s
        if policy != "timeout":
            return None
        if self._timeouts is None:
            return self.hicache_prefetch_timeout_s
        base, per_ki = self._timeouts
        return min(base + per_ki * tokens / 1024, MAX_WAIT_S)  # a long prompt: the longest wait

    def _check_extra_config(self) -> None:
        from hicache.storage.mooncake_options import load_extra_config

        x = self.hicache_storage_backend_extra_config
        if x is not None and not isinstance(x, str):
            raise TypeError("hicache_storage_backend_extra_config must be a JSON string or '@file', "
                            f"got {type(x).__name__}")
        generic = self.generic_extra()
        given = load_extra_config(x)
        if "prefetch_timeout_base" in given or "prefetch_timeout_per_ki_token" in given:
            object.__setattr__(self, "_timeouts", (generic["prefetch_timeout_base"],
                                                   generic["prefetch_timeout_per_ki_token"]))
        extra = self.extra_config()
        if self.hicache_storage_backend == "mooncake":
            from hicache.storage.mooncake_options import MooncakeOptions

            MooncakeOptions.resolve(self.hicache_storage_url, extra)
        elif self.hicache_storage_backend == "dynamic":
            from hicache.storage.registry import load_dynamic

            load_dynamic(extra)
        elif extra and self.hicache_storage_backend in ("file", "redis"):
            raise ValueError(f"hicache_storage_backend_extra_config keys {sorted(extra)} are not "
                             f"accepted by hicache_storage_backend={self.hicache_storage_backend!r}")


def _finite(x: int | float) -> bool:
    """Whether the number ``x`` is finite as a float (an int too large for one is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def check_storage_dir(path: str, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``path`` can be the file store's directory: no NUL,
    within the system's path and name length limits, not an existing non-directory, and the
    directory (or, when it does not exist yet, its nearest existing parent, where it will be
    made) writable and searchable by this process. A probe of the filesystem as it is when the
    config is built (permissions may still change later: writes then count as faults)."""
    if "\0" in path:
        raise ValueError(f"{name} must not contain a NUL character, got {path!r}")
    raw = os.fsencode(path)
    p = os.path.abspath(path)
    probe = p
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        path_max = os.pathconf(probe, "PC_PATH_MAX")
        name_max = os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        path_max, name_max = 4096, 255
    if len(os.fsencode(p)) >= path_max or any(len(part) > name_max for part in raw.split(b"/")):
        raise ValueError(f"{name} is too long for this filesystem (at most {path_max - 1} bytes, "
                         f"{name_max} per name), got {len(raw)} bytes")
    if not os.path.isdir(probe):
        where = "" if probe == p else f" (its parent {probe!r} is not one)"
        raise ValueError(f"{name} must be a directory{where}, got {path!r}: an existing file")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "it" if probe == p else f"its parent {probe!r}, where it would be made,"
        raise ValueError(f"{name}={path!r}: {what} is not writable by this process")
