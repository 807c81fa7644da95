"""L3 with a sliding window: the record at a node's end carries the window's SWA KV.

A cache over an ``SWAAllocator`` (full pool 64 tokens, SWA pool 32, real K / V tensors),
window ``W = 6``, page size 4, so the SWA part of an end record covers ``SPAN = 8`` tokens
(``ceil(6 / 4)`` pages), and optionally a state pool; a host tier (``write_through``) and L3
(the file store, or Redis at ``HPC_REDIS_URL``). What is checked, by hand:

* the layout tag gains ``swa=2x1x2:torch.float32,last=8`` and the end record its SWA K and V
  (after the state's ``(conv, ssm)`` on a hybrid cache);
* a second cache (or the same one with device and host emptied) matching the key reads the
  pages back: the chain is cut ``SPAN`` tokens before the record's end, the part above a
  tombstone (no SWA KV), the span live with the SWA KV the writer had there (gathered over
  several nodes when the span reaches above the node), every bit equal after load-back,
  full KV of the whole chain and the state too;
* the usable length is where an end record lies: a node whose end is a tombstone has none;
* a chain shorter than the span (the tree already holds its start) or a key shallower than
  the span takes the record's last tokens;
* a damaged end record (truncated, a flipped SWA byte, a well-formed one with a short SWA
  section) and an SWA ``unpack_end`` that fails are contained misses that change nothing;
* no end record where the span holds a tombstone, and none packed while a host copy is in
  flight (it waits for the next landing);
* seeded random operations on two caches sharing L3: every served full and SWA value is the
  signature of its prefix, every match ends with its window live.
"""

from __future__ import annotations

import os
import random
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from components.swa import SWAComponent
from hicache.storage import end_key, page_hashes
from tests.helpers.cache_helpers import alloc_request, bits, free_leftovers
from tests.helpers.swa_hicache import SWAHostRig
from tests.hicache.test_hicache_common import node_at

W = 6  # the sliding window [tokens]
PS = 4  # page size [tokens]
SPAN = 8  # ceil(W / PS) pages [tokens]: the SWA KV an end record holds
KEY = list(range(1, 33))
GEN = torch.Generator().manual_seed(37)


def file_store(tmp_path: Any) -> dict[str, Any]:
    return {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}


def fresh_model(name: str) -> str:
    """A model name of its own (Redis keeps records between tests)."""
    return f"{name}-{os.getpid()}-{torch.randint(1 << 30, ()).item()}"


class SWAL3(SWAHostRig):
    """One SWA cache with a host tier and L3, and every pool around it."""

    def __init__(self, where: dict[str, Any], model: str, states: int = 0,
                 page_size: int = PS, window: int = W, layout: str = "page_first",
                 policy: str = "write_through") -> None:
        super().__init__(64, 32, page_size, window, dim=2, states=states,
                         state_dims=((2,), (2, 2)), policy=policy, gen=GEN,
                         hicache_mem_layout=layout,
                         hicache_storage_prefetch_policy="wait_complete",
                         hicache_storage_model=model, **where)
        assert self.cache.storage is not None

    def empty(self) -> None:
        """Evict every device node (each demoted: write-through) and every host copy."""
        c = self.cache
        c.evict(64)
        c.evict_host(1 << 20)
        c.sanity_check()
        assert c.tree.num_nodes == 0

    def snapshot(self) -> dict[str, Any]:
        c = self.cache
        out: dict[str, Any] = {
            "device full": self.kv.full_side.snapshot(), "device swa": self.kv.swa_side.snapshot(),
            "host kv": self.hc.pools["kv"].host.snapshot(),
            "host swa": self.hc.pools["swa"].host.snapshot(),
            "swa allocator": self.kv.snapshot(), "pretty": c.pretty_print(),
            "sizes": (c.evictable_size(), c.protected_size(), c.swa_evictable_size(),
                      c.swa_protected_size(), c.host_size(), c.host_evictable_size()),
        }
        if self.sp is not None:
            out["host state"] = self.hc.pools["state"].host.snapshot()
        return out

    def check_loaded(self, key: list[int], fk: torch.Tensor, sk: torch.Tensor,
                     live_from: int) -> torch.Tensor:
        """After a load-back: the match of ``key`` is whole on device, full K / V of every
        token equal ``fk`` / ``-fk``, SWA K / V of ``[live_from, len(key))`` equal ``sk`` /
        ``-sk`` there, and the tokens before have no SWA slot. Returns the device slots."""
        m = self.cache.match_prefix(key)
        assert m.prefix_len == len(key)
        new = m.device_indices
        assert torch.equal(bits(self.full.k_all[:, new]), bits(fk))
        assert torch.equal(bits(self.full.v_all[:, new]), bits(-fk))
        live = new[live_from:]
        assert bool(self.kv.has_swa(live).all()) and not bool(self.kv.has_swa(new[:live_from]).any())
        swa = self.kv.translate(live)
        assert torch.equal(bits(self.swa.k_all[:, swa]), bits(sk[:, live_from:]))
        assert torch.equal(bits(self.swa.v_all[:, swa]), bits(-sk[:, live_from:]))
        self.cache.sanity_check()
        return new


