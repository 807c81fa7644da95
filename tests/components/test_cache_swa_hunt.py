"""Regression tests from a bug hunt over the SWA cache's slot-level entry points
(``RadixCache.swa_kept_mask`` / ``release_swa_slots``): bad input is refused with the argument
named, and nothing changes."""

from __future__ import annotations

import pytest
import torch

from allocators import SWAAllocator
from radix import CacheConfig, CacheRequest, RadixCache


def t(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def make(page_size: int = 1, window: int = 2) -> tuple[RadixCache, SWAAllocator]:
    kv = SWAAllocator(32, 16, page_size)
    return RadixCache(CacheConfig(page_size=page_size, sliding_window_size=window),
                      kv_allocator=kv), kv


@pytest.mark.parametrize(("caller", "tree", "exc", "msg"), [
    ([1, 2], t(1, 2), TypeError, "caller must be a torch.Tensor"),
    (t(1, 2), [1, 2], TypeError, "tree must be a torch.Tensor"),
    (t(1, 2).to(torch.int32), t(1, 2), TypeError, "caller must have dtype torch.int64"),
    (t(1, 2), t(1, 2).to(torch.int32), TypeError, "tree must have dtype torch.int64"),
    (t(1, 2).reshape(1, 2), t(1, 2), ValueError, "caller must be 1-D"),
    (t(1, 40), t(1, 2), ValueError, r"caller: index 40 is outside \[0, 33\)"),
    (t(1, 2), t(-1, 2), ValueError, r"tree: index -1 is outside \[0, 33\)"),
])
def test_swa_kept_mask_refuses_bad_slot_tensors(caller: object, tree: object, exc: type,
                                                msg: str) -> None:
    # Before: a list tripped an assert (AssertionError), an int32 tensor was taken, a slot
    # past the pool raised IndexError from numpy.
    c, kv = make()
    kv.alloc(4)
    with pytest.raises(exc, match=msg):
        c.swa_kept_mask(caller, tree)


def test_swa_kept_mask_still_answers_for_good_tensors() -> None:
    c, kv = make()
    mine = kv.alloc(4)  # slots 1..4, all live
    tree = kv.alloc(4)  # slots 5..8
    kv.free_swa(tree[:2])  # the tree's copy of positions 0, 1: tombstones
    kv.free_swa(mine[1:2])  # position 1 of the request's copy slid out of its window
    # kept: the request's copy is live and the tree's is not -> position 0 only
    assert c.swa_kept_mask(mine, tree).tolist() == [True, False, False, False]


@pytest.mark.parametrize(("slots", "start", "seq_len", "exc", "msg"), [
    ("list", 0, 8, TypeError, "slots must be a torch.Tensor"),
    ("int32", 0, 8, TypeError, "slots must have dtype torch.int64"),
    ("2d", 0, 2, ValueError, "slots must be 1-D"),
    ("ok", 1, 8, ValueError, "start=1 is not a multiple of page_size=2"),
])
def test_release_swa_slots_refuses_bad_input_naming_it(slots: str, start: int, seq_len: int,
                                                       exc: type, msg: str) -> None:
    # Before: a 2-D tensor was taken (its rows counted as tokens), a list or an int32 tensor
    # was refused as "indices", and an unaligned start as a "partial page" of free_swa.
    c, kv = make(page_size=2)
    own = kv.alloc(8)
    arg = {"list": own.tolist(), "int32": own.to(torch.int32), "2d": own.reshape(2, 4),
           "ok": own}[slots]
    before = kv.snapshot()
    with pytest.raises(exc, match=msg):
        c.release_swa_slots(arg, start, seq_len)
    assert kv.snapshot() == before
    # page 2, window 2: the margin is max(2, 2) = 2 tokens -> release [0, 6)
    assert c.release_swa_slots(own, 0, 8) == 6
    assert kv.has_swa(own).tolist() == [False] * 6 + [True] * 2


def test_release_swa_at_an_unaligned_length_keeps_the_cached_prompt_usable() -> None:
    # Window 5, page 4, 10 tokens computed. cache_finished_req caches the whole pages, [0, 8).
    # Before: the margin was counted back from 10, releasing [0, 4): the cached [4, 8) had 4
    # live tokens < 5 before its end, so a match of those 8 tokens hit nothing (prefix 0,
    # swa_miss 8) while the tree held 8 full and 4 SWA tokens no match could use.
    # Now it is counted back from the cached boundary 8: 8 - 5 = 3 -> page 0: nothing freed.

    c, kv = make(page_size=4, window=5)
    key = list(range(101, 111))
    req = CacheRequest(key=key, kv_indices=kv.alloc(12)[:10], cached_len=0, last_node=c.root,
                       lock=c.inc_lock_ref(c.root))
    assert c.release_swa(req, 10) == 0
    res = c.cache_finished_req(req, upto=10)
    assert res.inserted_len == 8
    m = c.match_prefix(key[:8])
    assert (m.prefix_len, m.swa_miss_tokens) == (8, 0)
    c.sanity_check()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 6, 7])
def test_the_prompt_cache_finished_req_caches_after_release_swa_is_matched_whole(
        page_size: int, window: int) -> None:
    # For every length: the whole pages cache_finished_req caches are a usable end (a match of
    # exactly those tokens hits all of them), whatever release_swa freed before.
    for seq in range(1, 17):
        c, kv = make(page_size=page_size, window=window)
        key = list(range(101, 101 + seq))
        n = -(-seq // page_size) * page_size
        req = CacheRequest(key=key, kv_indices=kv.alloc(n)[:seq], cached_len=0,
                           last_node=c.root, lock=c.inc_lock_ref(c.root))
        released = c.release_swa(req, seq)
        end = seq // page_size * page_size
        assert released <= max(end - max(window, page_size), 0), (seq, released)
        c.cache_finished_req(req, upto=seq)
        m = c.match_prefix(key[:end])
        assert (m.prefix_len, m.swa_miss_tokens) == (end, 0), (seq, released)
        c.sanity_check()
