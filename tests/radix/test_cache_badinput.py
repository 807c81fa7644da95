"""Misuse, table-driven: every bad argument raises the documented exception type with a message
naming the argument, and a refused call leaves the cache exactly as it was (``pretty_print()``,
both allocators' ``snapshot()``, ``stats()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix import CacheConfig, CacheRequest, RadixCache, RadixKey
from tests.helpers.cache_helpers import tiny_state_pool


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


@dataclass
class Env:
    cache: RadixCache  # hybrid, populated, reset once before (``stale`` predates the reset)
    kv: TokenAllocator
    pool: MambaStatePool
    kv_only: RadixCache
    kv2: TokenAllocator
    leaf: Any  # an unlocked leaf of ``cache`` with a state
    locked: Any  # a node of ``cache`` locked once
    stale: Any  # a node of ``cache`` from before its reset()
    foreign: Any  # a node of ``kv_only``
    slot: int  # a state slot the caller owns (not in the tree)
    fresh: torch.Tensor  # 3 KV slots the caller owns


def build() -> Env:
    kv, pool = TokenAllocator(32), tiny_state_pool(4)
    cache = RadixCache(kv_allocator=kv, state_allocator=pool)
    s = int(pool.alloc(1)[0])
    cache.insert([9, 9], kv.alloc(2), state_slot=s)
    stale = cache.match_prefix([9, 9]).last_device_node
    cache.reset()
    cache.insert([1, 2, 3], kv.alloc(3), state_slot=int(pool.alloc(1)[0]))
    cache.insert([5, 6], kv.alloc(2), state_slot=int(pool.alloc(1)[0]))
    leaf = cache.match_prefix([1, 2, 3]).last_device_node
    locked = cache.match_prefix([5, 6]).last_device_node
    cache.inc_lock_ref(locked)
    kv2 = TokenAllocator(8)
    kv_only = RadixCache(kv_allocator=kv2)
    kv_only.insert([1, 2], kv2.alloc(2))
    foreign = kv_only.match_prefix([1, 2]).last_device_node
    slot = int(pool.alloc(1)[0])
    fresh = kv.alloc(3)
    cache.sanity_check()
    kv_only.sanity_check()
    return Env(cache, kv, pool, kv_only, kv2, leaf, locked, stale, foreign, slot, fresh)


def fingerprint(env: Env) -> tuple:
    return (
        env.cache.pretty_print(),
        env.kv.snapshot(),
        env.pool.snapshot(),
        env.cache.stats(),
        env.cache.evictable_size(),
        env.cache.protected_size(),
        env.kv_only.pretty_print(),
        env.kv2.snapshot(),
        env.kv_only.stats(),
    )


Case = tuple[str, Callable[[Env], Any], type[Exception], str]

NEW = [7, 8, 9]  # a key not in the tree


CALLS: list[Case] = [
    # ---- keys
    ("key str", lambda e: e.cache.match_prefix("abc"), TypeError, "key"),
    ("key float in list", lambda e: e.cache.match_prefix([1, 2.5]), TypeError, "key"),
    ("key str in list", lambda e: e.cache.match_prefix([1, "2"]), TypeError, "key"),
    ("key None in list", lambda e: e.cache.match_prefix([1, None]), TypeError, "key"),
    ("key negative", lambda e: e.cache.match_prefix([1, -2]), ValueError, "key"),
    ("key float tensor", lambda e: e.cache.match_prefix(torch.tensor([1.0, 2.0])), TypeError, "key"),
    ("key bool tensor", lambda e: e.cache.match_prefix(torch.tensor([True])), TypeError, "key"),
    ("key 2-D tensor", lambda e: e.cache.match_prefix(torch.ones(2, 2, dtype=torch.int64)), TypeError, "key"),
    ("key float ndarray", lambda e: e.cache.match_prefix(np.array([1.0])), TypeError, "key"),
    ("key negative tensor", lambda e: e.cache.match_prefix(t64(1, -1)), ValueError, "key"),
    ("key int", lambda e: e.cache.match_prefix(5), TypeError, "key"),
    ("insert key float", lambda e: e.cache.insert([1.5, 2, 3], e.fresh, state_slot=e.slot), TypeError, "key"),
    ("insert key negative", lambda e: e.cache.insert([-7, 8, 9], e.fresh, state_slot=e.slot), ValueError, "key"),
    ("insert float tensor key", lambda e: e.cache.insert(torch.tensor([7.0, 8.0, 9.0]), e.fresh, state_slot=e.slot), TypeError, "key"),
    ("RadixKey bad ids", lambda e: RadixKey([1, -1]), ValueError, "token_ids"),
    ("RadixKey extra_key conflict", lambda e: e.cache.match_prefix(RadixKey([1, 2], "a"), extra_key="b"), ValueError, "extra_key"),
    # ---- values
    ("value too short", lambda e: e.cache.insert(NEW, e.fresh[:2], state_slot=e.slot), ValueError, "value"),
    ("value too long", lambda e: e.cache.insert(NEW[:2], e.fresh, state_slot=e.slot), ValueError, "value"),
    ("value int32", lambda e: e.cache.insert(NEW, e.fresh.to(torch.int32), state_slot=e.slot), TypeError, "value"),
    ("value float", lambda e: e.cache.insert(NEW, e.fresh.double(), state_slot=e.slot), TypeError, "value"),
    ("value 2-D", lambda e: e.cache.insert(NEW, e.fresh.view(3, 1), state_slot=e.slot), ValueError, "value"),
    ("value list", lambda e: e.cache.insert(NEW, e.fresh.tolist(), state_slot=e.slot), TypeError, "value"),
    ("value None", lambda e: e.cache.insert(NEW, None, state_slot=e.slot), TypeError, "value"),
    # ---- state slots
    ("state_slot on a KV-only cache", lambda e: e.kv_only.insert([4, 4], t64(5, 6), state_slot=1), ValueError, "state_slot"),
    ("state_slot held by the tree", lambda e: e.cache.insert(NEW, e.fresh, state_slot=e.leaf.state_slot), ValueError, "state_slot"),
    ("state_slot 0", lambda e: e.cache.insert(NEW, e.fresh, state_slot=0), ValueError, "state_slot"),
    ("state_slot past the pool", lambda e: e.cache.insert(NEW, e.fresh, state_slot=5), ValueError, "state_slot"),
    ("state_slot negative", lambda e: e.cache.insert(NEW, e.fresh, state_slot=-1), ValueError, "state_slot"),
    ("state_slot str", lambda e: e.cache.insert(NEW, e.fresh, state_slot="1"), TypeError, "state_slot"),
    ("state_slot bool", lambda e: e.cache.insert(NEW, e.fresh, state_slot=True), TypeError, "state_slot"),
    ("state_slot float", lambda e: e.cache.insert(NEW, e.fresh, state_slot=1.0), TypeError, "state_slot"),
    ("missing state_slot", lambda e: e.cache.insert(NEW, e.fresh), ValueError, "state_slot"),
    ("priority str", lambda e: e.cache.insert(NEW, e.fresh, state_slot=e.slot, priority="high"), TypeError, "priority"),
    # ---- nodes and locks
    ("unlock an unlocked node", lambda e: e.cache.dec_lock_ref(e.leaf), ValueError, "lock"),
    ("lock another cache's node", lambda e: e.cache.inc_lock_ref(e.foreign), ValueError, "node"),
    ("unlock another cache's node", lambda e: e.cache.dec_lock_ref(e.foreign), ValueError, "node"),
    ("lock a node after reset", lambda e: e.cache.inc_lock_ref(e.stale), ValueError, "node"),
    ("unlock a node after reset", lambda e: e.cache.dec_lock_ref(e.stale), ValueError, "node"),
    ("lock None", lambda e: e.cache.inc_lock_ref(None), TypeError, "node"),
    ("lock a str", lambda e: e.cache.inc_lock_ref("node-3"), TypeError, "node"),
    ("reset while locked", lambda e: e.cache.reset(), ValueError, "lock"),
    # ---- eviction counts
    ("evict negative", lambda e: e.cache.evict(-1), ValueError, "num_tokens"),
    ("evict float", lambda e: e.cache.evict(1.5), TypeError, "num_tokens"),
    ("evict str", lambda e: e.cache.evict("3"), TypeError, "num_tokens"),
    ("evict bool", lambda e: e.cache.evict(True), TypeError, "num_tokens"),
    ("evict_states negative", lambda e: e.cache.evict_states(-2), ValueError, "num_states"),
    ("evict_states on a KV-only cache", lambda e: e.kv_only.evict_states(1), ValueError, "state"),
    # ---- request helpers
    ("finished req not a request", lambda e: e.cache.cache_finished_req("req"), TypeError, "req"),
    ("unfinished req not a request", lambda e: e.cache.cache_unfinished_req({}), TypeError, "req"),
    (
        "req upto past its slots",
        lambda e: e.cache.cache_finished_req(
            CacheRequest(key=NEW, kv_indices=e.fresh[:2], cached_len=0, last_node=e.cache.root), upto=3
        ),
        ValueError,
        "upto",
    ),
    (
        "req last_node from another cache",
        lambda e: e.cache.cache_finished_req(
            CacheRequest(key=NEW, kv_indices=e.fresh, cached_len=0, last_node=e.foreign), state_slot=e.slot
        ),
        ValueError,
        "node",
    ),
]


@pytest.mark.parametrize(("name", "call", "exc", "word"), CALLS, ids=[c[0] for c in CALLS])
def test_bad_call_raises_and_changes_nothing(name: str, call: Callable[[Env], Any],
                                             exc: type[Exception], word: str) -> None:
    env = build()
    before = fingerprint(env)
    with pytest.raises(exc) as info:
        call(env)
    assert word in str(info.value), f"{name}: message {str(info.value)!r} does not name {word!r}"
    assert fingerprint(env) == before, name
    env.cache.sanity_check()
    env.kv_only.sanity_check()


def test_the_environment_is_what_the_table_assumes() -> None:
    env = build()
    assert env.leaf.state_slot is not None and env.leaf.kv_lock == 0 and not env.leaf.children
    assert env.locked.kv_lock == 1 and env.locked.state_lock == 1
    assert env.slot not in {env.leaf.state_slot, env.locked.state_slot}
    assert env.cache.state.allocator.size == 4
    # The good versions of the refused calls succeed.
    res = env.cache.insert(NEW, env.fresh, state_slot=env.slot)
    assert res.state_adopted and res.inserted_len == 3
    env.cache.dec_lock_ref(env.locked)
    env.cache.sanity_check()


CONFIGS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("unknown policy", lambda: CacheConfig(radix_eviction_policy="lruu"), ValueError, "radix_eviction_policy"),
    ("policy not a str", lambda: CacheConfig(radix_eviction_policy=3), TypeError, "radix_eviction_policy"),
    ("knobs not a dict", lambda: CacheConfig(radix_eviction_policy_config=[("d", 1)]), TypeError, "radix_eviction_policy_config"),
    ("unknown knob for lru", lambda: CacheConfig(radix_eviction_policy_config={"x": 1}), ValueError, "x"),
    ("slru threshold 0", lambda: CacheConfig(radix_eviction_policy="slru", radix_eviction_policy_config={"protected_threshold": 0}), ValueError, "protected_threshold"),
    ("tlru without threshold", lambda: CacheConfig(radix_eviction_policy="tlru"), ValueError, "threshold"),
    ("tlru threshold <= estimate", lambda: CacheConfig(radix_eviction_policy="tlru", radix_eviction_policy_config={"threshold": 2, "next_prompt_estimate": 3}), ValueError, "threshold"),
    ("tlru negative", lambda: CacheConfig(radix_eviction_policy="tlru", radix_eviction_policy_config={"threshold": -1}), ValueError, "threshold"),
    ("gds negative d", lambda: CacheConfig(radix_eviction_policy="gds", radix_eviction_policy_config={"d": -1}), ValueError, "'d'"),
    ("page_size 0", lambda: CacheConfig(page_size=0), ValueError, "page_size"),
    ("page_size negative", lambda: CacheConfig(page_size=-4), ValueError, "page_size"),
    ("page_size str", lambda: CacheConfig(page_size="4"), TypeError, "page_size"),
    ("page_size float", lambda: CacheConfig(page_size=4.0), TypeError, "page_size"),
    ("page_size bool", lambda: CacheConfig(page_size=True), TypeError, "page_size"),
    ("from_dict unknown key", lambda: CacheConfig.from_dict({"page_sz": 4}), ValueError, "page_sz"),
    ("from_json not json", lambda: CacheConfig.from_json("{page_size: 4"), ValueError, "JSON"),
    ("config not a CacheConfig", lambda: RadixCache({"page_size": 1}, kv_allocator=TokenAllocator(4)), TypeError, "config"),
    ("allocator page size differs", lambda: RadixCache(CacheConfig(page_size=4), kv_allocator=TokenAllocator(8)), ValueError, "page_size"),
    ("paged allocator, token config", lambda: RadixCache(kv_allocator=PagedAllocator(8, 2)), ValueError, "page_size"),
]


@pytest.mark.parametrize(("name", "build_it", "exc", "word"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_bad_configuration_fails_when_built(name: str, build_it: Callable[[], Any],
                                            exc: type[Exception], word: str) -> None:
    with pytest.raises(exc) as info:
        build_it()
    assert word in str(info.value), f"{name}: message {str(info.value)!r} does not name {word!r}"


def test_bool_token_ids_in_a_list_are_refused() -> None:
    env = build()
    before = fingerprint(env)
    with pytest.raises(TypeError, match="key"):
        env.cache.match_prefix([True, 2])
    assert fingerprint(env) == before


def test_unhashable_extra_key_is_refused_by_name() -> None:
    env = build()
    before = fingerprint(env)
    with pytest.raises(TypeError, match="extra_key"):
        env.cache.insert(NEW, env.fresh, extra_key=["lora"], state_slot=env.slot)
    assert fingerprint(env) == before


def test_a_second_release_says_it_was_released_already() -> None:
    env = build()
    env.cache.dec_lock_ref(env.locked)  # the one lock build() took
    before = fingerprint(env)
    with pytest.raises(ValueError, match=r"lock: node \d+ holds no lock of its own: "
                                         r"released already"):
        env.cache.dec_lock_ref(env.locked)
    assert fingerprint(env) == before


def test_a_refused_slot_is_named_once_and_a_page_by_its_first_slot() -> None:
    kv = TokenAllocator(32)
    cache = RadixCache(kv_allocator=kv)
    with pytest.raises(ValueError, match=r"^value holds slot 30, which is free"):
        cache.insert([7, 8], t64(30, 31))
    paged = PagedAllocator(64, 4)
    cache = RadixCache(CacheConfig(page_size=4), kv_allocator=paged)
    with pytest.raises(ValueError, match=r"^value holds page 10 \(slot 40\), which is free"):
        cache.insert([0, 1, 2, 3], torch.arange(40, 44))
    assert cache.total_size() == 0
