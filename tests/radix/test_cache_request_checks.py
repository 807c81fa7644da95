"""The request helpers' record check: its scalar fast path accepts exactly what the full
check accepts, and every record it does not accept reaches the full check's error."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from allocators import TokenAllocator
from radix import CacheConfig, CacheRequest, RadixCache, RadixKey
from radix.requests import _check_full, _check_req


def _outcome(check: Any, cache: RadixCache, req: Any, upto: Any) -> tuple[str, Any]:
    try:
        return "ok", check(cache, req, upto)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)


def test_fast_path_agrees_with_the_full_check_seeded() -> None:
    """A cached prefix of 8 tokens locked by a request of 12; records with one field drawn
    from good and bad values (types, lengths, locks, another cache's node): both checks
    return the same ``upto`` or raise the same error."""
    alloc = TokenAllocator(64)
    cache = RadixCache(CacheConfig(), kv_allocator=alloc)
    ctx = cache._request_ctx  # what the facade hands the request helpers
    other = RadixCache(CacheConfig(), kv_allocator=TokenAllocator(8))
    first = alloc.alloc(8)
    assert first is not None
    cache.insert(list(range(8)), first)
    m = cache.match_prefix(RadixKey(list(range(12))))
    assert m.prefix_len == 8
    node = m.last_device_node
    lock = cache.inc_lock_ref(node)
    own = alloc.alloc(4)
    assert own is not None
    kv = torch.cat([m.device_indices, own])
    base = CacheRequest(key=RadixKey(list(range(12))), kv_indices=kv, cached_len=8,
                        last_node=node, lock=lock)
    unlocked = cache.insert(list(range(8)) + [50, 51], torch.cat([first, own[:2]])).last_node
    fields: dict[str, list[Any]] = {
        "key": [base.key, list(range(12)), RadixKey(list(range(10))), 5],
        "kv_indices": [kv, kv[:10], kv[:6], kv.numpy(), kv.tolist()],
        "cached_len": [8, 0, 7, 9, -1, True, 8.0],
        "last_node": [node, cache.root, unlocked, other.root, "node"],
        "lock": [lock, None, unlocked, cache.root, 3],
    }
    uptos: list[Any] = [None, 12, 8, 0, 13, -1, True, 10.0]
    rng = random.Random(23)
    seen = {"ok": 0, "err": 0}
    for _ in range(400):
        name = rng.choice(list(fields))
        req = replace(base, **{name: rng.choice(fields[name])})
        upto = rng.choice(uptos)
        fast, full = _outcome(_check_req, ctx, req, upto), _outcome(_check_full, ctx, req, upto)
        assert fast == full, (name, getattr(req, name), upto)
        seen["ok" if fast[0] == "ok" else "err"] += 1
    assert seen["ok"] > 50 and seen["err"] > 50  # both outcomes were exercised
    assert _check_req(ctx, base, None) == 12
    assert _outcome(_check_req, ctx, "req", None) == (
        "TypeError", "req must be a CacheRequest, got str")


def test_fast_path_refuses_a_released_lock() -> None:
    alloc = TokenAllocator(16)
    cache = RadixCache(CacheConfig(), kv_allocator=alloc)
    kv = alloc.alloc(4)
    assert kv is not None
    node = cache.insert([1, 2, 3, 4], kv).last_node
    req = CacheRequest(key=RadixKey([1, 2, 3, 4]), kv_indices=kv, cached_len=4, last_node=node)
    with pytest.raises(ValueError, match="holds no lock of its own"):
        _check_req(cache._request_ctx, req, None)
