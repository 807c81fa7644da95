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
* Timeouts: ``timeout_s`` for connecting and for every socket read/write (a URL's own
  ``?socket_timeout=`` / ``?socket_connect_timeout=`` wins); one retry on a
  connection error (which reconnects), none on a timeout (a frozen server costs one
  ``timeout_s`` per call, not two); then the fault is a miss and the backend rests for
  ``cooldown_s`` (:class:`~hicache.storage.base.StorageBackend`). The client is made on first
  use, so an engine starts while its storage is down and picks it up when it comes back.
* Credentials (user names and passwords in the URLs) are never in ``repr``, logs or stats:
  :meth:`RedisStore.redact` masks them in every logged message.
"""

from __future__ import annotations

import importlib.util
import inspect
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from hicache.storage.base import WRITE_FAILED, StorageBackend, WriteResult, check_seconds

GET_CHUNK = 512

_CAS_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def split_urls(urls: Any, name: str = "urls") -> list[str]:
    """The URLs of ``"u1,u2"`` or a sequence of str, each checked; errors name ``name`` (the
    argument or setting) and mask credentials.

    Each URL: ``redis://`` or ``rediss://``, a host, a port in 1..65535 when given, a database
    ``/N`` (an int >= 0) when given. Several URLs are startup nodes of one cluster: one scheme,
    no node twice, database 0 only (a cluster has no other).

    Raises:
        TypeError: not a str or a sequence of str (naming ``name[i]``).
        ValueError: an empty list or element, or a malformed URL.
    """
    if isinstance(urls, str):
        items = [u.strip() for u in urls.split(",")]
        if not any(items):
            raise ValueError(f"{name}: no Redis URL given (redis://host:port or rediss://host:port)")
    elif isinstance(urls, (list, tuple)):
        items = []
        for i, u in enumerate(urls):
            if not isinstance(u, str):
                raise TypeError(f"{name}[{i}] must be a str URL (redis://host:port), got "
                                f"{type(u).__name__}")
            items.append(u.strip())
        if not items:
            raise ValueError(f"{name}: no Redis URL given (redis://host:port or rediss://host:port)")
    else:
        raise TypeError(f"{name} must be a str (one URL or comma-separated URLs) or a list of str, "
                        f"got {type(urls).__name__}")
    for i, u in enumerate(items):
        if not u:
            raise ValueError(f"{name}: URL {i + 1} of {len(items)} is empty")
    nodes = [_check_url(u, name) for u in items]
    if len(nodes) > 1:
        if len({scheme for scheme, _, _ in nodes}) > 1:
            raise ValueError(f"{name}: the startup nodes of one cluster use one scheme (all redis:// "
                             "or all rediss://)")
        seen: set[str] = set()
        for (_, node, db), u in zip(nodes, items, strict=True):
            if db != 0:
                raise ValueError(f"{name}: a Redis Cluster has only database 0, got /{db} in "
                                 f"{redact_url(u)!r}")
            if node in seen:
                raise ValueError(f"{name}: startup node {node} is given twice")
            seen.add(node)
    return items


def _check_url(url: str, name: str) -> tuple[str, str, int]:
    """``(scheme, host:port, db)`` of one checked URL."""
    shown = redact_url(url)
    form = "redis://[user:password@]host:port[/db] or rediss://..."
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"{name}: a Redis URL has no spaces or control characters (percent-"
                         f"encode them in a password), got {shown!r}")
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:  # an unclosed IPv6 bracket, ...
        raise ValueError(f"{name}: a Redis URL must look like {form} ({exc}), got {shown!r}") from None
    if parts.scheme not in ("redis", "rediss") or not host:
        raise ValueError(f"{name}: a Redis URL must look like {form}, got {shown!r}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{name}: port must be an int in 1..65535, got {shown!r}")
    path = parts.path
    db = 0
    if path not in ("", "/"):
        digits = path[1:]
        if not digits.isdigit() or not digits.isascii():
            raise ValueError(f"{name}: the database after the port must be an int >= 0 (/0), got "
                             f"{shown!r}")
        db = int(digits)
    if parts.query:
        _check_query(parts.scheme, parts.query, shown, name)
    return parts.scheme, f"{parts.hostname}:{port or 6379}", db


#: The timeouts a Redis URL's query may set [s] (redis-py's parsers take any float).
_URL_TIMEOUTS = ("socket_timeout", "socket_connect_timeout", "timeout")


def _check_query(scheme: str, query: str, shown: str, name: str) -> None:
    """The query arguments redis-py's connection takes (its URL parsers' keys and the
    connection class's keyword arguments), with values its parsers accept; redis-py passes an
    unknown one to the connection, which fails only when the first call connects. Skipped
    without redis-py (the store cannot be built then anyway)."""
    try:
        from redis.connection import (
            URL_QUERY_ARGUMENT_PARSERS,
            Connection,
            SSLConnection,
            parse_url,
        )
    except ImportError:
        return
    cls = SSLConnection if scheme == "rediss" else Connection
    known = set(URL_QUERY_ARGUMENT_PARSERS)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            known |= set(inspect.signature(init).parameters) - {"self", "args", "kwargs"}
    unknown = sorted(set(parse_qs(query)) - known)
    if unknown:
        raise ValueError(f"{name}: unknown Redis URL query argument(s) {unknown} (redis-py "
                         f"{'SSL' if scheme == 'rediss' else ''}connection arguments only), "
                         f"got {shown!r}")
    try:
        parsed = parse_url(f"{scheme}://h?{query}")
    except ValueError as exc:
        raise ValueError(f"{name}: {exc} (got {shown!r})") from None
    for key in _URL_TIMEOUTS:  # floats to redis-py; only a connect would refuse them
        if key in parsed:
            try:
                check_seconds(parsed[key], f"{name}: ?{key}=")
            except ValueError as exc:
                raise ValueError(f"{exc} in {shown!r}") from None


def redact_url(url: str) -> str:
    """``url`` with its user name and password replaced by ``***`` (also in a malformed URL)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # one urlsplit refuses (an unclosed IPv6 bracket): cut the netloc by hand
        scheme, sep, rest = url.partition("://")
        if not sep:
            return url
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        netloc = rest[:end]
        if "@" not in netloc:
            return url
        return f"{scheme}://***:***@{netloc.rsplit('@', 1)[1]}{rest[end:]}"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, f"***:***@{host}", parts.path, parts.query, parts.fragment))


