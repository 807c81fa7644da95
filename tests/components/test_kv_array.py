"""A CPU node's KV slots are an ``array('q')`` of its own (``components.kv``).

The node's array is a copy (never a view of the caller's tensor), a split's halves are two
new arrays, a removed node's slots go back to the allocator with their held marks cleared,
and every tensor handed out (``KVComponent.slots``, a match's ``device_indices``, an insert's
``tree_slots``) equals the node's slots, independently recomputed from the inserted tensors.
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

import components.kv as kv_mod
from allocators import PagedAllocator, TokenAllocator
from allocators.host_mirror import mirrored
from bench.dev.gpu.simcuda import OUTSIDE, SimCuda
from components.kv import cat_values, slot_tensor, to_value
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import node_slots


def make(size: int = 64, ps: int = 1) -> tuple[RadixCache, TokenAllocator | PagedAllocator]:
    kv: TokenAllocator | PagedAllocator = (TokenAllocator(size) if ps == 1
                                           else PagedAllocator(size, ps))
    return RadixCache(CacheConfig(page_size=ps), kv_allocator=kv), kv


def span(a: array) -> tuple[int, int]:
    """An array's memory, [first byte, one past the last)."""
    at, n = a.buffer_info()
    return at, at + n * a.itemsize


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("compiled", [True, False])
def test_a_node_keeps_its_own_array_not_a_view_of_the_callers_tensor(
        compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not compiled:  # the numpy claim (the C pass's reference) makes the node's array too
        monkeypatch.setattr(kv_mod, "_claim_c", None)
    elif kv_mod._claim_c is None:
        pytest.skip("components._claim is not built")
    cache, kv = make()
    value = kv.alloc(6)
    assert value is not None
    want = value.tolist()
    cache.insert([1, 2, 3, 4, 5, 6], value)
    (node,) = cache.root.children.values()
    own = node.kv_value
    assert type(own) is array and own.typecode == "q" and own.tolist() == want
    lo = value.data_ptr()
    assert not overlaps(span(own), (lo, lo + 8 * len(value)))
    value.fill_(0)  # the caller reuses its tensor: the node's slots stay
    assert own.tolist() == want and cache.kv.slots(node).tolist() == want
    cache.sanity_check()


def test_slots_is_a_zero_copy_view_of_the_nodes_array() -> None:
    cache, kv = make()
    value = kv.alloc(4)
    assert value is not None
    cache.insert([7, 8, 9, 10], value)
    (node,) = cache.root.children.values()
    t = cache.kv.slots(node)
    assert t.dtype == torch.int64 and t.dim() == 1 and t.tolist() == value.tolist()
    assert t.data_ptr() == node.kv_value.buffer_info()[0]  # no copy
    with pytest.raises(ValueError, match="no device KV"):
        cache.kv.slots(cache.root)


def test_a_splits_halves_are_two_arrays_that_share_no_memory() -> None:
    cache, kv = make()
    value = kv.alloc(6)
    assert value is not None
    cache.insert([1, 2, 3, 4, 5, 6], value)
    m = cache.match_prefix([1, 2, 9])  # splits [1..6] after 2
    upper = m.last_device_node
    (lower,) = upper.children.values()
    up, low = upper.kv_value, lower.kv_value
    assert type(up) is array and type(low) is array and up is not low
    assert (up.typecode, low.typecode) == ("q", "q")  # int64 slots, exactly the half's
    assert (up.buffer_info()[1], low.buffer_info()[1]) == (2, 4)
    assert (up.tolist(), low.tolist()) == (value[:2].tolist(), value[2:].tolist())
    assert not overlaps(span(up), span(low))
    # the match's answer is the upper half's slots (a view of its array: one node)
    assert m.device_indices.tolist() == value[:2].tolist()
    cache.sanity_check()


@pytest.mark.parametrize("path", ["c_release", "unmark_and_free"])
@pytest.mark.parametrize("ps", [1, 2])
def test_a_released_nodes_slots_are_freed_and_unmarked(path: str, ps: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache, kv = make(32, ps)
    if path == "unmark_and_free":  # the fallback: no one-pass release in C
        monkeypatch.setattr(cache.kv, "_release", None)
    elif cache.kv._release is None:
        pytest.skip("allocators._release is not built")
    a, b = kv.alloc(8), kv.alloc(4)
    assert a is not None and b is not None
    cache.insert(list(range(1, 9)), a)
    cache.insert([1, 2, 3, 4, 50, 51, 52, 53], torch.cat([a[:4], b]))  # splits A at 4
    assert kv.available_size() == 32 - 12
    held = cache.kv.held_mask()
    assert held is not None
    for slots in (a, b):
        ids = slots.numpy()[::ps] // ps
        assert held[ids].all()
    assert cache.evict(12).num_tokens == 12  # both leaves, then their parent
    assert cache.total_size() == 0 and kv.available_size() == 32
    assert bool(kv.is_free(torch.cat([a, b])).all())
    held = cache.kv.held_mask()
    assert held is not None and not held.any()
    cache.sanity_check()


def test_every_tensor_handed_out_equals_the_nodes_slots() -> None:
    cache, kv = make()
    a, b = kv.alloc(5), kv.alloc(3)
    assert a is not None and b is not None
    cache.insert([1, 2, 3, 4, 5], a)
    res = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.cat([a, b]))
    assert [t.tolist() for t in res.tree_slots] == [a.tolist()]
    assert [v.tolist() for v in res.tree_values] == [a.tolist()]
    assert res.duplicate_indices.tolist() == []
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])  # two nodes: a joined tensor
    assert m.prefix_len == 8 and m.device_indices.dtype == torch.int64
    assert m.device_indices.tolist() == a.tolist() + b.tolist()
    path = m.last_device_node.path_to_root()[::-1]
    assert cache.kv.path_slots(path).tolist() == a.tolist() + b.tolist()
    assert [node_slots(n).tolist() for n in path] == [a.tolist(), b.tolist()]


