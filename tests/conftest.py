"""Shared pytest set-up: every test module marked by the area it covers, so that a contributor
can run a subset (``python -m pytest tests -m "not storage and not model"``,
``python -m pytest tests -m cache``). The markers are registered in ``pyproject.toml``.

The modules live in one folder per layer (``tests/radix``, ``tests/components``,
``tests/allocators``, ``tests/hicache``, ``tests/storage``, ``tests/lora``, ``tests/sglang``,
``tests/reliability``, ``tests/bench``, ``tests/gpu``, ``tests/model``; ``python -m pytest
tests/components`` runs one), their shared helpers in ``tests/helpers``. A module's area is
read from its file name (``test_<area>_*.py``), one rule for every module present and future,
wherever it lives; a module whose name names no area gets only ``core``.

Fixtures used by more than one module live here too (``caches``).

Hypothesis profiles (``HYPOTHESIS_PROFILE`` picks one; unset: ``ci`` when ``CI`` is set, else
``dev``): both without hypothesis's 200 ms per-example deadline and its too-slow health check,
which fail a correct test on a loaded machine; ``ci`` also draws the same examples every run
(``derandomize``) and keeps no example database, so a CI run is reproducible. A test's own
``@settings`` / ``.settings`` override the profile only in what they name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

#: File-name prefix (after ``test_``) -> the markers its tests carry.
AREAS: dict[str, tuple[str, ...]] = {
    "allocators": ("allocators",),
    "bench": ("bench",),
    "sim": ("bench",),
    "cache": ("cache",),
    "compiled": ("cache",),
    "readme": ("cache",),
    "gpu": ("gpu",),
    "simcuda": ("gpu",),
    "sync": ("gpu",),
    "hicache": ("hicache",),
    "storage": ("hicache", "storage"),
    "lora": ("lora",),
    "model": ("model",),
    "reliability": ("reliability",),
    "sglang": ("sglang",),
    "kv": ("cache",),
    "threads": ("reliability",),
    "traces": ("bench",),
}


def markers_for(module_name: str) -> tuple[str, ...]:
    """The markers of test module ``module_name`` (``test_storage_tier`` -> hicache, storage)."""
    stem = module_name.removeprefix("test_")
    for prefix, marks in AREAS.items():
        if stem == prefix or stem.startswith(prefix + "_"):
            return marks
    return ("core",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        for mark in markers_for(module.__name__.rsplit(".", 1)[-1]):
            item.add_marker(getattr(pytest.mark, mark))


@pytest.fixture(params=["file", "redis"])
def l3_store(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    """Where L3 lives (``HiCacheConfig`` storage keys): the file store, or Redis at ``HPC_REDIS_URL`` (skipped without it)."""
    if request.param == "file":
        return {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    url = os.environ.get("HPC_REDIS_URL")
    if not url:
        pytest.skip('HPC_REDIS_URL is not set: eval "$(bash .ci/redis-up)"')
    return {"hicache_storage_backend": "redis", "hicache_storage_url": url}


@pytest.fixture
def caches() -> Iterator[list[Any]]:
    """A list the test appends the caches it builds to; each is ``close()``d at teardown
    (after a failure too), so backends release their connections, files and servers."""
    made: list[Any] = []
    yield made
    for h in made:
        h.close()
