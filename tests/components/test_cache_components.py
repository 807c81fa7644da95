"""The extension point: a component added by the caller plugs into the cache without editing it.

Two components written here, against ``components.base.Component`` only:

* ``Recorder`` records every hook call it receives (the calls of one engine step, in order);
* ``CoarseEnds`` is a usable-prefix rule: a match may end only at a depth that is a multiple
  of ``step`` tokens (say, a second group of recurrent layers that checkpoints only there).

The expected hook sequences and usable prefixes are worked out by hand from the module
docstring of ``components.base`` (the order the cache calls hooks in).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import radix
from allocators import KVPool, MambaStatePool, TokenAllocator
from components.base import Component, InsertPlan
from radix import RadixCache
from tests.helpers.cache_helpers import node_slots, tiny_state_pool
from tests.helpers.slot_tier_hooks import OneSlotTierHooks


class Recorder(Component):
    """Records ``(hook, *args)`` with nodes as ``(start, end)`` spans."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.resets = 0

    def take(self, skip: tuple[str, ...] = ("refresh",)) -> list[tuple[Any, ...]]:
        out = [c for c in self.calls if c[0] not in skip]
        self.calls = []
        return out

    @staticmethod
    def span(node: Any) -> tuple[int, int]:
        return (node.start, node.depth)

    def on_split(self, upper: Any, lower: Any, split_len: int) -> None:
        self.calls.append(("on_split", self.span(upper), self.span(lower), split_len))

    def on_remove(self, node: Any) -> int:
        self.calls.append(("on_remove", self.span(node)))
        return 0

    def refresh(self, node: Any) -> None:
        self.calls.append(("refresh", self.span(node)))

    def on_touch(self, path: list[Any]) -> None:
        self.calls.append(("on_touch", [self.span(n) for n in path]))

    def usable(self, path: list[Any], n: int) -> int:
        self.calls.append(("usable", n))
        return n

    def on_hit(self, node: Any, now: int) -> None:
        self.calls.append(("on_hit", self.span(node)))

    def check_insert(self, n: int, value: Any, state_slot: int | None) -> None:
        self.calls.append(("check_insert", n, state_slot))

    def plan_insert(self, plan: InsertPlan) -> None:
        self.calls.append(("plan_insert", plan.prefix_len, plan.end))

    def on_new_node(self, node: Any, plan: InsertPlan, lo: int, hi: int) -> None:
        self.calls.append(("on_new_node", self.span(node), lo, hi))

    def on_insert(self, plan: InsertPlan, last: Any, now: int) -> bool:
        self.calls.append(("on_insert", self.span(last)))
        return False

    def lock(self, node: Any) -> None:
        self.calls.append(("lock", self.span(node)))

    def unlock(self, node: Any, data: Any) -> None:
        self.calls.append(("unlock", self.span(node)))

    def reset(self) -> None:
        self.resets += 1
        self.calls = []

    def stats(self) -> dict[str, Any]:
        return {"recorder_calls": len(self.calls)}

    def check(self, nodes: list[Any]) -> None:
        self.calls.append(("check", len(nodes)))


class CoarseEnds(Component):
    """A match may end only at a depth that is a multiple of ``step`` tokens."""

    name = "coarse"

    def __init__(self, step: int) -> None:
        self.step = step

    def usable(self, path: list[Any], n: int) -> int:
        while n > 0 and path[n - 1].depth % self.step:
            n -= 1
        return n


K = list(range(1, 17))


