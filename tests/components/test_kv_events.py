"""KV events (``components.events``): a router rebuilds the cache's page set from them alone.

The reference here shares no code with the recorder: a page's hash is recomputed from the
documented formula (SHA-256 chain over int64 little-endian tokens, seeded by the layout tag
and the namespace's encoding, published as the first 8 bytes big-endian, signed), and the
page set is read off the tree (device KV -> ``GPU``, host copy -> ``CPU_PINNED``).

* narrated scenarios with exact hashes, parents, merged events and ``AllBlocksCleared``;
* seeded random operation sequences (inserts with namespaces, matches that split, locks,
  evictions of each kind, SWA tombstones, host backup / demotion / load-back / host eviction,
  ``reset``): after every step the set a consumer rebuilds from the events equals the
  tree's, every store's parent is held, and no store or removal is redundant.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any, cast

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, SWAAllocator, TokenAllocator
from components.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored
from hicache import HiCacheConfig
from hicache.storage.keys import encode_namespace
from radix import CacheConfig, RadixCache


# ============================================================== the reference
def ref_seed(extra_key: Any, tag: str = "") -> bytes:
    t = tag.encode()
    ns = encode_namespace(extra_key)
    assert ns is not None
    return hashlib.sha256(b"hpc-l3/1\x00" + struct.pack("<I", len(t)) + t + ns).digest()


def ref_chain(tokens: list[int], ps: int, extra_key: Any = None) -> list[int]:
    """Published hashes of the whole pages of ``tokens`` from the root."""
    d = ref_seed(extra_key)
    out = []
    for i in range(0, len(tokens) - len(tokens) % ps, ps):
        d = hashlib.sha256(d + struct.pack(f"<{ps}q", *tokens[i:i + ps])).digest()
        out.append(int.from_bytes(d[:8], "big", signed=True))
    return out


def tree_pages(cache: RadixCache) -> set[tuple[int, str, int]]:
    """(hash, medium, group) of every page the tree holds, from a walk of the tree: KV pages
    in group 0, the last page of a node holding a recurrent state in group 1."""
    ps = cache.page_size
    out = set()
    stack = [(c, []) for c in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        toks = above + node.key.tolist()
        mine = ref_chain(toks, ps, node.extra_key)[len(above) // ps:]
        if node.kv_value is not None:
            out |= {(h, GPU, 0) for h in mine}
        if node.host_value is not None:
            out |= {(h, CPU, 0) for h in mine}
        if node.state_slot is not None:
            out.add((mine[-1], GPU, 1))
        stack.extend((c, toks) for c in node.children.values())
    return out


class Router:
    """A strict consumer: applies events to a page set, refusing any redundant one."""

    def __init__(self) -> None:
        self.pages: set[tuple[int, str, int]] = set()
        self.events = 0

    def apply(self, events: list[Any]) -> None:
        for ev in events:
            self.events += 1
            if isinstance(ev, AllBlocksCleared):
                self.pages = set()
            elif isinstance(ev, BlockStored):
                assert ev.block_size * len(ev.block_hashes) == len(ev.token_ids)
                parent = ev.parent_block_hash
                g = ev.group_idx
                for h in ev.block_hashes:
                    assert g == 1 or parent is None or any(
                        (parent, m, 0) in self.pages for m in (GPU, CPU)), (
                        f"store of {h} whose parent {parent} is not held")
                    assert (h, ev.medium, g) not in self.pages, f"page {h} stored twice"
                    self.pages.add((h, str(ev.medium), g))
                    parent = h
            else:
                assert isinstance(ev, BlockRemoved)
                for h in ev.block_hashes:
                    assert (h, ev.medium, ev.group_idx) in self.pages, f"removal of {h} not held"
                    self.pages.discard((h, str(ev.medium), ev.group_idx))


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ============================================================== narrated scenarios
def test_stores_chain_from_the_namespace_and_a_split_is_invisible() -> None:
    kv = PagedAllocator(32, 2)
    cache = RadixCache(CacheConfig(page_size=2, enable_kv_cache_events=True), kv_allocator=kv)
    a = kv.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6, 7], torch.cat([a, t64(0)]))  # the partial page is not cached
    h = ref_chain([1, 2, 3, 4, 5, 6], 2)
    # every field the engines declare without a default is written, None included
    assert [e.to_dict() for e in cache.take_events()] == [{
        "type": "BlockStored", "block_hashes": h, "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
        "lora_name": None, "group_idx": 0}]
    assert cache.match_prefix([1, 2, 9, 9]).prefix_len == 2  # splits [0,6) at 2: no event
    assert cache.take_events() == []
    b = kv.alloc(4)
    res = cache.insert([1, 2, 8, 8, 8, 8], torch.cat([a[:2], b]))
    assert res.prefix_len == 2
    (ev,) = cache.take_events()
    assert ev == BlockStored(ref_chain([1, 2, 8, 8, 8, 8], 2)[1:], h[0], [8, 8, 8, 8], 2)
    # the leaf [2,6) of [1..6] is least recent: it leaves first, then [2,6) of the branch
    assert cache.evict(4).num_tokens == 4
    assert cache.take_events() == [BlockRemoved(h[1:])]
    cache.insert([7, 7], kv.alloc(2), extra_key="tenant")
    (ev,) = cache.take_events()
    assert ev.block_hashes == ref_chain([7, 7], 2, "tenant") != ref_chain([7, 7], 2)
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]  # no removal per node
    assert kv.available_size() == 32


def test_an_int_namespace_is_the_lora_id_and_consecutive_events_merge() -> None:
    kv = TokenAllocator(16)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    cache.insert([1, 2], kv.alloc(2), extra_key=3)
    m = cache.match_prefix([1, 2], extra_key=3)
    cache.insert([1, 2, 3], torch.cat([m.device_indices, kv.alloc(1)]), extra_key=3)
    (ev,) = cache.take_events()  # the second store continues the first: one event
    assert ev.block_hashes == ref_chain([1, 2, 3], 1, 3) and ev.lora_id == 3
    assert ev.token_ids == [1, 2, 3] and ev.parent_block_hash is None
    cache.evict(3)
    assert cache.take_events() == [BlockRemoved(ref_chain([1, 2, 3], 1, 3)[::-1][:1]
                                                + ref_chain([1, 2, 3], 1, 3)[:2])]


def test_hicache_publishes_each_medium() -> None:
    kv = TokenAllocator(8)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv,
                       hicache=HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1))
    router = Router()
    cache.insert([1, 2, 3, 4], kv.alloc(4))  # write_through: backed up at once
    cache.poll_transfers()
    evs = cache.take_events()
    h = ref_chain([1, 2, 3, 4], 1)
    assert [(type(e).__name__, e.medium) for e in evs] == [("BlockStored", GPU), ("BlockStored", CPU)]
    router.apply(evs)
    cache.evict(4)  # demoted: device copy gone, host copy stays
    evs = cache.take_events()
    assert evs == [BlockRemoved(h, GPU)]
    router.apply(evs)
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.prefix_len == 0 and m.host_hit_length == 4
    assert cache.load_back(m.last_host_node) == 4
    evs = cache.take_events()
    assert [(type(e).__name__, e.medium) for e in evs] == [("BlockStored", GPU)]
    router.apply(evs)
    assert router.pages == tree_pages(cache) == {(x, m, 0) for x in h for m in (GPU, CPU)}
    cache.evict(4)
    cache.evict_host(4)
    router.apply(cache.take_events())
    assert router.pages == set() == tree_pages(cache)
    cache.sanity_check()


def test_an_swa_tombstone_keeps_its_pages_and_a_pruned_one_removes_them() -> None:
    kv = SWAAllocator(32, 32)
    cache = RadixCache(CacheConfig(sliding_window_size=2, enable_kv_cache_events=True),
                       kv_allocator=kv)
    router = Router()
    cache.insert([1, 2, 3, 4], kv.alloc(4))
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.insert([1, 2, 3, 4, 5, 6], torch.cat([m.device_indices, kv.alloc(2)]))
    router.apply(cache.take_events())
    assert cache.evict_swa(1).num_swa_tokens == 4  # [0,4) is internal: a tombstone
    assert cache.take_events() == []
    assert router.pages == tree_pages(cache)
    cache.evict(2)  # the leaf goes, then the tombstone it leaves childless
    router.apply(cache.take_events())
    assert router.pages == set() == tree_pages(cache)


# ============================================================== seeded replays
CONFIGS = {
    "kv-p1": dict(ps=1),
    "kv-p4": dict(ps=4),
    "state-prune": dict(ps=1, states=6),
    "state-keep": dict(ps=1, states=6, keep=True),
    "swa": dict(ps=1, swa=3),
    "swa-state-p2": dict(ps=2, swa=4, states=6),
    "hicache-through": dict(ps=1, host="write_through"),
    "hicache-back-state": dict(ps=1, host="write_back", states=6),
    "hicache-through-p2": dict(ps=2, host="write_through"),
    # backs up only what two inserts passed through: few host-only chains to load back
    "hicache-selective": dict(ps=1, host="write_through_selective",
                              rare={"load_back_tokens", "host_evicted_tokens"}),
}


def build(cfg: dict[str, Any]) -> tuple[RadixCache, Any, MambaStatePool | None]:
    ps = cfg["ps"]
    size = 96
    if "swa" in cfg:
        kv: Any = SWAAllocator(size, size // 2, ps)
    else:
        kv = TokenAllocator(size) if ps == 1 else PagedAllocator(size, ps)
    sp = MambaStatePool(cfg["states"], num_layers=1, conv_state_shape=(1,),
                        ssm_state_shape=(1,)) if cfg.get("states") else None
    hc = HiCacheConfig(hicache_ratio=1.5, hicache_write_policy=cfg["host"],
                       load_back_threshold=1) if "host" in cfg else None
    config = CacheConfig(page_size=ps, sliding_window_size=cfg.get("swa"),
                         enable_kv_cache_events=True,
                         stateless_leaf="keep" if cfg.get("keep") else "prune")
    return RadixCache(config, kv_allocator=kv, state_allocator=sp, hicache=hc), kv, sp


def random_key(rng: random.Random, ps: int) -> tuple[list[int], Any]:
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8]]
    key = list(rng.choice(stems))[: rng.randrange(1, 9)]
    key += [rng.randrange(10, 14) for _ in range(rng.randrange(0, 3 * ps))]
    return key, rng.choice([None, None, None, "a", 7])


def put(cache: RadixCache, kv: Any, sp: MambaStatePool | None, key: list[int],
        extra_key: Any) -> None:
    """Match, lock, allocate the rest (evicting when short), insert, free what the tree did
    not take of the caller's own slots, unlock."""
    ps = cache.page_size
    if sp is not None:
        key = key[: len(key) // ps * ps]  # the state is valid at a page end
    m = cache.match_prefix(key, extra_key)
    lock = cache.inc_lock_ref(m.last_device_node)
    need = -(-(len(key) - m.prefix_len) // ps) * ps
    fresh = kv.alloc(need)
    if fresh is None:
        cache.evict(need)
        fresh = kv.alloc(need)
    slot = None
    if sp is not None and fresh is not None:
        got = sp.alloc(1)
        if got is None:
            cache.evict_states(1)
            got = sp.alloc(1)
        if got is None:
            kv.free(fresh)
            fresh = None
        else:
            slot = int(got[0])
    if fresh is not None:
        res = cache.insert(key, torch.cat([m.device_indices, fresh])[: len(key)], extra_key,
                           state_slot=slot)
        taken = set(res.adopted_indices.tolist()) | set(res.revived_indices.tolist())
        left = [s for s in fresh.tolist() if s not in taken]
        if left:
            kv.free(t64(*left))
        if slot is not None and not res.state_adopted:
            assert sp is not None
            sp.free(t64(slot))
    cache.dec_lock_ref(lock)


def step(cache: RadixCache, kv: Any, sp: MambaStatePool | None, rng: random.Random,
         locks: list[Any], history: list[tuple[list[int], Any]],
         force: str | None = None) -> str:
    ps = cache.page_size
    op = force or rng.choices(
        ["insert", "match", "lock", "unlock", "evict", "evict_states", "evict_swa",
         "evict_host", "load_back", "reset"],
        [30, 10, 8, 8, 10, 6, 6, 6, 8, 1])[0]
    if op == "insert":
        key = random_key(rng, ps)
        put(cache, kv, sp, *key)
        history.append(key)
    elif op == "match":
        cache.match_prefix(*random_key(rng, ps))
    elif op == "lock":
        m = cache.match_prefix(*random_key(rng, ps))
        if m.last_device_node is not cache.root:
            locks.append(cache.inc_lock_ref(m.last_device_node))
    elif op == "unlock" and locks:
        cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
    elif op == "evict":
        cache.evict(rng.randrange(1, 3 * ps + 1))
    elif op == "evict_states" and cache.state is not None:
        cache.evict_states(1)
    elif op == "evict_swa" and cache.swa is not None:
        cache.evict_swa(rng.randrange(1, 3 * ps + 1))
    elif op == "evict_host" and cache.hicache is not None:
        cache.evict_host(rng.randrange(1, 3 * ps + 1))
    elif op == "load_back" and cache.hicache is not None and history:
        cache.evict(rng.randrange(1, 3 * ps + 1))  # demote something first
        cache.poll_transfers()
        m = cache.match_prefix(*rng.choice(history[-8:]))
        if m.last_host_node is not None and m.host_hit_length:
            cache.load_back(m.last_host_node)
    elif op == "reset":
        while locks:
            cache.dec_lock_ref(locks.pop())
        cache.poll_transfers()
        cache.reset()
    cache.poll_transfers()
    return op


#: Counters a sequence must have moved (those its configuration has).
EXERCISED = ("evicted_tokens", "evicted_states", "evicted_swa_tokens", "demoted_tokens",
             "load_back_tokens", "host_evicted_tokens")


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(4))
def test_the_page_set_rebuilt_from_events_equals_the_tree_after_every_step(
        name: str, seed: int) -> None:
    cache, kv, sp = build(CONFIGS[name])
    rng = random.Random(f"{name}/{seed}")
    router = Router()
    locks: list[Any] = []
    history: list[tuple[list[int], Any]] = []
    seen = set()
    done = dict.fromkeys(EXERCISED, 0)  # what the sequence did, summed over resets
    last = dict.fromkeys(EXERCISED, 0)
    for i in range(250):
        op = step(cache, kv, sp, rng, locks, history, "reset" if i == 125 else None)
        seen.add(op)
        router.apply(cache.take_events())
        assert router.pages == tree_pages(cache), f"step {i} ({op})"
        cache.sanity_check()
        st = cache.stats()
        for k in EXERCISED:
            done[k] += max(st[k] - last[k], 0)
            last[k] = st[k]
    assert {"insert", "evict", "reset"} <= seen
    cfg = CONFIGS[name]
    want = {"evicted_tokens"} | ({"evicted_swa_tokens"} if "swa" in cfg else set()) | (
        {"evicted_states"} if cfg.get("states") else set()) | (
        {"demoted_tokens", "load_back_tokens", "host_evicted_tokens"} if "host" in cfg else set())
    want -= cfg.get("rare", set())
    assert {k for k in want if done[k] == 0} == set(), done


def test_bounded_queue_drops_the_oldest_and_counts_them() -> None:
    kv = TokenAllocator(64)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    assert cache.kv_events is not None
    cache.kv_events.max_events = 2
    for k in range(4):
        cache.insert([100 + k], kv.alloc(1))  # four roots: nothing merges
    evs = cache.take_events()
    assert [e.token_ids for e in evs] == [[102], [103]]
    assert cache.stats()["kv_events_dropped"] == 2


def test_without_the_option_nothing_is_recorded() -> None:
    kv = TokenAllocator(8)
    cache = RadixCache(kv_allocator=kv)
    cache.insert([1, 2], kv.alloc(2))
    assert cache.kv_events is None and cache.take_events() == []
    with pytest.raises(TypeError, match="enable_kv_cache_events"):
        CacheConfig(enable_kv_cache_events=cast(bool, 1))


def test_pages_an_l3_prefetch_brings_back_are_published_on_host(tmp_path: Any) -> None:
    kv = TokenAllocator(32)
    hc = HiCacheConfig(load_back_threshold=1, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path), hicache_storage_model="events-test",
                       hicache_storage_prefetch_policy="wait_complete")
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv, hicache=hc)
    router = Router()
    key = list(range(1, 17))
    try:
        cache.insert(key, kv.alloc(16))
        assert cache.flush_storage(30)  # the pages are in L3 (a generous bound: free when fast)
        cache.poll_transfers()
        cache.evict(32)
        cache.evict_host(64)  # the tree is empty; only L3 keeps the pages
        router.apply(cache.take_events())
        assert router.pages == set() and cache.tree.num_nodes == 0
        m = cache.match_prefix(key + [99])  # continues into L3: a prefetch attaches host pages
        assert m.host_hit_length == 16
        evs = cache.take_events()
        assert [(type(e).__name__, e.medium) for e in evs] == [("BlockStored", CPU)]
        router.apply(evs)
        assert router.pages == tree_pages(cache) == {(h, CPU, 0) for h in ref_chain(key, 1)}
        assert cache.load_back(m.last_host_node) == 16
        router.apply(cache.take_events())
        assert router.pages == tree_pages(cache)
        assert {m for _, m, _ in router.pages} == {GPU, CPU}
        cache.sanity_check()
    finally:
        cache.close_storage()


