"""Seeded random steps on a sliding-window hybrid cache with a host tier, under faults: every
host-tier copy may refuse to start (``write_rows`` / ``load_rows`` raise) and every host
``alloc`` may come up short, while copies are held in flight at random.

The faults are what a GPU and a busy host give an engine (a device out of memory for a copy's
temporary, a full host pool); each step must still complete (a copy that cannot start is a
backup or load-back without room), and after every step ``sanity_check()`` holds and every
copy the tree keeps, device and host, full KV, SWA KV and state, holds its prefix's value.
This is the harness that found the two ``CacheCore.evict`` bugs where an internal victim's
``before_internal`` (write-back save) landed copies that removed its children or demoted it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.helpers.swa_hicache import SWAHostRig
from tests.hicache.test_hicache_swa import W, random_step


def inject(h: SWAHostRig, rng: random.Random, p_copy: float, p_short: float) -> None:
    """Copies refuse to start with probability ``p_copy``; host allocs come up short with
    ``p_short``."""
    for name in ("write_rows", "load_rows"):
        orig = getattr(h.hc, name)

        def refuse(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            if rng.random() < p_copy:
                raise RuntimeError("injected: the copy cannot start")
            return _orig(*args, **kwargs)

        setattr(h.hc, name, refuse)
    for pair in h.hc.pools.values():
        host, alloc = pair.host, pair.host.alloc

        def short(*args: Any, _alloc: Any = alloc, **kwargs: Any) -> Any:
            return None if rng.random() < p_short else _alloc(*args, **kwargs)

        host.alloc = short  # type: ignore[method-assign]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("ps", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_random_steps_under_copy_and_host_faults_keep_every_invariant(seed: int, ps: int,
                                                                      policy: str) -> None:
    rng = random.Random(seed)
    h = SWAHostRig(32, 16, ps, W, dim=2, states=4, state_dims=((2,), (2, 2)), policy=policy)
    inject(h, random.Random(seed + 99), p_copy=0.15, p_short=0.1)
    c = h.cache
    keys = [[rng.randrange(1, 4) for _ in range(rng.randrange(2, 13 // ps + 1) * ps)]
            for _ in range(12)]
    for _ in range(200):
        h.hc.hold_completions = rng.random() < 0.5
        if rng.random() < 0.3:
            h.hc.release_held()
        random_step(h, rng, rng.random(), lambda: rng.choice(keys), ps)
    assert c.stats()["copy_failures"] > 0