def test_a_recorder_sees_every_hook_of_each_engine_step_in_order() -> None:
    rec = Recorder()
    kv = TokenAllocator(32)
    cache = RadixCache(kv_allocator=kv, components=[rec])
    assert [c.name for c in cache.components] == ["kv", "recorder"]

    res = cache.insert(K[:8], kv.alloc(8))
    assert rec.take() == [
        ("check_insert", 8, None), ("plan_insert", 0, 8), ("on_touch", []),
        ("on_new_node", (0, 8), 0, 8), ("on_insert", (0, 8)),
    ]

    m = cache.match_prefix(K[:4] + [99])  # ends inside [0, 8): split at 4
    assert rec.take() == [
        ("on_split", (0, 4), (4, 8), 4), ("on_touch", [(0, 4)]), ("usable", 1), ("on_hit", (0, 4)),
    ]
    assert m.prefix_len == 4

    lock = cache.inc_lock_ref(res.last_node)
    assert lock is res.last_node  # no component records data per lock
    cache.dec_lock_ref(lock)
    assert rec.take() == [("lock", (4, 8)), ("unlock", (4, 8))]

    assert cache.evict(8).num_tokens == 8  # the leaf [4, 8), then its parent, left a leaf
    assert rec.take() == [("on_remove", (4, 8)), ("on_remove", (0, 4))]

    cache.sanity_check()
    assert rec.take(skip=()) == [("check", 0)]
    assert cache.stats()["recorder_calls"] == 0
    cache.insert(K[:4], kv.alloc(4))
    cache.reset()
    assert rec.resets == 1 and cache.stats()["num_nodes"] == 0
    assert kv.available_size() == 32


def test_refresh_reaches_an_added_component_on_every_change() -> None:
    rec = Recorder()
    kv = TokenAllocator(32)
    cache = RadixCache(kv_allocator=kv, components=[rec])
    a = cache.insert(K[:4], kv.alloc(4)).last_node
    rec.take(skip=())
    cache.insert(K[:8], torch.cat([node_slots(a), kv.alloc(4)]))  # a new leaf below A
    refreshed = [c[1] for c in rec.take(skip=()) if c[0] == "refresh"]
    assert (0, 4) in refreshed and (4, 8) in refreshed  # A stopped being a leaf; the new leaf


def _hybrid(*extra: Component) -> tuple[RadixCache, TokenAllocator, MambaStatePool]:
    kv = TokenAllocator(64)
    pool = tiny_state_pool(8)
    return RadixCache(kv_allocator=kv, state_allocator=pool, components=list(extra)), kv, pool


def _put(cache: RadixCache, kv: TokenAllocator, pool: MambaStatePool, key: list[int],
         prefix: torch.Tensor) -> None:
    fresh = kv.alloc(len(key) - len(prefix))
    slot = int(pool.alloc(1)[0])
    res = cache.insert(key, torch.cat([prefix, fresh]), state_slot=slot)
    assert res.state_adopted


@pytest.mark.parametrize(("states_at", "query", "want"), [
    # states at 4, 8, 12: the state rule allows 12; 12 is not a multiple of 8 -> 8 (a state).
    ((4, 8, 12), 12, 8),
    # states at 4 and 12: 12 -> not coarse -> 8 has no state -> 4 -> not coarse -> 0.
    ((4, 12), 12, 0),
    # states at 8 and 16: 16 is both.
    ((8, 16), 16, 16),
])
def test_an_added_rule_bounds_matches_with_the_state_rule_to_a_fixpoint(
        states_at: tuple[int, ...], query: int, want: int) -> None:
    cache, kv, pool = _hybrid(CoarseEnds(8))
    prefix = torch.empty(0, dtype=torch.int64)
    for end in states_at:
        _put(cache, kv, pool, K[:end], prefix)
        prefix = cache.match_prefix(K[:end]).device_indices
    m = cache.match_prefix(K[:query])
    assert (m.prefix_len, m.kv_hit_length) == (want, query)
    assert m.state_slot is not None or want == 0
    assert m.branching_seqlen == (query if want < query else None)
    cache.sanity_check()


def test_added_components_are_refused_when_they_are_not_components_or_clash() -> None:
    kv = TokenAllocator(8)
    with pytest.raises(TypeError, match="components"):
        RadixCache(kv_allocator=kv, components=[object()])  # type: ignore[list-item]

    class Clash(Component):
        name = "kv"

    with pytest.raises(ValueError, match="unique"):
        RadixCache(kv_allocator=kv, components=[Clash()])


