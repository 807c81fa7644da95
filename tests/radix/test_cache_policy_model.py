"""Each KV eviction policy against an independent model of the node fields its key reads.

``tests/radix/test_cache_random.py::test_policy_victims_match_brute_force_oracle`` sorts the
library's own leaves by the policy key read off the library's nodes, so a field the library
keeps wrong (a node's ``priority``, ``hit_count``, ``history_len``, stamps) passes there. Here
the fields are recomputed from the operations alone, per page of an uncompressed page trie
(a node is the run of pages down to a page marked as a node end), by the rules the library
documents (``radix.node.TreeNode``) and SGLang 0.5.23's ``_insert_helper`` follows:

* every match and insert ticks a clock; the pages a walk passes take the tick; a walk that ends
  inside a node splits it and both halves take the tick;
* an insert adds a hit to each node on its path whose end lies beyond the depth its ``rid``
  already counted (a new ``rid``: 0), raises the node's priority to the request's when higher
  and its history to the insert's end; a new node takes the request's priority (negative too),
  one hit (unless counted) and the insert's end as history; its creation stamp is the tick;
* ``evict(1)`` removes one unlocked childless node of the least key (ties: any of them).

After every step the node ends of the model equal the library's, and each victim is one of
the model's least keys.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from allocators import PagedAllocator, TokenAllocator
from components.eviction.registry import POLICY_REGISTRY
from radix import CacheConfig, RadixCache

KNOBS: dict[str, dict[str, int]] = {"tlru": {"threshold": 6, "next_prompt_estimate": 2},
                                    "slru": {"protected_threshold": 2}}
Prefix = tuple[Any, tuple[int, ...]]


class Model:
    def __init__(self, ps: int, policy: str, knobs: dict[str, int]) -> None:
        self.ps, self.policy, self.knobs = ps, policy, knobs
        self.pages: dict[Prefix, dict[str, Any]] = {}
        self.clock = 0
        self.rids: dict[Any, int] = {}

    def parent(self, p: Prefix) -> Prefix | None:
        return None if len(p[1]) == self.ps else (p[0], p[1][: -self.ps])

    def children(self, p: Prefix) -> list[Prefix]:
        n = len(p[1]) + self.ps
        return [q for q in self.pages if q[0] == p[0] and len(q[1]) == n and q[1][: n - self.ps] == p[1]]

    def segment(self, end: Prefix) -> list[Prefix]:
        out, p = [end], self.parent(end)
        while p is not None and not self.pages[p]["end"]:
            out.append(p)
            p = self.parent(p)
        return out

    def walk(self, key: list[int], extra: Any) -> tuple[int, int]:
        end = len(key) - len(key) % self.ps
        k = 0
        while k < end and (extra, tuple(key[: k + self.ps])) in self.pages:
            k += self.ps
        return k, end

    def enter(self, key: list[int], extra: Any, k: int, now: int) -> None:
        """Split where a walk of ``k`` tokens ends (both halves stamped) and stamp its pages."""
        if k and not self.pages[(extra, tuple(key[:k]))]["end"]:
            end: Prefix = (extra, tuple(key[:k]))
            while not self.pages[end]["end"]:
                (end,) = self.children(end)
            for q in self.segment(end):
                self.pages[q]["t"] = now
            self.pages[(extra, tuple(key[:k]))]["end"] = True
        for j in range(self.ps, k + 1, self.ps):
            self.pages[(extra, tuple(key[:j]))]["t"] = now

    def match(self, key: list[int], extra: Any) -> int:
        k, _ = self.walk(key, extra)
        self.clock += 1
        self.enter(key, extra, k, self.clock)
        return k

    def insert(self, key: list[int], extra: Any, rid: Any, prio: int) -> tuple[int, int]:
        k, end = self.walk(key, extra)
        self.clock += 1
        now = self.clock
        counted = 0
        if rid is not None:
            counted = self.rids.pop(rid, 0)
            self.rids[rid] = max(counted, end)
        self.enter(key, extra, k, now)
        for j in range(self.ps, k + 1, self.ps):
            pg = self.pages[(extra, tuple(key[:j]))]
            node_end = j
            while not self.pages[(extra, tuple(key[:node_end]))]["end"]:
                node_end += self.ps
            pg["hits"] += node_end > counted
            pg["prio"] = max(pg["prio"], prio)
            pg["hist"] = max(pg["hist"], end)
        for j in range(k + self.ps, end + 1, self.ps):
            self.pages[(extra, tuple(key[:j]))] = dict(
                t=now, hits=int(end > counted), prio=prio, hist=end, created=now, end=j == end,
                lock=0)
        return k, end

    def key_of(self, end: Prefix) -> tuple[Any, ...]:
        pg, pol = self.pages[end], self.policy
        if pol == "lfu":
            return (pg["hits"], pg["t"])
        if pol == "slru":
            return (int(pg["hits"] >= self.knobs["protected_threshold"]), pg["t"])
        if pol == "priority":
            return (pg["prio"], pg["t"])
        if pol in ("fifo", "filo"):
            return (pg["created"] if pol == "fifo" else -pg["created"],)
        if pol == "mru":
            return (-pg["t"],)
        if pol == "tlru":
            start = len(self.segment(end)[-1][1]) - self.ps
            budget = max(pg["hist"] + self.knobs["next_prompt_estimate"] - self.knobs["threshold"], 0)
            return (-1 if start >= budget else 0, pg["t"])
        return (pg["t"],)  # lru and the policies that order KV leaves by recency

    def leaves(self) -> list[Prefix]:
        return [p for p, pg in self.pages.items()
                if pg["end"] and pg["lock"] == 0 and not self.children(p)]

    def lock(self, end: Prefix, d: int) -> None:
        q: Prefix | None = end
        while q is not None:
            self.pages[q]["lock"] += d
            q = self.parent(q)


def library_ends(cache: RadixCache) -> set[Prefix]:
    out: set[Prefix] = set()
    stack: list[tuple[Any, tuple[int, ...]]] = [(c, ()) for c in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        toks = above + tuple(int(x) for x in node.key)
        out.add((node.extra_key, toks))
        stack.extend((c, toks) for c in node.children.values())
    return out


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy", sorted(p for p in POLICY_REGISTRY if p != "unified"))
def test_victims_are_the_least_keys_of_an_independent_model(policy: str, page_size: int,
                                                             seed: int) -> None:
    # ("unified" needs a byte-sized pool: its KV order is covered by the unified tests.)
    rng = random.Random(f"{policy}/{page_size}/{seed}")
    ps = page_size
    kv: Any = TokenAllocator(40) if ps == 1 else PagedAllocator(40 * ps, ps)
    cache = RadixCache(CacheConfig(page_size=ps, radix_eviction_policy=policy,
                                   radix_eviction_policy_config=KNOBS.get(policy)),
                       kv_allocator=kv)
    model = Model(ps, policy, KNOBS.get(policy, {}))
    keys: list[list[int]] = []
    locks: list[tuple[Any, Prefix]] = []
    victims = 0
    for step in range(400):
        r = rng.random()
        if r < 0.45:
            if keys and rng.random() < 0.7:
                base = rng.choice(keys)
                toks = base[: rng.randint(0, len(base))]
                toks += [rng.randint(1, 3) for _ in range(rng.randint(1, 3 * ps))]
            else:
                toks = [rng.randint(1, 3) for _ in range(rng.randint(1, 4 * ps))]
            keys.append(toks)
            extra = rng.choice([None, None, "a"])
            need = -(-len(toks) // ps) * ps
            if kv.available_size() < need:
                continue
            fresh = kv.alloc(need)
            rid, prio = rng.choice([None, 0, 1, 2, 3]), rng.randint(-2, 2)
            res = cache.insert(toks, fresh[: len(toks)], extra, rid=rid, priority=prio)
            assert (res.prefix_len, res.inserted_len) == model.insert(toks, extra, rid, prio)
            if len(res.duplicate_indices):
                kv.free(res.duplicate_indices)
            tail = torch.cat([res.remainder_indices, fresh[len(toks):]])
            if len(tail):
                kv.free(tail)
            if rid is not None and rng.random() < 0.2:
                cache.release_rid(rid)
                model.rids.pop(rid, None)
        elif r < 0.65 and keys:
            toks, extra = rng.choice(keys)[: rng.randint(0, 8)], rng.choice([None, "a"])
            m = cache.match_prefix(toks, extra)
            k = model.match(toks, extra)
            assert m.prefix_len == k
            if k and rng.random() < 0.3:
                locks.append((cache.inc_lock_ref(m.last_device_node), (extra, tuple(toks[:k]))))
                model.lock(locks[-1][1], 1)
        elif r < 0.72 and locks:
            lock, end = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(lock)
            model.lock(end, -1)
        else:
            for _ in range(rng.randint(1, 3)):
                before = library_ends(cache)
                cache.evict(1)
                gone = before - library_ends(cache)
                keyed = {p: model.key_of(p) for p in model.leaves()}
                if not keyed:
                    assert not gone
                    break
                least = min(keyed.values())
                tied = {p for p, key in keyed.items() if key == least}
                assert len(gone) == 1 and gone <= tied, (
                    f"step {step}: evicted {gone}, the model's least keys {least}: {tied}")
                for q in model.segment(gone.pop()):
                    del model.pages[q]
                victims += 1
        assert library_ends(cache) == {p for p, pg in model.pages.items() if pg["end"]}, step
        cache.sanity_check()
    assert victims >= 20
