"""How much SWA KV a request keeps live when it releases what slid out of its window.

``release_swa`` keeps ``max(window, page)`` tokens live before the boundary, plus
``CacheConfig.swa_release_extra_pages`` pages. With no extra page a later key that diverges
inside the last cached page matches (page aligned) one page short of the boundary, where the
window before it is gone, and so is every earlier boundary's: the usable prefix is 0 although
the KV of nearly the whole prompt is cached. One extra page keeps that hit; it costs a page of
SWA pool per cached prompt. Measured on the shipped trace (``bench/README.md``) the extra page
gains nothing there (its prompts share up to the end checkpoint, never one page short of it)
and costs hit rate when the SWA pool is tight, so the default is 0; engines whose traffic
re-sends or edits the last turn set 1.
"""

from __future__ import annotations

import pytest

from allocators import SWAAllocator
from radix import CacheConfig, CacheRequest, RadixCache

A = list(range(300, 312))  # 12 tokens


def make(extra: int, window: int = 4, page_size: int = 2) -> tuple[RadixCache, SWAAllocator]:
    kv = SWAAllocator(128, 64, page_size)
    cfg = CacheConfig(page_size=page_size, sliding_window_size=window,
                      swa_release_extra_pages=extra)
    return RadixCache(cfg, kv_allocator=kv), kv


def finish(cache: RadixCache, kv: SWAAllocator, key: list[int]) -> None:
    """One request computes ``key`` from scratch, releases its out-of-window SWA KV at the end
    (as an engine does before caching a finished request) and caches it."""
    slots = kv.alloc(len(key))
    assert slots is not None
    req = CacheRequest(key=key, kv_indices=slots, cached_len=0, last_node=cache.root)
    cache.release_swa(req, len(key))
    cache.cache_finished_req(req)
    cache.sanity_check()


@pytest.mark.parametrize("extra,usable", [(0, 0), (1, 10)])
def test_a_late_divergence_keeps_its_hit_with_one_extra_page(extra: int, usable: int) -> None:
    """Window 4, page 2: A (12 tokens) finishes; B shares A's first 11 tokens. B's page-aligned
    KV match is 10 tokens; it is usable only if [6, 10) is live. Without the extra page A kept
    [8, 12) live only, and no earlier boundary has a window either."""
    cache, kv = make(extra)
    finish(cache, kv, A)
    live = [n.start for n in cache.tree.iter_nodes() if not n.swa_tombstone]
    assert min(live) == (6 if extra else 8)
    m = cache.match_prefix(A[:11] + [999])
    assert m.kv_hit_length == 10
    assert m.prefix_len == usable
    assert m.swa_miss_tokens == 10 - usable
    cache.sanity_check()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 3, 4, 6])
def test_with_one_extra_page_every_divergence_in_the_last_page_keeps_its_hit(
        page_size: int, window: int) -> None:
    """Whatever the window and the page, a key diverging anywhere inside the last cached page
    (or an engine matching the prompt minus its last token) gets its whole KV match usable."""
    n = 6 * page_size + 2 * window
    n -= n % page_size
    key = list(range(1000, 1000 + n))
    for extra, expect_full in ((1, True), (0, False)):
        cache, kv = make(extra, window, page_size)
        finish(cache, kv, key)
        for d in range(n - page_size, n):  # divergence position inside the last page
            m = cache.match_prefix(key[:d] + [5] * page_size)
            want = d - d % page_size
            assert m.kv_hit_length == want
            if expect_full:
                assert m.prefix_len == want, (d, m)
        m = cache.match_prefix(key[:-1])  # the replay's convention: the prompt minus one token
        if expect_full:
            assert m.prefix_len == (n - 1) - (n - 1) % page_size
        cache.sanity_check()


def test_the_extra_pages_cost_exactly_that_many_live_swa_tokens() -> None:
    for extra in (0, 1, 2):
        cache, kv = make(extra)
        finish(cache, kv, A)
        assert cache.swa_evictable_size() == 4 + 2 * extra  # max(window, page) + extra pages


@pytest.mark.parametrize("bad,err", [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_the_setting_is_checked(bad: object, err: type) -> None:
    with pytest.raises(err, match="swa_release_extra_pages"):
        CacheConfig(sliding_window_size=4, swa_release_extra_pages=bad)  # type: ignore[arg-type]
    assert CacheConfig().swa_release_extra_pages == 0
    assert CacheConfig.from_dict({"swa_release_extra_pages": 1}).swa_release_extra_pages == 1