def test_components_import_without_radix_and_radix_without_lazy_exports() -> None:
    code = ("import sys, components.base, components.kv, components.state, components.swa, "
            "components.eviction.adaptive; "
            "bad = [m for m in sys.modules if m == 'radix' or m.startswith('radix.')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-600:]
    assert "__getattr__" not in vars(radix)


class Summary(OneSlotTierHooks, Component):
    """A plug-in with a host copy: one slot of its own pool per node (say, a cross-attention
    summary valid at the node's end), kept in the node's extension slot (``node.ext``). It
    implements the tier hooks (``components.base.TIER_HOOKS``): the host tier backs it up
    with the node, drops the device slot on demotion and restores it on load-back (the hooks
    come from ``OneSlotTierHooks``)."""

    name = "summary"

    def __init__(self, size: int) -> None:
        self.pool = KVPool(size, 1, 1, 2, torch.float32, "cpu")
        self.allocator = TokenAllocator(size, pool=self.pool)
        self.restore_allocator = self.allocator

    def on_new_node(self, node: Any, plan: InsertPlan, lo: int, hi: int) -> None:
        got = self.allocator.alloc(1)
        assert got is not None
        self._ext(node)["dev"] = int(got[0])

    def on_remove(self, node: Any) -> int:
        slot = self._ext(node).pop("dev", None)
        if slot is None:
            return 0
        self.allocator.free(torch.tensor([slot]))
        return 1

    def host_pool(self, config: Any) -> tuple[Any, Any, Any]:
        from hicache.host_pools import kv_lanes

        size = 2 * self.allocator.size
        host = TokenAllocator(size, pool=KVPool(size, 1, 1, 2, torch.float32, "cpu"))
        return self.allocator, host, kv_lanes(self.allocator, host)


def test_a_plug_in_with_a_host_copy_is_backed_up_evicted_and_loaded_back_bit_exactly() -> None:
    from hicache import HiCacheConfig
    from tests.helpers.cache_helpers import bits, random_bits

    summary = Summary(8)
    kv = TokenAllocator(16)
    cache = RadixCache(kv_allocator=kv, components=[summary],
                       hicache=HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1,
                                             hicache_write_policy="write_back"))
    assert cache.hicache is not None and "summary" in cache.hicache.pools
    cache.insert(K[:8], kv.alloc(8))
    node = cache.match_prefix(K[:8]).last_device_node
    slot = node.ext["dev"]
    value = random_bits((1, 1, 1, 2), torch.float32, torch.Generator().manual_seed(3))
    summary.pool.k_all[:, [slot]] = value
    summary.pool.v_all[:, [slot]] = value
    assert "host" not in node.ext  # write_back: backed up when evicted
    assert cache.evict(8).num_tokens == 8  # backed up, then demoted: the device slot freed
    host = summary.host_allocator.pool
    assert torch.equal(bits(host.k_all[:, [node.ext["host"]]]), bits(value))
    assert "dev" not in node.ext and summary.allocator.available_size() == 8
    taken = summary.allocator.alloc(1)  # the load lands in another slot
    m = cache.match_prefix(K[:8])
    assert (m.host_hit_length, m.last_host_node) == (8, node)
    assert cache.load_back(node) == 8
    new = node.ext["dev"]
    assert taken is not None and new not in (slot, int(taken[0]))
    assert torch.equal(bits(summary.pool.k_all[:, [new]]), bits(value))
    assert torch.equal(bits(summary.pool.v_all[:, [new]]), bits(value))
    assert cache.evict_host(0) == 0 and cache.evict(8).num_tokens == 8
    assert cache.evict_host(8) == 8  # host eviction drops the plug-in's host copy too
    assert summary.host_allocator.available_size() == summary.host_allocator.size
    cache.sanity_check()
