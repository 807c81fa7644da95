"""An insert over host-only nodes of an SWA cache: the caller's slots revive them.

A request that matched only the device prefix computes the host-only tokens again and
inserts them with its own slots; the host tier gives the matched host-only nodes those slots
(they must be on device above the request's new tail). The caller's SWA KV is live only from
some position ``t`` on (it released what slid out of its window), so:

* a host-only node is split at ``t`` (page aligned): the part before is a device tombstone,
  the part from ``t`` on is live with the caller's SWA KV;
* with no new tail below them, the insert stops above the host-only nodes whose ends the
  window rule excludes (they stay host-only, with their host copies: a later load-back serves
  them); the caller keeps those slots (``inserted_len`` ends before them);
* every device copy (full KV, SWA KV of live nodes) holds the caller's data, every host copy
  the data it was backed up with, bit for bit (random bit patterns); ``sanity_check`` after
  every step.

The cache: ``tests.hicache.test_hicache_swa.SWAH`` (full pool 32 tokens, SWA pool 16, window
4, write-through host tier).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.cache_helpers import bits, node_slots, random_bits
from tests.hicache.test_hicache_common import node_at
from tests.hicache.test_hicache_swa import KEY, SWAH, W, demote_all

_GEN = torch.Generator().manual_seed(3737)
#: The KV of KEY's prefixes (token ``i`` of KEY, after KEY[:i]): full K, full V, SWA K, SWA V.
DATA = [random_bits((2, len(KEY), 1, 2), torch.float32, _GEN) for _ in range(4)]
#: The conv state after KEY[:n], by n.
STATE = {n: random_bits((2, 2), torch.float32, _GEN) for n in range(1, len(KEY) + 1)}


def fill(h: SWAH, slots: torch.Tensor, lo: int) -> None:
    """Write KEY's KV at positions ``lo ...`` into ``slots`` (full side and SWA side)."""
    hi = lo + len(slots)
    h.full.k_all[:, slots] = DATA[0][:, lo:hi]
    h.full.v_all[:, slots] = DATA[1][:, lo:hi]
    swa = h.kv.translate(slots)
    h.swa.k_all[:, swa] = DATA[2][:, lo:hi]
    h.swa.v_all[:, swa] = DATA[3][:, lo:hi]


def put(h: SWAH, n: int, prefix: torch.Tensor | None = None, dead: int = 0) -> tuple[Any, torch.Tensor]:
    """A request inserts ``KEY[:n]``: ``prefix`` (slots it got from the tree) then fresh
    slots filled with KEY's KV, the SWA KV of its first ``dead`` tokens released (out of its
    window); a fresh state on a hybrid cache. Frees what the result leaves to the caller
    (duplicates, the slots past ``inserted_len``, an unadopted state) and returns the result
    and the slots it inserted with."""
    prefix = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
    fresh = h.kv.alloc(n - len(prefix))
    assert fresh is not None
    fill(h, fresh, len(prefix))
    value = torch.cat([prefix, fresh])
    if dead > len(prefix):
        h.kv.free_swa(value[len(prefix):dead])
    slot = None
    if h.sp is not None:
        got = h.sp.alloc(1)
        assert got is not None
        slot = int(got[0])
        h.sp.conv[:, slot] = STATE[n]
    res = h.cache.insert(KEY[:n], value, state_slot=slot)
    if len(res.duplicate_indices):
        h.kv.free(res.duplicate_indices)
    if len(res.remainder_indices):
        h.kv.free(res.remainder_indices)
    if slot is not None and not res.state_adopted:
        assert h.sp is not None
        h.sp.free(torch.tensor([slot]))
    h.cache.sanity_check()
    return res, value


