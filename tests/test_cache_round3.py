"""Reliability round 3 (issue 36), the library's own API: a state lands only on the node ending
at its position; request helpers validate before anything changes; namespaces are values."""

from __future__ import annotations

from typing import Any

import pytest

from allocators import MambaStatePool, PagedAllocator
from radix import CacheConfig, RadixCache


def states(n: int = 8) -> MambaStatePool:
    return MambaStatePool(n, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))


def paged_hybrid(size: int = 64, ps: int = 4) -> tuple[RadixCache, PagedAllocator, MambaStatePool]:
    kv, sp = PagedAllocator(size, ps), states()
    return RadixCache(CacheConfig(page_size=ps), kv_allocator=kv, state_allocator=sp), kv, sp


def frozen(cache: RadixCache, *pools: Any) -> tuple[Any, ...]:
    return (cache.pretty_print(), cache.evictable_size(), cache.protected_size(),
            *(p.snapshot() for p in pools))


# ============================================================================ item 2
def test_a_state_after_a_partial_page_is_refused_and_nothing_changes() -> None:
    """Page 4, a 10-token key with the state valid after token 10: the node the insert would
    end at holds tokens [0, 8), so the state does not belong there (before: inserted_len=8,
    state_adopted=True, and a later 8-token match resumed from a state that holds 9 and 10)."""
    cache, kv, sp = paged_hybrid()
    slots = kv.alloc(12)
    assert slots is not None
    slot = int(sp.alloc(1)[0])
    key = list(range(1, 11))
    before = frozen(cache, kv, sp)
    with pytest.raises(ValueError, match=r"state_slot .* 10 tokens.* ends at token 8") as info:
        cache.insert(key, slots[:10], state_slot=slot)
    assert "page_size=4" in str(info.value)
    assert frozen(cache, kv, sp) == before
    assert cache.match_prefix(key).prefix_len == 0
    # the same state at a page end is adopted where it belongs
    res = cache.insert(key[:8], slots[:8], state_slot=slot)
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (0, 8, True)
    assert res.last_node.depth == 8 and res.last_node.state_slot == slot
    m = cache.match_prefix(key)
    assert (m.prefix_len, m.state_slot) == (8, slot)
    kv.free(slots[8:])
    cache.sanity_check()


def test_a_state_after_a_partial_page_is_refused_over_a_cached_prefix_too() -> None:
    """The 8 tokens are cached already (with their own state); a 10-token insert with a state
    would hand back state_adopted=False before, but the refusal is the same one check."""
    cache, kv, sp = paged_hybrid()
    slots = kv.alloc(8)
    assert slots is not None
    first = int(sp.alloc(1)[0])
    cache.insert(list(range(1, 9)), slots, state_slot=first)
    other = int(sp.alloc(1)[0])
    mine = kv.alloc(12)
    assert mine is not None
    before = frozen(cache, kv, sp)
    with pytest.raises(ValueError, match="state_slot"):
        cache.insert(list(range(1, 11)), mine[:10], state_slot=other)
    assert frozen(cache, kv, sp) == before
    cache.sanity_check()
