"""SGLang's unit tests of its radix cache, reproduced against the front end (``radix.sglang``).

Source: SGLang's public ``test/registered/radix_cache/test_radix_cache_unit.py``
(``TestRadixKey``, ``TestTreeNode``, ``TestRadixCache``), the same calls and expected values,
written again here. Where SGLang 0.5.23 itself changed since the test was written, the
reproduction asserts 0.5.23's behaviour and says so:

* its KV event recorder merges consecutive pages of one chain into one ``BlockStored`` (the
  test's "one event per page" no longer holds there; the hashes, parents and page counts
  still do, as asserted here);
* a simulated cache's eviction frees through the allocator (the test's ``free``; 0.5.23 calls
  ``free_segment``).

Not reproduced: ``test_memory_allocated`` (CUDA memory accounting of SGLang's own tensors).
"""

from __future__ import annotations

import unittest.mock
from typing import Any

import pytest
import torch

from radix.sglang import MatchPrefixParams, RadixCache, RadixKey, TreeNode
from radix.sglang.kv_events import BlockRemoved, BlockStored

T = torch.tensor


def i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ================================================================== TestRadixKey
def test_radix_key_init_keeps_tokens_and_extra_key() -> None:
    key = RadixKey([1, 2, 3, 4])
    assert key.token_ids == [1, 2, 3, 4] and key.extra_key is None
    key = RadixKey([1, 2, 3], "test_key")
    assert key.token_ids == [1, 2, 3] and key.extra_key == "test_key"


@pytest.mark.parametrize(("tokens", "n"), [([1, 2, 3], 3), ([], 0), ([42], 1)])
def test_radix_key_len_and_iter(tokens: list[int], n: int) -> None:
    key = RadixKey(tokens)
    assert len(key) == n and list(key) == tokens


@pytest.mark.parametrize(("index", "expected"), [(0, [10]), (-1, [30]), (2, [30])])
def test_radix_key_getitem_int_is_a_one_token_key(index: int, expected: list[int]) -> None:
    got = RadixKey([10, 20, 30])[index]
    assert isinstance(got, RadixKey) and got.token_ids == expected


def test_radix_key_getitem_slice_and_edges() -> None:
    key = RadixKey([1, 2, 3, 4, 5], "extra")
    sliced = key[1:4]
    assert isinstance(sliced, RadixKey)
    assert sliced.token_ids == [2, 3, 4] and sliced.extra_key == "extra"
    assert key[2:2].token_ids == [] and key[:].token_ids == [1, 2, 3, 4, 5]
    with pytest.raises(IndexError):
        _ = RadixKey([1, 2, 3])[10]


def test_radix_key_repr() -> None:
    text = repr(RadixKey([1, 2, 3], "test"))
    assert "RadixKey" in text and "extra_key='test'" in text and "[1, 2, 3]" in text
    assert "..." in repr(RadixKey(list(range(15))))


# ================================================================== TestTreeNode
@pytest.fixture
def fresh_counter() -> None:
    TreeNode.counter = 0


def test_tree_node_init(fresh_counter: None) -> None:
    node = TreeNode()
    assert node.id == 0 and len(node.children) == 0 and node.parent is None
    assert node.key is None and node.value is None
    assert node.lock_ref == 0 and node.hit_count == 0 and node.host_ref_counter == 0
    assert node.host_value is None and node.hash_value is None


def test_tree_node_ids_follow_the_counter(fresh_counter: None) -> None:
    assert TreeNode(id=42).id == 42
    assert TreeNode().id == 1  # the counter moved anyway
    a, b = TreeNode(), TreeNode()
    assert (a.id, b.id) == (2, 3)


@pytest.mark.parametrize(("value", "host", "evicted", "backuped"), [
    (False, False, True, False), (True, False, False, False),
    (True, True, False, True), (False, True, True, True)])
def test_tree_node_evicted_and_backuped(fresh_counter: None, value: bool, host: bool,
                                        evicted: bool, backuped: bool) -> None:
    node = TreeNode()
    if value:
        node.value = T([1, 2, 3])
    if host:
        node.host_value = T([4, 5, 6])
    assert node.evicted == evicted and node.backuped == backuped


def test_tree_node_protect_and_release_host(fresh_counter: None) -> None:
    node = TreeNode()
    node.protect_host()
    assert node.host_ref_counter == 1
    node.release_host()
    assert node.host_ref_counter == 0
    with pytest.raises(RuntimeError):
        node.release_host()


def test_tree_node_last_hash_value_and_order(fresh_counter: None) -> None:
    node = TreeNode()
    assert node.get_last_hash_value() is None
    node.hash_value = ["hash1", "hash2", "hash3"]
    assert node.get_last_hash_value() == "hash3"
    first, second = TreeNode(), TreeNode()
    assert first < second and not second < first


