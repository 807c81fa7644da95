"""The CUDA path, proven on the CPU with the simulated device (bench/dev/gpu/simcuda.py, strict: an
unordered copy, a mixed-device operation or a device value read by host code fails the test
where it happens): HiCache copies bit-exact straight between the device rows and the pinned
host pools (no CPU copy), ordered by events, load-back asynchronous with the current stream waiting for it, an engine's own K/V
tensors copied through ``KVBuffers``, the host waiting only where the docstrings say, and the
host mirrors that keep device values off the host. The two bugs the audit found are in
``test_gpu_bugs.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from allocators import (
    KVBuffers,
    KVPool,
    MambaStatePool,
    TokenAllocator,
    cat_slots,
)
from allocators.host_mirror import MISSES, mirror_of
from bench.dev.gpu.simcuda import OUTSIDE, SimCuda
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, RadixCache

L, H, D = 3, 2, 4  # KV layers, heads, head dim of the pools below


@contextmanager
def cuda(**kw: bool) -> Iterator[SimCuda]:
    """A strict simulator; the test also checks that no device tensor went without a mirror."""
    before = sum(MISSES.values())
    with SimCuda(**kw) as sim:
        yield sim
    assert sum(MISSES.values()) == before, f"device tensors read without a mirror: {MISSES}"


def tracked_syncs(sim: SimCuda) -> int:
    """Syncs inside tracked library calls (a test's own reads and checks are outside them)."""
    return sum(s.total for op, s in sim.ops.items() if op != OUTSIDE)


CACHE_CALLS = ["insert", "match_prefix", "evict", "evict_states", "load_back", "poll_transfers",
               "inc_lock_ref", "dec_lock_ref", "cache_finished_req", "cache_unfinished_req"]


def fill(pool: KVPool | KVBuffers, slots: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write random K/V into ``slots`` of every layer; return what was written (on the host)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, len(slots), H, D, generator=g).to(pool.dtype)
    v = torch.randn(L, len(slots), H, D, generator=g).to(pool.dtype)
    pool.scatter(slots, k.to(pool.device), v.to(pool.device))
    return k, v


def device_rows(pool: KVPool | KVBuffers, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = pool.gather(slots)
    return k.cpu(), v.cpu()  # a test's read: it synchronises, outside the cache's calls


# ======================================================================= HiCache
def hicache_cache(*, buffers: bool = False,
                  **cfg: Any) -> tuple[RadixCache, tuple[Any, TokenAllocator, MambaStatePool]]:
    """A hybrid cache with a host tier on the simulated device, its KV in a ``KVPool`` or in
    the engine's own per-layer tensors (``KVBuffers``)."""
    if buffers:  # the engine's own per-layer tensors, behind the pool interface
        pool: KVPool | KVBuffers = KVBuffers(
            [torch.zeros(65, H, D, device="cuda") for _ in range(L)],
            [torch.zeros(65, H, D, device="cuda") for _ in range(L)])
    else:
        pool = KVPool(64, L, H, D, torch.float32, "cuda")
    kv = TokenAllocator(64, pool=pool, device="cuda")
    sp = MambaStatePool(8, 2, (3, 2), (2, 2, 2), device="cuda")
    c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                   hicache=HiCacheConfig(load_back_threshold=1, **cfg))
    return c, (pool, kv, sp)


IO = [(io, layout) for io in ("direct", "kernel") for layout in ("page_first", "layer_first")]


@pytest.mark.parametrize("io, layout", IO, ids=[f"{a}-{b}" for a, b in IO])
@pytest.mark.parametrize("buffers", [False, True], ids=["KVPool", "KVBuffers"])
def test_backup_and_load_back_are_bit_exact_ordered_and_never_wait(buffers: bool, io: str,
                                                                   layout: str) -> None:
    with cuda() as sim:
        c, (pool, kv, sp) = hicache_cache(buffers=buffers, hicache_io_backend=io,
                                          hicache_mem_layout=layout)
        slots = kv.alloc(48)
        k, v = fill(pool, slots, 0)
        s = sp.alloc(1)
        sp.conv.index_copy_(1, s, torch.randn(2, 1, 3, 2).to("cuda"))
        conv = sp.conv[:, 1].cpu()
        res = c.insert(list(range(1, 49)), slots, state_slot=s)  # write_through: backed up
        node = res.last_node
        assert c.poll_transfers() == 0 and c.hicache is not None and c.hicache.num_inflight == 0
        hp = c.hicache.host_kv.pool
        hs = c.hicache.host_state
        assert torch.equal(hp.k_all[:, node.host_value], k)  # what was on device, bit for bit
        assert torch.equal(hp.v_all[:, node.host_value], v)
        assert hs is not None and torch.equal(hs.conv[:, node.host_state_slot], conv)
        c.evict(48)  # demoted: host-only
        assert node.kv_value is None
        for buf in ([pool.k_all, pool.v_all] if isinstance(pool, KVPool) else pool.k_buffers):
            buf.zero_()
        sp.conv.zero_()
        assert c.load_back(node) == 48
        got_k, got_v = device_rows(pool, c.kv.slots(node))
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert torch.equal(sp.conv[:, node.state_slot].cpu(), conv)
        c.sanity_check()
    assert sim.errors == []  # strict: an unordered copy would have raised where it happened


def test_every_cache_call_of_a_backup_and_load_back_is_sync_free() -> None:
    with cuda() as sim:
        c, (pool, kv, sp) = hicache_cache()
        sim.track(c, CACHE_CALLS, "cache")
        sim.track(kv, ["alloc", "free"], "kv")
        sim.track(sp, ["alloc", "free", "copy"], "state")
        for i in range(3):
            slots = kv.alloc(16)
            fill(pool, slots, i)
            s = sp.alloc(1)
            c.insert(list(range(100 * i + 1, 100 * i + 17)), slots, state_slot=s)
        c.evict(48)
        m = c.match_prefix(list(range(1, 17)))
        assert m.host_hit_length == 16 and c.load_back(m.last_host_node) == 16
        m = c.match_prefix(list(range(1, 17)))
        lock = c.inc_lock_ref(m.last_device_node)
        mine = sp.alloc(1)
        sp.copy(m.state_slot, mine)
        c.dec_lock_ref(lock)
        sp.free(mine)
        hc = c.hicache
        assert hc is not None and hc.last_load is not None
        # the current stream waits for the load (on the GPU, not the host)
        cur = torch.cuda.current_stream()
        assert cur.waited[hc.last_load.event.stream] >= hc.last_load.event.seq
    assert sim.ops["cache.load_back"].calls == 1
    assert tracked_syncs(sim) == 0, sim.report()


def test_a_gpu_kv_allocator_without_its_tensors_is_refused() -> None:
    with cuda():
        with pytest.raises(ValueError, match="KVBuffers"):
            RadixCache(kv_allocator=TokenAllocator(64, device="cuda"),
                       hicache=HiCacheConfig())


def test_host_pools_are_pinned_once_and_the_cpu_copies_nothing() -> None:
    """No pinned memory is allocated per copy (the host pools were pinned where they were
    allocated), and no host-side torch call copies pool data: 0 CPU-copied bytes for the bytes
    the copies moved."""
    with cuda() as sim:
        c, (pool, kv, sp) = hicache_cache()
        sim.track(c, CACHE_CALLS, "cache")
        first = None
        for i in range(12):
            slots = kv.alloc(4)
            fill(pool, slots, i)
            c.insert(list(range(10 * i + 1, 10 * i + 5)), slots, state_slot=sp.alloc(1))
            c.evict(4)
            if first is None:
                first = len(sim.pinned_allocs)
        m = c.match_prefix(list(range(1, 5)))
        assert c.load_back(m.last_host_node) == 4
        assert len(sim.pinned_allocs) == first and sim.pinned_copies == []
        moved = sum(n for op, n in sim.link_bytes.items() if op != OUTSIDE)
        # 12 backups and one load, each of 4 tokens (K+V of L layers: 2*L*H*D float32 each)
        # and one state (2 layers of a (3, 2) conv and a (2, 2, 2) SSM state, float32)
        kv_bytes = 2 * L * H * D * 4
        state_bytes = 2 * (3 * 2 + 2 * 2 * 2) * 4
        assert moved == 13 * (4 * kv_bytes + state_bytes)
        assert sum(n for op, n in sim.cpu_copied.items() if op != OUTSIDE) == 0
    assert tracked_syncs(sim) == 0, sim.report()


def test_copies_in_flight_never_block_the_host_and_land_exactly() -> None:
    """Events never complete on their own: backups stay in flight (their nodes locked), no
    engine-facing call waits for them, and once the device is synchronised they land bit for
    bit."""
    with cuda(events_complete=False) as sim:
        pool = KVPool(64, L, H, D, torch.float32, "cuda")
        kv = TokenAllocator(64, pool=pool, device="cuda")
        c = RadixCache(kv_allocator=kv, hicache=HiCacheConfig(load_back_threshold=1))
        sim.track(c, CACHE_CALLS, "cache")
        hc = c.hicache
        assert hc is not None
        written = []
        for i in range(6):
            slots = kv.alloc(8)
            written.append((fill(pool, slots, i), c.insert(list(range(10 * i + 1, 10 * i + 9)),
                                                           slots).last_node))
        assert hc.num_inflight == 6 and c.poll_transfers() == 0
        assert tracked_syncs(sim) == 0, sim.report()
        torch.cuda.synchronize()
        assert c.poll_transfers() == 6
        hp = hc.host_kv.pool
        for (k, v), node in written:
            assert torch.equal(hp.k_all[:, node.host_value], k)
            assert torch.equal(hp.v_all[:, node.host_value], v)
    assert sim.errors == []


def test_a_load_of_a_state_still_being_written_is_ordered_after_it_on_the_gpu() -> None:
    """Events never complete on their own. A state set on a node after its KV's backup is
    copied to the host asynchronously; its device state is then evicted while that copy is in
    flight; bringing the state back orders the load after that copy on the GPU (the load
    stream waits for its event: no host wait) and gets its data."""
    with cuda(events_complete=False) as sim:
        c, (pool, kv, sp) = hicache_cache()
        slots = kv.alloc(16)
        fill(pool, slots, 1)
        c.insert(list(range(1, 17)), slots, state_slot=sp.alloc(1))  # N16 (KV + state)
        torch.cuda.synchronize()
        c.poll_transfers()  # landed: N16 unlocked
        s = sp.alloc(1)
        sp.ssm.index_copy_(1, s, torch.full((2, 1, 2, 2, 2), 7.0).to("cuda"))
        c.insert(list(range(1, 9)), slots[:8], state_slot=s)  # splits: N8 takes the state
        n8 = c.match_prefix(list(range(1, 9))).last_device_node
        assert n8.host_value is not None and n8.host_state_slot is not None
        assert c.evict_states(2).num_states == 2  # N16 demoted, N8 loses its device state
        assert n8.state_slot is None and n8.kv_value is not None
        before = sim.total_syncs
        hc = c.hicache
        assert hc is not None
        write = hc._host_writes[("state", n8.host_state_slot)]
        assert c.load_back(n8) == 0 and n8.state_slot is not None  # the state alone came back
        assert hc.load_waits == 1 and sim.total_syncs == before  # ordered on the GPU only
        load = hc.last_load
        assert load is not None and hc._load_stream.waited[write.event.stream] >= write.event.seq
        assert (sp.ssm[:, n8.state_slot].cpu() == 7.0).all()
        c.sanity_check()
    assert sim.errors == []


def test_load_back_lands_layer_by_layer_and_layer_0_is_usable_before_the_last() -> None:
    """``layer_first`` host pools, ``layerwise`` loads, events that never complete on their
    own: the load-back returns at once with one event per layer, in order; the current stream
    waits for layer 0 alone and reads its rows bit for bit while the last layer has not landed
    (its event incomplete); touching the last layer's rows with only layer 0 waited for is the
    unordered access the strict simulator refuses."""
    with cuda(events_complete=False) as sim:
        c, (pool, kv, sp) = hicache_cache(buffers=True, hicache_mem_layout="layer_first")
        assert isinstance(pool, KVBuffers)
        sim.track(c, CACHE_CALLS, "cache")
        slots = kv.alloc(24)
        k, v = fill(pool, slots, 3)
        node = c.insert(list(range(1, 25)), slots, state_slot=sp.alloc(1)).last_node
        torch.cuda.synchronize()
        c.poll_transfers()
        c.evict(24)
        assert node.kv_value is None
        for b in (*pool.k_buffers, *pool.v_buffers):
            b.zero_()
        hc = c.hicache
        assert hc is not None
        hc.layerwise = True
        assert c.load_back(node) == 24
        t = hc.last_load
        assert t is not None and len(t.layer_events) == L
        seqs = [ev.seq for ev in t.layer_events]
        assert seqs == sorted(seqs) and len(set(seqs)) == L  # one event per layer, in order
        assert not t.layer_done(L - 1) and not t.done()  # the last layer has not landed
        cur = torch.cuda.current_stream()
        assert cur.waited.get(t.event.stream, -1) < seqs[0]  # layerwise: no wait for the load
        t.wait_layer(0)
        assert cur.waited[t.event.stream] == seqs[0] < seqs[-1]
        rows = c.kv.slots(node)
        k0 = pool.k_buffers[0].index_select(0, rows)  # layer 0 on the current stream: ordered
        v0 = pool.v_buffers[0].index_select(0, rows)
        assert torch.equal(k0.cpu(), k[0]) and torch.equal(v0.cpu(), v[0])
        with pytest.raises(AssertionError, match="without waiting"):
            pool.k_buffers[L - 1].index_select(0, rows)  # the last layer: not waited for
        t.wait_layer(L - 1)
        assert torch.equal(pool.k_buffers[L - 1].index_select(0, rows).cpu(), k[L - 1])
        assert tracked_syncs(sim) == 0, sim.report()


def test_a_page_first_load_lands_every_layer_at_once() -> None:
    with cuda():
        c, (pool, kv, sp) = hicache_cache()
        slots = kv.alloc(8)
        fill(pool, slots, 4)
        node = c.insert(list(range(1, 9)), slots, state_slot=sp.alloc(1)).last_node
        c.evict(8)
        assert c.load_back(node) == 8
        t = c.hicache.last_load if c.hicache is not None else None
        assert t is not None and len(t.layer_events) == L
        assert all(ev is t.event for ev in t.layer_events)
        assert torch.cuda.current_stream().waited[t.event.stream] >= t.event.seq


def _state(c: RadixCache, pools: tuple[Any, TokenAllocator, MambaStatePool]) -> tuple[Any, ...]:
    hc = c.hicache
    assert hc is not None and hc.host_state is not None
    pool, kv, sp = pools
    return (kv.available_size(), sp.available_size(), hc.host_kv.available_size(),
            hc.host_state.available_size(), hc.num_inflight, c.stats().get("host_tokens"))


def test_a_backup_or_load_that_cannot_start_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device temporary that cannot be allocated (an out-of-memory error in the gather, or
    in the load's fetch): the copy is skipped and counted (``copy_failures``), the host and
    device units it took are back, the node is as before, the cache checks."""
    import hicache.controller as ctl

    def oom(*args: Any, **kwargs: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    with cuda():
        c, pools = hicache_cache()
        pool, kv, sp = pools
        slots = kv.alloc(16)
        fill(pool, slots, 5)
        with monkeypatch.context() as m:
            m.setattr(ctl, "_gather", oom)
            before = _state(c, pools)
            # write_through: the backup cannot start, is skipped and counted (the insert
            # itself goes on: radix/tiers/host.py ``_copy_failed``)
            c.insert(list(range(1, 17)), slots, state_slot=sp.alloc(1))
            assert c.stats()["copy_failures"] == 1
            node = c.match_prefix(list(range(1, 17))).last_device_node
            assert node.host_value is None and node.kv_lock == 0
            after = _state(c, pools)
            assert after[2:] == before[2:]  # host units back, nothing in flight
            c.sanity_check()
        c.evict(16)  # no backup: the node leaves the tree
        slots = kv.alloc(16)
        k, _ = fill(pool, slots, 6)
        node = c.insert(list(range(1, 17)), slots, state_slot=sp.alloc(1)).last_node
        c.evict(16)
        assert node.kv_value is None
        with monkeypatch.context() as m:
            m.setattr(ctl, "_fetch_all", oom)
            before = _state(c, pools)
            assert c.load_back(node) == 0  # as with no device room; counted
            assert c.stats()["copy_failures"] == 2
            assert _state(c, pools) == before and node.kv_value is None
            c.sanity_check()
        assert c.load_back(node) == 16  # and it works once it can start
        assert torch.equal(device_rows(pool, c.kv.slots(node))[0], k)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_registered_pool_pair_moves_the_same_way(device: str, layout: str) -> None:
    """A third pool pair (a component's own rows: here a state-shaped pool of 3 layers)
    registered on the controller: ``write_rows`` / ``load_rows`` move its slots bit for bit,
    with the host copying nothing on the (simulated) GPU; an unknown pair name is a KeyError
    before anything is enqueued."""
    from hicache.host_pools import state_lanes

    with cuda() if device == "cuda" else contextlib.nullcontext() as sim:
        if device == "cuda":
            c, _ = hicache_cache(hicache_mem_layout=layout)
        else:
            kv_pool = KVPool(64, L, H, D, torch.float32, "cpu")
            c = RadixCache(kv_allocator=TokenAllocator(64, pool=kv_pool),
                           hicache=HiCacheConfig(hicache_mem_layout=layout))
        hc = c.hicache
        assert hc is not None
        dev = MambaStatePool(6, 3, (2, 5), (3,), device=device)
        host = MambaStatePool(12, 3, (2, 5), (3,), device="cpu", pin_memory=device == "cuda",
                              slot_first=layout == "page_first", zero_on_alloc=False)
        hc.register_pair("extra", dev, host, state_lanes(dev, host))
        with pytest.raises(ValueError, match="registered already"):
            hc.register_pair("extra", dev, host, ())
        if sim is not None:
            sim.track(hc, ["write_rows", "load_rows", "poll"], "hc")
        d = dev.alloc(2)
        assert d is not None
        conv = torch.randn(3, 2, 2, 5)
        dev.conv.index_copy_(1, d, conv.to(device))
        h = host.alloc(2)
        assert h is not None
        with pytest.raises(KeyError):
            hc.write_rows([("nope", d, h)], None)
        assert hc.num_inflight == 0
        hc.write_rows([("extra", d, h)], None)
        assert hc.poll() == 0 and hc.num_inflight == 0
        assert torch.equal(host.conv[:, h], conv)
        dev.conv.zero_()
        hc.load_rows([("extra", d, h)])
        if sim is not None:
            assert torch.cuda.current_stream().waited[hc.last_load.event.stream] >= hc.last_load.event.seq
            assert sum(n for op, n in sim.cpu_copied.items() if op != OUTSIDE) == 0
            assert tracked_syncs(sim) == 0
        assert torch.equal(dev.conv[:, d].cpu(), conv)


def test_a_kernel_backend_write_into_the_mapped_host_pool_lands_only_at_its_event() -> None:
    """``kernel``: a GPU kernel writes the pinned host pool through its device mapping; the
    simulator treats that as an asynchronous write of host memory, so reading the host rows
    before the write's event completed is the race it refuses, and after it the rows are
    exact."""
    with cuda(events_complete=False):
        c, (pool, kv, sp) = hicache_cache(hicache_io_backend="kernel")
        slots = kv.alloc(8)
        k, _ = fill(pool, slots, 7)
        node = c.insert(list(range(1, 9)), slots, state_slot=sp.alloc(1)).last_node
        hc = c.hicache
        assert hc is not None and hc.num_inflight == 1
        hp = hc.host_kv.pool
        with pytest.raises(AssertionError, match="before the event"):
            hp.k_all[:, node.host_value]
        torch.cuda.synchronize()
        assert c.poll_transfers() == 1
        assert torch.equal(hp.k_all[:, node.host_value], k)


def test_the_kernel_backend_needs_cuda_and_unknown_names_are_refused() -> None:
    assert not torch.cuda.is_available()
    with pytest.raises(ValueError, match=r"hicache_io_backend.*'direct'"):
        HiCacheConfig(hicache_io_backend="kernel")
    with pytest.raises(ValueError, match=r"hicache_io_backend='dma' is unknown.*'direct', 'kernel'"):
        HiCacheConfig(hicache_io_backend="dma")
    with pytest.raises(ValueError, match=r"hicache_mem_layout='page_first_direct' is unknown.*"
                                         r"'layer_first', 'page_first'"):
        HiCacheConfig(hicache_mem_layout="page_first_direct")
    with cuda():
        assert HiCacheConfig(hicache_io_backend="kernel").hicache_io_backend == "kernel"


# ============================================================ mirrors, engine rows
def test_request_rows_built_with_cat_slots_keep_their_mirrors() -> None:
    with cuda() as sim:
        kv = TokenAllocator(64, device="cuda")
        sp = MambaStatePool(4, device="cuda")
        c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp)
        sim.track(c, CACHE_CALLS, "cache")
        first = kv.alloc(8)
        c.insert(list(range(1, 9)), first, state_slot=sp.alloc(1))
        m = c.match_prefix(list(range(1, 13)))
        own = kv.alloc(4)
        row = cat_slots((m.device_indices, own))
        assert mirror_of(row) is not None and mirror_of(row[8:]) is not None
        assert mirror_of(torch.cat((m.device_indices, own))) is None  # torch.cat alone: none
        req = CacheRequest(key=list(range(1, 13)), kv_indices=row, cached_len=8,
                           last_node=m.last_device_node, lock=c.inc_lock_ref(m.last_device_node))
        res = c.cache_finished_req(req, state_slot=sp.alloc(1))
        assert res.inserted_len == 12
        c.sanity_check()
    assert tracked_syncs(sim) == 0 and sim.ops["cache.cache_finished_req"].calls == 1


def test_a_device_tensor_without_a_mirror_costs_one_sync_and_is_counted() -> None:
    with SimCuda() as sim:
        kv = TokenAllocator(64, device="cuda")
        c = RadixCache(CacheConfig(), kv_allocator=kv)
        slots = kv.alloc(8)
        assert slots is not None
        before = MISSES["value"]
        engine_row = slots.clone()  # the engine's own tensor: the library never saw it
        sim.track(c, ["insert"], "cache")
        c.insert(list(range(1, 9)), engine_row)
        assert sim.syncs_of("cache.insert") == 1 and MISSES["value"] == before + 1
        c.sanity_check()


def test_an_in_place_write_invalidates_the_mirror() -> None:
    with cuda():
        kv = TokenAllocator(16, device="cuda")
        slots = kv.alloc(4)
        assert slots is not None and mirror_of(slots) is not None
        slots[0:1].fill_(9)  # the engine rewrote it: the host copy is stale
        assert mirror_of(slots) is None and mirror_of(slots[1:]) is None


def test_a_strided_views_mirror_equals_the_view_on_the_host() -> None:
    """``mirror_of(t[::2])`` is the host copy of the strided view itself (every other slot,
    from the view's offset), not of the tensor it views."""
    with cuda():
        kv = TokenAllocator(16, device="cuda")
        slots = kv.alloc(8)
        assert slots is not None
        host = slots.cpu().tolist()
        views = (slots[::2], slots[1::2], slots[1:7:3], slots[5:6])
        expected = (host[::2], host[1::2], host[1:7:3], host[5:6])
        for view, want in zip(views, expected, strict=True):
            got = mirror_of(view)
            assert got is not None and got.tolist() == want