def close(*caches: SWAL3) -> None:
    for h in caches:
        h.cache.close_storage()


# ======================================================================== format
@pytest.mark.parametrize("states", [0, 4])
def test_the_tag_and_end_record_carry_the_windows_swa_kv(tmp_path: Any, states: int) -> None:
    h = SWAL3(file_store(tmp_path), "m", states)
    st = h.cache.storage
    assert st is not None
    swa = 2 * SPAN * 1 * 2 * 4  # layers x span x heads x head_dim x float32
    conv, ssm = 2 * 2 * 4, 2 * 2 * 2 * 4
    assert st.tag.endswith(";swa=2x1x2:torch.float32,last=8")
    assert st.end_record_bytes == ((conv, ssm + 2 * swa) if states else (swa, swa))
    close(h)


def test_a_span_that_is_not_whole_pages_is_refused(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SWAComponent, "l3_span", lambda self: 6)
    with pytest.raises(ValueError, match=r"component 'swa': l3_span\(\) must be a multiple of "
                                         r"page_size=4"):
        SWAL3(file_store(tmp_path), "m")


# ======================================================================== round trips
@pytest.mark.parametrize("states", [0, 4])
@pytest.mark.parametrize("reader", ["fresh cache", "evicted host"])
def test_an_swa_prefix_read_back_from_l3_is_usable_and_bit_exact(
        l3_store: dict[str, Any], states: int, reader: str) -> None:
    """[0, 24) live in one node: one end record, at 24, holding the SWA KV of [16, 24). Read
    back: [0, 16) a tombstone, [16, 24) live; the host hit is all 24 tokens."""
    model = fresh_model("swa-l3")
    a = SWAL3(l3_store, model, states)
    b = SWAL3(l3_store, model, states) if reader == "fresh cache" else a
    try:
        _, fk, sk, conv = a.insert(KEY[:24])
        assert a.cache.flush_storage(10)
        assert a.cache.stats()["l3_backup_written"] == 6 + 1  # six pages, one end record
        if b is a:
            a.empty()
        m = b.cache.match_prefix(KEY[:24])
        assert (m.prefix_len, m.host_hit_length) == (0, 24)
        upper, lower = node_at(b.cache, KEY[:16]), node_at(b.cache, KEY[:24])
        assert m.last_host_node is lower and lower.parent is upper
        assert (upper.swa_tombstone, upper.host_swa_value) == (True, None)
        assert not lower.swa_tombstone and lower.host_swa_value is not None
        host_swa = b.hc.pools["swa"].host.pool
        assert torch.equal(bits(host_swa.k_all[:, lower.host_swa_value]), bits(sk[:, 16:]))
        b.cache.sanity_check()
        assert b.cache.load_back(lower) == 24
        b.cache.sanity_check()
        b.check_loaded(KEY[:24], fk, sk, 16)
        if states:
            m = b.cache.match_prefix(KEY[:24])
            assert b.sp is not None and m.state_slot is not None and conv is not None
            assert torch.equal(bits(b.sp.conv[:, m.state_slot]), bits(conv))
    finally:
        close(a, b) if b is not a else close(a)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_the_span_gathers_the_swa_kv_of_several_nodes(l3_store: dict[str, Any], layout: str) -> None:
    """[0, 8) then [8, 12) below it: the record at 12 holds [4, 12), from both nodes' host
    copies; the record at 8 holds [0, 8)."""
    model = fresh_model("swa-l3-gather")
    a, b = SWAL3(l3_store, model, layout=layout), SWAL3(l3_store, model, layout=layout)
    try:
        _, fk1, sk1, _ = a.insert(KEY[:8])
        pa = a.cache.match_prefix(KEY[:8]).device_indices
        _, fk2, sk2, _ = a.insert(KEY[:12], prefix=pa)
        assert a.cache.flush_storage(10)
        assert a.cache.stats()["l3_backup_written"] == 3 + 2
        m = b.cache.match_prefix(KEY[:12])
        assert (m.prefix_len, m.host_hit_length) == (0, 12)
        upper = node_at(b.cache, KEY[:4])
        assert upper.swa_tombstone and upper.host_swa_value is None
        assert b.cache.load_back(m.last_host_node) == 12
        b.check_loaded(KEY[:12], torch.cat([fk1, fk2], 1), torch.cat([sk1, sk2], 1), 4)
    finally:
        close(a, b)