def check_bits(h: SWAH) -> None:
    """Every node's device full KV, device SWA KV (live nodes), host KV, host SWA KV and
    states (device and host) hold KEY's values at its positions, bit for bit; every pool's
    ledger (free + held by the tree == capacity: the caller holds nothing now)."""
    host_kv = h.hc.pools["kv"].host.pool
    host_swa = h.hc.pools["swa"].host.pool
    host_st = h.hc.pools["state"].host if h.sp is not None else None
    held = dict.fromkeys(("full", "swa", "host kv", "host swa", "state", "host state"), 0)
    for n in h.cache.tree.iter_nodes():
        lo, hi = n.start, n.depth
        if n.state_slot is not None:
            assert h.sp is not None and torch.equal(bits(h.sp.conv[:, n.state_slot]),
                                                    bits(STATE[hi])), n
            held["state"] += 1
        if n.host_state_slot is not None:
            assert host_st is not None and torch.equal(
                bits(host_st.conv[:, n.host_state_slot]), bits(STATE[hi])), n
            held["host state"] += 1
        held["full"] += 0 if n.kv_value is None else hi - lo
        held["swa"] += 0 if n.kv_value is None or n.swa_tombstone else hi - lo
        held["host kv"] += 0 if n.host_value is None else hi - lo
        held["host swa"] += 0 if n.host_swa_value is None else hi - lo
        if n.kv_value is not None:
            s = node_slots(n)
            assert torch.equal(bits(h.full.k_all[:, s]), bits(DATA[0][:, lo:hi])), n
            assert torch.equal(bits(h.full.v_all[:, s]), bits(DATA[1][:, lo:hi])), n
            if not n.swa_tombstone:
                sw = h.kv.translate(s)
                assert torch.equal(bits(h.swa.k_all[:, sw]), bits(DATA[2][:, lo:hi])), n
                assert torch.equal(bits(h.swa.v_all[:, sw]), bits(DATA[3][:, lo:hi])), n
        if n.host_value is not None:
            assert torch.equal(bits(host_kv.k_all[:, n.host_value]), bits(DATA[0][:, lo:hi])), n
            assert torch.equal(bits(host_kv.v_all[:, n.host_value]), bits(DATA[1][:, lo:hi])), n
        if n.host_swa_value is not None:
            hs = n.host_swa_value
            assert torch.equal(bits(host_swa.k_all[:, hs]), bits(DATA[2][:, lo:hi])), n
            assert torch.equal(bits(host_swa.v_all[:, hs]), bits(DATA[3][:, lo:hi])), n
    pools = h.pools()
    for name, a, k in (("full", h.kv, "full"), ("swa", h.kv, "swa"),
                       ("host kv", pools["host kv"], None), ("host swa", pools["host swa"], None),
                       ("state", pools.get("device state"), None),
                       ("host state", pools.get("host state"), None)):
        if a is None:
            continue
        if k == "full":
            free, size = a.full_available_size(), a.size
        elif k == "swa":
            free, size = a.swa_available_size(), a.swa_size
        else:
            free, size = a.available_size(), a.size
        assert free + held[name] == size, f"{name}: {free} free + {held[name]} held != {size}"


def layout(h: SWAH) -> list[tuple[int, int, str, bool]]:
    """Every node as ``(start, end, where, tombstone)``, ``where`` one of dev / host."""
    return sorted((n.start, n.depth, "dev" if n.kv_value is not None else "host",
                   n.swa_tombstone) for n in h.cache.tree.iter_nodes())


def host_only_chain(h: SWAH, *ends: int) -> None:
    """Nodes ``KEY[:ends[0]]``, ``KEY[ends[0]:ends[1]]`` ..., every one backed up with live
    SWA KV, then demoted: all host-only, live on host."""
    prev = 0
    for e in ends:
        prefix = h.cache.match_prefix(KEY[:prev]).device_indices if prev else None
        res, _ = put(h, e, prefix)
        assert res.inserted_len == e
        prev = e
    demote_all(h)
    assert all(n.host_swa_value is not None and not n.swa_tombstone
               for n in h.cache.tree.iter_nodes())


# ======================================================================== splits
@pytest.mark.parametrize("page_size,dead,states", [(1, 2, 0), (1, 6, 0), (1, 8, 0), (4, 4, 0),
                                                   (1, 2, 4), (4, 4, 4)])
def test_a_host_node_is_split_where_the_callers_swa_kv_turns_live(page_size: int, dead: int,
                                                                  states: int) -> None:
    h = SWAH(page_size, states)
    host_only_chain(h, 8)
    res, value = put(h, 12, dead=dead)  # over host-only [0, 8), new tail [8, 12)
    assert (res.prefix_len, res.inserted_len) == (8, 12)
    want = [(0, dead, "dev", True)] if dead else []
    if dead < 8:
        want.append((dead, 8, "dev", False))
    want.append((8, 12, "dev", False))
    assert layout(h) == want
    check_bits(h)
    m = h.cache.match_prefix(KEY[:12])
    assert m.prefix_len == 12 and torch.equal(m.device_indices, value)  # the caller's slots
    assert h.kv.swa_used_size() == 12 - dead  # exactly the live tokens hold SWA slots
    # the host copies of the revived pieces stay (live on host: their SWA KV backed up)
    assert all(n.host_value is not None for n in h.cache.tree.iter_nodes() if n.depth <= 8)


