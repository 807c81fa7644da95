"""The insert without a plan (``radix.insert._insert_unplanned``) against the planned path.

A cache whose components neither plan an insert, see its new nodes nor adopt anything at its
end (the plain KV cache: ``CacheCore.unplanned_inserts``) builds no ``InsertPlan``. Twin caches,
one forced through the planned path, take the same random calls (inserts with namespaces,
priorities, request ids, splits, refused inserts, locks, evictions) and must answer, refuse,
and end up exactly alike.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix import CacheConfig, RadixCache, RadixKey


def test_only_the_plain_kv_cache_inserts_without_a_plan() -> None:
    plain = RadixCache(CacheConfig(), kv_allocator=TokenAllocator(64))
    assert plain.core.unplanned_inserts
    hybrid = RadixCache(CacheConfig(), kv_allocator=TokenAllocator(64),
                        state_allocator=MambaStatePool(4, num_layers=1, conv_state_shape=(1,),
                                                       ssm_state_shape=(1,)))
    assert not hybrid.core.unplanned_inserts  # the state component plans (a state required)
    events = RadixCache(CacheConfig(enable_kv_cache_events=True),
                        kv_allocator=TokenAllocator(64))
    assert not events.core.unplanned_inserts  # the event recorder sees every new node


def _tree(cache: RadixCache) -> list[tuple[Any, ...]]:
    out = []
    for n in cache.tree.iter_nodes():
        value = n.kv_value
        out.append((n.id, list(n.key), n.extra_key, None if value is None else value.tolist(),
                    n.depth, n.parent.id if n.parent is not None else None,
                    n.last_access_time, n.creation_time, n.hit_count, n.priority,
                    n.history_len, n.kv_lock))
    return sorted(out)


def _insert(cache: RadixCache, key: Any, value: torch.Tensor, ns: Any, priority: int,
            rid: Any) -> Any:
    """``("ok", result)``, or the refusal's type and message."""
    try:
        return ("ok", cache.insert(key, value, ns, priority=priority, rid=rid))
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "priority"])
@pytest.mark.parametrize("seed", range(8))
def test_the_unplanned_insert_does_what_the_planned_one_does(ps: int, policy: str,
                                                              seed: int) -> None:
    rng = random.Random(seed)
    twins = []
    for planned in (False, True):
        kv: Any = TokenAllocator(2048) if ps == 1 else PagedAllocator(2048, ps)
        cache = RadixCache(CacheConfig(page_size=ps, radix_eviction_policy=policy),
                           kv_allocator=kv)
        assert cache.core.unplanned_inserts
        if planned:
            cache.core.unplanned_inserts = False  # the general path, with its InsertPlan
        twins.append((cache, kv))
    prompts = [[rng.randrange(30) for _ in range(rng.randrange(4, 48))] for _ in range(5)]
    locks: list[list[Any]] = [[], []]
    for step in range(120):
        ids = rng.choice(prompts)[: rng.randrange(0, 49)] + [
            rng.randrange(30) for _ in range(rng.randrange(0, 20))]
        ns = rng.choice([None, None, "t"])
        trusted = rng.random() < 0.6
        cut = rng.randrange(0, len(ids) + 1)
        bad = rng.random() < 0.1  # a refused insert: a repeated or a free slot
        evict = rng.randrange(1, 60) if rng.random() < 0.15 else 0
        lock, unlock = rng.random() < 0.2, rng.random() < 0.3
        priority, rid = rng.randrange(3), rng.choice([None, step % 4])
        answers = []
        for i, (cache, kv) in enumerate(twins):
            key: Any = RadixKey(ids, ns)[:cut] if trusted else ids[:cut]
            m = cache.match_prefix(key, None if trusted else ns)
            n_new = cut - m.prefix_len
            value = m.device_indices
            new = None
            if n_new:
                new = kv.alloc(-(-n_new // ps) * ps)
                assert new is not None
                value = torch.cat([value, new[:n_new]])
            if bad and n_new >= 2:
                value = value.clone()
                value[-1] = value[-2] if ps == 1 else 0  # repeated (or, paged, not a page)
            got = _insert(cache, key, value, None if trusted else ns, priority, rid)
            if got[0] == "ok":
                res = got[1]
                answer: Any = (res.prefix_len, res.inserted_len, res.last_node.id,
                               res.state_adopted, res.revived_indices.tolist(),
                               [t.tolist() for t in res.tree_slots],
                               res.duplicate_indices.tolist())
                if res.prefix_len > m.prefix_len:
                    kv.free(value[m.prefix_len:res.prefix_len])
                if new is not None:
                    kv.free(new[max(res.inserted_len - m.prefix_len, 0):])
                if lock and res.last_node is not cache.root:
                    locks[i].append(cache.inc_lock_ref(res.last_node))
            else:
                answer = got
                if new is not None:
                    kv.free(new)
            if unlock and locks[i]:
                cache.dec_lock_ref(locks[i].pop(0))
            if evict:
                answer = (answer, cache.evict(evict).num_tokens)
            answers.append((m.prefix_len, m.device_indices.tolist(), answer))
        assert answers[0] == answers[1], step
        assert _tree(twins[0][0]) == _tree(twins[1][0]), step
    for (cache, _), held in zip(twins, locks, strict=True):
        for lk in held:
            cache.dec_lock_ref(lk)
        cache.sanity_check()
    a, b = twins[0][0], twins[1][0]
    assert a.stats() == b.stats()
    assert twins[0][1].available_size() == twins[1][1].available_size()