def test_the_usable_length_is_where_an_end_record_lies(tmp_path: Any) -> None:
    """[0, 8) out of the window (a tombstone), [8, 24) live: no record at 8 (its end is no
    usable end), one at 24 ([16, 24)). A reader of [0, 12) or [0, 20) finds no record: 0;
    of [0, 24): all 24, [0, 16) a tombstone."""
    where = file_store(tmp_path)
    a = SWAL3(where, "m")
    _, fk, sk, _ = a.insert(KEY[:24], tombstone=8)
    t, live = node_at(a.cache, KEY[:8]), node_at(a.cache, KEY[:24])
    assert (t.swa_tombstone, live.swa_tombstone) == (True, False)
    assert a.cache.flush_storage(10)
    assert a.cache.stats()["l3_backup_written"] == 6 + 1
    for n, want in ((12, 0), (20, 0), (24, 24)):
        b = SWAL3(where, "m")
        m = b.cache.match_prefix(KEY[:n])
        assert (m.prefix_len, m.host_hit_length) == (0, want), n
        b.cache.sanity_check()
        if want:
            assert b.cache.load_back(m.last_host_node) == 24
            b.check_loaded(KEY[:24], fk, sk, 16)
        close(b)
    close(a)


def test_a_chain_shorter_than_the_span_takes_the_records_last_tokens(tmp_path: Any) -> None:
    """The reader holds [0, 20) on device (its own KV); L3 brings [20, 24): 4 live tokens,
    the last 4 of the record's 8, below a live path: usable."""
    where = file_store(tmp_path)
    a, b = SWAL3(where, "m"), SWAL3(where, "m")
    _, fk, sk, _ = a.insert(KEY[:24])
    assert a.cache.flush_storage(10)
    _, fk_b, sk_b, _ = b.insert(KEY[:20])
    m = b.cache.match_prefix(KEY[:24])
    assert (m.prefix_len, m.host_hit_length) == (20, 4)  # the host part past the device
    tail = m.last_host_node
    assert tail is not None and len(tail.key) == 4 and not tail.swa_tombstone
    assert b.cache.load_back(tail) == 4
    b.check_loaded(KEY[:24], torch.cat([fk_b, fk[:, 20:]], 1),
                   torch.cat([sk_b, sk[:, 20:]], 1), 0)
    close(a, b)


def test_a_key_shallower_than_the_span_is_read_back_whole(tmp_path: Any) -> None:
    where = file_store(tmp_path)
    a, b = SWAL3(where, "m"), SWAL3(where, "m")
    _, fk, sk, _ = a.insert(KEY[:4])  # the record's first 4 tokens are unused (zero)
    assert a.cache.flush_storage(10)
    m = b.cache.match_prefix(KEY[:4])
    assert (m.prefix_len, m.host_hit_length) == (0, 4)
    assert b.cache.load_back(m.last_host_node) == 4
    b.check_loaded(KEY[:4], fk, sk, 0)
    close(a, b)


# ======================================================================== faults
def _end_path(h: SWAL3, root: Path, depth: int) -> tuple[str, Path]:
    """The end record's key and file at ``depth`` of ``KEY`` (a node ends there)."""
    st = h.cache.storage
    assert st is not None
    seed = st.seed(None)
    assert seed is not None
    key = end_key(page_hashes(seed, array("q", KEY[:depth]), PS)[-1])
    (path,) = root.rglob(key)
    return key, path


@pytest.mark.parametrize("damage", ["truncated", "flipped", "short section"])
@pytest.mark.parametrize("states", [0, 4])
def test_a_damaged_end_record_is_a_miss_that_changes_nothing(tmp_path: Any, damage: str,
                                                             states: int) -> None:
    where = file_store(tmp_path)
    a = SWAL3(where, "m", states)
    a.insert(KEY[:24])
    assert a.cache.flush_storage(10)
    key, path = _end_path(a, tmp_path, 24)
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:-5])
    elif damage == "flipped":  # a byte of the SWA V section (the record's last bytes)
        path.write_bytes(raw[:-3] + bytes([raw[-3] ^ 0x40]) + raw[-2:])
    else:  # a well-formed record whose SWA V section lacks a token
        path.unlink()
        st = SWAL3(where, "m", states).cache.storage
        assert st is not None
        sections = [bytes(n) for n in st.end_sections]
        sections[-1] = sections[-1][: -2 * 2 * 4]
        assert st.backend.batch_set([(key, sections[0], b"".join(sections[1:]))]) == 1
    b = SWAL3(where, "m", states)
    before = b.snapshot()
    m = b.cache.match_prefix(KEY[:24])
    assert (m.prefix_len, m.host_hit_length) == (0, 0)
    assert b.snapshot() == before
    b.cache.sanity_check()
    close(a, b)


