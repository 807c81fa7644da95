"""Storage backends by name: the built-in ones and those an engine registers.

``hicache_storage_backend`` takes a name this registry knows (``"file"``, ``"redis"``,
``"mooncake"`` and every name given to :func:`register_backend`), ``None`` (no L3), or a
:class:`~hicache.storage.base.StorageBackend` instance built by the caller (its ``tag`` must be
the cache's layout tag, :func:`hicache.storage.keys.layout_tag`, so a record of another layout is
refused).

``"dynamic"`` loads the factory as SGLang's ``dynamic`` backend loads its class: the extra
config's ``module_path`` and ``class_name`` (and ``backend_name``, for messages) name it.

A factory is called as ``factory(config, tag)`` with the cache's
:class:`~hicache.config.HiCacheConfig` (its backend options: ``config.extra_config()``, the
extra config less SGLang's generic keys) and the layout tag, and must return a
``StorageBackend`` built with that tag.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from hicache.storage.base import StorageBackend

if TYPE_CHECKING:
    from hicache.config import HiCacheConfig

#: ``factory(config, tag) -> StorageBackend``.
BackendFactory = Callable[["HiCacheConfig", str], StorageBackend]

#: Names with their own checks in ``HiCacheConfig`` (they cannot be registered again).
BUILTIN_BACKENDS = ("file", "redis", "mooncake", "dynamic")

#: Extra-config keys of the ``dynamic`` backend (SGLang's names).
DYNAMIC_KEYS = ("backend_name", "module_path", "class_name")

_lock = threading.Lock()
_factories: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``hicache_storage_backend=name`` build its backend with ``factory(config, tag)``.

    Args:
        name: a non-empty str, not a built-in name, not registered yet.
        factory: a callable ``(HiCacheConfig, tag: str) -> StorageBackend``.

    Raises:
        TypeError: ``name`` not a str, ``factory`` not callable (or a ``StorageBackend``
            instance: pass that to ``hicache_storage_backend`` directly).
        ValueError: an empty name, a built-in name, a name already registered.
    """
    if not isinstance(name, str):
        raise TypeError(f"register_backend name must be a str, got {type(name).__name__}")
    if not name.strip() or name != name.strip():
        raise ValueError(f"register_backend name must be a non-empty str without surrounding "
                         f"spaces, got {name!r}")
    if isinstance(factory, StorageBackend) or not callable(factory):
        raise TypeError("register_backend factory must be a callable (config, tag) -> "
                        f"StorageBackend, got {type(factory).__name__}")
    with _lock:
        if name in BUILTIN_BACKENDS or name in _factories:
            raise ValueError(f"register_backend name {name!r} is taken; registered: "
                             f"{backend_names()}")
        _factories[name] = factory


def unregister_backend(name: str) -> None:
    """Forget a name :func:`register_backend` gave (``KeyError`` if it did not)."""
    with _lock:
        del _factories[name]


def backend_names() -> list[str]:
    """Every name ``hicache_storage_backend`` accepts, built-in first."""
    return [*BUILTIN_BACKENDS, *sorted(_factories)]


def is_known(name: str) -> bool:
    """Whether ``name`` is a built-in or registered backend name."""
    return name in BUILTIN_BACKENDS or name in _factories


def build_registered(name: str, config: HiCacheConfig, tag: str) -> StorageBackend:
    """The backend the factory registered under ``name`` builds.

    Raises:
        ValueError: ``name`` is not registered (any more).
        TypeError: the factory returned something other than a ``StorageBackend``.
        ValueError: the factory's backend has another layout tag.
    """
    with _lock:
        factory = _factories.get(name)
    if factory is None:
        raise ValueError(f"hicache_storage_backend={name!r} is not registered; expected one of "
                         f"{backend_names()}")
    backend = factory(config, tag)
    if not isinstance(backend, StorageBackend):
        raise TypeError(f"the factory registered as {name!r} returned {type(backend).__name__}, "
                        "not a hicache.storage.StorageBackend")
    check_tag(backend, tag, f"the factory registered as {name!r}")
    return backend


def load_dynamic(extra: Mapping[str, Any]) -> BackendFactory:
    """The factory the ``dynamic`` backend's extra config names: ``getattr(import_module(
    module_path), class_name)``, a callable ``(config, tag) -> StorageBackend`` (a backend
    class taking those two arguments, or a function).

    Raises:
        ValueError: a key missing or not a non-empty str, a module that does not import, a
            name it lacks, an object that is not callable (naming the key).
    """
    for key in DYNAMIC_KEYS:
        v = extra.get(key)
        if not isinstance(v, str) or not v:
            raise ValueError(f'hicache_storage_backend="dynamic" needs extra config {key} (a '
                             f"non-empty str), got {v!r}")
    module_path, class_name = extra["module_path"], extra["class_name"]
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ValueError(f"hicache_storage_backend_extra_config module_path {module_path!r} "
                         f"does not import ({exc})") from exc
    factory = getattr(module, class_name, None)
    if factory is None or not callable(factory):
        raise ValueError(f"hicache_storage_backend_extra_config class_name {class_name!r}: "
                         f"{module_path} has no callable of that name")
    if isinstance(factory, type) and not issubclass(factory, StorageBackend):
        raise ValueError(f"hicache_storage_backend_extra_config class_name {class_name!r} is a "
                         "class that is not a hicache.storage.StorageBackend")
    return cast(BackendFactory, factory)


def build_dynamic(config: HiCacheConfig, tag: str) -> StorageBackend:
    """The ``dynamic`` backend: :func:`load_dynamic`'s factory called with ``(config, tag)``.

    Raises:
        ValueError / TypeError: as :func:`load_dynamic` and :func:`build_registered`.
    """
    extra = config.extra_config()
    backend = load_dynamic(extra)(config, tag)
    what = f"the dynamic backend {extra['backend_name']!r}"
    if not isinstance(backend, StorageBackend):
        raise TypeError(f"{what} returned {type(backend).__name__}, not a "
                        "hicache.storage.StorageBackend")
    check_tag(backend, tag, what)
    return backend


def check_tag(backend: StorageBackend, tag: str, what: str) -> None:
    """``ValueError`` naming ``what`` when ``backend`` was built with another layout tag."""
    if backend.tag != tag:
        raise ValueError(f"{what} built its backend with tag {backend.tag!r}; this cache's layout "
                         f"tag is {tag!r} (hicache.storage.layout_tag): build it with tag={tag!r}")
