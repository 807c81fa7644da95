"""A prefix slice of a ``RadixKey`` shares its token array (O(1), no copy).

``key[:n]`` records the base array and its end; the cache walks and inserts the base array up
to that end. Checked here: every slice reads the ids a list slice reads; a prefix shares the
base and any other slice copies; and a cache driven with prefix slices answers exactly as a
twin driven with keys copied out of the same ids (matches, inserts, statistics, the tree).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix import CacheConfig, RadixCache, RadixKey

IDS = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]

SLICES = [slice(None), slice(None, -1), slice(0, 7), slice(None, 0), slice(None, 100),
          slice(None, -100), slice(2, 9), slice(-4, None), slice(None, None, 2),
          slice(0, 10, 1), slice(9, 2), slice(None, None, -1), slice(3, 3)]


@pytest.mark.parametrize("s", SLICES, ids=str)
def test_a_slice_reads_what_a_list_slice_reads(s: slice) -> None:
    key = RadixKey(IDS, extra_key="ns")
    got = key[s]
    assert list(got.token_ids) == IDS[s]
    assert len(got) == len(IDS[s])
    assert got.extra_key == "ns"
    start, _, step = s.indices(len(IDS))
    assert (got.base is key.base) == (start == 0 and step == 1)  # a prefix shares the ids
    # and a slice of a slice is the slice of its ids
    for t in SLICES:
        assert list(got[t].token_ids) == IDS[s][t]
        assert len(got[t]) == len(IDS[s][t])


def test_a_prefix_copies_its_ids_once_on_first_use() -> None:
    key = RadixKey(IDS)
    assert key.token_ids is key.base  # a whole key is its array
    head = key[:-1]
    assert head.end == len(IDS) - 1 and head.base is key.base
    ids = head.token_ids
    assert list(ids) == IDS[:-1] and ids is not key.base
    assert head.token_ids is ids  # kept
    assert key[: len(IDS)].token_ids is key.base  # the whole prefix: no copy at all
    assert repr(head) == f"RadixKey(len={len(IDS) - 1}, extra_key=None)"
    with pytest.raises(TypeError, match="slicing only"):
        key[0]  # type: ignore[index]


def _make(ps: int, hybrid: bool) -> tuple[RadixCache, Any, Any]:
    kv: Any = TokenAllocator(4096) if ps == 1 else PagedAllocator(4096, ps)
    states = MambaStatePool(64, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,)) \
        if hybrid else None
    cfg = CacheConfig(page_size=ps)
    return RadixCache(cfg, kv_allocator=kv, state_allocator=states), kv, states


def _tree(cache: RadixCache) -> list[tuple[Any, ...]]:
    out = []
    for n in cache.tree.iter_nodes():
        value = n.kv_value
        out.append((n.id, list(n.key), None if value is None else value.tolist(), n.depth,
                    n.parent.id if n.parent is not None else None, n.last_access_time,
                    n.hit_count, n.history_len, n.state_slot))
    return sorted(out)


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_a_cache_given_prefix_slices_answers_as_one_given_copies(ps: int, hybrid: bool,
                                                                 seed: int) -> None:
    rng = random.Random(seed)
    twins = [_make(ps, hybrid), _make(ps, hybrid)]  # [0]: prefix slices, [1]: copied keys
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    for step in range(60):
        ids = rng.choice(prompts) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        cut = rng.randrange(0, len(ids) + 1)
        if hybrid:
            cut -= cut % ps  # the state is valid at a page end (insert refuses others)
        ns = rng.choice([None, "a"])
        full = RadixKey(ids, ns)
        keys = [full[:cut], RadixKey(ids[:cut], ns)]
        assert keys[0].base is full.base
        evict = rng.randrange(1, 40) if step % 7 == 6 else 0
        answers = []
        for (cache, kv, states), key in zip(twins, keys, strict=True):
            m = cache.match_prefix(key)
            value = m.device_indices
            n_new = len(key) - m.prefix_len
            if n_new:
                new = kv.alloc(-(-n_new // ps) * ps)
                assert new is not None
                value = torch.cat([value, new[:n_new]])
            slot = int(states.alloc(1)[0]) if states is not None else None
            res = cache.insert(key, value, state_slot=slot, priority=step % 3, rid=step % 5)
            if res.prefix_len > m.prefix_len:
                kv.free(value[m.prefix_len:res.prefix_len])
            if n_new:
                tail = res.inserted_len - m.prefix_len
                kv.free(new[max(tail, 0):])
            if states is not None and not res.state_adopted:
                states.free(torch.tensor([slot], dtype=torch.int64))
            if evict:
                cache.evict(evict)
            answers.append((m.prefix_len, m.device_indices.tolist(), m.kv_hit_length,
                            m.branching_seqlen, res.prefix_len, res.inserted_len,
                            res.last_node.id, res.state_adopted,
                            [t.tolist() for t in res.tree_slots],
                            res.revived_indices.tolist()))
        assert answers[0] == answers[1], step
    caches = [c for c, _, _ in twins]
    for c in caches:
        c.sanity_check()
    assert _tree(caches[0]) == _tree(caches[1])
    assert caches[0].stats() == caches[1].stats()
