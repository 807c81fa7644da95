"""SGLang 0.5.23's remaining cache-side names in ``radix.sglang``: the eviction-strategy classes
of ``evict_policy`` (each ordering nodes as the cache's own eviction does), the free helper
``common.available_and_evictable_str``, LoRA's ``get_eviction_policy`` factory, and SGLang
0.5.12's ``MambaRadixCache`` / ``SWARadixCache``."""

from __future__ import annotations

import json
import random
import subprocess
from typing import Any, cast

import pytest
import torch

import radix.sglang as sg
from allocators.lora import BASE_MODEL, LoraUid, get_eviction_policy
from radix.sglang import EvictParams, MatchPrefixParams, RadixKey
from radix.sglang.common import available_and_evictable_str
from radix.sglang.evict_policy import (
    EVICTION_STRATEGIES,
    EvictionStrategy,
    LFUStrategy,
    SLRUStrategy,
    TLRUStrategy,
)
from tests.helpers.sglang_anchor import ANCHOR_DIR, ANCHOR_PY, anchor_missing

#: SGLang's formulas (evict_policy.py), written from its documentation, on a node's fields.
SGLANG_FORMULA = {
    "lru": lambda n, **k: n.last_access_time,
    "lfu": lambda n, **k: (n.hit_count, n.last_access_time),
    "fifo": lambda n, **k: n.creation_time,
    "mru": lambda n, **k: -n.last_access_time,
    "filo": lambda n, **k: -n.creation_time,
    "priority": lambda n, **k: (n.priority, n.last_access_time),
    "slru": lambda n, protected_threshold=2: (
        1 if n.hit_count >= protected_threshold else 0, n.last_access_time),
    "tlru": lambda n, threshold=0, next_prompt_estimate=0: (
        -1 if n.start >= max(n.history_len + next_prompt_estimate - threshold, 0) else 0,
        n.last_access_time),
}
KNOBS: dict[str, dict[str, Any]] = {"slru": {"protected_threshold": 2},
                                    "tlru": {"threshold": 6, "next_prompt_estimate": 2}}


def leaves(cache: Any) -> list[Any]:
    return [n for n in cache.cache.tree.iter_nodes()
            if n.parent is not None and not n.children and n.kv_lock == 0]


def drive(cache: Any, rng: random.Random) -> None:
    """Branches of different lengths, creation times, hits and recencies."""
    for i in range(8):
        key = [100 + i % 3] + [i] * rng.randrange(1, 5)
        cache.insert(RadixKey(key), torch.arange(len(key), dtype=torch.int64) + 10 * i)
        for _ in range(rng.randrange(0, 4)):
            cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))


@pytest.mark.parametrize("name", sorted(EVICTION_STRATEGIES))
def test_each_strategy_is_sglangs_formula_and_the_caches_eviction_order(name: str) -> None:
    strategy = EVICTION_STRATEGIES[name](**KNOBS.get(name, {}))
    assert strategy.policy == name
    cache = sg.RadixCache.create_simulated(eviction_policy=name,
                                           eviction_policy_config=KNOBS.get(name))
    rng = random.Random(name)
    drive(cache, rng)
    for node in cache.cache.tree.iter_nodes():
        if node.parent is None:
            continue
        want = SGLANG_FORMULA[name](node, **KNOBS.get(name, {}))
        assert strategy.get_priority(node) == want  # the library node
        assert strategy.get_priority(cache.views.get(node)) == want  # the SGLang view
    checked = 0
    while leaves(cache):
        cands = leaves(cache)
        prios = [strategy.get_priority(n) for n in cands]
        first = min(prios)
        before = {n.id for n in cands}
        cache.evict(EvictParams(num_tokens=1))
        gone = before - {n.id for n in cache.cache.tree.iter_nodes()}
        if prios.count(first) == 1:  # the strategy's minimum is the leaf the cache evicted
            assert gone == {cands[prios.index(first)].id}, name
            checked += 1
    assert checked >= 4


