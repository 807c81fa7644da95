"""An opt-in lock around a :class:`~radix.cache.RadixCache`, for engines that call it from
more than one thread.

The threading contract (also in ``RadixCache``'s docstring and ``radix/README.md``):

* **Engine calls are single-threaded.** Every public method of ``RadixCache`` (matches,
  inserts, locks, evictions, request helpers, ``stats``, ``sanity_check``...) and the
  allocators and pools it was built over must be called by one thread at a time; the cache
  takes no lock itself (the scheduler loop of an engine is one thread, and a lock per call
  would cost every engine what only a few need).
* **The library's own threads never touch the tree.** The L3 writer thread stores bytes that
  the engine thread packed; the L3 prefetch thread reads and verifies pages into its job; both
  share only their queues and counters (locked) with the engine thread, which attaches
  prefetched pages and finishes device -> host copies itself (``match_prefix``,
  ``poll_transfers``, ``poll_storage``). On CUDA a backup copy runs on a side stream and is
  finished on the engine thread once its event has completed.

:class:`LockedCache` serialises every call of a cache through one re-entrant lock, for an
engine that does need several threads (a router thread matching while the scheduler inserts,
a metrics thread reading ``stats``). Results it returns (nodes, locks, ``MatchResult``) are the
cache's own: pass them back through the wrapper, never to the cache directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from radix.cache import RadixCache


class LockedCache:
    """``cache`` with every method call made under one ``threading.RLock``.

    Methods are wrapped on first use (``getattr``); attributes that are not callable
    (``config``, ``page_size``, views such as ``tree``) are returned as they are, unlocked:
    read them only while no other thread calls the cache, or through a method.

    Args:
        cache: the cache to protect; no other thread may call it directly afterwards.

    Raises:
        TypeError: ``cache`` is not a ``RadixCache``.
    """

    def __init__(self, cache: RadixCache) -> None:
        if not isinstance(cache, RadixCache):
            raise TypeError(f"cache must be a RadixCache, got {type(cache).__name__}")
        self._cache = cache
        self.lock = threading.RLock()
        self._wrapped: dict[str, Callable[..., Any]] = {}

    @property
    def cache(self) -> RadixCache:
        """The wrapped cache (for single-threaded phases: setup, tests)."""
        return self._cache

    def __getattr__(self, name: str) -> Any:
        fn = self._wrapped.get(name)
        if fn is not None:
            return fn
        attr = getattr(self._cache, name)
        if not callable(attr) or name.startswith("_"):
            return attr
        lock = self.lock

        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return attr(*args, **kwargs)

        locked.__name__ = name
        locked.__doc__ = attr.__doc__
        self._wrapped[name] = locked
        return locked

    def __repr__(self) -> str:
        return f"LockedCache({self._cache!r})"