def test_a_partly_matched_host_node_is_split_at_the_match_and_where_the_swa_kv_turns_live(
) -> None:
    h = SWAH(1)
    host_only_chain(h, 8)
    res, value = put(h, 6, dead=2)  # ends inside host-only [0, 8): no new tail
    assert (res.prefix_len, res.inserted_len) == (6, 6)
    assert layout(h) == [(0, 2, "dev", True), (2, 6, "dev", False), (6, 8, "host", False)]
    check_bits(h)
    m = h.cache.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length) == (6, 2)  # [2, 8) live: 6 >= W on host too
    assert h.cache.load_back(m.last_host_node) == 2
    h.cache.sanity_check()
    check_bits(h)
    assert h.cache.match_prefix(KEY[:8]).prefix_len == 8


# ======================================================================== stops
@pytest.mark.parametrize("dead", [2, 4, 5, 6, 8])
def test_with_no_new_tail_the_insert_stops_above_host_nodes_the_window_excludes(
        dead: int) -> None:
    """Host-only [0, 8) and the caller's SWA KV live from ``dead`` on: [dead, 8) is a usable
    end only when it holds a window (8 - dead >= W). Otherwise nothing is revived: a device
    tombstone leaf would be dead, and the node is live on host (a load-back serves it)."""
    revived = 8 - dead >= W  # (dead 2, 4: revived; 5, 6, 8: not)
    h = SWAH(1)
    host_only_chain(h, 8)
    before = layout(h)
    swa_free = h.kv.swa_available_size()
    res, value = put(h, 8, dead=dead)
    if revived:
        assert (res.prefix_len, res.inserted_len) == (8, 8)
        assert layout(h) == [(0, dead, "dev", True), (dead, 8, "dev", False)]
        assert torch.equal(h.cache.match_prefix(KEY[:8]).device_indices, value)
    else:
        assert (res.prefix_len, res.inserted_len) == (0, 0)  # the caller keeps (frees) all 8
        assert layout(h) == before
        assert h.kv.swa_available_size() == swa_free  # its slots went back whole
        m = h.cache.match_prefix(KEY[:8])
        assert (m.prefix_len, m.host_hit_length) == (0, 8)
        assert h.cache.load_back(m.last_host_node) == 8
        h.cache.sanity_check()
    check_bits(h)
    assert h.cache.match_prefix(KEY[:8]).prefix_len == 8


def test_the_insert_stops_between_host_nodes_below_the_last_usable_end() -> None:
    """Host-only A [0, 4) and B [4, 8); the caller's SWA KV is live on [0, 4) only (a
    request's out-of-window release is a prefix; this is the bad-order case): A revives live
    (a usable end: no tombstone above it), B would be a dead tombstone leaf and stays on host."""
    h = SWAH(1)
    host_only_chain(h, 4, 8)
    fresh = h.kv.alloc(8)
    assert fresh is not None
    fill(h, fresh, 0)
    h.kv.free_swa(fresh[4:])
    res = h.cache.insert(KEY[:8], fresh)
    assert (res.prefix_len, res.inserted_len) == (4, 4)
    h.kv.free(res.remainder_indices)
    h.cache.sanity_check()
    assert layout(h) == [(0, 4, "dev", False), (4, 8, "host", False)]
    check_bits(h)
    b = node_at(h.cache, KEY[:8])
    m = h.cache.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (4, 4, b)
    assert h.cache.load_back(b) == 4
    h.cache.sanity_check()
    check_bits(h)
    assert layout(h) == [(0, 4, "dev", False), (4, 8, "dev", False)]


def test_a_new_tail_revives_every_host_node_above_it_even_as_tombstones() -> None:
    """Host-only A [0, 4), B [4, 8); the caller's SWA KV is live from 8 on: the new tail
    [8, 12) hangs below A and B, which come to device as tombstones (the device set is
    prefix-closed); a match of the whole key is usable (the tail holds a window)."""
    h = SWAH(1)
    host_only_chain(h, 4, 8)
    res, value = put(h, 12, dead=8)
    assert (res.prefix_len, res.inserted_len) == (8, 12)
    assert layout(h) == [(0, 4, "dev", True), (4, 8, "dev", True), (8, 12, "dev", False)]
    check_bits(h)
    assert h.cache.match_prefix(KEY[:12]).prefix_len == 12
    assert h.cache.match_prefix(KEY[:8]).prefix_len == 0