# ================================================================== TestRadixCache
@pytest.mark.parametrize(("page_size", "disable", "events"), [(1, False, False), (4, False, True),
                                                              (1, True, False)])
def test_init_variations(page_size: int, disable: bool, events: bool) -> None:
    cache = RadixCache.create_simulated(disable=disable, page_size=page_size,
                                        enable_kv_cache_events=events)
    assert cache.page_size == page_size and cache.disable == disable
    assert cache.enable_kv_cache_events == events
    assert cache.device == torch.device("cpu")
    assert cache.root_node is not None and len(cache.root_node.key) == 0


def test_reset() -> None:
    cache = RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2, 3]), i64([10, 20, 30]))
    assert cache.total_size() > 0
    cache.reset()
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)


@pytest.mark.parametrize("disable", [False, True])
def test_insert_and_match_basic(disable: bool) -> None:
    cache = RadixCache.create_simulated(disable=disable)
    value = i64([10, 20, 30])
    assert cache.insert(RadixKey([1, 2, 3]), value) == 0
    if disable:
        assert cache.total_size() == 0
        return
    assert cache.total_size() == 3 and cache.evictable_size() == 3
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3])))
    assert len(res.device_indices) == 3
    torch.testing.assert_close(res.device_indices, value)
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))
    torch.testing.assert_close(res.device_indices, i64([10, 20]))


@pytest.mark.parametrize("value", [torch.tensor([1.7, 2.2, 3.9]), torch.tensor([True, False, True]),
                                   [10, 20, 30]], ids=["float", "bool", "list"])
def test_a_value_that_is_not_integer_slots_is_refused(value: Any) -> None:
    """A float or bool tensor would be truncated into slots (1.7 -> 1), a list has no dtype:
    a TypeError naming ``params.value``, and nothing is cached."""
    cache = RadixCache.create_simulated()
    with pytest.raises(TypeError, match="params.value must be a 1-D int32 or int64 tensor"):
        cache.insert(RadixKey([1, 2, 3]), value)
    assert cache.total_size() == 0


def test_int32_slots_are_read_as_int64() -> None:
    """SGLang's ``req_to_token`` rows are int32; the adapter takes them as its caches do."""
    cache = RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2, 3]), torch.tensor([10, 20, 30], dtype=torch.int32))
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3])))
    assert res.device_indices.dtype == torch.int64 and res.device_indices.tolist() == [10, 20, 30]


def test_insert_with_none_value_uses_the_token_ids() -> None:
    cache = RadixCache.create_simulated()
    assert cache.insert(RadixKey([1, 2, 3]), None) == 0
    assert cache.total_size() == 3


def test_total_size() -> None:
    cache = RadixCache.create_simulated()
    assert cache.total_size() == 0
    cache.insert(RadixKey([1, 2, 3]), i64([10, 20, 30]))
    assert cache.total_size() == 3
    cache.insert(RadixKey([4, 5]), i64([40, 50]))
    assert cache.total_size() == 5


@pytest.mark.parametrize(("page_size", "events"), [(1, True), (2, True), (1, False)])
def test_kv_cache_events(page_size: int, events: bool) -> None:
    cache = RadixCache.create_simulated(page_size=page_size, enable_kv_cache_events=events)
    cache.insert(RadixKey([1, 2, 3, 4, 5]), None)
    got = cache.take_events()
    if not events:
        assert got == []
        return
    stored = [e for e in got if isinstance(e, BlockStored)]
    assert stored
    # 0.5.23 merges the chain's pages into one event: whole pages of block_size tokens
    for e in stored:
        assert e.block_size == page_size
        assert len(e.token_ids) == page_size * len(e.block_hashes)
    assert sum(len(e.block_hashes) for e in stored) == 5 // page_size


def test_kv_cache_events_with_eviction() -> None:
    mock = unittest.mock.Mock()
    mock.device = torch.device("cpu")
    cache = RadixCache.create_simulated(mock_allocator=mock, enable_kv_cache_events=True)
    cache.insert(RadixKey([1, 2, 3]), i64([10, 20, 30]))
    cache.evict(3)
    got = cache.take_events()
    assert "BlockStored" in [type(e).__name__ for e in got]
    removed = [e for e in got if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) > 0 for e in removed)


