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

A lock per call does not make a request atomic: between one thread's ``match_prefix`` and its
``inc_lock_ref`` another thread may evict the matched node (a refusal), and an allocator
called outside the lock hands one slot to two threads (wrong states served). An engine
thread therefore wraps each request step in ``with cache.locked():`` (one hold over match ->
lock -> allocate -> insert -> free) and calls the allocators through
``LockedCache.kv_allocator`` / ``state_allocator`` (the cache's own allocators under the same
lock)::

    with lc.locked():
        m = lc.match_prefix(key)
        lock = lc.inc_lock_ref(m.last_device_node)
        fresh = lc.kv_allocator.alloc(n) ...
        lc.insert(key, value, state_slot=slot)

What the lock does not cover: the pools' tensors (an engine's forward pass writes KV and
state slots it owns without the cache), a ``MatchResult``'s slots read after the ``with``
block ends (lock the node first: an unlocked node may be evicted by another thread at once),
and the library's L3 threads (they never touch the tree; their queues and counters have their
own locks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from radix.cache import RadixCache


def _under(lock: threading.RLock, name: str, attr: Callable[..., Any]) -> Callable[..., Any]:
    def locked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return attr(*args, **kwargs)

    locked.__name__ = name
    locked.__doc__ = attr.__doc__
    return locked


class Guarded:
    """``obj`` (an allocator or pool; the cache itself in :class:`LockedCache`) with every
    public method call made under ``lock``, wrapped on first use; attributes that are not
    callable, and private ones, pass through unlocked."""

    def __init__(self, obj: Any, lock: threading.RLock) -> None:
        self._obj = obj
        self._lock = lock
        self._wrapped: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Any:
        fn = self._wrapped.get(name)
        if fn is not None:
            return fn
        attr = getattr(self._obj, name)
        if not callable(attr) or name.startswith("_"):
            return attr
        locked = _under(self._lock, name, attr)
        self._wrapped[name] = locked
        return locked

    def __repr__(self) -> str:
        return f"Guarded({self._obj!r})"


class LockedCache(Guarded):
    """``cache`` with every method call made under one ``threading.RLock`` (a
    :class:`Guarded` cache).

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
        super().__init__(cache, threading.RLock())
        self._cache = cache
        self.lock = self._lock

        self.kv_allocator = Guarded(cache.kv.allocator, self.lock)
        """The cache's KV allocator, every call under the cache's lock."""
        self.state_allocator = (None if cache.state is None
                                else Guarded(cache.state.allocator, self.lock))
        """The cache's state pool under the cache's lock (``None`` without states)."""

    @property
    def cache(self) -> RadixCache:
        """The wrapped cache (for single-threaded phases: setup, tests)."""
        return self._cache

    @contextmanager
    def locked(self) -> Iterator[LockedCache]:
        """Hold the lock for a request step (match -> lock -> allocate -> insert -> free):
        no other thread calls the cache or its guarded allocators meanwhile. Re-entrant; the
        calls inside go through this wrapper as usual."""
        with self.lock:
            yield self

    def __repr__(self) -> str:
        return f"LockedCache({self._cache!r})"
