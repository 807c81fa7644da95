"""Seeded random operations on two caches sharing one L3, with injected faults.

Every KV slot written for token ``j`` of a key holds a signature of the key's prefix
``key[:j+1]`` (and every state one of the prefix it ends), so whatever a match serves can be
checked exactly: a wrong page, a page of another namespace, a stale or half-written page
would show. ``sanity_check`` runs after every step; nothing may raise.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.helpers.cache_helpers import alloc_request
from tests.storage.test_storage_common import L3, WAIT_S, Flaky, fresh_model, make, t64

VOCAB = (1, 2, 3)
SPACES = (None, "tenant")


def sig(prefix: list[int], salt: int) -> float:
    h = salt
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (1 << 23)
    return float(h)


def expected_kv(key: list[int], upto: int, pool: Any, extra_key: Any, salt: int) -> torch.Tensor:
    ns = 0 if extra_key is None else 7
    vals = torch.tensor([sig(key[: j + 1], salt + ns) for j in range(upto)], dtype=pool.dtype)
    return vals.view(1, -1, 1, 1).expand(pool.num_layers, upto, pool.num_heads, pool.head_dim)


def serve(h: L3, key: list[int], extra_key: Any, rng: random.Random) -> None:
    """An engine's request: match (prefetch), load back, check every served value, insert."""
    c, pool, ps = h.cache, h.pool, h.cache.page_size
    m = c.match_prefix(key, extra_key)
    if m.host_hit_length and rng.random() < 0.8:
        c.load_back(m.last_host_node)
        m = c.match_prefix(key, extra_key)
    n = m.prefix_len
    assert torch.equal(pool.k_all[:, m.device_indices], expected_kv(key, n, pool, extra_key, 1))
    assert torch.equal(pool.v_all[:, m.device_indices], expected_kv(key, n, pool, extra_key, 2))
    if h.sp is not None and n:
        assert m.state_slot is not None
        want = sig(key[:n], 3 + (0 if extra_key is None else 7))
        assert bool((h.sp.conv[:, m.state_slot] == want).all())
    end = len(key) - len(key) % ps
    if end <= n:
        return
    swa_start = c.inc_lock_ref(m.last_device_node)
    got = alloc_request(c, h.kv, h.sp, end - n)
    if got is None:
        c.dec_lock_ref(swa_start)
        return
    fresh, slot = got
    pool.k_all[:, fresh] = expected_kv(key, end, pool, extra_key, 1)[:, n:]
    pool.v_all[:, fresh] = expected_kv(key, end, pool, extra_key, 2)[:, n:]
    if slot is not None:
        assert h.sp is not None
        h.sp.conv[:, slot] = sig(key[:end], 3 + (0 if extra_key is None else 7))
    res = c.insert(key[:end], torch.cat([m.device_indices, fresh]), extra_key, state_slot=slot)
    c.dec_lock_ref(swa_start)
    if len(res.duplicate_indices):
        h.kv.free(res.duplicate_indices)
    if slot is not None and not res.state_adopted:
        h.sp.free(t64(slot))  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", range(6))
def test_random_ops_on_two_caches_sharing_l3(tmp_path: Any, seed: int) -> None:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    states = rng.choice([0, 6])
    prefetch = rng.choice(["wait_complete", "best_effort", "timeout"])
    model = fresh_model()
    caches = [make("file", where=str(tmp_path), page_size=page_size, states=states, size=48,
                   model=model, prefetch=prefetch, max_bytes=rng.choice([None, 6000]))
              for _ in range(2)]
    for h in caches:
        flaky = Flaky(h.cache.storage.backend)  # type: ignore[union-attr]
        flaky.fail = {i for i in range(1, 4000) if rng.random() < 0.08}
        h.cache.storage.backend = flaky  # type: ignore[union-attr]
    try:
        for _ in range(150):
            h = rng.choice(caches)
            op = rng.random()
            if op < 0.6:
                key = [rng.choice(VOCAB) for _ in range(rng.randint(1, 14))]
                serve(h, key, rng.choice(SPACES), rng)
            elif op < 0.75:
                h.cache.evict(rng.randint(1, 24))
            elif op < 0.9:
                h.cache.evict_host(rng.randint(1, 24))
            else:
                assert h.cache.flush_storage(WAIT_S)
            for x in caches:
                x.cache.sanity_check()
        st = [x.cache.stats() for x in caches]
        assert sum(s["l3_backend_errors"] for s in st) > 0  # faults were injected and counted
        if prefetch == "wait_complete":  # best_effort / timeout may serve nothing on a busy box
            assert sum(s["l3_prefetch_tokens"] for s in st) > 0  # and L3 still served pages
    finally:
        for h in caches:
            h.close()
