"""KV events of namespaces that Python's ``==`` merges but the tree keeps apart (found by the
``hunt-core`` hunt): ``(1,)`` and ``(1.0,)``, ``(1, True)`` and ``(True, 1)``, ``(0,)`` and
``(False,)``, ``0.0`` and ``-0.0`` are separate tenants (``radix.tree.namespace_key``), so
their pages must publish separate hashes and their own labels, whichever was seen first.

The expected hashes are recomputed from the documented chain (as in
``tests/components/test_kv_events.py``: SHA-256 from the namespace seed over int64
little-endian tokens, the first 8 bytes big-endian signed)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import pytest
import torch

from allocators import TokenAllocator
from components.events import BlockStored
from hicache.storage.keys import encode_namespace
from radix import CacheConfig, RadixCache


def ref_hashes(tokens: list[int], extra_key: Any) -> list[int]:
    ns = encode_namespace(extra_key)
    assert ns is not None
    d = hashlib.sha256(b"hpc-l3/1\x00" + struct.pack("<I", 0) + ns).digest()
    out = []
    for t in tokens:
        d = hashlib.sha256(d + struct.pack("<q", t)).digest()
        out.append(int.from_bytes(d[:8], "big", signed=True))
    return out


PAIRS = [((1,), (1.0,)), ((1, True), (True, 1)), ((0,), (False,)), (0.0, -0.0),
         (("a", 1), ("a", True))]


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[repr(p) for p in PAIRS])
def test_equal_comparing_namespaces_publish_their_own_hashes_and_labels(first: Any,
                                                                        second: Any) -> None:
    kv = TokenAllocator(16)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    cache.insert([5, 6], kv.alloc(2), extra_key=first)
    cache.insert([5, 6], kv.alloc(2), extra_key=second)
    assert len(cache.root.children) == 2  # the tree keeps two tenants
    events = cache.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    a, b = events
    assert a.block_hashes == ref_hashes([5, 6], first)
    assert b.block_hashes == ref_hashes([5, 6], second)
    assert a.block_hashes != b.block_hashes
    # the labels are each namespace's own: those a cache seeing only it publishes
    for ns, ev in ((first, a), (second, b)):
        kv1 = TokenAllocator(16)
        alone = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv1)
        alone.insert([5, 6], kv1.alloc(2), extra_key=ns)
        (want,) = alone.take_events()
        assert (ev.lora_id, ev.lora_name, ev.cache_salt) == (
            want.lora_id, want.lora_name, want.cache_salt), ns
    cache.sanity_check()


def test_an_observer_sees_every_event_once_and_never_a_grown_one() -> None:
    # Two stores chaining (a leaf, then its child) merge into one queued event; the observer
    # (``KVEventRecorder.on_event``: "called with every event as it is queued") got the
    # first one before the merge, and must not see it grow afterwards: the pages it saw
    # are [1, 2], then [3], each stored once.
    kv = TokenAllocator(16)
    cache = RadixCache(CacheConfig(enable_kv_cache_events=True), kv_allocator=kv)
    recorder = cache.kv_events
    assert recorder is not None
    seen: list[Any] = []
    recorder.on_event = seen.append
    cache.insert([1, 2], kv.alloc(2))
    m = cache.match_prefix([1, 2])
    cache.insert([1, 2, 3], torch.cat([m.device_indices, kv.alloc(1)]))
    want = ref_hashes([1, 2, 3], None)
    assert [(e.block_hashes, e.token_ids) for e in seen] == [(want[:2], [1, 2]), (want[2:], [3])]
    (queued,) = cache.take_events()  # the queue still merges them
    assert (queued.block_hashes, queued.token_ids) == (want, [1, 2, 3])