def test_an_swa_unpack_that_fails_is_a_miss_that_changes_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    where = file_store(tmp_path)
    a, b = SWAL3(where, "m", 4), SWAL3(where, "m", 4)
    _, fk, sk, _ = a.insert(KEY[:24])
    assert a.cache.flush_storage(10)
    before = b.snapshot()

    def boom(*args: Any) -> None:
        raise RuntimeError("unpack failed")

    swa = next(c for c in b.cache.components if c.name == "swa")
    monkeypatch.setattr(swa, "unpack_end", boom)
    m = b.cache.match_prefix(KEY[:24])  # the pages and the state landed, the SWA KV failed
    assert m.host_hit_length == 0 and b.cache.stats()["l3_faults"] == 1
    after = b.snapshot()
    for name in ("host kv", "host swa", "host state"):  # given back (at the free lists' ends)
        assert after.pop(name).num_used == before.pop(name).num_used == 0
    assert after == before
    b.cache.sanity_check()
    monkeypatch.undo()
    m = b.cache.match_prefix(KEY[:24])  # a later match reads it again
    assert m.host_hit_length == 24
    assert b.cache.load_back(m.last_host_node) == 24
    b.check_loaded(KEY[:24], fk, sk, 16)
    close(a, b)


def test_no_end_record_where_the_span_lacks_host_swa_kv(tmp_path: Any) -> None:
    """[0, 4) a tombstone, [4, 8) live: 4 live tokens < W, no usable end on device; the
    record at 8 would need [0, 8): none is written, and a reader gets nothing either."""
    where = file_store(tmp_path)
    a = SWAL3(where, "m")
    a.insert(KEY[:8], tombstone=4)
    t, live = node_at(a.cache, KEY[:4]), node_at(a.cache, KEY[:8])
    assert (t.swa_tombstone, live.swa_tombstone) == (True, False)
    assert live.host_swa_value is not None and t.host_swa_value is None
    assert a.cache.match_prefix(KEY[:8]).prefix_len == 0  # the window rule on device
    assert a.cache.flush_storage(10)
    assert a.cache.stats()["l3_backup_written"] == 2  # the pages, no end record
    b = SWAL3(where, "m")
    m = b.cache.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length) == (0, 0) and b.cache.tree.num_nodes == 0
    close(a, b)


# ======================================================================== random
def sig(prefix: list[int], salt: int) -> float:
    h = salt
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (1 << 23)
    return float(h)


def sigs(key: list[int], lo: int, hi: int, salt: int) -> torch.Tensor:
    """Token ``j``'s value for ``j`` in ``[lo, hi)``: a signature of ``key[:j+1]``, shaped as
    a pool's ``[layers, tokens, heads, head_dim]``."""
    vals = torch.tensor([sig(key[: j + 1], salt) for j in range(lo, hi)])
    return vals.view(1, -1, 1, 1).expand(2, hi - lo, 1, 2)