def test_cat_values_and_to_value() -> None:
    parts = [array("q", [3, 1]), array("q"), array("q", [7])]
    got = cat_values(parts)
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 7]
    got[0] = 99  # a new tensor: the parts are untouched
    assert parts[0].tolist() == [3, 1]
    assert cat_values([]).tolist() == [] and cat_values([array("q")]).tolist() == []
    assert slot_tensor(array("q")).tolist() == []
    t = torch.arange(10)[::3]  # not contiguous
    own = to_value(t)
    assert type(own) is array and own.tolist() == [0, 3, 6, 9]
    assert to_value(own) is own  # a node's array as it is
    assert np.frombuffer(own, dtype=np.int64).tolist() == [0, 3, 6, 9]
    with SimCuda() as sim:  # on a device: the tensor's host mirror, no CUDA call
        host = np.array([5, 2, 8], dtype=np.int64)
        dev = mirrored(host, torch.device("cuda"))
        before = sim.api_of(OUTSIDE).total
        got_dev = to_value(dev[1:])
        assert sim.api_of(OUTSIDE).total == before and sim.total_syncs == 0
    assert type(got_dev) is array and got_dev.tolist() == [2, 8]


def test_the_c_claim_refuses_a_destination_buffer_of_the_wrong_size() -> None:
    claim = kv_mod._claim_c
    if claim is None:
        pytest.skip("components._claim is not built")
    src = torch.tensor([5, 6, 7], dtype=torch.int64)
    held = np.zeros(8, dtype=np.uint8)
    free = np.zeros(64, dtype=np.bool_)
    with pytest.raises(ValueError, match="dst"):
        claim(src.data_ptr(), 3, array("q", [0, 0]), 1, 1, 64, held, free)
    assert not held.any()  # nothing marked
    dst = array("q", [0, 0, 0])
    assert claim(src.data_ptr(), 3, dst, 1, 1, 64, held, free) == -1
    assert dst.tolist() == [5, 6, 7]
    assert np.unpackbits(held, bitorder="little")[[5, 6, 7]].all()


def test_slots_keeps_its_last_view_only_for_the_same_array() -> None:
    cache, kv = make()
    a, b = kv.alloc(4), kv.alloc(4)
    assert a is not None and b is not None
    cache.insert([1, 2, 3, 4], a)
    cache.insert([9, 8, 7, 6], b)
    first = cache.match_prefix([1, 2, 3, 4]).device_indices
    assert cache.match_prefix([1, 2, 3, 4]).device_indices is first  # the kept view
    m = cache.match_prefix([9, 8, 7, 6])
    assert m.device_indices is not first and m.device_indices.tolist() == b.tolist()
    x, y = cache.match_prefix([1, 2, 3, 4]).last_device_node, m.last_device_node
    assert cache.kv.slots(x).tolist() == a.tolist() and cache.kv.slots(y).tolist() == b.tolist()
    m = cache.match_prefix([1, 2, 9])  # splits X: its upper half is a new array
    assert m.device_indices.tolist() == a[:2].tolist()
    (low,) = m.last_device_node.children.values()
    assert cache.kv.slots(low).tolist() == a[2:].tolist()
    assert cache.evict(8).num_tokens == 8  # every node leaves; a stale view is never served
    c = kv.alloc(4)
    assert c is not None
    cache.insert([1, 2, 3, 4], c)
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == c.tolist()
    cache.reset()
    assert cache.kv._view_of is None