def test_strategies_refuse_bad_knobs_and_the_base_class() -> None:
    with pytest.raises(TypeError, match="abstract"):
        EvictionStrategy()
    with pytest.raises(ValueError, match="protected_threshold"):
        SLRUStrategy(0)
    with pytest.raises(ValueError, match="threshold"):
        TLRUStrategy(threshold=-1)
    TLRUStrategy()  # SGLang's defaults (0, 0) are accepted
    assert LFUStrategy().get_priority(sg.RadixCache.create_simulated().cache.root) == (0, 0)


def test_available_and_evictable_str_is_the_caches() -> None:
    cache = sg.RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2, 3]), torch.tensor([5, 6, 7]))
    assert available_and_evictable_str(cache) == cache.available_and_evictable_str()
    assert "full_evictable_size_=3" in available_and_evictable_str(cache)


def test_the_earlier_class_names_are_the_unified_cache() -> None:
    assert sg.MambaRadixCache is sg.UnifiedRadixCache and sg.SWARadixCache is sg.UnifiedRadixCache
    assert {"MambaRadixCache", "SWARadixCache"} <= set(sg.__all__)


def test_lora_get_eviction_policy() -> None:
    a, b = LoraUid("a", 1), LoraUid("b", 2)
    lru, fifo = get_eviction_policy("lru"), get_eviction_policy("fifo")
    for p in (lru, fifo):
        p.mark_used(a)
        p.mark_used(b)
        p.mark_used(a)
    assert lru.select_victim({a, b, BASE_MODEL}) == b  # a was used last
    assert fifo.select_victim({a, b, BASE_MODEL}) == a  # a came first
    with pytest.raises(ValueError, match="policy_name"):
        get_eviction_policy("random")
    with pytest.raises(TypeError, match="policy_name"):
        get_eviction_policy(cast(Any, 3))


# ------------------------------------------------------------- SGLang's own classes (anchor)
ANCHOR_PRIORITIES = """
import json, sys
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
import sglang_cpu_shim
from sglang.srt.mem_cache import evict_policy as ep
classes = {"lru": ep.LRUStrategy, "lfu": ep.LFUStrategy, "fifo": ep.FIFOStrategy,
           "mru": ep.MRUStrategy, "filo": ep.FILOStrategy, "priority": ep.PriorityStrategy,
           "slru": ep.SLRUStrategy, "tlru": ep.TLRUStrategy}
job = json.load(sys.stdin)
out = {}
for name, knobs in job["policies"].items():
    s = classes[name](**knobs)
    out[name] = [s.get_priority(SimpleNamespace(
        key=[0] * n["len"], _tlru_history_len=n["history_len"],
        _tlru_cached_prefix_len=n["start"] + n["len"], **n["fields"])) for n in job["nodes"]]
print(json.dumps(out))
"""


@pytest.mark.skipif(anchor_missing() is not None, reason=str(anchor_missing()))
def test_priorities_equal_sglangs_own_strategies() -> None:
    cache = sg.RadixCache.create_simulated()
    drive(cache, random.Random(7))
    nodes = [n for n in cache.cache.tree.iter_nodes() if n.parent is not None]
    job = {"policies": {name: KNOBS.get(name, {}) for name in EVICTION_STRATEGIES},
           "nodes": [{"len": len(n.key), "history_len": n.history_len, "start": n.start,
                      "fields": {"last_access_time": n.last_access_time,
                                 "hit_count": n.hit_count, "creation_time": n.creation_time,
                                 "priority": n.priority}} for n in nodes]}
    proc = subprocess.run([str(ANCHOR_PY), "-c", ANCHOR_PRIORITIES, str(ANCHOR_DIR)],
                          input=json.dumps(job), text=True, capture_output=True, timeout=300,
                          check=True)
    theirs = json.loads(proc.stdout)
    for name, cls in EVICTION_STRATEGIES.items():
        ours = [cls(**KNOBS.get(name, {})).get_priority(n) for n in nodes]
        assert [list(p) if isinstance(p, tuple) else p for p in ours] == theirs[name], name
