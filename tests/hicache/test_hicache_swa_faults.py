"""Allocation faults at every pool, at every step of the SWA host path.

A cache with a sliding window, recurrent states and a host tier (``SWAH``: device full, SWA
and state pools; host KV, SWA and state pools mirroring them). Each step below is run once to
count the ``alloc`` calls the library makes across all six pools, then once per ``k`` and
mode (``from``: the k-th call and every later one fail; ``once``: only the k-th) on a fresh
copy:

* every multi-pool allocation inside the library that fails (``alloc_all``: a load-back's
  device parts, a backup's host parts) leaves every pool's ``snapshot()`` (free-list order and
  the full-to-SWA map included), ``pretty_print()`` and ``stats()`` exactly as just before it;
* a load-back that fails with room on device (nothing evicted) leaves the whole cache exactly
  as before: pools, tree, counters, sizes, the controller's counters;
* an insert over host-only nodes (revived with the caller's slots, cut where its SWA KV turns
  live) ends on device exactly as without the fault (the host tier only skips backups);
* after every step ``sanity_check()``, every copy bit-exact (KV, SWA KV, states, device and
  host) and every pool's ledger (``test_hicache_swa_revive.check_bits``).

Steps: an insert over host-only nodes (write-through backs up the new tail), a load-back of a
chain with a host tombstone, live SWA KV and a state (room on device, and a full device that
must evict first), and under write-back an ``evict_swa`` that backs up an internal node before
tombstoning it and an ``evict`` that backs up its victim before demoting it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hicache.controller
import radix.tiers.host
from allocators import alloc_all as real_alloc_all
from tests.helpers.cache_helpers import node_slots
from tests.hicache.test_hicache_common import FailAllocs, assert_same, node_at
from tests.hicache.test_hicache_swa import KEY, SWAH, demote_all
from tests.hicache.test_hicache_swa_revive import STATE, check_bits, fill, layout, put

#: A step: ``(cache, library call, what must hold after a fault, given the call's result)``.
Step = tuple[SWAH, Callable[[], Any], Callable[[SWAH, Any, dict[str, Any]], None]]


def fingerprint(h: SWAH) -> tuple:
    c = h.cache
    return (c.pretty_print(), c.stats(), tuple(a.snapshot() for a in h.pools().values()),
            h.kv.snapshot())


def device_side(h: SWAH) -> tuple:
    return ([row[:4] for row in layout(h)], h.kv.snapshot(), h.sp.snapshot() if h.sp else None)


# ======================================================================== steps
def revive_insert(ps: int, dead: int) -> Step:
    """Host-only [0, 8) (live on host, a host state); a request inserts KEY[:12] with its own
    slots, its SWA KV released on [0, dead): the node is revived (cut at ``dead``), the new
    tail [8, 12) backed up (host KV, host SWA KV, host state)."""
    h = SWAH(ps, states=4)
    put(h, 8)
    demote_all(h)
    fresh = h.kv.alloc(12)
    got = h.sp.alloc(1) if h.sp is not None else None
    assert fresh is not None and got is not None and h.sp is not None
    fill(h, fresh, 0)
    if dead:
        h.kv.free_swa(fresh[:dead])
    slot = int(got[0])
    h.sp.conv[:, slot] = STATE[12]

    def call() -> Any:
        res = h.cache.insert(KEY[:12], fresh, state_slot=slot)
        assert (res.prefix_len, res.inserted_len, res.state_adopted) == (8, 12, True)
        return res

    def after(h: SWAH, res: Any, clean: dict[str, Any]) -> None:
        assert device_side(h) == clean["device"], "a host-side fault changed the device outcome"

    return h, call, after


def chain(ps: int, full_device: bool) -> Step:
    """Host-only A [0, 4) (a host tombstone: its SWA KV was released before the backup) and
    B [4, 12) (live on host, a host state); ``load_back(B)``: full KV for both, SWA KV for B,
    B's state. ``full_device``: another prompt fills the device and must be evicted first."""
    h = SWAH(ps, states=4)
    put(h, 12, dead=4)  # [0, 4) a tombstone, [4, 12) live
    demote_all(h)
    if full_device:
        other = [k + 20 for k in KEY]
        fresh = h.kv.alloc(h.kv.available_size() - h.kv.available_size() % ps)
        got = h.sp.alloc(1) if h.sp is not None else None
        assert fresh is not None and got is not None and h.sp is not None
        res = h.cache.insert(other[:len(fresh)], fresh, state_slot=int(got[0]))
        assert res.inserted_len == len(fresh) and res.state_adopted
        h.cache.sanity_check()
    b = node_at(h.cache, KEY[:12])
    a = node_at(h.cache, KEY[:4])
    assert a.swa_tombstone and a.host_swa_value is None and b.host_swa_value is not None

    def call() -> Any:
        return h.cache.load_back(b)

    def after(h: SWAH, got: Any, clean: dict[str, Any]) -> None:
        assert got in (0, 12)
        if got == 0 and not full_device:
            assert_same(clean["before"], h.snapshot())
        if got:
            assert layout(h)[:2] == [(0, 4, "dev", True), (4, 12, "dev", False)]

    if full_device:  # (the filler is not KEY's: check_bits reads KEY's values)
        return h, call, lambda h, got, clean: None
    return h, call, after