def serve(h: SWAL3, key: list[int], window: int, rng: random.Random) -> None:
    """An engine's request: match (prefetch from L3), maybe load back, check every served
    full and SWA value and the window rule, then insert with fresh slots (some of their SWA
    KV released first, as out of a request's window)."""
    c, kv, ps = h.cache, h.kv, h.cache.page_size
    m = c.match_prefix(key)
    if m.host_hit_length and rng.random() < 0.8:
        c.load_back(m.last_host_node)
        m = c.match_prefix(key)
    n, dev = m.prefix_len, m.device_indices
    assert torch.equal(h.full.k_all[:, dev], sigs(key, 0, n, 1))
    assert torch.equal(h.full.v_all[:, dev], sigs(key, 0, n, 2))
    live = kv.has_swa(dev)
    assert bool(live[max(0, n - window):].all()), "a match ended without its window's SWA KV"
    at = torch.nonzero(live).flatten()
    swa = kv.translate(dev[at])
    want_k = torch.cat([sigs(key, j, j + 1, 4) for j in at.tolist()], 1) if len(at) else None
    if want_k is not None:
        assert torch.equal(h.swa.k_all[:, swa], want_k)
        assert torch.equal(h.swa.v_all[:, swa], -want_k)
    if h.sp is not None and n:
        assert m.state_slot is not None and bool((h.sp.conv[:, m.state_slot] == sig(key[:n], 3)).all())
    end = len(key) - len(key) % ps
    if end <= n:
        return
    lock = c.inc_lock_ref(m.last_device_node)
    need = end - n
    got = alloc_request(c, kv, h.sp, need, swa=True)
    if got is None:
        c.dec_lock_ref(lock)
        return
    fresh, slot = got
    h.full.k_all[:, fresh] = sigs(key, n, end, 1)
    h.full.v_all[:, fresh] = sigs(key, n, end, 2)
    h.swa.k_all[:, kv.translate(fresh)] = sigs(key, n, end, 4)
    h.swa.v_all[:, kv.translate(fresh)] = -sigs(key, n, end, 4)
    released = rng.choice([0, 0, rng.randrange(0, need + 1, ps)])
    if released:
        kv.free_swa(fresh[:released])
    if slot is not None:
        assert h.sp is not None
        h.sp.conv[:, slot] = sig(key[:end], 3)
    res = c.insert(key[:end], torch.cat([dev, fresh]), state_slot=slot)
    c.dec_lock_ref(lock)
    free_leftovers(kv, res, fresh, need)
    if slot is not None and not res.state_adopted:
        assert h.sp is not None
        h.sp.free(torch.tensor([slot]))


@pytest.mark.parametrize("seed", range(6))
def test_random_ops_on_two_swa_caches_sharing_l3(tmp_path: Any, seed: int) -> None:
    """Two caches (page 1, 2 or 4; window 3 or 6; with or without states; write-through or
    write-back) serve random keys of a 3-token vocabulary, evict device, SWA and host, flush
    to L3, with host copies held in flight at times (end records then wait); every served
    value is the signature of its prefix, every match ends with its window live, the
    invariant check holds after every step, and L3 serves tokens."""
    rng = random.Random(seed)
    ps, window, states = rng.choice([1, 2, 4]), rng.choice([3, 6]), rng.choice([0, 6])
    where = file_store(tmp_path)
    caches = [SWAL3(where, "m", states, page_size=ps, window=window,
                    policy=rng.choice(["write_through", "write_back"])) for _ in range(2)]
    try:
        for _ in range(150):
            h = rng.choice(caches)
            h.hc.hold_completions = rng.random() < 0.2
            op = rng.random()
            if op < 0.05:
                h.hc.release_held()
                h.cache.poll_transfers()
            elif op < 0.55:
                serve(h, [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 20))], window, rng)
            elif op < 0.65:
                h.cache.evict(rng.randint(1, 24))
            elif op < 0.75:
                h.cache.evict_swa(rng.randint(1, 16))
            elif op < 0.85:
                h.cache.evict_host(rng.randint(1, 24))
            else:
                assert h.cache.flush_storage(10)
            for x in caches:
                x.cache.sanity_check()
        for x in caches:
            x.hc.hold_completions = False
            x.hc.release_held()
            assert x.cache.flush_storage(10)
            x.cache.sanity_check()
        assert sum(x.cache.stats()["l3_prefetch_tokens"] for x in caches) > 0
    finally:
        close(*caches)


def test_an_end_record_waits_while_a_host_copy_is_in_flight(tmp_path: Any) -> None:
    """X's copy lands while a later copy (Y's) is still in flight: X's pages go to L3 at
    once, its end record (whose SWA KV could lie in a copy issued after X's: an ancestor's
    within the span) waits until nothing is in flight, then is written; a reader gets X."""
    where = file_store(tmp_path)
    a = SWAL3(where, "m")
    hc = a.hc
    hc.hold_completions = True  # copies are issued (on the CPU: run) but not complete
    _, fk, sk, _ = a.insert(KEY[:8])
    a.insert([100 + t for t in range(8)])
    assert hc.num_inflight == 2
    hc._pending[0][0].released = True  # X's copy (issued first) lands, Y's does not
    a.cache.poll_transfers()
    assert hc.num_inflight == 1 and hc.writes_landing()
    assert a.cache.flush_storage(10)
    assert a.cache.stats()["l3_backup_written"] == 2  # X's pages, not its end record
    hc.hold_completions = False
    hc.release_held()
    assert a.cache.flush_storage(10)
    assert a.cache.stats()["l3_backup_written"] == 2 + 3 + 1  # Y's pages and end, X's end
    b = SWAL3(where, "m")
    m = b.cache.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length) == (0, 8)
    assert b.cache.load_back(m.last_host_node) == 8
    b.check_loaded(KEY[:8], fk, sk, 0)
    close(a, b)