class RedisStore(StorageBackend):
    """Pages in Redis / Valkey (see the module docstring).

    Args:
        urls: one URL, comma-separated URLs, or a sequence of them (cluster startup nodes).
        tag / cooldown_s / secret: see :class:`StorageBackend`.
        timeout_s: connect and socket timeout of every call [s], unless the (first) URL's
            query sets its own (``?socket_timeout=10&socket_connect_timeout=2``): the URL's
            option wins.
        prefix: key prefix (several caches may share a server under different prefixes).

    Raises:
        TypeError / ValueError: bad arguments, naming them (URLs: see :func:`split_urls`,
            credentials masked); ``ImportError`` without redis-py.
    """

    name = "redis"

    def __init__(self, urls: str | Sequence[str], tag: str = "", timeout_s: float = 1.0,
                 prefix: str = "hpc:", cooldown_s: float = 1.0, secret: bytes | None = None) -> None:
        super().__init__(tag, cooldown_s, secret)
        if importlib.util.find_spec("redis") is None:  # fail at construction, not on a call
            raise ModuleNotFoundError(
                "RedisStore needs redis-py: pip install 'hybrid-prefix-cache[redis]'")

        self._urls = split_urls(urls)
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str (a key prefix such as 'hpc:'), got "
                            f"{type(prefix).__name__}")
        if not prefix:
            raise ValueError("prefix must not be empty (several caches share a server by prefix)")
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
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.retry import Retry

        return {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            # one retry on a lost connection (it reconnects), none on a timeout: a frozen
            # server would cost a second full timeout before the backend rests
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        }

    def _client(self) -> Any:
        c = self._client_obj
        if c is not None:
            return c
        with self._connect_lock:
            if self._client_obj is None:
                self._client_obj = self._hold(self._connect())
            return self._client_obj

    def _connect(self) -> Any:
        import redis
        from redis.cluster import ClusterNode, RedisCluster
        from redis.connection import SSLConnection, parse_url

        parsed = [parse_url(u) for u in self._urls]
        for kw in parsed:  # rediss://: redis-py takes ssl=True, not a connection class
            if kw.pop("connection_class", None) is SSLConnection:
                kw["ssl"] = True
        # the URL's own options (``?socket_timeout=10``) win over ``timeout_s``
        first = {**self._common(), **parsed[0]}
        cluster = len(parsed) > 1
        if not cluster:
            probe = redis.Redis(**first)
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
        return RedisCluster(startup_nodes=nodes, **kwargs)

    def close(self) -> None:
        c, self._client_obj = self._client_obj, None
        if c is not None:
            self._unhold(c)
            try:
                c.close()
            except Exception:  # (closing only: counted, never raised)
                self._count("close_errors")

    def _reply_fault(self, op: str, exc: Exception) -> None:
        """One command of a pipeline failed: a lost connection or a timeout (a cluster node
        down) rests the backend; an error reply about its key (``NOPERM`` of an ACL key
        pattern, ``WRONGTYPE``) is a miss for that key only."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        self._fault(op, exc, rest=isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)))

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
                self._reply_fault("exists", r)
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
                self._reply_fault("get", r)
                continue
            for i, v in zip(g, r, strict=True):
                out[i] = v
        return out

    def _set_nx_raw(self, items: Sequence[tuple[str, bytes]]) -> list[WriteResult]:
        c = self._client()
        full = self._full([k for k, _ in items])
        order = [i for g in self._groups(full) for i in g]
        pipe = c.pipeline(transaction=False)
        for i in order:
            pipe.set(full[i], items[i][1], nx=True)
        res = pipe.execute(raise_on_error=False)
        out: list[WriteResult] = [False] * len(items)
        for i, r in zip(order, res, strict=True):
            if isinstance(r, Exception):
                self._reply_fault("set", r)
                out[i] = WRITE_FAILED
            else:
                out[i] = bool(r)
        return out

    def _delete_raw(self, key: str, record: bytes) -> None:
        self._client().eval(_CAS_DELETE, 1, self._full([key])[0], record)
