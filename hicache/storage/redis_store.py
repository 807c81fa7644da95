"""The distributed L3 backend: a Redis Cluster, or one Redis / Valkey node, via redis-py.

Configuration by URL: ``redis://[user:password@]host:port[/db]`` or ``rediss://`` for TLS
(query arguments such as ``?ssl_ca_certs=/path&ssl_cert_reqs=required`` go to the TLS
connection). Several comma-separated URLs are startup nodes of one cluster; a single URL is
probed once (``INFO cluster``) and used as a cluster when the node has cluster mode on.

* Keys: ``<prefix><page key>`` (prefix ``hpc:``); values: whole records (checksummed).
* Batches: one pipeline per call. On a cluster the keys are grouped by hash slot, one ``MGET``
  per slot (reads) and ``SET NX`` / ``EXISTS`` commands per key (writes, presence), which
  redis-py sends as one round trip per node. On one node: ``MGET`` in chunks of 512 keys.
* ``SET ... NX``: a page is written once; a second writer of the same key changes nothing.
* Timeouts: ``timeout_s`` for connecting and for every socket read/write; one retry on a
  connection error (which reconnects), then the fault is a miss and the backend rests for
  ``cooldown_s`` (:class:`~hicache.storage.base.StorageBackend`). The client is made on first
  use, so an engine starts while its storage is down and picks it up when it comes back.
* Credentials (user names and passwords in the URLs) are never in ``repr``, logs or stats:
  :meth:`RedisStore.redact` masks them in every logged message.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hicache.storage.base import StorageBackend

GET_CHUNK = 512

_CAS_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """A list of URLs from ``"u1,u2"`` or a sequence; ``ValueError`` when a scheme is not
    ``redis://`` / ``rediss://`` or no host is given."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip() for u in items if u and u.strip()]
    if not out:
        raise ValueError("no Redis URL given (redis://host:port or rediss://host:port)")
    for u in out:
        parts = urlsplit(u)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError(
                f"Redis URL must look like redis://[user:password@]host:port[/db] or rediss://..., "
                f"got {redact_url(u)!r}"
            )
    return out


def redact_url(url: str) -> str:
    """``url`` with its user name and password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"***:***@{host}", parts.path, parts.query, parts.fragment))


class RedisStore(StorageBackend):
    """Pages in Redis / Valkey (see the module docstring).

    Args:
        urls: one URL, comma-separated URLs, or a sequence of them (cluster startup nodes).
        tag / cooldown_s: see :class:`StorageBackend`.
        timeout_s: connect and socket timeout of every call [s].
        prefix: key prefix (several caches may share a server under different prefixes).

    Raises:
        ValueError: bad URLs (with credentials masked); ``ImportError`` without redis-py.
    """

    name = "redis"

    def __init__(self, urls: str | Sequence[str], tag: str = "", timeout_s: float = 1.0,
                 prefix: str = "hpc:", cooldown_s: float = 1.0) -> None:
        super().__init__(tag, cooldown_s)
        import redis  # noqa: F401 - fail at construction when the client is missing

        self._urls = split_urls(urls)
        self.timeout_s = float(timeout_s)
        self.prefix = prefix
        self._secrets = set()
        for u in self._urls:
            p = urlsplit(u)
            for s in (p.password, p.username):
                if s:
                    self._secrets.add(s)
        self._client_obj: Any = None
        self.is_cluster: bool | None = None
        self._connect_lock = threading.Lock()

    def __repr__(self) -> str:
        urls = ",".join(redact_url(u) for u in self._urls)
        return f"RedisStore(urls={urls!r}, cluster={self.is_cluster}, prefix={self.prefix!r})"

    def redact(self, text: str) -> str:
        for s in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(s, "***")
        return text

    # -------------------------------------------------------------- client
    def _common(self) -> dict[str, Any]:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 1),
        }

    def _client(self) -> Any:
        c = self._client_obj
        if c is not None:
            return c
        with self._connect_lock:
            if self._client_obj is None:
                self._client_obj = self._connect()
            return self._client_obj

    def _connect(self) -> Any:
        import redis
        from redis.cluster import ClusterNode, RedisCluster
        from redis.connection import SSLConnection, parse_url

        parsed = [parse_url(u) for u in self._urls]
        for kw in parsed:  # rediss://: redis-py takes ssl=True, not a connection class
            if kw.pop("connection_class", None) is SSLConnection:
                kw["ssl"] = True
        first = dict(parsed[0])
        cluster = len(parsed) > 1
        if not cluster:
            probe = redis.Redis(**first, **self._common())
            try:
                cluster = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
            finally:
                if cluster:
                    probe.close()
            if not cluster:
                self.is_cluster = False
                return probe
        kwargs = {k: v for k, v in first.items() if k not in ("host", "port", "db")}
        nodes = [ClusterNode(p["host"], p.get("port", 6379)) for p in parsed]
        self.is_cluster = True
        return RedisCluster(startup_nodes=nodes, **kwargs, **self._common())

    def close(self) -> None:
        c, self._client_obj = self._client_obj, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    # -------------------------------------------------------------- batches
    def _groups(self, keys: list[bytes]) -> list[list[int]]:
        """Indices of ``keys`` grouped by hash slot (cluster) or in chunks (one node)."""
        if not self.is_cluster:
            return [list(range(i, min(i + GET_CHUNK, len(keys)))) for i in range(0, len(keys), GET_CHUNK)]
        from redis.crc import key_slot

        by_slot: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            by_slot.setdefault(key_slot(k), []).append(i)
        return [by_slot[s] for s in sorted(by_slot)]

    def _full(self, keys: Sequence[str]) -> list[bytes]:
        return [(self.prefix + k).encode() for k in keys]

    def _exists_raw(self, keys: Sequence[str]) -> list[bool]:
        c = self._client()
        full = self._full(keys)
        pipe = c.pipeline(transaction=False)
        for k in full:
            pipe.exists(k)
        res = pipe.execute(raise_on_error=False)
        out = []
        for r in res:
            if isinstance(r, Exception):
                self._fault("exists", r)
                out.append(False)
            else:
                out.append(bool(r))
        return out

    def _get_raw(self, keys: Sequence[str]) -> list[bytes | None]:
        c = self._client()
        full = self._full(keys)
        groups = self._groups(full)
        pipe = c.pipeline(transaction=False)
        for g in groups:
            pipe.execute_command("MGET", *[full[i] for i in g])  # one slot per MGET
        res = pipe.execute(raise_on_error=False)
        out: list[bytes | None] = [None] * len(keys)
        for g, r in zip(groups, res, strict=True):
            if isinstance(r, Exception):
                self._fault("get", r)
                continue
            for i, v in zip(g, r, strict=True):
                out[i] = v
        return out

    def _set_nx_raw(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        c = self._client()
        full = self._full([k for k, _ in items])
        order = [i for g in self._groups(full) for i in g]
        pipe = c.pipeline(transaction=False)
        for i in order:
            pipe.set(full[i], items[i][1], nx=True)
        res = pipe.execute(raise_on_error=False)
        out = [False] * len(items)
        for i, r in zip(order, res, strict=True):
            if isinstance(r, Exception):
                self._fault("set", r)
            else:
                out[i] = bool(r)
        return out

    def _delete_raw(self, key: str, record: bytes) -> None:
        self._client().eval(_CAS_DELETE, 1, self._full([key])[0], record)