def write_back_evict_swa(ps: int) -> Step:
    """Write-back: A [0, 8) below which B [8, 12) hangs, nothing on host yet; ``evict_swa``
    tombstones A (least recently used) and backs it up first (host KV, host SWA KV, host
    state)."""
    h = SWAH(ps, states=4, policy="write_back")
    put(h, 8)
    put(h, 12, prefix=h.cache.match_prefix(KEY[:8]).device_indices)
    h.cache.match_prefix(KEY[:12])  # B more recent than A

    def call() -> Any:
        return h.cache.evict_swa(4)

    def after(h: SWAH, res: Any, clean: dict[str, Any]) -> None:
        assert node_at(h.cache, KEY[:8]).swa_tombstone

    return h, call, after


def write_back_evict(ps: int) -> Step:
    """Write-back: A [0, 8), B [8, 12) below; ``evict(4)`` backs B (and A) up before demoting
    B."""
    h = SWAH(ps, states=4, policy="write_back")
    put(h, 8)
    put(h, 12, prefix=h.cache.match_prefix(KEY[:8]).device_indices)

    def call() -> Any:
        out = h.cache.evict(4)
        h.cache.poll_transfers()
        return out

    return h, call, lambda h, res, clean: None


STEPS: dict[str, Callable[[int], Step]] = {
    "revive insert": lambda ps: revive_insert(ps, 0),
    "revive insert, SWA KV released": lambda ps: revive_insert(ps, 4),
    "load_back": lambda ps: chain(ps, False),
    "load_back evicting first": lambda ps: chain(ps, True),
    "write_back evict_swa": write_back_evict_swa,
    "write_back evict": write_back_evict,
}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_every_allocation_failure_at_every_pool(step: str, page_size: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    h, call, after = STEPS[step](page_size)
    with FailAllocs(h.pools()) as probe:
        call()
    h.cache.sanity_check()
    if step != "load_back evicting first":
        check_bits(h)
    clean = {"device": device_side(h)}
    assert probe.calls, f"{step}: the library allocated nothing"
    failed_all = [0]
    for k in range(1, len(probe.calls) + 1):
        for mode in ("from", "once"):
            h, call, after = STEPS[step](page_size)
            clean["before"] = h.snapshot()

            def checked(requests: Any, h: SWAH = h) -> Any:
                before = fingerprint(h)
                got = real_alloc_all(requests)
                if got is None:
                    failed_all[0] += 1
                    assert fingerprint(h) == before, "a failed multi-pool allocation moved"
                return got

            monkeypatch.setattr(radix.tiers.host, "alloc_all", checked)
            monkeypatch.setattr(hicache.controller, "alloc_all", checked)
            with FailAllocs(h.pools(), k, mode) as f:
                result = call()
            monkeypatch.undo()
            assert any(failed for _, _, failed in f.calls), (k, mode, f.calls)
            h.cache.sanity_check()
            if step != "load_back evicting first":
                check_bits(h)
            after(h, result, clean)
    if step.startswith("load_back") or step.startswith("revive"):
        assert failed_all[0] > 0, f"{step}: no multi-pool allocation ever failed"


def test_the_steps_reach_every_pool() -> None:
    """Between them the steps ask every device and host pool (else a pool's faults go
    untested)."""
    names = set()
    for step in STEPS.values():
        h, call, _ = step(1)
        with FailAllocs(h.pools()) as probe:
            call()
        names |= {name for name, _, _ in probe.calls}
    assert names == {"device full", "device swa", "device state", "host kv", "host swa",
                     "host state"}, names


def test_a_released_window_is_not_backed_up_from_the_revived_tombstone() -> None:
    """After the revive insert with SWA KV released on [0, 4): the revived tombstone piece
    keeps the host SWA copy it had (taken while it was live), and nothing allocates SWA KV on
    host for it again."""
    h, call, _ = revive_insert(1, 4)
    host_swa = h.hc.pools["swa"].host
    used = host_swa.used_size()
    call()
    h.cache.sanity_check()
    check_bits(h)
    a = node_at(h.cache, KEY[:4])
    assert a.swa_tombstone and a.kv_value is not None and a.host_swa_value is not None
    assert host_swa.used_size() == used + 4  # only the new tail [8, 12)
    assert torch.equal(h.cache.match_prefix(KEY[:12]).device_indices[:4], node_slots(a))
