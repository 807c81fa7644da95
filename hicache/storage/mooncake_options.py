"""Options of the Mooncake Store backend, resolved from the places SGLang reads them.

Order (the first source that names a master wins, as in SGLang's Mooncake backend):

1. ``hicache_storage_backend_extra_config`` (a JSON object, or ``@path`` to a JSON, YAML or
   TOML file) with ``master_server_address``. Keys it leaves out take the defaults below, not the
   environment.
2. ``hicache_storage_url = "mooncake://host:port"``: the master's address; the other options
   from the extra config when it has them, else from the environment.
3. A JSON file named by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` (same keys).
4. The environment: ``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``,
   ``MOONCAKE_LOCAL_HOSTNAME`` (or ``LOCAL_HOSTNAME``), ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
   ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``, ``SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE``.

==========================  ===============================  =================================
key (extra config / file)   environment                      default
==========================  ===============================  =================================
``master_server_address``   ``MOONCAKE_MASTER``              (required) ``host:port``
``metadata_server``         ``MOONCAKE_TE_META_DATA_SERVER`` ``P2PHANDSHAKE``, or an
                                                             ``http://host:port/metadata`` URL
``local_hostname``          ``MOONCAKE_LOCAL_HOSTNAME``      ``localhost``
``global_segment_size``     ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` ``4gb``: memory this client lends
                                                             the store [bytes, or ``N<unit>``]
``local_buffer_size``       ``SGLANG_MOONCAKE_LOCAL_BUFFER_  16 MiB: the client's transfer
                            SIZE``                           buffer of the copying path [bytes]
``protocol``                ``MOONCAKE_PROTOCOL``            ``tcp`` (``rdma`` needs a device)
``device_name``             ``MOONCAKE_DEVICE``              ``""`` (RDMA device names)
``zero_copy``               --                               ``true``: transfer from / into
                                                             registered buffers
``zero_copy_min_bytes``     --                               1 MiB: smaller batches take the
                                                             copying path (registering costs
                                                             more than the copy it saves)
``key_prefix``              --                               ``hpc:``
==========================  ===============================  =================================

Sizes: an int of bytes or a string ``"<number><unit>"`` with unit ``b``, ``kb``, ``mb`` or
``gb`` (powers of 1024, as SGLang's ``4gb``). SGLang's generic keys (``prefetch_timeout_base``,
``prefetch_timeout_per_ki_token``, ``check_server``) are read by ``hicache.config`` for every
backend and never reach this module; the other keys SGLang's HiCache reads for itself
(``prefetch_threshold``, ``hicache_storage_pass_prefix_keys``) and its other Mooncake keys that
have no meaning here (``master_metrics_port``, ``standalone_storage``, ...) are refused by
name, so a setting never silently does nothing.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_LOCAL_HOSTNAME = "localhost"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 << 30
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20
DEFAULT_PROTOCOL = "tcp"
#: The Mooncake client refuses a segment smaller than this [bytes] (0: lend nothing).
MIN_SEGMENT_SIZE = 16 << 20

KEYS = ("master_server_address", "metadata_server", "local_hostname", "global_segment_size",
        "local_buffer_size", "protocol", "device_name", "zero_copy", "zero_copy_min_bytes",
        "key_prefix")

_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?b)?\s*$", re.IGNORECASE)


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or ``"<n>[b|kb|mb|gb]"``; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes (int) or a size like '4gb', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(m.group(1)) * _UNITS[(m.group(2) or "b").lower()]
    raise ValueError(f"{name} must be bytes (int) or a size like '4gb' / '512mb', got {value!r}")


def load_extra_config(text: str | None) -> dict[str, Any]:
    """``hicache_storage_backend_extra_config`` as a dict: a JSON object, or ``@path`` to a
    ``.json``, ``.yaml`` / ``.yml`` (read with PyYAML's ``safe_load``) or ``.toml`` file, as
    SGLang reads it.

    Raises:
        ValueError: not a JSON object, a file that cannot be read or parsed, another extension,
            a YAML file without PyYAML installed (naming what to install).
    """
    if text is None or not text.strip():
        return {}
    if text.startswith("@"):
        path = text[1:]
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".json", ".toml", ".yaml", ".yml"):
            raise ValueError("hicache_storage_backend_extra_config file must be .json, .yaml / "
                             f".yml or .toml, got {path!r}")
        try:
            with open(path, "rb") as f:
                raw = f.read()
            if ext == ".toml":
                data = tomllib.loads(raw.decode())
            elif ext == ".json":
                data = json.loads(raw)
            else:
                data = _load_yaml(raw, path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"hicache_storage_backend_extra_config: cannot read {path!r} ({exc})") from exc
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"hicache_storage_backend_extra_config is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"hicache_storage_backend_extra_config must be a JSON object, got {type(data).__name__}")
    return data


def _load_yaml(raw: bytes, path: str) -> Any:
    """A YAML document (``yaml.safe_load``); ``ValueError`` without PyYAML or on bad YAML."""
    try:
        import yaml
    except ImportError as exc:
        raise ValueError(f"{path!r} is YAML and PyYAML is not installed (pip install pyyaml); "
                         "use a .json or .toml file instead") from exc
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from exc


def _check_address(addr: Any, name: str) -> str:
    """``addr`` if it is ``host:port`` with a port in 1..65535."""
    m = re.fullmatch(r"[^\s:/]+:(\d{1,5})", addr) if isinstance(addr, str) else None
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise ValueError(f"{name} must be 'host:port' (port 1..65535), got {addr!r}")
    return addr


def _url_port(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        return -1


def master_from_url(url: str) -> str:
    """``host:port`` from ``mooncake://host:port`` (port 1..65535; a host name or IPv4
    address, as ``master_server_address`` takes it): no credentials (the store has none),
    query or fragment, which would otherwise be dropped unseen."""
    from hicache.storage.redis_store import redact_url

    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:  # an unclosed IPv6 bracket
        host = None
    port = _url_port(url)
    if (host is None or parts.scheme != "mooncake" or ":" in host or port is None
            or not 1 <= port <= 65535 or parts.path not in ("", "/") or "@" in parts.netloc
            or parts.query or parts.fragment):
        raise ValueError(f"hicache_storage_url for mooncake must be mooncake://host:port (port "
                         f"1..65535, a host name or IPv4 address), got {redact_url(url)!r}")
    return f"{host}:{port}"


@dataclass(frozen=True)
class MooncakeOptions:
    """Resolved options of one Mooncake Store client (see the module docstring)."""

    master_server_address: str
    metadata_server: str = DEFAULT_METADATA_SERVER
    local_hostname: str = DEFAULT_LOCAL_HOSTNAME
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    protocol: str = DEFAULT_PROTOCOL
    device_name: str = ""
    zero_copy: bool = True
    zero_copy_min_bytes: int = 1 << 20
    key_prefix: str = "hpc:"
    source: str = "extra_config"

    def __post_init__(self) -> None:
        _check_address(self.master_server_address, "master_server_address")
        for name in ("metadata_server", "local_hostname", "protocol", "device_name", "key_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {getattr(self, name)!r}")
        if not self.local_hostname:
            raise ValueError("local_hostname must not be empty")
        ms = self.metadata_server
        if ms != DEFAULT_METADATA_SERVER:
            form = ("metadata_server must be P2PHANDSHAKE, http://host:port/metadata, etcd://... or "
                    f"host:port (port 1..65535), got {ms!r}")
            if ms.startswith(("http://", "etcd://", "redis://")):
                port = _url_port(ms)
                if not urlsplit(ms).hostname or (port is not None and not 1 <= port <= 65535):
                    raise ValueError(form)
            elif not re.fullmatch(r"[^\s:/]+:\d{1,5}", ms) or not 1 <= int(ms.rsplit(":", 1)[1]) <= 65535:
                raise ValueError(form)
        if not self.key_prefix:
            raise ValueError("key_prefix must not be empty (several caches share a store by prefix)")
        seg = self.global_segment_size
        if 0 < seg < MIN_SEGMENT_SIZE:
            raise ValueError(f"global_segment_size must be 0 or >= {MIN_SEGMENT_SIZE} bytes "
                             f"(16 MiB, the client's minimum), got {seg}")
        if self.local_buffer_size < 1 << 20:
            raise ValueError(f"local_buffer_size must be >= 1 MiB, got {self.local_buffer_size}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.protocol == "rdma" and not self.device_name:
            raise ValueError("protocol='rdma' needs device_name (MOONCAKE_DEVICE: the RDMA NIC, "
                             "e.g. 'mlx5_0'); the client would fail only when it connects")
        if isinstance(self.zero_copy_min_bytes, bool) or not isinstance(self.zero_copy_min_bytes, int):
            raise ValueError(f"zero_copy_min_bytes must be bytes, got {self.zero_copy_min_bytes!r}")
        if not isinstance(self.zero_copy, bool):
            raise ValueError(f"zero_copy must be true or false, got {self.zero_copy!r}")

    @classmethod
    def resolve(cls, url: str | None, extra: Mapping[str, Any],
                environ: Mapping[str, str] | None = None) -> MooncakeOptions:
        """Options from ``hicache_storage_url``, the extra config and the environment.

        Raises:
            ValueError: no master anywhere, an unknown key, a malformed value (naming it).
        """
        env = os.environ if environ is None else environ
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"hicache_storage_backend_extra_config: unknown key(s) {unknown} for "
                             f"the mooncake backend; accepted: {list(KEYS)}")
        if "master_server_address" in extra:
            if url is not None:
                raise ValueError("give the mooncake master once: hicache_storage_url or "
                                 "extra config master_server_address, not both")
            return cls._build(dict(extra), "extra_config")
        if url is not None:
            fields = dict(extra) if extra else cls._from_env(env)
            fields["master_server_address"] = master_from_url(url)
            return cls._build(fields, "url")
        path = env.get("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
        if path:
            data = load_extra_config("@" + path)
            unknown = sorted(set(data) - set(KEYS))
            if unknown:
                raise ValueError(f"{path}: unknown key(s) {unknown}; accepted: {list(KEYS)}")
            if "master_server_address" not in data:
                raise ValueError(f"{path} (SGLANG_HICACHE_MOONCAKE_CONFIG_PATH) needs master_server_address")
            return cls._build(data, "file")
        fields = {**cls._from_env(env), **extra}
        if "master_server_address" not in fields:
            raise ValueError(
                'hicache_storage_backend="mooncake" needs a master: hicache_storage_url='
                '"mooncake://host:port", extra config master_server_address, '
                "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER")
        return cls._build(fields, "env")

    @staticmethod
    def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
        names = {"master_server_address": "MOONCAKE_MASTER",
                 "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
                 "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                 "protocol": "MOONCAKE_PROTOCOL", "device_name": "MOONCAKE_DEVICE",
                 "local_buffer_size": "SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE"}
        out: dict[str, Any] = {k: env[v] for k, v in names.items() if env.get(v) is not None}
        host = env.get("MOONCAKE_LOCAL_HOSTNAME") or env.get("LOCAL_HOSTNAME")
        if host:
            out["local_hostname"] = host
        return out

    @classmethod
    def _build(cls, fields: dict[str, Any], source: str) -> MooncakeOptions:
        for name in ("global_segment_size", "local_buffer_size", "zero_copy_min_bytes"):
            if name in fields:
                fields[name] = parse_size(fields[name], name)
        return cls(**fields, source=source)