def test_extra_key_isolation() -> None:
    cache = RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2, 3], "key1"), i64([10, 20, 30]))
    cache.insert(RadixKey([1, 2, 3], "key2"), i64([40, 50, 60]))
    cache.insert(RadixKey([1, 2, 3], None), i64([70, 80, 90]))

    def hit(extra: str | None) -> torch.Tensor:
        return cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3], extra))).device_indices

    torch.testing.assert_close(hit("key1"), i64([10, 20, 30]))
    torch.testing.assert_close(hit("key2"), i64([40, 50, 60]))
    torch.testing.assert_close(hit(None), i64([70, 80, 90]))
    assert len(hit("nonexistent")) == 0


def test_lock_ref_operations() -> None:
    cache = RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2, 3]), i64([10, 20, 30]))
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3]))).last_device_node
    ev, pr = cache.evictable_size(), cache.protected_size()
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (pr + 3, ev - 3)
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (pr, ev)


def test_evict_functionality() -> None:
    mock = unittest.mock.Mock()
    mock.device = torch.device("cpu")
    cache = RadixCache.create_simulated(mock_allocator=mock)
    cache.insert(RadixKey([1, 2]), i64([10, 20]))
    cache.insert(RadixKey([3, 4]), i64([30, 40]))
    before = cache.total_size()
    cache.evict(2)
    mock.free.assert_called()
    assert cache.total_size() < before


@pytest.mark.parametrize(("page_size", "n"), [(1, 5), (2, 5), (4, 6)])
def test_page_alignment_boundary(page_size: int, n: int) -> None:
    cache = RadixCache.create_simulated(page_size=page_size)
    tokens = list(range(n))
    cache.insert(RadixKey(tokens), i64(tokens))
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert len(res.device_indices) > 0 and len(res.device_indices) % page_size == 0


def test_pretty_print_basic(capsys: pytest.CaptureFixture[str]) -> None:
    cache = RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2, 3]), i64([10, 20, 30]))
    cache.pretty_print()
    assert "[0,3)" in capsys.readouterr().out


def test_all_values_flatten() -> None:
    cache = RadixCache.create_simulated()
    cache.insert(RadixKey([1, 2]), i64([10, 20]))
    cache.insert(RadixKey([3, 4]), i64([30, 40]))
    values = cache.all_values_flatten()
    assert len(values) == 4 and set(values.tolist()) == {10, 20, 30, 40}


@pytest.mark.parametrize("page_size", [1, 2])
def test_advanced_prefix_match_with_node_splits(page_size: int) -> None:
    cache = RadixCache.create_simulated(page_size=page_size)
    seq1 = [1, 2, 3, 4, 5, 6, 7, 8]
    val1 = i64([x * 10 for x in seq1])
    cache.insert(RadixKey(seq1), val1)
    seq2 = [1, 2, 9, 10]
    val2 = i64([x * 10 for x in seq2])
    cache.insert(RadixKey(seq2), val2)
    assert cache.total_size() == 10

    def hit(q: list[int]) -> torch.Tensor:
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(q))).device_indices

    torch.testing.assert_close(hit([1, 2, 3, 4, 999, 1000]), val1[:4])
    assert cache.total_size() == 10  # a split changes no data
    torch.testing.assert_close(hit(seq1), val1)
    torch.testing.assert_close(hit([1, 2, 3, 4, 5, 6, 777, 888]), val1[:6])
    assert cache.total_size() == 10
    torch.testing.assert_close(hit(seq2), val2)


def test_hash_value_storage() -> None:
    cache = RadixCache.create_simulated(page_size=4, enable_kv_cache_events=True)
    cache.insert(RadixKey([1, 2, 3, 4, 5, 6, 7, 8]), None)
    cache.take_events()
    node = cache.root_node.children[(1, 2, 3, 4)]
    assert node.hash_value is not None and len(node.hash_value) == 2


def test_hash_value_repeating_tokens() -> None:
    cache = RadixCache.create_simulated(page_size=4, enable_kv_cache_events=True)
    cache.insert(RadixKey([1, 2, 3, 4, 1, 2, 3, 4]), None)
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    # 0.5.23: one merged event for the chain's two pages (the test's two events)
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 2
    assert hashes[0] != hashes[1], "equal pages at different positions hash differently"
    assert stored[0].parent_block_hash is None
    cache.insert(RadixKey([1, 2, 3, 4, 1, 2, 3, 4, 9, 9, 9, 9]), None)
    (tail,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert tail.parent_block_hash == hashes[1]  # the page's parent is the previous page


def test_hash_value_split() -> None:
    cache = RadixCache.create_simulated(page_size=2, enable_kv_cache_events=True)
    cache.insert(RadixKey([1, 2, 3, 4]), None)
    cache.take_events()
    cache.insert(RadixKey([1, 2, 5, 6]), None)
    cache.take_events()
    node = cache.root_node.children[(1, 2)]
    assert node.hash_value is not None and len(node.hash_value) == 1
