"""Request-level fuzz of ``RadixCache`` over the configuration grid (hunt-core).

An engine's cycle (match -> lock -> allocate with evict-and-retry -> chunk checkpoints through
``cache_unfinished_req`` -> ``cache_finished_req``) interleaved with ``evict`` /
``evict_states`` / matches, for every KV policy (``unified`` aside: it needs a byte-sized
pool), page sizes, KV-only and hybrid, and the ``stateless_leaf`` / ``state_recency`` /
``match_recency`` options. After every step:

* ``sanity_check()``; the tree's tokens equal ``total_size() == evictable + protected``;
* every slot is accounted for once: free + tree + the running requests' own == capacity
  (KV slots and state slots);
* every running request's locked node is still attached, on device, locked;
* an eviction frees exactly what its result says (KV slots and state slots, and the
  `evicted_tokens` / `evicted_states` counters move by it) and never touches protected sizes;
* the page set a consumer rebuilds from the KV events equals the tree's
  (``tests/components/test_kv_events.py``'s strict ``Router`` and ``tree_pages``).

Run from the repository root::

    PYTHONPATH=. python bench/results/hunt-core/request_fuzz.py --seeds 2 --page-sizes 1 4 16
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import random
from typing import Any

import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from components.eviction.registry import POLICY_REGISTRY
from radix import CacheConfig, CacheRequest, RadixCache, RadixKey

KNOBS: dict[str, dict[str, Any]] = {"tlru": {"threshold": 6, "next_prompt_estimate": 2}}
#: The events' reference consumer and page set (loaded by name: a test module, outside the
#: packages the type check covers).
ev: Any = importlib.import_module("tests.components.test_kv_events")


def nodes(cache: RadixCache) -> list[Any]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def run(policy: str, ps: int, hybrid: bool, leaf: str, recency: str, match: str, seed: int,
        steps: int = 300) -> None:
    rng = random.Random(seed)
    cap = 48 * ps
    kv: Any = TokenAllocator(cap) if ps == 1 else PagedAllocator(cap, ps)
    sp = MambaStatePool(6, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,)) \
        if hybrid else None
    cfg = CacheConfig(page_size=ps, radix_eviction_policy=policy,
                      radix_eviction_policy_config=KNOBS.get(policy), stateless_leaf=leaf,
                      state_recency=recency, match_recency=match, enable_kv_cache_events=True)
    cache = RadixCache(cfg, kv_allocator=kv, state_allocator=sp)
    router = ev.Router()
    running: list[tuple[CacheRequest, int | None]] = []
    keys: list[list[int]] = []

    def check(tag: str) -> None:
        cache.sanity_check()
        router.apply(cache.take_events())
        assert router.pages == ev.tree_pages(cache), (tag, "events")
        tree = sum(len(n.key) for n in nodes(cache) if n.kv_value is not None)
        assert tree == cache.total_size() == cache.evictable_size() + cache.protected_size(), tag
        own = sum(-(-(len(r.kv_indices) - r.cached_len) // ps) * ps for r, _ in running)
        assert kv.available_size() + tree + own == cap, (tag, "KV slots")
        if sp is not None:
            states = sum(1 for n in nodes(cache) if n.state_slot is not None)
            assert states == cache.state_evictable_size() + cache.state_protected_size(), tag
            assert sp.available_size() + states + len(running) == sp.size, (tag, "state slots")
        for r, _ in running:
            n = r.last_node
            if n is not cache.root:
                assert n.kv_value is not None and n.lock_ref > 0 and cache.holds(n), tag

    def alloc_kv(n: int) -> torch.Tensor | None:
        got = kv.alloc(n)
        if got is None:
            before = kv.available_size()
            res = cache.evict(n - before)
            assert kv.available_size() - before == res.num_tokens
            got = kv.alloc(n)
        return got

    def alloc_state() -> int | None:
        if sp is None:
            return None
        got = sp.alloc_slot()
        if got is None:
            before = sp.available_size()
            res = cache.evict_states(1)
            assert sp.available_size() - before == res.num_states
            got = sp.alloc_slot()
        return got

    def finish(req: CacheRequest, st: int | None) -> None:
        if sp is not None and st is not None and len(req.kv_indices) % ps:
            sp.free_slot(st)  # a state valid inside a page cannot be cached: cache no more
            cache.cache_finished_req(req, upto=req.cached_len)
        else:
            cache.cache_finished_req(req, state_slot=st)

    for i in range(steps):
        tag = f"{policy} ps={ps} hybrid={hybrid} {leaf} {recency} {match} seed={seed} step={i}"
        r = rng.random()
        if r < 0.35 and len(running) < 4:
            if keys and rng.random() < 0.7:
                base = rng.choice(keys)
                toks = base[: rng.randint(0, len(base))]
                toks += [rng.randint(1, 3) for _ in range(rng.randint(1, 3 * ps))]
            else:
                toks = [rng.randint(1, 3) for _ in range(rng.randint(1, 4 * ps))]
            keys.append(toks)
            key = RadixKey(toks, rng.choice([None, None, "a"]))
            m = cache.match_prefix(key[:-1] if rng.random() < 0.5 else key)
            lock = cache.inc_lock_ref(m.last_device_node)
            need = len(toks) - m.prefix_len
            fresh = alloc_kv(-(-need // ps) * ps)
            st = alloc_state()
            if fresh is None or (sp is not None and st is None):
                if fresh is not None:
                    kv.free(fresh)
                if sp is not None and st is not None:
                    sp.free_slot(st)
                cache.dec_lock_ref(lock)
            else:
                running.append((CacheRequest(
                    key=key, cached_len=m.prefix_len, last_node=m.last_device_node, lock=lock,
                    kv_indices=torch.cat([m.device_indices, fresh[:need]]),
                    priority=rng.randint(-2, 2), rid=i), st))
        elif r < 0.55 and running:
            req, _ = running[rng.randrange(len(running))]
            stops = [p for p in range(req.cached_len + 1, len(req.kv_indices) + 1) if p % ps == 0]
            if stops and sp is not None:
                snap = alloc_state()
                if snap is not None:
                    cache.cache_unfinished_req(req, state_slot=snap, upto=rng.choice(stops))
            elif stops:
                cache.cache_unfinished_req(req, upto=rng.choice(stops))
        elif r < 0.75 and running:
            finish(*running.pop(rng.randrange(len(running))))
        elif r < 0.85:
            before, prot = kv.available_size(), cache.protected_size()
            st0 = cache.stats()
            res = cache.evict(rng.randint(1, 4 * ps))
            assert kv.available_size() - before == res.num_tokens, tag
            st1 = cache.stats()
            assert st1["evicted_tokens"] - st0["evicted_tokens"] == res.num_tokens, (tag, res)
            assert st1["evicted_states"] - st0["evicted_states"] == res.num_states, (tag, res)
            assert cache.protected_size() == prot, tag
        elif r < 0.95 and sp is not None:
            before, prot = sp.available_size(), cache.state_protected_size()
            kv_before, st0 = kv.available_size(), cache.stats()
            res = cache.evict_states(rng.randint(1, 3))
            assert sp.available_size() - before == res.num_states, tag
            assert kv.available_size() - kv_before == res.num_tokens, (tag, res)
            st1 = cache.stats()
            assert st1["evicted_states"] - st0["evicted_states"] == res.num_states, tag
            assert st1["evicted_tokens"] - st0["evicted_tokens"] == res.num_tokens, (tag, res)
            assert cache.state_protected_size() == prot, tag
        else:
            cache.match_prefix(rng.choice(keys) if keys else [1])
        check(tag)
    while running:
        finish(*running.pop())
    cache.evict(cap)
    if sp is not None:
        cache.evict_states(sp.size)
    check("the end")
    assert cache.total_size() == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    policies = [p for p in sorted(POLICY_REGISTRY) if p != "unified"]
    runs = failures = 0
    for policy, ps, hybrid, leaf, recency, match in itertools.product(
            policies, args.page_sizes, [False, True], ["prune", "keep"], ["consumed", "path"],
            ["matched", "usable"]):
        if not hybrid and (leaf == "keep" or recency == "path"):
            continue  # the state options change nothing without states
        if recency == "path" and POLICY_REGISTRY[policy].state_walk != "lru":
            continue  # refused by CacheConfig
        for seed in range(args.seeds):
            runs += 1
            try:
                run(policy, ps, hybrid, leaf, recency, match, seed)
            except AssertionError as e:
                failures += 1
                print("FAIL", policy, ps, hybrid, leaf, recency, match, seed, str(e)[:300])
    print(f"{runs} runs of 300 steps, {failures} failed")


if __name__ == "__main__":
    main()