def test_a_bool_namespace_publishes_no_lora_id_and_an_int_one_does() -> None:
    """``lora_id`` is the namespace when it is an int (vLLM's LoRA id); ``True`` is a bool,
    not the LoRA id 1."""
    kv = PagedAllocator(32, 2)
    cache = RadixCache(CacheConfig(page_size=2, enable_kv_cache_events=True), kv_allocator=kv)
    cache.insert([1, 2], kv.alloc(2), extra_key=True)
    cache.insert([1, 2], kv.alloc(2), extra_key=1)
    got = [(e.lora_id, e.block_hashes) for e in cache.take_events()]
    assert got == [(None, ref_chain([1, 2], 2, True)), (1, ref_chain([1, 2], 2, 1))]


def test_the_queue_keeps_exactly_max_events_after_an_odd_overflow() -> None:
    """Seven events that cannot merge (seven root children) into a queue of 4: the 3 oldest
    are dropped, the 4 newest kept, in order."""
    kv = TokenAllocator(16)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    assert cache.kv_events is not None
    cache.kv_events.max_events = 4
    for k in range(7):
        cache.insert([100 + k], kv.alloc(1))
    assert (cache.kv_events.pending(), cache.kv_events.dropped) == (4, 3)
    assert [e.token_ids for e in cache.take_events()] == [[103], [104], [105], [106]]
