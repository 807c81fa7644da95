"""Shared helpers of the HiCache (L2 host tier) tests, and tests of the helpers themselves.

* :func:`make` builds a cache over real pools (float32 KV, tiny state shapes) with a host tier.
* :func:`dump` is everything a failed step must leave unchanged: every node's values, locks
  and stamps, ``pretty_print``, ``stats()``, every size, the order of every eviction set,
  every pool's ``snapshot()`` (free list order included) and the controller's counters.
* :class:`FailAllocs` (``tests.helpers.cache_helpers``) wraps the ``alloc`` of chosen pools so
  the k-th call across them (or the k-th and every later one) returns ``None``, the way a real
  shortage does.
* :func:`sig` gives every token position a value that depends on its whole prefix, so a test
  can write "the KV of this prefix" into slots and later check any slot's content exactly.

Slot ids follow the allocators' FIFO rule: initially ascending, ``alloc`` from the front,
``free`` to the back, rollback (``undo_alloc``) to the front.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from allocators import KVPool, MambaStatePool, PagedAllocator, TokenAllocator
from hicache import HiCacheConfig, HiCacheController
from radix import CacheConfig, RadixCache
from radix.node import TreeNode
from tests.helpers.cache_helpers import FailAllocs, free_leftovers, node_slots
from tests.helpers.gds_helpers import gds_entry, gds_stamp


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def ids(x: torch.Tensor | None) -> list[int] | None:
    return None if x is None else x.tolist()


# ======================================================================== building
@dataclass
class HC:
    """One cache and every pool around it."""

    cache: RadixCache
    kv: TokenAllocator | PagedAllocator  # device KV allocator (its .pool holds the tensors)
    sp: MambaStatePool | None  # device state pool

    @property
    def hc(self) -> HiCacheController:
        assert self.cache.hicache is not None
        return self.cache.hicache

    @property
    def host_kv(self) -> Any:
        return self.hc.host_kv

    @property
    def host_state(self) -> MambaStatePool | None:
        return self.hc.host_state

    def pools(self) -> dict[str, Any]:
        """Every allocator by name (device and host)."""
        out = {"device kv": self.kv, "host kv": self.host_kv}
        if self.sp is not None:
            out["device state"] = self.sp
            assert self.host_state is not None
            out["host state"] = self.host_state
        return out

    def state(self) -> int:
        """A fresh device state slot (the caller's)."""
        assert self.sp is not None
        got = self.sp.alloc(1)
        assert got is not None
        return int(got[0])


def make(
    page_size: int = 1,
    size: int = 16,
    states: int = 0,
    policy: str = "write_through",
    ratio: float = 2.0,
    threshold: int = 1,
    eviction: str | None = None,
    layers: int = 2,
    heads: int = 1,
    head_dim: int = 2,
    dtype: torch.dtype = torch.float32,
) -> HC:
    pool = KVPool(size, layers, heads, head_dim, dtype, "cpu", page_size=page_size)
    kv = TokenAllocator(size, pool=pool) if page_size == 1 else PagedAllocator(size, page_size, pool=pool)
    sp = (
        MambaStatePool(states, num_layers=layers, conv_state_shape=(2,), ssm_state_shape=(2, 2))
        if states
        else None
    )
    cache = RadixCache(
        CacheConfig(page_size=page_size, radix_eviction_policy=eviction),
        kv_allocator=kv,
        state_allocator=sp,
        hicache=HiCacheConfig(
            hicache_ratio=ratio, hicache_write_policy=policy, load_back_threshold=threshold
        ),
    )
    cache.sanity_check()
    return HC(cache, kv, sp)


def put(h: HC, key: list[int], prefix: torch.Tensor | None = None, extra_key: Any = None,
        with_state: bool | None = None) -> Any:
    """Insert ``key`` reusing ``prefix`` slots and fresh ones for the rest (a fresh state on a
    hybrid cache); free what the result leaves to the caller; return the InsertResult."""
    prefix = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
    ps = h.cache.page_size
    need = len(key) - len(prefix)
    fresh = h.kv.alloc(-(-need // ps) * ps)
    assert fresh is not None, "test set-up: device KV pool too small"
    with_state = h.sp is not None if with_state is None else with_state
    slot = h.state() if with_state else None
    res = h.cache.insert(key, torch.cat([prefix, fresh[:need]]), extra_key, state_slot=slot)
    free_leftovers(h.kv, res, fresh, need)
    if slot is not None and not res.state_adopted:
        h.sp.free(t64(slot))  # type: ignore[union-attr]
    h.cache.sanity_check()
    return res


def node_at(cache: RadixCache, key: list[int], extra_key: Any = None) -> TreeNode:
    """The node ending exactly at ``key`` (walking children; no stamps, no splits)."""
    node = cache.root
    pos = 0
    while pos < len(key):
        ck = cache.tree.child_key(node, _arr(key), pos, extra_key)
        node = node.children[ck]
        pos += len(node.key)
    assert pos == len(key), f"no node ends at {len(key)}"
    return node


def _arr(key: list[int]) -> Any:
    from array import array

    return array("q", key)


# ======================================================================== observing
def node_rows(cache: RadixCache) -> list[tuple]:
    """Every node: where it is and everything it holds, sorted by (namespace, path)."""
    rows = []
    stack = [(c, ()) for c in cache.root.children.values()]
    while stack:
        n, above = stack.pop()
        path = above + tuple(int(x) for x in n.key)
        rows.append((
            repr(n.extra_key), path, n.id, None if n.kv_value is None else ids(node_slots(n)),
            ids(n.host_value), n.state_slot,
            n.host_state_slot, n.kv_lock, n.lock_ref, n.state_lock, n.last_access_time,
            n.state_access_time, n.hit_count, gds_entry(cache, n), gds_stamp(cache, n),
        ))
        stack.extend((c, path) for c in n.children.values())
    return sorted(rows)


def dump(h: HC) -> dict[str, Any]:
    """Everything a refused or failed step must leave exactly as it was."""
    c = h.cache
    out: dict[str, Any] = {
        "nodes": node_rows(c),
        "pretty": c.pretty_print(),
        "stats": c.stats(),
        "sizes": (c.evictable_size(), c.protected_size(), c.state_evictable_size(),
                  c.state_protected_size(), c.host_size(), c.host_evictable_size()),
        "kv_leaves": [n.id for n in c.kv.leaves],
        "host_leaves": [n.id for n in c.host_leaves],
        "clock": c.core.clock,
        "controller": (h.hc.backup_tokens, h.hc.load_tokens, h.hc.num_inflight),
    }
    if c.state is not None and c.state.lru is not None:
        out["state_lru"] = [n.id for n in c.state.lru]
    for name, a in h.pools().items():
        out[name] = a.snapshot()
    return out


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for k in before:
        assert before[k] == after[k], f"{k} changed:\n{before[k]}\n-->\n{after[k]}"


def tree_device_tokens(c: RadixCache) -> int:
    return sum(len(node_slots(n)) for n in c.tree.iter_nodes() if n.kv_value is not None)


def check_accounting(h: HC, held_kv: int = 0, held_states: int = 0) -> None:
    """Every pool: free + held by the tree + held by the caller == capacity."""
    c = h.cache
    nodes = c.tree.iter_nodes()
    assert h.kv.available_size() + tree_device_tokens(c) + held_kv == h.kv.size
    assert h.host_kv.available_size() + c.host_size() == h.host_kv.size
    assert c.host_size() == sum(len(n.host_value) for n in nodes if n.host_value is not None)
    if h.sp is not None:
        dev_states = sum(n.state_slot is not None for n in nodes)
        host_states = sum(n.host_state_slot is not None for n in nodes)
        assert h.sp.available_size() + dev_states + held_states == h.sp.size
        assert h.host_state is not None
        assert h.host_state.available_size() + host_states == h.host_state.size


# ======================================================================== faults
@contextmanager
def held(h: HC) -> Iterator[None]:
    """Backups issued inside stay in flight until the block ends (then they land)."""
    h.hc.hold_completions = True
    try:
        yield
    finally:
        h.hc.hold_completions = False


# ======================================================================== contents
_MOD = 8_388_593  # a prime < 2**23: every value is exact in float32


def sig(extra_key: Any, tokens: Iterable[int]) -> list[int]:
    """Signature of every prefix: ``out[i]`` stands for the KV of token ``i`` after
    ``tokens[:i]``; ``out[-1]`` (one more entry) for the state after all of them."""
    h = {None: 17, "a": 29}.get(extra_key, 41)
    out = []
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 7) % _MOD
        out.append(h)
    return out


def write_kv(pool: KVPool, slots: torch.Tensor, values: list[int]) -> None:
    v = torch.tensor(values, dtype=pool.dtype)
    pool.k_all[:, slots] = v[None, :, None, None]
    pool.v_all[:, slots] = -v[None, :, None, None] - 1


def read_kv(pool: KVPool, slots: torch.Tensor) -> list[int]:
    """The value each slot holds, checking K and V agree across layers, heads and dims."""
    k = pool.k_all[:, slots]
    v = pool.v_all[:, slots]
    first = k[0, :, 0, 0]
    assert bool((k == first[None, :, None, None]).all()), "K differs across layers/heads"
    assert bool((v == -first[None, :, None, None] - 1).all()), "V does not match K"
    return [int(x) for x in first.tolist()]


def write_state(sp: MambaStatePool, slot: int, value: int) -> None:
    sp.conv[:, slot] = float(value)
    sp.ssm[:, slot] = -float(value)


def read_state(sp: MambaStatePool, slot: int) -> int:
    conv = sp.conv[:, slot]
    assert bool((conv == conv.reshape(-1)[0]).all()) and bool((sp.ssm[:, slot] == -conv.reshape(-1)[0]).all())
    return int(conv.reshape(-1)[0])


def check_contents(h: HC) -> None:
    """Every device and host copy in the tree holds its prefix's signature."""
    c = h.cache
    dev_pool = h.kv.pool
    host_pool = h.host_kv.pool
    stack = [(n, []) for n in c.root.children.values()]
    while stack:
        n, above = stack.pop()
        path = above + [int(x) for x in n.key]
        want = sig(n.extra_key, path)
        if n.kv_value is not None:
            assert read_kv(dev_pool, node_slots(n)) == want[n.start:], f"device KV of {n}"
        if n.host_value is not None:
            assert read_kv(host_pool, n.host_value) == want[n.start:], f"host KV of {n}"
        if n.state_slot is not None:
            assert read_state(h.sp, n.state_slot) == want[-1], f"device state of {n}"  # type: ignore[arg-type]
        if n.host_state_slot is not None:
            assert read_state(h.host_state, n.host_state_slot) == want[-1], f"host state of {n}"  # type: ignore[arg-type]
        stack.extend((ch, path) for ch in n.children.values())


# ======================================================================== helper tests
def test_fail_allocs_counts_across_pools_and_restores_the_methods() -> None:
    h = make(states=2)
    pools = h.pools()
    with FailAllocs(pools, k=2, mode="once") as f:
        assert ids(h.kv.alloc(2)) == [1, 2]
        assert h.sp.alloc(1) is None  # type: ignore[union-attr]
        assert ids(h.host_kv.alloc(1)) == [1]
    assert f.calls == [("device kv", 2, False), ("device state", 1, True), ("host kv", 1, False)]
    assert "alloc" not in vars(h.kv) and ids(h.sp.alloc(1)) == [1]  # type: ignore[union-attr]
    with FailAllocs(pools, k=1, mode="from") as f:
        assert h.kv.alloc(1) is None and h.host_kv.alloc(1) is None
    assert f.names == ["device kv", "host kv"]


def test_sig_depends_on_the_whole_prefix_and_the_namespace() -> None:
    a, b = sig(None, [1, 2, 3]), sig(None, [9, 2, 3])
    assert len(a) == 3 and a[0] != b[0] and a[2] != b[2]
    assert sig("a", [1]) != sig(None, [1]) and sig(None, [1, 2])[:1] == sig(None, [1])
    assert all(0 <= x < _MOD for x in a)


def test_dump_sees_a_stamp_and_a_free_list_change() -> None:
    h = make()
    put(h, [1, 2, 3, 4])
    before = dump(h)
    h.cache.match_prefix([1, 2])
    with pytest.raises(AssertionError):
        assert_same(before, dump(h))
    before = dump(h)
    h.kv.free(h.kv.alloc(1))  # same free set, different order
    with pytest.raises(AssertionError, match="device kv"):
        assert_same(before, dump(h))
